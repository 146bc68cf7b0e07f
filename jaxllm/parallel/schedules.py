"""The pipeline schedules as tables, computed before tracing: who does what at each iteration.

:func:`timetable` gives every stage's slot at every iteration of a 1F1B-family loop (the
order is :mod:`jaxllm.parallel.pipeline`'s module docstring); :func:`stats` counts the bubble
and the stash on it, the one place they are computed (the log line, ``jaxllm.plan``,
``jaxllm.bench``, the FLOPs of :mod:`jaxllm.runtime.flops`); :func:`check` is what a config
needs of the pipeline (called by :func:`jaxllm.resolve.resolve`).  Plain numpy: nothing here
traces or imports the model.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxllm.errors import ConfigError

FUSED = ("1f1b", "interleaved_1f1b", "zb_h1")  # schedules whose one loop runs forwards and backwards
# Relative cost of a slot, for the bubble: a stage forward 1, its backward 2 (input and weight gradients,
# 1 each); the backward slot also recomputes the forward.  Qi et al. 2024 assume the same T_F = T_B = T_W.
_COST = {"forward": 1, "backward": 3, "input_grad": 2, "weight_grad": 1}


def check(cfg) -> None:
    """What the pipeline needs of a config being resolved (``stages`` and ``microbatches`` filled).

    Raises:
      ConfigError: microbatches not a multiple of the stages (which also guarantees ``m >= p``); the layers'
        checks are :func:`jaxllm.parallel.pipeline.check`'s.
    """
    stages, t = cfg.stages, cfg.train
    if stages > 1 and cfg.microbatches % stages:
        rows = t.micro_batch_size * cfg.data_parallel
        raise ConfigError(
            "train.global_batch_size", t.global_batch_size,
            f"gives {cfg.microbatches} microbatches (global batch / (micro batch {t.micro_batch_size} x data-parallel "
            f"size {cfg.data_parallel})), which must be a multiple of the {stages} pipeline stages; use a global "
            f"batch that is a multiple of {rows * stages}, or a smaller train.micro_batch_size")


@dataclasses.dataclass(frozen=True)
class Timetable:
    """What every stage does at every iteration of a 1F1B-family loop (see the module docstring).

    Each array is int32 ``[iterations, stages]``, -1 where the slot idles: ``forward``,
    ``backward``, ``weight`` (the microbatch of the forward, the backward (input and, except
    zb_h1, weight gradient) and zb_h1's deferred weight gradient), ``forward_chunk``,
    ``backward_chunk`` (which of the stage's ``v`` chunks), ``stash_write`` / ``stash_read``
    (the slot of the stage-input stash the forward fills and the backward reads) and
    ``deferred_write`` / ``deferred_read`` (zb_h1: the slot of the matmul inputs and output
    gradients kept for W).  ``stash`` and ``deferred`` are the slot counts (the peak over the
    stages); ``phases`` the runs of iterations ``(start, stop, (forward?, backward?, weight?))``
    with the same slots in use somewhere.
    """

    forward: np.ndarray
    forward_chunk: np.ndarray
    backward: np.ndarray
    backward_chunk: np.ndarray
    weight: np.ndarray
    stash_write: np.ndarray
    stash_read: np.ndarray
    deferred_write: np.ndarray
    deferred_read: np.ndarray
    stash: int
    deferred: int
    phases: tuple

    def rows(self) -> dict:
        """The per-iteration arrays by name (what the loop scans over)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name),
                                                                                              np.ndarray)}

    def text(self) -> str:
        """One line per stage: ``F3``/``B1``/``W0`` = forward/backward/weight gradient of microbatch 3/1/0
        (``F3.1``: chunk 1), ``.`` idle."""
        interleaved = self.forward_chunk.max() > 0

        def slot(kind, mb, chunk):
            return [] if mb < 0 else [f"{kind}{mb}" + (f".{chunk}" if interleaved and kind != "W" else "")]

        lines = []
        for s in range(self.forward.shape[1]):
            cells = [" ".join(slot("F", self.forward[t, s], self.forward_chunk[t, s])
                              + slot("B", self.backward[t, s], self.backward_chunk[t, s])
                              + slot("W", self.weight[t, s], 0)) or "." for t in range(len(self.forward))]
            lines.append(f"stage {s}: " + " | ".join(cells))
        return "\n".join(lines)


@functools.lru_cache(maxsize=64)
def timetable(schedule: str, p: int, v: int, m: int) -> Timetable:
    """The iteration-by-iteration plan of ``schedule`` (one of :data:`FUSED`) for ``p`` stages, ``v``
    chunks per stage and ``m`` microbatches (a multiple of ``p``); stash slots are given out lowest
    free first, per stage, a slot freed by a backward is reusable from the next iteration.

    Raises:
      ValueError: an unknown schedule, ``m`` not a multiple of ``p``, or zb_h1 with ``v > 1``.
    """
    if schedule not in FUSED or m % p or (schedule == "zb_h1" and v != 1):
        raise ValueError(f"no {schedule} timetable for p={p}, v={v}, m={m}")
    iterations = m * v + p * v + p - 2
    shape = (iterations, p)
    a = {name: np.full(shape, -1, np.int32) for name in ("forward", "forward_chunk", "backward", "backward_chunk",
                                                          "weight", "stash_write", "stash_read", "deferred_write",
                                                          "deferred_read")}
    stash_size = deferred_size = 0
    for s in range(p):
        held, free, pending, pending_free = {}, [], {}, []
        for t in range(iterations):
            k = t - s
            if 0 <= k < m * v:
                g, r, q = k // (p * v), k % (p * v) // p, k % p
                a["forward"][t, s], a["forward_chunk"][t, s] = g * p + q, r
                slot = min(free) if free else len(held)
                free = [f for f in free if f != slot]
                held[(g * p + q, r)] = a["stash_write"][t, s] = slot
                stash_size = max(stash_size, slot + 1)
            k = t - (p * v + p - 2) + s
            if 0 <= k < m * v:
                g, r, q = k // (p * v), v - 1 - k % (p * v) // p, k % p
                a["backward"][t, s], a["backward_chunk"][t, s] = g * p + q, r
                a["stash_read"][t, s] = slot = held.pop((g * p + q, r))
                free.append(slot)
                if schedule == "zb_h1":
                    slot = min(pending_free) if pending_free else len(pending)
                    pending_free = [f for f in pending_free if f != slot]
                    pending[g * p + q] = a["deferred_write"][t, s] = slot
                    deferred_size = max(deferred_size, slot + 1)
            i = t - 2 * (p - 1)
            if schedule == "zb_h1" and 0 <= i < m:
                a["weight"][t, s] = i
                a["deferred_read"][t, s] = slot = pending.pop(i)
                pending_free.append(slot)
        assert not held and not pending, (schedule, p, v, m)
    # The last virtual stage backwards a microbatch in the iteration of its forward (the head's gradient seeds it).
    last = a["backward_chunk"][:, p - 1] == v - 1
    assert (a["forward"][last, p - 1] == a["backward"][last, p - 1]).all()
    assert (a["forward_chunk"][last, p - 1] == v - 1).all()
    used = np.stack([(a[k] >= 0).any(1) for k in ("forward", "backward", "weight")], 1)
    phases, start = [], 0
    for t in range(1, iterations + 1):
        if t == iterations or (used[t] != used[start]).any():
            phases.append((start, t, tuple(bool(u) for u in used[start])))
            start = t
    return Timetable(**a, stash=stash_size, deferred=deferred_size, phases=tuple(phases))


@dataclasses.dataclass(frozen=True)
class Stats:
    """A schedule's bubble (the fraction of each stage's loop time spent on idle, masked slots) and
    its activation stash: ``in_flight`` (microbatch-chunks whose activations a stage holds at the
    peak: residuals for gpipe/interleaved, stage inputs for the 1F1B family) and ``deferred``
    (zb_h1: microbatches whose matmul inputs and output gradients wait for W)."""

    bubble: float
    in_flight: int
    deferred: int = 0


def stats(schedule: str, p: int, v: int, m: int) -> Stats:
    """:class:`Stats` of ``schedule`` with ``p`` stages, ``v`` chunks per stage and ``m`` microbatches:
    the one place the bubble and the stash are computed (log line, plan, bench, docs).

    gpipe / interleaved: ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021, section 2.2), all ``v m``
    held.  1F1B family: counted on :func:`timetable` with the slot costs of ``_COST`` (a stage
    forward 1, a backward slot 3 = recomputed forward + input and weight gradients; zb_h1's B slot 2
    and W slot 1): for ``1f1b`` this is the same ``(p - 1) / (v m + p - 1)``.
    """
    if p == 1:
        return Stats(0.0, 0)
    if schedule not in FUSED:
        return Stats((p - 1) / (v * m + p - 1), v * m)
    tt = timetable(schedule, p, v, m)
    cost = {"forward": _COST["forward"], "backward": _COST["input_grad" if schedule == "zb_h1" else "backward"],
            "weight": _COST["weight_grad"]}
    total = sum((stop - start) * sum(cost[k] for k, on in zip(cost, used, strict=True) if on)
                for start, stop, used in tt.phases)
    work = sum(cost[k] * int((getattr(tt, k)[:, 0] >= 0).sum()) for k in cost)  # every stage does the same work
    return Stats(1 - work / total, tt.stash, tt.deferred)


def bubble_fraction(stages: int, virtual_stages: int, microbatches: int) -> float:
    """GPipe's and the interleaved schedule's idle fraction ``(p - 1) / (v m + p - 1)``."""
    return stats("gpipe", stages, virtual_stages, microbatches).bubble


def schedule_stats(cfg) -> Stats:
    """:func:`stats` of a resolved config's pipeline (zeros without one)."""
    return stats(cfg.parallel.pipeline_schedule, cfg.stages, cfg.parallel.pipeline_virtual_stages, cfg.microbatches)


def schedule_bubble(cfg) -> float:
    """The bubble of :func:`schedule_stats`."""
    return schedule_stats(cfg).bubble


def recomputed_forwards(cfg) -> int:
    """Stage forwards per microbatch a schedule runs beyond autodiff's one: 1 for the 1F1B family
    (the backward slot recomputes the chunk from its stashed input), else 0 (:mod:`jaxllm.runtime.flops`
    counts them in the hardware FLOPs)."""
    return int(cfg.stages > 1 and cfg.parallel.pipeline_schedule in FUSED)


def summary(cfg) -> str:
    """``"1f1b, bubble 27.3%, 7 microbatches in flight per stage"`` (the log line's and the plan's words)."""
    st, v = schedule_stats(cfg), cfg.parallel.pipeline_virtual_stages
    unit = "microbatch-chunks" if v > 1 else "microbatches"
    return (f"{cfg.parallel.pipeline_schedule}, bubble {st.bubble:.1%}, {st.in_flight} {unit} in flight per stage"
            + (f", {st.deferred} awaiting W" if st.deferred else ""))
