"""One writer per workdir: ``WORKDIR/run.lock``, held by process 0 of a training run for the whole run and by an
import (``jaxllm.convert --from-*``) while it writes.

Two runs on one workdir would interleave their ``metrics.jsonl`` rows and replace each other's checkpoints; the
second is refused instead (:class:`WorkdirBusy`, a config error: one line, exit 2, before it writes anything).

The file names its holder (host, pid, start time, what it is) and its modification time is the holder's
heartbeat, renewed every :data:`HEARTBEAT_S` seconds.  Who holds it:

* On the holder's host, an ``flock`` on the file, which the kernel releases when the holder dies (``kill -9``
  included): a lock file whose ``flock`` is free is left over from a dead run and is taken over with one note
  line, so a restart (``launch/`` scripts, a requeued job) goes on.  Where the filesystem cannot ``flock``, the
  holder's pid is looked for instead.
* A holder on another host (a job requeued onto other nodes; an ``flock`` that is node-local, as Lustre's
  ``localflock``): it is alive while its heartbeat is younger than :data:`STALE_S`; an older one is taken over
  with one note line, and a younger one that stops is waited for until it is that old.

The lock is released (the file removed) when the run or the import ends, whatever the exit status.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator

from jaxllm.errors import ConfigError

LOCK_FILE = "run.lock"
HEARTBEAT_S = 60.0  # the holder renews the file's modification time this often
# A holder on another host whose heartbeat is older than this is dead: five heartbeats missed, far more than NFS's
# default attribute cache (60 s) could age a live one's; as long as the launchers' restart window
# (JAXLLM_RESTART_MIN_TIME's default, 300 s)
STALE_S = 300.0
_POLL_S = 5.0
_HELD: set[str] = set()  # the workdirs (real paths) this process holds (re-entrant)
_AGREED = "jaxllm/workdir_lock"  # the coordination service's key: process 0 took the lock


class WorkdirBusy(ConfigError):
    """Another run or import holds the workdir (exit 2); the message names it."""

    def __init__(self, workdir: str, holder: dict | str, flag: str = "--workdir"):
        who = holder if isinstance(holder, str) else _who(holder)
        super().__init__(flag, workdir, f"is in use by {who}, which holds {os.path.join(workdir, LOCK_FILE)}; wait "
                         f"for it to end, or use another {flag}")


def _who(holder: dict) -> str:
    """The holder a lock file names, in words."""
    return (f"{holder.get('what', 'a jaxllm run')} (pid {holder.get('pid')} on {holder.get('host')}, started "
            f"{holder.get('started')})")


def _read(path: str) -> dict:
    """The holder the lock file names ({} if it names none: empty, being written, or not ours)."""
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.loads(f.read() or "{}")
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # another user's process, or an unreadable pid: assume it runs
    return True


class _Lock:
    """This process's hold of ``path``: the open file (its ``flock``) and the heartbeat thread."""

    def __init__(self, path: str, what: str, flag: str):
        self.path, self.flag = path, flag
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "what": what,
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.fd, self.flock = None, True
        self.stop = threading.Event()

    def acquire(self, workdir: str) -> str | None:
        """Takes the lock; returns a note line if it took over a dead holder's.  Raises WorkdirBusy."""
        while True:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    os.close(self.fd)
                    raise WorkdirBusy(workdir, _read(self.path) or "another process", self.flag) from None
                self.flock = False  # the filesystem cannot flock (ENOLCK, EOPNOTSUPP): the pid and heartbeat decide
            try:
                same = os.fstat(self.fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(self.fd)  # the holder removed the file while we opened it: try the new one
        try:
            note = self._check_holder(workdir, _read(self.path))
        except BaseException:
            os.close(self.fd)
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(self.me).encode(), 0)
        os.fsync(self.fd)
        threading.Thread(target=self._beat, daemon=True, name="jaxllm workdir lock").start()
        return note

    def _check_holder(self, workdir: str, holder: dict) -> str | None:
        """None if the file names no holder; a note if the holder is dead; raises WorkdirBusy if it lives."""
        if not holder:
            return None
        if holder.get("host") == self.me["host"]:
            if not self.flock and _pid_alive(holder.get("pid")):
                raise WorkdirBusy(workdir, holder, self.flag)
        else:
            self._wait_for_heartbeat(workdir, holder)
        return f"jaxllm: note: took over {self.path} from {_who(holder)}, which is gone"

    def _wait_for_heartbeat(self, workdir: str, holder: dict) -> None:
        """Returns once another host's holder is dead (no heartbeat for STALE_S); raises WorkdirBusy if it beats."""
        first, announced = os.fstat(self.fd).st_mtime, False
        while True:
            mtime = os.stat(self.path).st_mtime
            if mtime != first:
                raise WorkdirBusy(workdir, holder, self.flag)
            age = time.time() - mtime
            if age > STALE_S:
                return
            if not announced:
                print(f"jaxllm: {self.path} names pid {holder.get('pid')} on {holder.get('host')}, last heard from "
                      f"{age:.0f} s ago: waiting up to {STALE_S - age:.0f} s for its next heartbeat", flush=True)
                announced = True
            time.sleep(min(_POLL_S, STALE_S - age + 0.1))

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.fd)

    def release(self) -> None:
        self.stop.set()
        if _read(self.path) == self.me:
            with contextlib.suppress(OSError):
                os.remove(self.path)
        os.close(self.fd)


def _job() -> tuple[int, object]:
    """``(process index, the jax.distributed client or None)``, without starting a backend."""
    from jax._src import distributed  # noqa: PLC0415  (jax.process_index() would start the backend)

    state = distributed.global_state
    return (state.process_id, state.client) if state.client is not None else (0, None)


def _agreed(ok: bool, process: int, client) -> bool:
    """Process 0's ``ok``, for every process: through the job's coordination service (a key it sets and the others
    wait for), not a device collective, which would start a backend and Gloo's connection lines before the console
    is set up."""
    if client is None:
        return ok
    if process == 0:
        client.key_value_set(_AGREED, "1" if ok else "0")
        return ok
    return client.blocking_key_value_get(_AGREED, 600_000) == "1"


@contextlib.contextmanager
def held(workdir: str, what: str = "jaxllm.train", *, collective: bool = True, flag: str = "--workdir"
         ) -> Iterator[None]:
    """Holds ``WORKDIR/run.lock`` inside (re-entrant in one process; ``workdir`` created if missing): process 0
    takes it, and with ``collective`` every process of the job learns whether it did.  A dead holder's lock is
    taken over with one note line on stdout.  ``what`` names this holder to others; ``flag`` is the option that
    gave ``workdir``, for the message.

    Raises:
      WorkdirBusy: a live run or import holds it (every process raises).
    """
    os.makedirs(workdir, exist_ok=True)
    key = os.path.realpath(workdir)
    if key in _HELD:
        yield
        return
    lock, error = None, None
    process, client = _job() if collective else (0, None)
    if process == 0:
        lock = _Lock(os.path.join(workdir, LOCK_FILE), what, flag)
        try:
            note = lock.acquire(workdir)
            if note:
                print(note, flush=True)
        except WorkdirBusy as e:
            lock, error = None, e
    if not _agreed(error is None, process, client):  # process 0 holds no lock then: its error, or the others'
        raise error or WorkdirBusy(workdir, "another run (process 0 says which)", flag)
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        if lock:
            lock.release()


def snapshot(workdir: str) -> frozenset[str] | None:
    """The names in ``workdir`` now (None: it does not exist), for :func:`remove_new`."""
    try:
        return frozenset(os.listdir(workdir))
    except FileNotFoundError:
        return None
    except OSError:  # a file, or unreadable: nothing of it is ever removed
        return frozenset()


def remove_new(workdir: str, before: frozenset[str] | None) -> None:
    """Removes what ``workdir`` holds that it did not at :func:`snapshot` ``before``, and ``workdir`` itself if it did
    not exist then: what a failed import or a run refused for bad input wrote (call it while holding the lock)."""
    if before is None:
        if os.path.isdir(workdir):
            shutil.rmtree(workdir, ignore_errors=True)
        return
    for name in set(snapshot(workdir) or ()) - before:
        path = os.path.join(workdir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
