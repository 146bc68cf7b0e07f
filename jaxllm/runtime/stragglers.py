"""Stragglers: the process that slows every step of a multi-process run, named in one line.

In an SPMD job every process waits for the slowest at each collective, so all of them measure
the same wall-clock time per step.  What differs is how they spend it: the slow process is busy
with its own work (its input pipeline, dispatch, a busy or throttled host, a slow file system),
while the others wait for device results that wait for its contribution.  Each process therefore
counts the seconds it spends waiting for device results (:meth:`StepTimes.waiting`); at each log
step the processes exchange their busy and waiting seconds per step in one allgather of two
numbers each (``jax.experimental.multihost_utils.process_allgather``), and a process's own step
time is its busy time plus the least waiting time of any process (the devices' own time, which
no process can avoid).  The log record carries ``step_time_spread``, the slowest of those over
their median, and ``slowest_process``; above ``train.straggler_threshold`` process 0 prints one
warning line naming the process and its host, once per process and run, and not on the first
:data:`SETTLE_STEPS` steps after a start.

What the host cannot see: a device that is slow by itself (a throttled GPU) makes every process
wait for it alike, inside the collectives; the spread stays near 1 and the step time rises.
"""

from __future__ import annotations

import contextlib
import socket
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

_HOST_BYTES = 64  # a host name is exchanged as this many bytes (longer names are cut)
# No verdict on the first steps after a start: first dispatches, caches warming and the data's first reads make the
# processes differ for reasons that pass (1.35x-1.75x seen on the first step of an even run); measured, not judged.
SETTLE_STEPS = 5


class StepTimes:
    """One process's busy and waiting seconds between log steps, and the stragglers among all processes.

    ``StepTimes(threshold)``: ``threshold`` is ``train.straggler_threshold`` (0: never warn).  Single-process
    runs measure nothing and log nothing.  :meth:`report` is a collective: every process calls it at the same
    steps (the log steps).
    """

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.processes = jax.process_count()
        self.process = jax.process_index()
        self.waited = 0.0
        self.warned: set[int] = set()  # the processes named already
        self.measured = 0  # steps reported since the start
        self.hosts = _gather_hosts() if self.processes > 1 else [socket.gethostname()]

    @contextlib.contextmanager
    def waiting(self):
        """A block in which this process waits for device results (or dispatches to a device that is behind)."""
        tick = time.perf_counter()
        try:
            yield
        finally:
            self.waited += time.perf_counter() - tick

    def report(self, elapsed: float, steps: int) -> tuple[dict, str | None]:
        """``(metrics, warning)`` for the ``steps`` steps of the last ``elapsed`` seconds: ``step_time_spread``
        and ``slowest_process`` (none in single-process runs), and the warning line to print or None.  Starts
        the next interval, which holds the wait for the other processes here (the caller's clock of the next
        interval starts before this call)."""
        waited, self.waited = self.waited, 0.0
        if self.processes == 1 or steps == 0:
            return {}, None
        mine = np.array([max(elapsed - waited, 0.0) / steps, waited / steps], np.float32)
        with self.waiting():
            busy, wait = np.asarray(multihost_utils.process_allgather(mine), np.float64).T
        own = busy + wait.min()
        slowest = int(np.argmax(own))
        median = float(np.median(own))
        spread = float(own[slowest] / median) if median > 0 else 1.0
        warning = None
        self.measured += steps
        if self.threshold and spread > self.threshold and slowest not in self.warned and \
                self.measured > SETTLE_STEPS:
            self.warned.add(slowest)
            warning = (f"jaxllm: warning: straggler: process {slowest} (host {self.hosts[slowest]}) takes "
                       f"{own[slowest]:.3g} s/step, {spread:.2f}x the median {median:.3g} s/step of the "
                       f"{self.processes} processes (train.straggler_threshold={self.threshold:g}); the others "
                       f"wait for it at every collective")
        return {"step_time_spread": spread, "slowest_process": slowest}, warning


def _gather_hosts() -> list[str]:
    """Every process's host name, in process order (a collective)."""
    name = socket.gethostname().encode()[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0")
    rows = np.asarray(multihost_utils.process_allgather(np.frombuffer(name, np.uint8)))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows.reshape(-1, _HOST_BYTES)]
