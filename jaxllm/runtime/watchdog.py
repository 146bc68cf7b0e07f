"""A run that stops making progress ends with one line naming what it waited for, and a status.

A collective whose participants never all arrive blocks the thread that waits for its
result forever (gloo: ``--xla_cpu_collective_timeout_seconds``, 30 min by default) or until
XLA:CPU's in-process rendezvous aborts the process (``--xla_cpu_collective_call_terminate_timeout_seconds``,
40 s, with a stack dump of every thread).  The training loop announces each wait for device
results (:meth:`Watchdog.waiting`); a daemon thread ends the process with
:data:`EXIT_STALLED` when one lasts longer than the timeout.  XLA's own "may be stuck"
lines (``--xla_cpu_collective_call_warn_stuck_timeout_seconds``) name the collective
(``all reduce RendezvousKey{... op_id=1}``) before that.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

# BSD's EX_SOFTWARE: the run cannot go on; rerunning resumes from the last checkpoint.
EXIT_STALLED = 70


class Watchdog:
    """Ends the process (``os._exit(exit_code)``) when a :meth:`waiting` block lasts longer than
    ``timeout_s`` seconds (0: never).  The main thread, blocked inside XLA, cannot raise; this
    thread can still print and exit because a blocked XLA call releases the GIL."""

    def __init__(self, timeout_s: float, exit_code: int = EXIT_STALLED):
        self.timeout_s, self.exit_code = timeout_s, exit_code
        self._cv = threading.Condition()
        self._wait: tuple[str, float] | None = None  # (what, since) of the wait in progress
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="jaxllm-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self, what: str):
        """A block that waits for device results, ``what`` naming them (``"train step 12"``)."""
        with self._cv:
            self._wait = (what, time.monotonic())
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._wait = None

    def alive(self) -> None:
        """Progress inside a :meth:`waiting` block (a chunk of a long evaluation): its time starts again."""
        with self._cv:
            if self._wait is not None:
                self._wait = (self._wait[0], time.monotonic())

    def _watch(self):
        with self._cv:
            while True:
                if self._wait is None:
                    self._cv.wait()
                    continue
                what, since = self._wait
                left = since + self.timeout_s - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                os.write(2, (f"jaxllm: stalled: {what} made no progress for {self.timeout_s:.0f} s (a collective "
                             f"that some devices never reached; XLA's 'rendezvous' lines above name it); exiting "
                             f"with status {self.exit_code}, rerun to resume from the last checkpoint\n").encode())
                os._exit(self.exit_code)
