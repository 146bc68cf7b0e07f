"""A directory built once by one of many processes that share a file system, the others waiting.

Used for prepared text (:func:`jaxllm.data.text.ensure_prepared`) and for sample indices
(:mod:`jaxllm.data.samples`). Only the ``rename`` of a finished directory and the exclusive
creation of a lock file (``O_CREAT | O_EXCL``) are relied on, both atomic on local file
systems, NFS (v3+) and Lustre: the directory either exists complete or not at all, and at
most one process builds at a time. The builder touches its lock every few seconds; a lock
whose modification time stops changing for ``stale_s`` seconds (of the waiter's own clock,
so clock skew between nodes does not matter) belonged to a process that died, and a waiter
takes over. Should two processes ever build anyway (a lock taken over from a live but
stalled builder), both produce the same bytes and the second rename is discarded.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable

HEARTBEAT_S = 5.0


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for root, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def build_once(final: str, build: Callable[[str], None], *, what: str, poll_s: float = 0.2,
               stale_s: float = 120.0) -> bool:
    """Makes the directory ``final`` with ``build(tmp_dir)`` unless it exists, once across processes.

    Args:
      final: the directory to create (its parent is created if missing).
      build: fills the empty directory it is given; an exception leaves nothing behind.
      what: a few words for the line printed while waiting for another process.
      poll_s: seconds between looks while waiting.
      stale_s: a lock unchanged this long is taken over.
    Returns:
      True if this process built ``final``, False if it existed or another process built it.
    Raises:
      whatever ``build`` raises; OSError when the parent directory cannot be written.
    """
    final = os.path.abspath(final)
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    lock = final + ".lock"
    told = False
    while not os.path.isdir(final):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not told:
                print(f"jaxllm: waiting for another process to build {what} ({lock})", file=sys.stderr, flush=True)
                told = True
            _wait(final, lock, poll_s, stale_s)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        stop = threading.Event()
        beat = threading.Thread(target=_heartbeat, args=(lock, stop), daemon=True)
        beat.start()
        tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(tmp)
            build(tmp)
            _fsync_tree(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not os.path.isdir(final):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # built by a process that took over a stalled lock
                return False
            fsync_dir(parent)
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            stop.set()
            beat.join()
            try:
                os.unlink(lock)
            except FileNotFoundError:
                pass
    return False


def _heartbeat(lock: str, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(lock)
        except OSError:
            return


def _wait(final: str, lock: str, poll_s: float, stale_s: float) -> None:
    """Returns when ``final`` exists, the lock is gone, or the lock went stale (then removed)."""
    seen, since = None, time.monotonic()
    while not os.path.isdir(final):
        try:
            mtime = os.stat(lock).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != seen:
            seen, since = mtime, time.monotonic()
        elif time.monotonic() - since > stale_s:
            aside = f"{lock}.stale-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(lock, aside)
                os.unlink(aside)
            except FileNotFoundError:
                pass
            print(f"jaxllm: took over {lock}: unchanged for {stale_s:.0f} s (its process died)", file=sys.stderr,
                  flush=True)
            return
        time.sleep(poll_s)
