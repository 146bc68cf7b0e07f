"""Pipeline parallelism over the ``pipeline`` mesh axis, inside one SPMD program.

The layer stack is split into ``p`` stages (the size of the mesh axis the rules
table gives the logical ``stage`` axis), each holding ``v`` chunks of
``num_layers / (p v)`` consecutive layers (``parallel.pipeline_virtual_stages``):
stage ``s`` holds chunks ``s, s + p, s + 2p, ...`` (with ``v = 1`` exactly its block
of the ``layers`` axis, which is how the parameters are sharded anyway), and every
micro batch passes the ring of stages ``v`` times.  The parameters stay in layer
order, so checkpoints do not depend on the layout; for ``v > 1`` they are regrouped
into the stage layout at each step (an all-to-all over ``pipeline``, and its inverse
for the gradients).  The step's micro batches (global batch / (micro batch x
data-parallel size)) are the pipeline's ``m`` microbatches.

All ``p`` stages run every iteration of a loop as one ``vmap`` over the stage axis,
whose dimension is sharded over ``pipeline`` (``spmd_axis_name``); moving the
activations one stage on is a roll of that axis, which XLA turns into one collective
permute.  Five schedules (``parallel.pipeline_schedule``):

``gpipe`` (Huang et al. 2019) and ``interleaved`` (the circular schedule, GSPMD,
    Xu et al. 2021, section 3.3; Narayanan et al. 2021, section 2.2, for the bubble):
    a forward loop over ``v m + p - 1`` iterations (iteration ``t``: stage ``s``
    forwards item ``t - s``, pass ``item // m`` of microbatch ``item % m``), and the
    backward pass is autodiff's transpose of that loop.  Every microbatch's
    activations stay alive until the backward reaches them: memory grows with ``m``.
``1f1b`` and ``interleaved_1f1b`` (PipeDream-Flush and its interleaved form,
    Narayanan et al. 2021, sections 2.2-2.3; Megatron-LM
    ``core/pipeline_parallel/schedules.py``): one loop whose iteration runs, on
    every stage, the forward of one (microbatch, chunk) and the backward of another,
    with the cotangents rolled the other way.  With microbatch ``i = g p + q``
    (group ``g``, ``0 <= q < p``) and chunk ``r``, iteration ``t`` has stage ``s``

    - forward item ``k = t - s``: ``g = k // (p v)``, ``r = k % (p v) // p``, ``q = k % p``
      (chunk 0 of ``p`` microbatches, then chunk 1 of the same ``p``, ...), so the last
      stage's output for chunk ``r`` reaches stage 0 exactly when chunk ``r + 1`` of
      that microbatch is due, and
    - backward item ``K = t - (p v + p - 2) + s`` in the mirrored order (chunks
      ``v - 1`` down to 0), so the last virtual stage runs a microbatch's backward in
      the iteration of its forward: the loss gradient of the head seeds it there.

    For ``v = 1``: stage ``s`` forwards microbatch ``t - s`` and backwards microbatch
    ``t - 2(p - 1) + s``.  A stage keeps the input of every (microbatch, chunk) it
    has forwarded and not yet backwarded (at most ``p v + p - 1``, on stage 0; the
    backward recomputes the chunk's forward from it with ``jax.vjp``, under the
    ``model.remat`` policy), so memory is bounded by ``p``, not ``m``.
``zb_h1`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ZB-H1; ``v = 1``):
    1F1B whose backward is split in two: B, the input gradient (which the previous
    stage waits for), at 1F1B's time, and W, the weight gradient (which nobody waits
    for), deferred by ``s`` iterations on stage ``s`` so that every stage computes W
    of microbatch ``i`` at iteration ``i + 2(p - 1)``.  Every matmul ``y = x w + b``
    of the layers goes through the model's ``dense`` operation (:class:`jaxllm.model.Ops`),
    which a copy of the layers routes here: B runs the vjp with the weights held
    constant and a zero ``tap`` added to ``y``, whose gradient is ``dy``; W is
    ``x^T dy`` and ``sum dy`` from the kept ``x`` and ``dy``.

What one SPMD program can and cannot do, against MPMD runtimes (Megatron-LM,
DeepSpeed, JaxPP): every stage runs the same iteration body in lockstep, so an idle
slot is masked work that costs as much as a real one, and the lockstep makes a
forward hop and a backward hop cost one whole iteration each.  The loop is therefore
cut into phases (forward only, forward + backward, backward only; and W for zb_h1),
each a ``scan`` whose body holds only the slots some stage uses, which gives the 1F1B
schedules GPipe's bubble ``(p - 1) / (v m + p - 1)``; but the round trip of a
microbatch is twice MPMD's, so stage 0 holds ``2p - 1`` stage inputs where
Megatron-LM's 1F1B holds ``p`` (for ``v > 1`` both hold ``p v + p - 1``).  ZB-H1 in lockstep
cannot fill the cooldown bubble as MPMD does; aligning W across the stages removes W
from the bubble phases instead (:func:`stats`): ``3 (p - 1) / (4 m + 3 (p - 1))``
against 1F1B's ``(p - 1) / (m + p - 1)``, counting the recomputed forward as work,
and it keeps ``p`` microbatches of matmul inputs and output gradients for W.

In the 1F1B family the loop computes the gradients itself (a ``jax.custom_vjp``
whose forward is the fused loop and whose backward only scales them), so autodiff
never transposes the loop.  Per stage, the embedding runs at the first virtual
stage and its gradient at its backward; the final norm, output layer and loss (and
their gradient, the backward's seed) at the last virtual stage; the gradients are
summed per stage over the microbatches in float32 and returned in layer order.
Dropout keys are the non-pipelined step's, so every schedule matches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import model
from jaxllm.errors import ConfigError
from jaxllm.sharding import Layout

ACTIVATION = ("stage", "batch", "residual", "act_embed")
STASH = ("stage", None, "batch", "residual", "act_embed")
FUSED = ("1f1b", "interleaved_1f1b", "zb_h1")  # schedules whose one loop runs forwards and backwards
# Relative cost of a slot, for the bubble: a stage forward 1, its backward 2 (input and weight gradients,
# 1 each); the backward slot also recomputes the forward.  Qi et al. 2024 assume the same T_F = T_B = T_W.
_COST = {"forward": 1, "backward": 3, "input_grad": 2, "weight_grad": 1}


def check(cfg) -> None:
    """What the pipeline needs of a config being resolved (``stages`` and ``microbatches`` filled).

    Raises:
      ConfigError: layers not divisible by stages x virtual stages; microbatches not a multiple
        of the stages (which also guarantees ``m >= p``).
    """
    stages, virtual, t = cfg.stages, cfg.parallel.pipeline_virtual_stages, cfg.train
    if cfg.model.num_layers % (stages * virtual):
        raise ConfigError("model.num_layers", cfg.model.num_layers,
                          f"must be divisible by pipeline stages x virtual stages (mesh.pipeline x "
                          f"parallel.pipeline_virtual_stages) = {stages} x {virtual} = {stages * virtual}")
    if stages > 1 and cfg.microbatches % stages:
        rows = t.micro_batch_size * cfg.data_parallel
        raise ConfigError(
            "train.global_batch_size", t.global_batch_size,
            f"gives {cfg.microbatches} microbatches (global batch / (micro batch {t.micro_batch_size} x data-parallel "
            f"size {cfg.data_parallel})), which must be a multiple of the {stages} pipeline stages; use a global "
            f"batch that is a multiple of {rows * stages}, or a smaller train.micro_batch_size")


# ----- schedules ------------------------------------------------------------------------------


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
    (the backward slot recomputes the chunk from its stashed input), else 0 (:mod:`jaxllm.flops`
    counts them in the hardware FLOPs)."""
    return int(cfg.stages > 1 and cfg.parallel.pipeline_schedule in FUSED)


def summary(cfg) -> str:
    """``"1f1b, bubble 27.3%, 7 microbatches in flight per stage"`` (the log line's and the plan's words)."""
    st, v = schedule_stats(cfg), cfg.parallel.pipeline_virtual_stages
    unit = "microbatch-chunks" if v > 1 else "microbatches"
    return (f"{cfg.parallel.pipeline_schedule}, bubble {st.bubble:.1%}, {st.in_flight} {unit} in flight per stage"
            + (f", {st.deferred} awaiting W" if st.deferred else ""))


# ----- shared pieces --------------------------------------------------------------------------


def _stage_layout(w, p, v):
    """``[layers, ...]`` -> ``[p, v, layers / (p v), ...]``: stage ``s``, pass ``r`` holds chunk ``r p + s``."""
    return w.reshape(v, p, w.shape[0] // (p * v), *w.shape[1:]).swapaxes(0, 1)


def _layer_order(w):
    """The inverse of :func:`_stage_layout`."""
    return w.swapaxes(0, 1).reshape(-1, *w.shape[3:])


def _stage_axes(axes):
    """Logical axes of a ``[layers, ...]`` parameter (``axes``) in the stage layout ``[p, v, n, ...]``."""
    return ("stage", None, None) + axes[1:]


def _select(tree, index, axis):
    """Per stage: ``tree[s][index[s]]`` (leaves ``[p, n, ...]``, ``index`` int ``[p]``; ``axis``: the
    mesh axes of ``stage``)."""
    take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
    return jax.vmap(lambda t, i: jax.tree.map(lambda a: take(a, i), t), spmd_axis_name=axis)(tree, index)


def _store(buffers, slot, value, where, axis):
    """Per stage: ``buffers[s][slot[s]] = value[s]`` where ``where[s]`` (trees of ``[p, n, ...]`` / ``[p, ...]``)."""
    def one(b, i, x, w):
        return jax.tree.map(lambda b, x: jax.lax.dynamic_update_index_in_dim(b, jnp.where(w, x, b[i]), i, 0), b, x)

    p = jax.tree.leaves(buffers)[0].shape[0]
    return jax.vmap(one, spmd_axis_name=axis)(buffers, jnp.broadcast_to(slot, (p,)), value, where)


def loss(cfg, layout: Layout, spec, params, inputs, targets, positions, dropout_keys):
    """Mean loss of a batch of microbatches pushed through the pipeline.

    Args:
      cfg: the resolved run config (``cfg.stages > 1``).
      layout: the mesh and rules table (``stage`` over the pipeline axis).
      spec, params: the model (:class:`jaxllm.model.Spec`: its graph definition and logical axes).
      inputs, targets: int32 ``[microbatches, micro_batch, seq]``; ``microbatches`` must be a
        multiple of the stages (checked by :func:`check`).
      positions: int32 ``[microbatches, micro_batch, seq]``, the same in every microbatch (ring
        attention's order, :func:`jaxllm.context_parallel.zigzag`), or None: ``arange(seq)``.
      dropout_keys: one PRNG key per row ``[microbatches, micro_batch]``
        (:func:`jaxllm.step.row_keys`), or None (no dropout).
    Returns:
      float32 scalar: the mean cross entropy over every token (the model's fused output loss,
      :meth:`jaxllm.model.GPT.output_loss`), as the same batch gives without pipeline.  Its
      gradient (``jax.grad``) is autodiff's transpose of the forward loop for gpipe /
      interleaved, and the fused loop's own for the 1F1B family (the value is then the fused
      loop's too); without differentiation every schedule runs the forward loop.
    """
    if cfg.parallel.pipeline_schedule not in FUSED:
        return _forward_loss(cfg, layout, spec, params, inputs, targets, positions, dropout_keys)

    @jax.custom_vjp
    def fused(params, inputs, targets, positions, dropout_keys):
        return _forward_loss(cfg, layout, spec, params, inputs, targets, positions, dropout_keys)

    def fwd(params, inputs, targets, positions, dropout_keys):
        return _fused_loss_and_grads(cfg, layout, spec, params, inputs, targets, positions, dropout_keys)

    def bwd(grads, ct):
        return jax.tree.map(lambda g: g * ct, grads), None, None, None, None

    fused.defvjp(fwd, bwd)
    return fused(params, inputs, targets, positions, dropout_keys)


# ----- gpipe / interleaved: the forward loop (autodiff transposes it) --------------------------


def _forward_loss(cfg, layout, spec, params, inputs, targets, positions, dropout_keys):
    p, v, (m, mb, seq) = cfg.stages, cfg.parallel.pipeline_virtual_stages, inputs.shape
    stage_axis, constrain = layout.mesh_axes("stage"), layout.constrain
    gpt = nnx.merge(spec.graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(seq) if positions is None else positions[0], (mb, seq))

    if dropout_keys is None:
        x, layer_keys = jax.vmap(lambda t: gpt.embed(t, positions)[0])(inputs), None
    else:  # [m, layers, mb] -> per stage [p, m, v, layers / (p v), mb]
        x, layer_keys = jax.vmap(lambda t, k: gpt.embed(t, positions, k, positions))(inputs, dropout_keys)
        layer_keys = _stage_layout(layer_keys.swapaxes(0, 1), p, v).transpose(0, 3, 1, 2, 4)

    stage_params = jax.tree.map(lambda w, axes: constrain(_stage_layout(w, p, v), _stage_axes(axes)),
                                params["layers"], spec.axes["layers"])

    stage = jnp.arange(p)
    first, last = stage == 0, stage == p - 1

    select = functools.partial(_select, axis=stage_axis)
    store = functools.partial(_store, axis=stage_axis)

    def run_stage(w, h, keys):  # positions are the sequence order too (no data.reset_* options here)
        return gpt.run_layers(h, positions, w, keys, order=positions)[0]

    def iteration(carry, t):
        out, buffers = carry
        item = t - stage  # stage s works on pass item // m of microbatch item % m
        chunk = jnp.clip(item // m, 0, v - 1)
        w = jax.tree.map(lambda a: a[:, 0], stage_params) if v == 1 else select(stage_params, chunk)
        keys = None if layer_keys is None else select(jax.vmap(lambda k, i: k[i])(layer_keys, item % m), chunk)
        # Each stage receives its predecessor's output; stage 0 the last stage's, which it keeps in its
        # buffer until the microbatch's next pass, and otherwise reads the embeddings held there.
        received = jnp.roll(out, 1, axis=0)
        buffers = store(buffers, (t - p) % m, received, first & (t >= p))
        fed = jnp.where(t < v * m, select(buffers, jnp.broadcast_to(t % m, (p,))), 0)
        h = constrain(jnp.where(first[:, None, None, None], fed, received), ACTIVATION)
        out = constrain(jax.vmap(run_stage, spmd_axis_name=stage_axis)(w, h, keys), ACTIVATION)
        done = t - (p - 1)  # the item the last stage just finished: kept in its buffer
        buffers = store(buffers, done % m, out, last & (done >= 0) & (done < v * m))
        return (out, buffers), None

    # per stage a buffer of m microbatch activations (stage 0: inputs, last stage: outputs)
    buffers = constrain(jnp.broadcast_to(x, (p, *x.shape)), STASH)
    out = jnp.zeros((p, mb, seq, x.shape[-1]), x.dtype)
    (_, buffers), _ = jax.lax.scan(iteration, (out, buffers), jnp.arange(v * m + p - 1))
    hidden = buffers[-1]

    hidden = constrain(hidden.reshape(p, m // p, mb, seq, -1), STASH)
    # each stage: the summed token losses of its m / p microbatches
    totals = jax.vmap(gpt.output_loss, spmd_axis_name=stage_axis)(hidden, targets.reshape(p, m // p, mb, seq))
    return totals.sum() / targets.size


# ----- the 1F1B family: one loop of forwards and backwards ------------------------------------


@dataclasses.dataclass(frozen=True)
class _Matmul:
    weight: int  # index of the weight among the layer's parameter leaves
    bias: int | None
    spec: str  # the einsum, e.g. "bse,ehd->bshd"
    dtype: object
    input: int  # which of the layer's distinct matmul inputs
    out: jax.ShapeDtypeStruct


class _Router:
    """The ``dense`` operation (:class:`jaxllm.model.Ops`) of zb_h1's copy of the layers: the
    matmul function :meth:`using` sets while a layer is traced (:func:`jaxllm.model.dense` otherwise)."""

    def __init__(self):
        self.fn = model.dense

    def __call__(self, x, w, b, spec, dtype):
        return self.fn(x, w, b, spec, dtype)

    @contextlib.contextmanager
    def using(self, fn):
        previous, self.fn = self.fn, fn
        try:
            yield
        finally:
            self.fn = previous


class _SplitBackward:
    """zb_h1's backward of a chunk in two passes: B (input gradient) and W (weight gradient).

    Every matmul ``y = einsum(x, w) + b`` of a layer goes through the model's ``dense``
    operation, here a :class:`_Router`.
    B: the vjp of the chunk with ``w``, ``b`` held constant and a zero ``tap`` added to each ``y``
    gives the input gradient, the gradients of the other parameters (norms) and each ``dy`` as its
    tap's gradient; it also returns each matmul's input ``x`` (as the matmul casts it).  W: per
    matmul the vjp of ``einsum(x, w) + b`` alone with ``dy``: ``dw = x^T dy``, ``db = sum dy``, the
    same operations autodiff runs, so B + W give the 1F1B gradients.

    Args:
      layer_graphdef: ``nnx.graphdef`` of the model's layers, built with ``router`` as the ``dense``
        operation; router: that :class:`_Router`; layer_params: one layer's parameters
        (arrays or ``ShapeDtypeStruct``); x: ``[micro_batch, seq, embed]`` abstract input;
      positions: int32 ``[micro_batch, seq]``; remat: ``model.remat``; layer_axes: the logical
        axes of one layer's parameters (leading ``layers`` removed).
    Raises:
      RuntimeError: a matmul's weight is not one of the layer's parameters.
    """

    def __init__(self, layer_graphdef, router, layer_params, x, positions, remat, layer_axes):
        self.graphdef, self.router, self.positions = layer_graphdef, router, positions
        self.treedef = jax.tree.structure(layer_params)
        self.matmuls, self.inputs = [], []

        def probe(params, x):
            ids = {id(a): i for i, a in enumerate(jax.tree.leaves(params))}
            seen = []

            def hook(xin, w, b, spec, dtype):
                if id(w) not in ids or (b is not None and id(b) not in ids):
                    raise RuntimeError(f"zb_h1: the weight of a {spec} matmul is not a layer parameter")
                j = next((i for i, a in enumerate(seen) if a is xin), None)
                if j is None:
                    seen.append(xin)
                    j = len(seen) - 1
                    self.inputs.append(jax.ShapeDtypeStruct(xin.shape, jnp.dtype(dtype)))
                y = model.dense(xin, w, b, spec, dtype)
                self.matmuls.append(_Matmul(ids[id(w)], None if b is None else ids[id(b)], spec, dtype, j,
                                            jax.ShapeDtypeStruct(y.shape, y.dtype)))
                return y

            with router.using(hook):
                return nnx.merge(self.graphdef, params)(x, positions, None, None, positions)[0]

        jax.eval_shape(probe, layer_params, x)
        self.layer = self._layer if remat == "none" else jax.checkpoint(
            self._layer, policy=model.REMAT_POLICIES[remat], prevent_cse=False)
        # logical axes of the kept [layers, micro_batch, seq, ...] inputs and gradients, from the einsums
        axes = jax.tree.leaves(layer_axes, is_leaf=lambda a: isinstance(a, tuple))

        def names(mm, operand):  # logical axes of the matmul's input ("x") or output ("y") [layers, b, s, ...]
            (x, w), y = (side.split(",") for side in mm.spec.split("->"))
            by_letter = {"b": "batch", "s": "length", **dict(zip(w, axes[mm.weight], strict=True))}
            activation = {"embed": "act_embed"}  # the weights' name of a dimension -> the activations'
            return (None, *(activation.get(by_letter[c], by_letter[c]) for c in (x if operand == "x" else y[0])))

        first_use = {mm.input: mm for mm in reversed(self.matmuls)}
        self.record_axes = (tuple(names(first_use[j], "x") for j in range(len(self.inputs))),
                            tuple(names(mm, "y") for mm in self.matmuls))

    def _layer(self, params, x, taps, key):
        seen, count = [], iter(range(len(self.matmuls)))

        def hook(xin, w, b, spec, dtype):
            if not any(a is xin for a in seen):
                seen.append(xin)
            sg = jax.lax.stop_gradient
            return model.dense(xin, sg(w), None if b is None else sg(b), spec, dtype) + taps[next(count)]

        with self.router.using(hook):
            y = nnx.merge(self.graphdef, params)(x, self.positions, key, None, self.positions)[0]
        return y, tuple(a.astype(s.dtype) for a, s in zip(seen, self.inputs, strict=True))

    def record_shapes(self, n):
        """Abstract ``(inputs, output gradients)`` of a chunk of ``n`` layers."""
        stack = lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype)  # noqa: E731
        return tuple(map(stack, self.inputs)), tuple(stack(mm.out) for mm in self.matmuls)

    def input_grad(self, w, h, g, keys):
        """B of a chunk: ``(parameter gradients (zero for the matmuls), dh, (inputs, dys))`` from its
        input ``h [micro_batch, seq, embed]``, output gradient ``g`` and parameters ``w [n, ...]``."""
        n = jax.tree.leaves(w)[0].shape[0]
        taps = tuple(jnp.zeros((n, *mm.out.shape), mm.out.dtype) for mm in self.matmuls)

        def chunk(w, h, taps):
            return jax.lax.scan(lambda x, xs: self.layer(xs[0], x, xs[1], xs[2]), h, (w, taps, keys))

        _, vjp, inputs = jax.vjp(chunk, w, h, taps, has_aux=True)
        dw, dh, dys = vjp(g)
        return dw, dh, (inputs, dys)

    def weight_grad(self, w, record):
        """W of a chunk: the matmul weight and bias gradients ``[n, ...]`` (zero elsewhere), float32."""
        def layer(params, inputs, dys):
            leaves = jax.tree.leaves(params)
            grads = [jnp.zeros(a.shape, jnp.float32) for a in leaves]
            for mm, dy in zip(self.matmuls, dys, strict=True):
                bias = None if mm.bias is None else leaves[mm.bias]
                _, vjp = jax.vjp(lambda w, b: model.dense(inputs[mm.input], w, b, mm.spec, mm.dtype),  # noqa: B023
                                 leaves[mm.weight], bias)
                gw, gb = vjp(dy)
                grads[mm.weight] = grads[mm.weight] + gw
                if mm.bias is not None:
                    grads[mm.bias] = grads[mm.bias] + gb
            return jax.tree.unflatten(self.treedef, grads)

        return jax.vmap(layer)(w, *record)


def _fused_loss_and_grads(cfg, layout, spec, params, inputs, targets, positions, dropout_keys):
    """``(mean loss, gradients)`` of the 1F1B-family loop (see the module docstring); gradients
    float32, shaped as ``params``."""
    schedule, p, v = cfg.parallel.pipeline_schedule, cfg.stages, cfg.parallel.pipeline_virtual_stages
    m, mb, seq = inputs.shape
    n = cfg.model.num_layers // (p * v)
    tt = timetable(schedule, p, v, m)
    axis, constrain = layout.mesh_axes("stage"), layout.constrain
    vmap = functools.partial(jax.vmap, spmd_axis_name=axis)
    positions = jnp.broadcast_to(jnp.arange(seq) if positions is None else positions[0], (mb, seq))
    layers, rest = params["layers"], {k: w for k, w in params.items() if k != "layers"}
    gpt = nnx.merge(spec.graphdef, params)
    dtype, hidden = jnp.dtype(cfg.model.dtype), cfg.model.hidden_size
    scale = 1.0 / targets.size
    logical = spec.axes
    split = None
    if schedule == "zb_h1":  # a copy of the layers whose matmuls go through a router
        router = _Router()
        layer_graphdef = nnx.graphdef(nnx.merge(
            model.describe(cfg.model, dataclasses.replace(gpt.ops, dense=router)).graphdef, params).layers)
        one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
        layer_axes = jax.tree.map(lambda axes: axes[1:], logical["layers"], is_leaf=lambda a: isinstance(a, tuple))
        split = _SplitBackward(layer_graphdef, router, one_layer, jax.ShapeDtypeStruct((mb, seq, hidden), dtype),
                               positions, cfg.model.remat, layer_axes)

    def embed(rest, tokens, key):  # -> [mb, seq, embed], dropout keys of every layer [layers, mb] or None
        return nnx.merge(spec.graphdef, {**rest, "layers": layers}).embed(tokens, positions, key, positions)

    def head_loss(rest, h, y):  # summed token losses of one microbatch (the model's fused output loss)
        return nnx.merge(spec.graphdef, {**rest, "layers": layers}).output_loss(h, y)

    def chunk_of(w, keys, chunk, stage):  # one stage's parameters [v, n, ...] -> virtual stage chunk p + stage
        w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, chunk, keepdims=False), w)
        return w, None if keys is None else jax.lax.dynamic_slice_in_dim(keys, (chunk * p + stage) * n, n)

    def run_chunk(w, h, keys):  # positions are the sequence order too (no data.reset_* options here)
        return gpt.run_layers(h, positions, w, keys, order=positions)[0]

    def take(a, index, axes):  # per stage a[index[s]]: [p, ...]
        return constrain(jnp.take(a, index, axis=0), ("stage", *axes))

    stage = jnp.arange(p)
    stage_params = jax.tree.map(lambda w, axes: constrain(_stage_layout(w, p, v), _stage_axes(axes)),
                                layers, logical["layers"])
    rest_axes = {k: logical[k] for k in rest}
    zeros = lambda shape, dt, axes: constrain(jnp.zeros(shape, dt), axes)  # noqa: E731
    carry = {
        "forward": zeros((p, mb, seq, hidden), dtype, ACTIVATION),  # what each stage receives to forward
        "backward": zeros((p, mb, seq, hidden), dtype, ACTIVATION),  # ... and the gradient it receives
        "stash": zeros((p, tt.stash, mb, seq, hidden), dtype, STASH),  # inputs forwarded, not yet backwarded
        "grads": jax.tree.map(lambda w, axes: zeros(w.shape, jnp.float32, _stage_axes(axes)), stage_params,
                              logical["layers"]),
        "rest_grads": jax.tree.map(lambda w, axes: zeros((p, *w.shape), jnp.float32, ("stage",) + axes), rest,
                                   rest_axes),
        "loss": jnp.zeros((p,), jnp.float32),
    }
    if split:
        carry["deferred"] = jax.tree.map(
            lambda s, axes: zeros((p, tt.deferred, *s.shape), s.dtype, ("stage", None, *axes)),
            split.record_shapes(n), split.record_axes, is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct))

    def forward_slot(carry, row):
        f, chunk = row["forward"], row["forward_chunk"]
        keys = None if dropout_keys is None else dropout_keys[jnp.maximum(f, 0)]

        def one(w, received, tokens, key, chunk, stage):
            x, layer_keys = embed(rest, tokens, key)
            h = jnp.where((stage == 0) & (chunk == 0), x, received)
            wc, kc = chunk_of(w, layer_keys, chunk, stage)
            return h, run_chunk(wc, h, kc)

        tokens = take(inputs, jnp.maximum(f, 0), ("batch", "length"))
        h, out = vmap(one)(stage_params, carry["forward"], tokens, keys, chunk, stage)
        carry["stash"] = _store(carry["stash"], row["stash_write"], h, f >= 0, axis)
        carry["forward"] = constrain(jnp.roll(out, 1, axis=0), ACTIVATION)
        return carry, constrain(out, ACTIVATION)

    def backward_slot(carry, row, out):
        b, chunk = row["backward"], row["backward_chunk"]
        valid, bi = b >= 0, jnp.maximum(b, 0)
        keys = None if dropout_keys is None else dropout_keys[bi]

        def one(w, grads, rest_grads, received, h, tokens, y, key, chunk, stage, valid, out):
            first, last = valid & (stage == 0) & (chunk == 0), valid & (stage == p - 1) & (chunk == v - 1)
            masked = lambda cond, t: jax.tree.map(lambda a: jnp.where(cond, a, 0), t)  # noqa: E731
            g, loss = received, jnp.zeros((), jnp.float32)
            if out is not None:  # the last virtual stage's loss gradient seeds the backward (head in lockstep)
                loss, head_vjp = jax.vjp(lambda r, o: head_loss(r, o, y), rest, out)
                d_rest, d_out = head_vjp(jnp.asarray(scale, loss.dtype))
                g = jnp.where(last, d_out, received)
                rest_grads = jax.tree.map(jnp.add, rest_grads, masked(last, d_rest))
            _, embed_vjp, layer_keys = jax.vjp(lambda r: embed(r, tokens, key), rest, has_aux=True)
            wc, kc = chunk_of(w, layer_keys, chunk, stage)
            if split is None:
                dw, dh = jax.vjp(lambda w, h: run_chunk(w, h, kc), wc, h)[1](g)
                record = None
            else:
                dw, dh, record = split.input_grad(wc, h, g, kc)
            rest_grads = jax.tree.map(jnp.add, rest_grads, masked(first, embed_vjp(dh)[0]))
            grads = jax.tree.map(lambda a, d: jax.lax.dynamic_update_index_in_dim(
                a, a[chunk] + jnp.where(valid, d, 0).astype(jnp.float32), chunk, 0), grads, dw)
            return grads, rest_grads, dh, jnp.where(last, loss, 0), record

        h = _select(carry["stash"], row["stash_read"], axis)
        tokens, y = take(inputs, bi, ("batch", "length")), take(targets, bi, ("batch", "length"))
        grads, rest_grads, dh, loss, record = vmap(one, in_axes=(0,) * 11 + (None if out is None else 0,))(
            stage_params, carry["grads"], carry["rest_grads"], carry["backward"], h, tokens, y, keys, chunk, stage,
            valid, out)
        carry.update(grads=grads, rest_grads=rest_grads, loss=carry["loss"] + loss,
                     backward=constrain(jnp.roll(dh, -1, axis=0), ACTIVATION))
        if split:
            carry["deferred"] = _store(carry["deferred"], row["deferred_write"], record, valid, axis)
        return carry

    def weight_slot(carry, row):
        record = _select(carry["deferred"], row["deferred_read"], axis)

        def one(w, grads, record, valid):
            dw = split.weight_grad(jax.tree.map(lambda a: a[0], w), record)
            return jax.tree.map(lambda a, d: a.at[0].add(jnp.where(valid, d, 0)), grads, dw)

        carry["grads"] = vmap(one)(stage_params, carry["grads"], record, row["weight"] >= 0)
        return carry

    def body(used, carry, row):
        forward, backward, weight = used
        out = None
        if forward:
            carry, out = forward_slot(carry, row)
        if backward:
            carry = backward_slot(carry, row, out)
        if weight:
            carry = weight_slot(carry, row)
        return carry, None

    rows = tt.rows()
    for start, stop, used in tt.phases:
        xs = {k: jnp.asarray(a[start:stop]) for k, a in rows.items()}
        carry, _ = jax.lax.scan(functools.partial(body, used), carry, xs)
    grads = {"layers": jax.tree.map(lambda g, axes: constrain(_layer_order(g), axes), carry["grads"],
                                    logical["layers"]),
             **jax.tree.map(lambda g, axes: constrain(g.sum(0), axes), carry["rest_grads"], rest_axes)}
    return carry["loss"].sum() * scale, grads
