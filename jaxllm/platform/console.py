"""What a run prints: one copy of each message, library chatter in log files (``log.verbose`` shows it).

Where the chatter comes from (jaxlib 0.10.2):

* ``[Gloo] Rank N is connected to K peer ranks...``: Gloo's
  ``transport::tcp::Context::printConnectivityInfo`` writes it to C++ ``std::cout`` (file
  descriptor 1) every time XLA:CPU's Gloo collectives connect a new group of processes,
  with no level or switch.  Only the descriptor can be redirected: it goes to
  ``WORKDIR/logs/process_N.out`` while Python's ``sys.stdout`` keeps the terminal.
* XLA's C++ warnings (``[SPMD] Involuntary full rematerialization``, ...): absl logging on
  descriptor 2; ``jaxlib.utils.absl_set_min_log_level`` (what ``jax_logging_level`` calls)
  keeps errors (a collective that is stuck, a fatal check) and drops warnings and info.
* Python loggers (Orbax, JAX, ours through absl): every process logs; processes other than
  0 write theirs to ``WORKDIR/logs/process_N.log`` and print errors only.
* ``RuntimeError: Event loop is closed`` tracebacks, dozens per damaged checkpoint step:
  Orbax (0.12.8, ``asyncio_utils._run_sync_via_new_loop``) runs a restore's TensorStore
  reads in an event loop it closes as soon as one read fails; the other reads finish later
  on TensorStore's threads and their done-callbacks call ``loop.call_soon_threadsafe`` on
  the closed loop.  Python reports those through ``sys.unraisablehook`` (no frame of ours,
  so no way to catch them), at any time after the failed restore, even after the run's
  last message.  They go to the ``jaxllm.library`` log with the full Orbax errors.
* ``Task exception was never retrieved`` (``Future exception ...`` after a failed save) with a TensorStore
  traceback, from the same failed restore: the reads Orbax abandoned raised too, and asyncio's default
  exception handler logs each such task on the ``asyncio`` logger when the task is garbage-collected (any
  time later).
  Those records go to the ``jaxllm.library`` log; the ``asyncio`` logger's other records stay.
* ``Jax plugin configuration error: Exception when calling jax_plugins.xla_cuda12.initialize()`` and its
  12-line traceback (``cuInit(0) failed``): JAX's CUDA plugin, installed for XLA:GPU's deviceless compiles
  (:mod:`jaxllm.platform.xla_gpu`), fails its start-up check on a machine without an NVIDIA GPU, and JAX logs
  that on ``jax._src.xla_bridge`` before it runs on the CPU as it would without the plugin.  On such a machine
  (no ``/dev/nvidiactl``, ``JAX_PLATFORMS`` not asking for ``cuda``) the record goes to the ``jaxllm.library``
  log (:func:`quiet_absent_gpu_plugin`, which every tool calls as it starts); anywhere else it is shown.
* Orbax's records (through absl): a failed save's background threads log each failure with its traceback
  (about 30 lines); jaxllm says it in one line (:mod:`jaxllm.runtime.checkpoint`), so they go to the
  ``jaxllm.library`` log.
* Python warnings of the libraries (``warnings.warn``: JAX's, Orbax's, tensorboardX's ...) are
  written straight to ``sys.stderr`` by the ``warnings`` module, past any logger, once per
  process: they go to the ``py.warnings`` logger (``logging.captureWarnings``) and from there to
  the ``jaxllm.library`` log file.
"""

from __future__ import annotations

import io
import logging
import os
import sys

from absl import logging as absl_logging

# absl's C++ severities: 0 info, 1 warning, 2 error, 3 fatal.
_CPP_ERROR = 2


class _AbsentGpuPlugin(logging.Filter):
    """Sends JAX's record of its CUDA plugin failing to start (no GPU here) to the ``jaxllm.library`` log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Jax plugin configuration error: Exception when calling "
                                          "jax_plugins.xla_cuda"):
            logging.getLogger("jaxllm.library").debug("%s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


def quiet_absent_gpu_plugin(environ=None, dev: str = "/dev") -> bool:
    """On a machine without an NVIDIA GPU, where ``JAX_PLATFORMS`` does not ask for ``cuda``: JAX's record of its CUDA
    plugin failing to start goes to the ``jaxllm.library`` log instead of the console (see the module doc); returns
    whether it does.  Call before JAX starts a backend; idempotent."""
    environ = os.environ if environ is None else environ
    asked = {p.strip() for p in environ.get("JAX_PLATFORMS", "").lower().split(",")} & {"cuda", "gpu"}
    if asked or os.path.exists(os.path.join(dev, "nvidiactl")):
        return False
    logger = logging.getLogger("jax._src.xla_bridge")
    if not any(isinstance(f, _AbsentGpuPlugin) for f in logger.filters):
        logger.addFilter(_AbsentGpuPlugin())
    return True


class _Divert(logging.Filter):
    """Sends the records ``diverted(record)`` is true of to ``logger`` (the log file's), keeps the others."""

    def __init__(self, logger, diverted):
        super().__init__()
        self.logger, self.diverted = logger, diverted

    def filter(self, record):
        if self.diverted(record):
            self.logger.handle(record)
            return False
        return True


class _LogFile(logging.FileHandler):
    """``WORKDIR/logs/process_N.log``; a record it cannot write (a full disk: the run says so in its own line) is
    dropped, where logging's default would print "--- Logging error ---" and a traceback on the console."""

    def handleError(self, record):  # noqa: N802  (logging's name)
        pass


def logs_dir(workdir: str) -> str:
    """``WORKDIR/logs``, created."""
    path = os.path.join(workdir, "logs")
    os.makedirs(path, exist_ok=True)
    return path


def redirect_native_stdout(path: str) -> None:
    """Points file descriptor 1 (C++ ``std::cout``, where Gloo prints) at ``path``; Python's
    ``sys.stdout`` keeps writing to the terminal it had."""
    sys.stdout.flush()
    terminal = os.dup(1)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.close(log)
    sys.stdout = io.TextIOWrapper(io.FileIO(terminal, "w"), encoding=sys.stdout.encoding,
                                  errors=sys.stdout.errors, line_buffering=True)


def _closed_loop_callbacks_to(logger, previous):
    """An ``unraisablehook`` sending "Event loop is closed" from asyncio's ``call_soon_threadsafe``
    to ``logger``, anything else to ``previous``."""

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            exc = unraisable.exc_value
            logger.debug("a TensorStore callback reached a closed asyncio loop",
                         exc_info=(unraisable.exc_type, exc, unraisable.exc_traceback))
        else:
            previous(unraisable)

    return hook


# The survivors of a multi-process job whose coordinator or other process died: JAX's distributed client (C++) logs
# the coordination service's errors and gRPC's, then ends the process (LOG(FATAL): nothing of Python runs after).
_PEER_DIED = (rb"coordination_service_agent\.cc|preemption_sync_manager\.cc|client\.h:\d+\]|GRPC error|"
              rb"Error received from peer|grpc_status|coordination service")
_FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
# Reads what this process writes to file descriptor 2 (a pipe) and outlives it: the lines of a peer's death (and the
# abort's stack traces after them) go to the log file and one jaxllm line to the console in their place; every other
# line passes through unchanged.
_STDERR_FILTER = r"""
import re, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)  # the job's signals are for the process it serves; this one ends at its EOF
log, note = open(int(sys.argv[1]), "ab", buffering=0), sys.argv[2].encode() + b"\n"  # opened by the parent
peer, fatal, out = re.compile(sys.argv[3].encode()), sys.argv[4].encode(), sys.stdout.buffer
record = re.compile(rb"[IWEF]\d{4} ")  # a C++ log record's first line (absl's); its next lines start otherwise
dying = diverted = False  # after the fatal line: the abort's stack traces; diverted: the last record was a peer's
for line in sys.stdin.buffer:
    if record.match(line):
        diverted = bool(peer.search(line)) or fatal in line  # its continuation lines (JAX 0.12: a source trace) too
    if dying or diverted or peer.search(line) or fatal in line:
        log.write(line)
        if fatal in line and not dying:
            out.write(note)
            out.flush()
            dying = True
    else:
        out.write(line)
        out.flush()
"""


def filter_native_stderr(path: str, process: int) -> None:
    """Points file descriptor 2 at a filter process (:data:`_STDERR_FILTER`): the C++ lines a multi-process job's
    survivors print when its coordinator or another process dies go to ``path``, and one line to the console in
    their place; everything else written to descriptor 2 reaches the console as before."""
    import subprocess  # noqa: PLC0415

    note = (f"jaxllm: process {process} stops: the job's coordinator (process 0) or another of its processes died, "
            f"and JAX's distributed service ends the others (its lines: {path})")
    sys.stderr.flush()
    console, log = os.dup(2), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    child = subprocess.Popen([sys.executable, "-c", _STDERR_FILTER, str(log), note, _PEER_DIED.decode(),
                              _FATAL.decode()], stdin=subprocess.PIPE, stdout=console, pass_fds=(log,),
                             start_new_session=True)
    os.close(console)
    os.close(log)
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()  # descriptor 2 holds the pipe now: the filter's input ends when this process does


def configure(workdir: str, *, process: int, verbose: bool, processes: int = 1) -> None:
    """Applies the policy of this module to this process (call it before the first collective):
    ``WORKDIR/logs/process_N.log`` receives the ``jaxllm.library`` logger (and with ``verbose``
    the console too); one of ``processes`` > 1 also has its descriptor 2 filtered (:func:`filter_native_stderr`)."""
    directory = logs_dir(workdir)
    library = logging.getLogger("jaxllm.library")
    handler = _LogFile(os.path.join(directory, f"process_{process}.log"))
    handler.setFormatter(absl_logging.PythonFormatter())
    library.addHandler(handler)
    library.setLevel(logging.DEBUG)
    library.propagate = verbose
    sys.unraisablehook = _closed_loop_callbacks_to(library, sys.unraisablehook)
    logging.getLogger("asyncio").addFilter(_Divert(library, lambda r: r.getMessage().startswith((
        "Task exception was never retrieved", "Future exception was never retrieved"))))  # a failed restore's
    logging.captureWarnings(True)
    warnings = logging.getLogger("py.warnings")
    warnings.addHandler(handler)
    warnings.propagate = verbose
    if verbose:
        return
    from jaxlib import utils  # noqa: PLC0415  (jax's own switch for C++ logging, see jax._src.logging_config)

    utils.absl_set_min_log_level(_CPP_ERROR)
    import orbax.checkpoint  # noqa: PLC0415  (its records, by the files they come from)

    orbax_files = os.path.dirname(orbax.checkpoint.__file__) + os.sep  # its background save threads log each failure
    absl_logging.get_absl_handler().addFilter(  # of a save with its traceback, ~30 lines, through absl
        _Divert(library, lambda r: r.pathname.startswith(orbax_files)))
    redirect_native_stdout(os.path.join(directory, f"process_{process}.out"))
    if processes > 1:
        filter_native_stderr(os.path.join(directory, f"process_{process}.out"), process)
    if process:  # one copy of each message: process 0's; the others' go to their log file
        absl_logging.get_absl_handler().setLevel(logging.ERROR)
        logging.getLogger().addHandler(handler)
