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
    of the layers goes through the model's ``dense`` operation (:class:`jaxllm.model.gpt.Ops`),
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
from the bubble phases instead (:func:`jaxllm.parallel.schedules.stats`): ``3 (p - 1) / (4 m + 3 (p - 1))``
against 1F1B's ``(p - 1) / (m + p - 1)``, counting the recomputed forward as work,
and it keeps ``p`` microbatches of matmul inputs and output gradients for W.

In the 1F1B family the loop computes the gradients itself (a ``jax.custom_vjp``
whose forward is the fused loop and whose backward only scales them), so autodiff
never transposes the loop.  Per stage, the embedding runs at the first virtual
stage and its gradient at its backward; the final norm, output layer and loss (and
their gradient, the backward's seed) at the last virtual stage; the gradients are
summed per stage over the microbatches in float32 and returned in layer order.
Dropout keys are the non-pipelined step's, so every schedule matches it.

A model of several layer groups (:func:`jaxllm.model.gpt.layer_groups`: DeepSeek-V3's dense layers, then its
MoE layers) pipelines its last group; the groups before it must be dense and run with the embedding, on every
stage (as MaxText runs DeepSeek's dense layers outside its pipeline), because the stages of one SPMD loop
must hold layers of one kind.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.errors import ConfigError
from jaxllm.model import gpt as gpt_module  # `gpt` is the merged model in the functions below
from jaxllm.parallel import schedules, zero_bubble
from jaxllm.parallel.schedules import FUSED
from jaxllm.parallel.sharding import Layout

ACTIVATION = ("stage", "batch", "residual", "act_embed")
STASH = ("stage", None, "batch", "residual", "act_embed")
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


def _unstacked(axes):
    """Logical axes of a parameter kept whole on every stage: ``layers`` (split over the same mesh axis as
    ``stage``) left out."""
    return tuple(None if a == "layers" else a for a in axes)


def pipelined(cfg) -> gpt_module.Group:
    """The layer group the stages split: the model's last (:func:`jaxllm.model.gpt.layer_groups`)."""
    return gpt_module.layer_groups(cfg.model)[-1]


def check(cfg) -> None:
    """What the pipeline needs of a config's layers (called by :func:`jaxllm.resolve.resolve`).

    Raises:
      ConfigError: the pipelined layers (:func:`pipelined`) not divisible by stages x virtual stages; with
        pipeline parallelism, a mixture-of-experts layer before the last group (those run with the embedding).
    """
    stages, virtual = cfg.stages, cfg.parallel.pipeline_virtual_stages
    groups = gpt_module.layer_groups(cfg.model)
    if stages > 1 and any(g.kind.moe for g in groups[:-1]):
        raise ConfigError("model.moe_layer_freq", cfg.model.moe_layer_freq,
                          "with pipeline parallelism only the last group of layers of one kind may be mixtures of "
                          "experts (the stages split that group; the dense layers before it run with the "
                          "embedding): dense layers first, then MoE layers, e.g. ([0]*2+[1]*6), or mesh.pipeline=1")
    if stages > 1 and cfg.model.moe_router_enable_expert_bias and cfg.parallel.pipeline_schedule not in FUSED:
        raise ConfigError("model.moe_router_enable_expert_bias", True, f"the experts' loads reach the bias through the "
                          f"backward pass, which parallel.pipeline_schedule={cfg.parallel.pipeline_schedule} also runs "
                          f"for idle slots: use 1f1b, interleaved_1f1b or zb_h1")
    period = len(groups[-1].pattern)  # a chunk's layers must be whole periods of its pattern of kinds
    if groups[-1].num_layers % (stages * virtual * period):
        key, value, what = ("model.num_layers", cfg.model.num_layers, "must be") if len(groups) == 1 else (
            "model.moe_layer_freq", cfg.model.moe_layer_freq,
            f"ends with a group of {groups[-1].num_layers} layer(s) of one kind, which the stages split: it must be")
        if period > 1:
            key, value, what = ("model.window_attn_skip_freq", cfg.model.window_attn_skip_freq,
                                f"ends with a group of {groups[-1].num_layers} layers in periods of {period}, which "
                                f"the stages split in whole periods: its periods must be")
        raise ConfigError(key, value, f"{what} divisible by pipeline stages x virtual stages (mesh.pipeline x "
                          f"parallel.pipeline_virtual_stages) = {stages} x {virtual} = {stages * virtual}")


def _no_stats(cfg, m):
    """Per stage and microbatch ``[p, m]`` sums over a stage's layers of the routing statistics
    (:func:`jaxllm.model.moe.route`; ``max_load`` their maximum), zero; None for dense pipelined layers."""
    if not pipelined(cfg).kind.moe:
        return None
    return {k: jnp.zeros((cfg.stages, m), jnp.float32) for k in ("aux_loss", "z_loss", "max_load", "dropped")}


def _add_stats(acc, stats, micro, valid):
    """``acc`` (:func:`_no_stats`) plus one iteration's statistics ``stats`` (``[p, layers of a chunk]``) of
    microbatch ``micro`` int ``[p]`` where ``valid`` bool ``[p]``."""
    if acc is None:
        return None

    def one(acc, stats, i, ok):
        return {k: a.at[i].set(jnp.maximum(a[i], jnp.where(ok, stats[k].max(), 0)) if k == "max_load"
                               else a[i] + jnp.where(ok, stats[k].sum(), 0)) for k, a in acc.items()}

    return jax.vmap(one)(acc, stats, micro, valid)


def _stats_metrics(cfg, acc) -> dict:
    """The logged statistics of :meth:`jaxllm.model.gpt.GPT.moe_stats` from the accumulated ones: per microbatch
    the layers' mean (the busiest expert: their maximum), then the microbatches' mean."""
    if acc is None:
        return {}
    layers, m = pipelined(cfg).num_layers, acc["aux_loss"].shape[1]
    per_micro = {k: a.max(0) if k == "max_load" else a.sum(0) / layers for k, a in acc.items()}
    return {name: per_micro[k].sum() / m for name, k in zip(gpt_module.MOE_STATS, ("aux_loss", "z_loss", "max_load",
                                                                                "dropped"))}


def loss(cfg, layout: Layout, spec, params, inputs, targets, positions, dropout_keys):
    """Mean loss of a batch of microbatches pushed through the pipeline, and a mixture of experts' statistics.

    Args:
      cfg: the resolved run config (``cfg.stages > 1``).
      layout: the mesh and rules table (``stage`` over the pipeline axis).
      spec, params: the model (:class:`jaxllm.model.gpt.Spec`: its graph definition and logical axes).
      inputs, targets: int32 ``[microbatches, micro_batch, seq]``; ``microbatches`` must be a
        multiple of the stages (checked by :func:`check`).
      positions: int32 ``[microbatches, micro_batch, seq]``, the same in every microbatch (ring
        attention's order, :func:`jaxllm.parallel.context_parallel.zigzag`), or None: ``arange(seq)``.
      dropout_keys: one PRNG key per row ``[microbatches, micro_batch]``
        (:func:`jaxllm.runtime.step.row_keys`), or None (no dropout).
    Returns:
      ``(loss, stats)``: float32 scalar, the mean cross entropy over every token (the model's fused
      output loss, :meth:`jaxllm.model.gpt.GPT.output_loss`), as the same batch gives without pipeline,
      and the routing statistics of :meth:`jaxllm.model.gpt.GPT.moe_stats`, averaged over the
      microbatches (``{}`` for a dense model), with ``model.mtp_num_layers`` (gpipe, interleaved; :func:`_mtp_loss`)
      also ``mtp_loss``, whose ``mtp_loss_scaling_factor`` x gradient joins the loss's as the routers' do (the
      value stays the cross entropy).  The loss's gradient (``jax.grad`` with ``has_aux``) is
      autodiff's transpose of the forward loop for gpipe / interleaved, and the fused loop's own for
      the 1F1B family (the values are then the fused loop's too); without differentiation every
      schedule runs the forward loop.  A router's losses reach its gradients through the model's
      ``router_loss`` (:func:`jaxllm.model.moe.attach_loss`), in every schedule.
    """
    if cfg.parallel.pipeline_schedule not in FUSED:
        return _forward_loss(cfg, layout, spec, params, inputs, targets, positions, dropout_keys)

    @jax.custom_vjp
    def fused(params, inputs, targets, positions, dropout_keys):
        return _forward_loss(cfg, layout, spec, params, inputs, targets, positions, dropout_keys)

    def fwd(params, inputs, targets, positions, dropout_keys):
        loss, stats, grads = _Fused(cfg, layout, spec, params, inputs, targets, positions, dropout_keys).run()
        return (loss, stats), grads

    def bwd(grads, ct):
        return jax.tree.map(lambda g: g * ct[0], grads), None, None, None, None

    fused.defvjp(fwd, bwd)
    return fused(params, inputs, targets, positions, dropout_keys)


def _embed(gpt, params, group, tokens, positions, key):
    """The input of the pipelined layer ``group`` for one microbatch ``[mb, seq, embed]``: the embedding, then
    the groups before it (:func:`pipelined`); and its layers' dropout keys ``[layers, mb]`` (None without ``key``)."""
    x, keys = gpt.embed(tokens, positions, key, positions)
    before = tuple(g for g in gpt.groups if g.stop <= group.first)
    if before:
        x, _ = gpt.run_groups(x, positions, params, None if keys is None else keys[:group.first], groups=before,
                              order=positions)
    return x, None if keys is None else keys[group.first:group.stop]  # (the multi-token prediction's after)


# ----- gpipe / interleaved: the forward loop (autodiff transposes it) --------------------------


def _detached(x, loss):
    """The model's ``router_loss`` in the forward loop: nothing, because every slot of the loop, idle ones
    too, would give its router the loss's gradient; :func:`_forward_loss` adds the valid slots' losses."""
    return x


def _forward_loss(cfg, layout, spec, params, inputs, targets, positions, dropout_keys):
    p, v, (m, mb, seq) = cfg.stages, cfg.parallel.pipeline_virtual_stages, inputs.shape
    stage_axis, constrain = layout.mesh_axes("stage"), layout.constrain
    gpt = nnx.merge(spec.graphdef, params)
    if cfg.model.num_experts:  # the routers' losses join the objective at the end, from the valid slots only
        gpt = nnx.merge(gpt_module.describe(cfg.model, dataclasses.replace(gpt.ops, router_loss=_detached)).graphdef,
                        params)
    positions = jnp.broadcast_to(jnp.arange(seq) if positions is None else positions[0], (mb, seq))
    group = pipelined(cfg)

    if dropout_keys is None:
        x, layer_keys = jax.vmap(lambda t: _embed(gpt, params, group, t, positions, None))(inputs)
    else:  # [m, layers, mb] -> per stage [p, m, v, layers / (p v), mb]
        x, layer_keys = jax.vmap(lambda t, k: _embed(gpt, params, group, t, positions, k))(inputs, dropout_keys)
        layer_keys = _stage_layout(layer_keys.swapaxes(0, 1), p, v).transpose(0, 3, 1, 2, 4)

    stage_params = jax.tree.map(lambda w, axes: constrain(_stage_layout(w, p, v), _stage_axes(axes)),
                                params[group.name], spec.axes[group.name])

    stage = jnp.arange(p)
    first, last = stage == 0, stage == p - 1

    select = functools.partial(_select, axis=stage_axis)
    store = functools.partial(_store, axis=stage_axis)

    def run_stage(w, h, keys):  # positions are the sequence order too (no data.reset_* options here)
        return gpt.run_layers(h, positions, w, keys, group=group, order=positions)

    def iteration(carry, t):
        out, buffers, stats = carry
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
        out, layer_stats = jax.vmap(run_stage, spmd_axis_name=stage_axis)(w, h, keys)
        out = constrain(out, ACTIVATION)
        stats = _add_stats(stats, layer_stats, item % m, (item >= 0) & (item < v * m))
        done = t - (p - 1)  # the item the last stage just finished: kept in its buffer
        buffers = store(buffers, done % m, out, last & (done >= 0) & (done < v * m))
        return (out, buffers, stats), None

    # per stage a buffer of m microbatch activations (stage 0: inputs, last stage: outputs)
    buffers = constrain(jnp.broadcast_to(x, (p, *x.shape)), STASH)
    out = jnp.zeros((p, mb, seq, x.shape[-1]), x.dtype)
    (_, buffers, stats), _ = jax.lax.scan(iteration, (out, buffers, _no_stats(cfg, m)), jnp.arange(v * m + p - 1))
    hidden = buffers[-1]

    hidden = constrain(hidden.reshape(p, m // p, mb, seq, -1), STASH)
    # each stage: the summed token losses of its m / p microbatches
    by_stage = lambda a: None if a is None else a.reshape(p, m // p, *a.shape[1:])  # noqa: E731
    totals = jax.vmap(gpt.output_loss, spmd_axis_name=stage_axis)(hidden, by_stage(targets))
    loss, metrics = totals.sum() / targets.size, _stats_metrics(cfg, stats)
    if stats is not None:  # their gradient, not their value: the loss stays the cross entropy
        mc = cfg.model
        routers = (mc.moe_aux_loss_coeff * stats["aux_loss"].sum() + mc.moe_z_loss_coeff * stats["z_loss"].sum()) / m
        loss = loss + (routers - jax.lax.stop_gradient(routers))
    if gpt.mtp is not None:  # the same, their gradient: the depths on each stage's microbatches of the last stage's
        mtp = _mtp_loss(cfg, gpt, hidden, by_stage(inputs), by_stage(targets), positions, by_stage(dropout_keys),
                        stage_axis)
        loss, metrics = loss + cfg.model.mtp_loss_scaling_factor * (mtp - jax.lax.stop_gradient(mtp)), {
            **metrics, "mtp_loss": mtp}
    return loss, metrics


def _mtp_loss(cfg, gpt, hidden, inputs, targets, positions, dropout_keys, stage_axis):
    """The multi-token prediction depths' mean loss (:meth:`jaxllm.model.gpt.GPT.mtp_losses`, each depth over
    its tokens, :func:`jaxllm.runtime.step.counts`) of the last stage's outputs ``hidden`` ``[p, m / p, mb, seq,
    embed]``, each stage taking m / p of them as the output loss does; inputs, targets ``[p, m / p, mb, seq]``,
    dropout keys ``[p, m / p, mb]`` or None."""
    n, seq = cfg.model.mtp_num_layers, inputs.shape[-1]

    def one(h, tokens, y, key):
        keys = None if key is None else gpt.dropout_keys(key, tokens.shape[0])[1 + cfg.model.num_layers:]
        return gpt.mtp_losses(gpt.ln_f(h), tokens, y, positions, keys, order=positions)

    over_micro = jax.vmap(one, in_axes=(0, 0, 0, None if dropout_keys is None else 0))
    sums = jax.vmap(over_micro, in_axes=(0, 0, 0, None if dropout_keys is None else 0), spmd_axis_name=stage_axis)(
        hidden, inputs, targets, dropout_keys).sum((0, 1))
    tokens = inputs.size // seq * (seq - jnp.arange(1, n + 1))  # each depth drops the last k places of each row
    return jnp.mean(sums / tokens)


# ----- the 1F1B family: one loop of forwards and backwards ------------------------------------


class _Carry(NamedTuple):
    """What the 1F1B-family loop carries from one iteration to the next (leading axis: the ``p`` stages)."""

    forward: jax.Array  # [p, mb, seq, hidden], model dtype: the activation each stage receives to forward
    backward: jax.Array  # [p, mb, seq, hidden]: the gradient each stage receives to backward
    stash: jax.Array  # [p, stash slots, mb, seq, hidden]: the inputs forwarded and not yet backwarded
    grads: dict  # float32, the layers' in the stage layout [p, v, n, ...]
    rest_grads: dict  # float32 [p, ...]: each stage's part of the embedding's, final norm's and head's
    loss: jax.Array  # float32 [p]: the summed token losses (the last stage's)
    stats: dict | None  # the routing statistics (:func:`_no_stats`); None for a dense model
    deferred: dict | None  # zb_h1: the matmul inputs and output gradients kept for W [p, deferred slots, ...]


class _Slot(NamedTuple):
    """One slot's microbatch on every stage (leading axis ``p``)."""

    tokens: jax.Array  # int32 [p, mb, seq]
    targets: jax.Array | None  # int32 [p, mb, seq]; None in a forward slot
    keys: jax.Array | None  # the rows' dropout keys [p, mb], or None (no dropout)
    chunk: jax.Array  # int32 [p]: which of the stage's v chunks
    stage: jax.Array  # int32 [p]: the stage's index
    valid: jax.Array  # bool [p]: whether the stage's slot is in use (else idle: computed, masked)


class _Fused:
    """The 1F1B-family loop of one batch (see the module docstring and :func:`loss`): the slot kinds of
    :func:`jaxllm.parallel.schedules.timetable` (forward, backward, zb_h1's weight gradient) as methods over
    every stage at once (a ``vmap`` over the stage axis), scanned phase by phase by :meth:`run`.

    Args: those of :func:`loss` (``cfg.parallel.pipeline_schedule`` one of :data:`FUSED`).
    """

    def __init__(self, cfg, layout, spec, params, inputs, targets, positions, dropout_keys):
        self.cfg, self.spec, self.p, self.v = cfg, spec, cfg.stages, cfg.parallel.pipeline_virtual_stages
        m, mb, seq = inputs.shape
        self.group = group = pipelined(cfg)
        self.n = group.num_layers // (self.p * self.v)
        self.tt = schedules.timetable(cfg.parallel.pipeline_schedule, self.p, self.v, m)
        self.axis, self.constrain = layout.mesh_axes("stage"), layout.constrain
        self.inputs, self.targets, self.dropout_keys = inputs, targets, dropout_keys
        self.positions = jnp.broadcast_to(jnp.arange(seq) if positions is None else positions[0], (mb, seq))
        self.layers, self.rest = params[group.name], {k: w for k, w in params.items() if k != group.name}
        self.gpt = nnx.merge(spec.graphdef, params)
        self.scale = 1.0 / targets.size
        self.split = self._split_backward(params) if cfg.parallel.pipeline_schedule == "zb_h1" else None
        self.stage = jnp.arange(self.p)
        self.stage_params = jax.tree.map(
            lambda w, axes: self.constrain(_stage_layout(w, self.p, self.v), _stage_axes(axes)),
            self.layers, spec.axes[group.name])
        self.rest_axes = {k: spec.axes[k] for k in self.rest}

    def _split_backward(self, params) -> zero_bubble.SplitBackward:
        """zb_h1's backward in two (B, W): a copy of the layers whose matmuls go through a router."""
        router = zero_bubble.Router()
        routed = gpt_module.describe(self.cfg.model, dataclasses.replace(self.gpt.ops, dense=router))
        layer_graphdef = nnx.graphdef(getattr(nnx.merge(routed.graphdef, params), self.group.name))
        one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.layers)
        layer_axes = jax.tree.map(lambda axes: axes[1:], self.spec.axes[self.group.name],
                                  is_leaf=lambda a: isinstance(a, tuple))
        x = jax.ShapeDtypeStruct((*self.positions.shape, self.cfg.model.hidden_size), jnp.dtype(self.cfg.model.dtype))
        return zero_bubble.SplitBackward(layer_graphdef, router, one_layer, x, self.positions, self.cfg.model.remat,
                                         layer_axes)

    def _zeros(self, shape, dtype, axes):
        return self.constrain(jnp.zeros(shape, dtype), axes)

    def initial(self) -> _Carry:
        """The carry before the first iteration: zeros."""
        p, tt, dtype, logical = self.p, self.tt, jnp.dtype(self.cfg.model.dtype), self.spec.axes
        act = (p, *self.positions.shape, self.cfg.model.hidden_size)
        return _Carry(
            forward=self._zeros(act, dtype, ACTIVATION), backward=self._zeros(act, dtype, ACTIVATION),
            stash=self._zeros((p, tt.stash, *act[1:]), dtype, STASH),
            grads=jax.tree.map(lambda w, axes: self._zeros(w.shape, jnp.float32, _stage_axes(axes)),
                               self.stage_params, logical[self.group.name]),
            rest_grads=jax.tree.map(lambda w, axes: self._zeros((p, *w.shape), jnp.float32,
                                                                ("stage",) + _unstacked(axes)),
                                    self.rest, self.rest_axes),
            loss=jnp.zeros((p,), jnp.float32), stats=_no_stats(self.cfg, self.inputs.shape[0]),
            deferred=None if self.split is None else jax.tree.map(
                lambda s, axes: self._zeros((p, tt.deferred, *s.shape), s.dtype, ("stage", None, *axes)),
                self.split.record_shapes(self.n), self.split.record_axes,
                is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct)))

    def _embed(self, rest, tokens, key):
        """-> ``[mb, seq, embed]`` (:func:`_embed`), the dropout keys of the pipelined layers ``[layers, mb]`` or
        None."""
        params = {**rest, self.group.name: self.layers}
        return _embed(nnx.merge(self.spec.graphdef, params), params, self.group, tokens, self.positions, key)

    def _head_loss(self, rest, h, y):
        """The summed token losses of one microbatch (the model's fused output loss)."""
        return nnx.merge(self.spec.graphdef, {**rest, self.group.name: self.layers}).output_loss(h, y)

    def _chunk_of(self, w, keys, chunk, stage):
        """One stage's parameters ``[v, n, ...]`` and layer keys -> those of virtual stage ``chunk p + stage``."""
        w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, chunk, keepdims=False), w)
        return w, None if keys is None else jax.lax.dynamic_slice_in_dim(keys, (chunk * self.p + stage) * self.n,
                                                                          self.n)

    def _run_chunk(self, w, h, keys):  # positions are the sequence order too (no data.reset_* options here)
        return self.gpt.run_layers(h, self.positions, w, keys, group=self.group, order=self.positions)

    def _take(self, a, index):
        """Per stage ``a[index[s]]``: ``[p, mb, seq]``."""
        return self.constrain(jnp.take(a, index, axis=0), ("stage", "batch", "length"))

    def _slot(self, micro, chunk, *, targets: bool) -> _Slot:
        """The work of a slot: microbatch ``micro`` int32 ``[p]`` (-1: idle), chunk ``chunk`` int32 ``[p]``."""
        valid, i = micro >= 0, jnp.maximum(micro, 0)
        keys = None if self.dropout_keys is None else self.dropout_keys[i]
        return _Slot(self._take(self.inputs, i), self._take(self.targets, i) if targets else None, keys, chunk,
                     self.stage, valid)

    def forward(self, carry: _Carry, row) -> tuple[_Carry, jax.Array]:
        """The forward slot: each stage runs its chunk on what it received (stage 0, chunk 0: the embedding),
        stashes that input for the backward and passes its output on; also returns the output ``[p, mb, seq,
        hidden]`` (the last virtual stage's is the head's input)."""
        slot = self._slot(row["forward"], row["forward_chunk"], targets=False)

        def one(w, received, slot):
            x, layer_keys = self._embed(self.rest, slot.tokens, slot.keys)
            h = jnp.where((slot.stage == 0) & (slot.chunk == 0), x, received)
            wc, kc = self._chunk_of(w, layer_keys, slot.chunk, slot.stage)
            return h, *self._run_chunk(wc, h, kc)

        h, out, stats = jax.vmap(one, spmd_axis_name=self.axis)(self.stage_params, carry.forward, slot)
        carry = carry._replace(stats=_add_stats(carry.stats, stats, jnp.maximum(row["forward"], 0), slot.valid),
                               stash=_store(carry.stash, row["stash_write"], h, slot.valid, self.axis),
                               forward=self.constrain(jnp.roll(out, 1, axis=0), ACTIVATION))
        return carry, self.constrain(out, ACTIVATION)

    def _backward_stage(self, w, grads, rest_grads, received, h, slot, out):
        """One stage's backward of ``slot`` from its stashed input ``h``: ``(grads, rest_grads, input gradient,
        loss, zb_h1's record for W or None)``; the last virtual stage seeds it with the loss gradient of the
        head on ``out`` (None: no forward in this slot's iteration)."""
        valid, chunk, stage = slot.valid, slot.chunk, slot.stage
        first, last = valid & (stage == 0) & (chunk == 0), valid & (stage == self.p - 1) & (chunk == self.v - 1)
        masked = lambda cond, t: jax.tree.map(lambda a: jnp.where(cond, a, 0), t)  # noqa: E731
        g, loss = received, jnp.zeros((), jnp.float32)
        if out is not None:  # the last virtual stage's loss gradient seeds the backward (head in lockstep)
            loss, head_vjp = jax.vjp(lambda r, o: self._head_loss(r, o, slot.targets), self.rest, out)
            d_rest, d_out = head_vjp(jnp.asarray(self.scale, loss.dtype))
            g = jnp.where(last, d_out, received)
            rest_grads = jax.tree.map(jnp.add, rest_grads, masked(last, d_rest))
        _, embed_vjp, layer_keys = jax.vjp(lambda r: self._embed(r, slot.tokens, slot.keys), self.rest, has_aux=True)
        wc, kc = self._chunk_of(w, layer_keys, chunk, stage)
        if self.split is None:
            dw, dh = jax.vjp(lambda w, h: self._run_chunk(w, h, kc)[0], wc, h)[1](g)
            record = None
        else:
            dw, dh, record = self.split.input_grad(wc, h, g, kc)
        rest_grads = jax.tree.map(jnp.add, rest_grads, masked(first, embed_vjp(dh)[0]))
        grads = jax.tree.map(lambda a, d: jax.lax.dynamic_update_index_in_dim(
            a, a[chunk] + jnp.where(valid, d, 0).astype(jnp.float32), chunk, 0), grads, dw)
        return grads, rest_grads, dh, jnp.where(last, loss, 0), record

    def backward(self, carry: _Carry, row, out: jax.Array | None) -> _Carry:
        """The backward slot (input and weight gradients; zb_h1: input gradient, W's operands kept): each
        stage backwards its chunk from the stashed input and passes the input gradient back."""
        h = _select(carry.stash, row["stash_read"], self.axis)
        slot = self._slot(row["backward"], row["backward_chunk"], targets=True)
        grads, rest_grads, dh, loss, record = jax.vmap(self._backward_stage, spmd_axis_name=self.axis)(
            self.stage_params, carry.grads, carry.rest_grads, carry.backward, h, slot, out)
        carry = carry._replace(grads=grads, rest_grads=rest_grads, loss=carry.loss + loss,
                               backward=self.constrain(jnp.roll(dh, -1, axis=0), ACTIVATION))
        if self.split:
            carry = carry._replace(deferred=_store(carry.deferred, row["deferred_write"], record, slot.valid,
                                                   self.axis))
        return carry

    def weight(self, carry: _Carry, row) -> _Carry:
        """zb_h1's W slot: the weight gradients of a deferred backward from its kept matmul operands."""
        record = _select(carry.deferred, row["deferred_read"], self.axis)

        def one(w, grads, record, valid):
            dw = self.split.weight_grad(jax.tree.map(lambda a: a[0], w), record)
            return jax.tree.map(lambda a, d: a.at[0].add(jnp.where(valid, d, 0)), grads, dw)

        grads = jax.vmap(one, spmd_axis_name=self.axis)(self.stage_params, carry.grads, record, row["weight"] >= 0)
        return carry._replace(grads=grads)

    def _iteration(self, used, carry: _Carry, row):
        forward, backward, weight = used
        out = None
        if forward:
            carry, out = self.forward(carry, row)
        if backward:
            carry = self.backward(carry, row, out)
        if weight:
            carry = self.weight(carry, row)
        return carry, None

    def run(self):
        """``(mean loss, routing statistics, gradients)``: float32 scalar, :func:`_stats_metrics`, and float32
        gradients shaped as the parameters; one ``scan`` per phase of the timetable, each iteration holding
        only the slot kinds some stage uses in it."""
        carry, rows = self.initial(), self.tt.rows()
        for start, stop, used in self.tt.phases:
            xs = {k: jnp.asarray(a[start:stop]) for k, a in rows.items()}
            carry, _ = jax.lax.scan(functools.partial(self._iteration, used), carry, xs)
        grads = {self.group.name: jax.tree.map(lambda g, axes: self.constrain(_layer_order(g), axes), carry.grads,
                                               self.spec.axes[self.group.name]),
                 **jax.tree.map(lambda g, axes: self.constrain(g.sum(0), axes), carry.rest_grads, self.rest_axes)}
        return carry.loss.sum() * self.scale, _stats_metrics(self.cfg, carry.stats), grads
