"""Preemption: a signal or Ctrl-C -> a checkpoint at the next step boundary, then exit."""

from __future__ import annotations

import os
import signal
import threading

import jax


class Preemption:
    """SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) -> save at the next step boundary and exit (a context manager).

    Call :meth:`reached` with the number of completed steps at every step boundary; once
    it returns True, save and stop.  Single process: a Python handler for the three signals
    sets a flag.  Several processes must all stop after the same step, or the collective
    save hangs: JAX's preemption sync manager (started by ``jax.distributed.initialize``)
    catches SIGTERM in every process and agrees on a step through the coordination service,
    and :meth:`reached` is ``multihost_utils.reached_preemption_sync_point``; so SIGTERM is
    left to it (a Python handler would replace it) and SIGUSR1 and SIGINT are forwarded to
    it as SIGTERM.  Handlers are installed only from the main thread (Python's rule);
    :meth:`uninstall` (or leaving the ``with`` block) puts the previous ones back.

    Ctrl-C: the first SIGINT prints one line and stops like SIGTERM; its handler then gives
    SIGINT back to the operating system's default, so a second Ctrl-C ends the process at
    once (status 130 in a shell), even inside a long XLA call or while an asynchronous save
    completes: Orbax writes into a temporary directory renamed only when complete, so the
    previous checkpoints stay intact.  An inherited ignored SIGINT (a background job of a
    launcher script, ``nohup``) stays ignored.
    """

    def install(self) -> Preemption:
        """Installs the signal handlers; returns self."""
        self.multi = jax.process_count() > 1
        self.signum = None
        signals = (signal.SIGUSR1,) if self.multi else (signal.SIGTERM, signal.SIGUSR1)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signals += (signal.SIGINT,)
        in_main = threading.current_thread() is threading.main_thread()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals} if in_main else {}
        return self

    def uninstall(self) -> None:
        """Puts the previous signal handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    __enter__ = install

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the second Ctrl-C ends the process at once
            os.write(2, b"\njaxllm: Ctrl-C: saving a checkpoint at the end of this step, then stopping "
                        b"(Ctrl-C again: stop now, unsaved)\n")
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.signum = signum

    def reached(self, step: int) -> bool:
        """Whether to save after ``step`` completed steps and stop (collective when multi-process:
        every process must call it at every step)."""
        if self.multi:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return multihost_utils.reached_preemption_sync_point(step)
        return self.signum is not None

    def __exit__(self, *exc):
        self.uninstall()
        return False
