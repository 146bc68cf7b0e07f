"""``python ...`` commands without a Python start each: a server process imports JAX and jaxllm's libraries once,
then forks one child per command, which runs it as the interpreter would (``-m MODULE``, ``-c CODE`` or a
script; its argv, environment, working directory, standard streams, exit status and atexit hooks; an uncaught
exception's traceback as the interpreter prints it, but for ``-m`` without runpy's frames).

A command's process starts Python and imports jax, numpy, optax, orbax and jaxllm's core before it does
anything (about 1.5 s of CPU on the 2-core machine; the suite starts some 280). A child forked from a process
that holds those imports but no JAX backend (the backend, its devices and its threads start in the child, with
the command's ``XLA_FLAGS``) is that process at the point its command begins. What the interpreter and JAX read
once, at start or at import (the ``PYTHON*``, ``JAX_*`` and ``TF_*`` variables), is the server's: :func:`run`
keeps a server per set of them, and a script that sets one itself before importing jax (tests/multidevice.py's
``JAX_PLATFORMS``) must be given it in ``env``. Tests of what a new interpreter imports stay subprocesses.

    python tests/forkserver.py      (a server: requests on stdin, one JSON line each; answers on stdout)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

# imported once by the server: what every jaxllm command imports first (no tool module: ``python -m TOOL``
# must find its module not yet imported, as a fresh interpreter does)
PRELOAD = ("numpy", "jax", "jax.numpy", "optax", "orbax.checkpoint", "ml_collections", "absl.app", "absl.flags",
           "jaxllm.config", "jaxllm.resolve", "jaxllm.runtime.run", "jaxllm.runtime.checkpoint", "jaxllm.cli")
FIXED_AT_START = ("PYTHON", "JAX_", "TF_", "XLA_PYTHON_")  # read by the interpreter or at import
UNBUFFERED = "PYTHONUNBUFFERED"  # only how the streams buffer: a child flushes them at its end


def _child(request: dict) -> None:
    """In the forked child: becomes the command's process, runs it, exits with its status (never returns)."""
    import atexit
    import runpy
    import traceback

    code = 0
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                               (2, request["stderr"], os.O_WRONLY)):
            opened = os.open(path, mode)
            os.dup2(opened, fd)
            os.close(opened)
        if request["env"].get(UNBUFFERED):
            sys.stdout.reconfigure(write_through=True)
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            sys.modules["__main__"] = main = types.ModuleType("__main__")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv, sys.path[0] = list(argv), str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # noqa: BLE001  (what the interpreter does with an uncaught exception)
        tb = e.__traceback__  # without the frames of this server and runpy
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>", runpy.__file__):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve() -> None:
    """The server's loop: a request per line of stdin; answers ``{"pid": ...}`` at the fork, ``{"rc": ...}`` at
    the command's end."""
    for name in PRELOAD:
        __import__(name)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        status = os.waitpid(pid, 0)[1]
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


class ForkServer:
    """A server (``python tests/forkserver.py``) started with ``env``; :meth:`run` runs one command at a time."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, cwd=tempfile.gettempdir())
        if self.proc.stdout.readline() != "ready\n":  # its imports done, or it died (its error is on stderr)
            raise RuntimeError(f"tests/forkserver.py did not start (exit {self.proc.wait()})")
        self.lock = threading.Lock()

    def run(self, args: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        """``python ARGS`` (``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...``) as ``subprocess.run(...,
        capture_output=True, text=True)`` gives it; raises ``subprocess.TimeoutExpired`` (the child killed)."""
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            paths = [os.path.join(tmp, name) for name in ("stdout", "stderr")]
            for p in paths:
                open(p, "w").close()
            request = {"argv": list(map(str, args)), "env": env, "cwd": str(cwd), "stdout": paths[0],
                       "stderr": paths[1]}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            timer = threading.Timer(timeout, os.kill, (pid, 9))
            timer.start()
            start = time.monotonic()
            rc = json.loads(self.proc.stdout.readline())["rc"]
            timer.cancel()
            out, err = (Path(p).read_text(errors="replace") for p in paths)
        command = [sys.executable, *map(str, args)]
        if rc == -9 and time.monotonic() - start >= timeout:
            raise subprocess.TimeoutExpired(command, timeout, out, err)
        return subprocess.CompletedProcess(command, rc, out, err)


_SERVERS: dict[tuple, ForkServer] = {}


def run(args, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, by a child of a server started with ``env``'s start-up variables (one per such set,
    kept for the next command)."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(FIXED_AT_START) and k != UNBUFFERED))
    if key not in _SERVERS:
        _SERVERS[key] = ForkServer(env)
    return _SERVERS[key].run(args, env, cwd, timeout)


if __name__ == "__main__":
    serve()
