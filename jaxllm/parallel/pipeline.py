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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

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


def _no_stats(cfg, m):
    """Per stage and microbatch ``[p, m]`` sums over a stage's layers of the routing statistics
    (:func:`jaxllm.model.moe.route`; ``max_load`` their maximum), zero; None for a dense model."""
    if not cfg.model.num_experts:
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
    layers, m = cfg.model.num_layers, acc["aux_loss"].shape[1]
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
      microbatches (``{}`` for a dense model).  The loss's gradient (``jax.grad`` with ``has_aux``) is
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
        loss, stats, grads = _fused_loss_and_grads(cfg, layout, spec, params, inputs, targets, positions,
                                                   dropout_keys)
        return (loss, stats), grads

    def bwd(grads, ct):
        return jax.tree.map(lambda g: g * ct[0], grads), None, None, None, None

    fused.defvjp(fwd, bwd)
    return fused(params, inputs, targets, positions, dropout_keys)


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
        return gpt.run_layers(h, positions, w, keys, order=positions)

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
    totals = jax.vmap(gpt.output_loss, spmd_axis_name=stage_axis)(hidden, targets.reshape(p, m // p, mb, seq))
    loss = totals.sum() / targets.size
    if stats is not None:  # their gradient, not their value: the loss stays the cross entropy
        mc = cfg.model
        routers = (mc.moe_aux_loss_coeff * stats["aux_loss"].sum() + mc.moe_z_loss_coeff * stats["z_loss"].sum()) / m
        loss = loss + (routers - jax.lax.stop_gradient(routers))
    return loss, _stats_metrics(cfg, stats)


# ----- the 1F1B family: one loop of forwards and backwards ------------------------------------


def _fused_loss_and_grads(cfg, layout, spec, params, inputs, targets, positions, dropout_keys):
    """``(mean loss, routing statistics, gradients)`` of the 1F1B-family loop (see the module docstring and
    :func:`loss`); gradients float32, shaped as ``params``."""
    schedule, p, v = cfg.parallel.pipeline_schedule, cfg.stages, cfg.parallel.pipeline_virtual_stages
    m, mb, seq = inputs.shape
    n = cfg.model.num_layers // (p * v)
    tt = schedules.timetable(schedule, p, v, m)
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
        router = zero_bubble.Router()
        layer_graphdef = nnx.graphdef(nnx.merge(
            gpt_module.describe(cfg.model, dataclasses.replace(gpt.ops, dense=router)).graphdef, params).layers)
        one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
        layer_axes = jax.tree.map(lambda axes: axes[1:], logical["layers"], is_leaf=lambda a: isinstance(a, tuple))
        split = zero_bubble.SplitBackward(layer_graphdef, router, one_layer,
                                          jax.ShapeDtypeStruct((mb, seq, hidden), dtype), positions, cfg.model.remat,
                                          layer_axes)

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
        "stats": _no_stats(cfg, m),
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
            return h, *gpt.run_layers(h, positions, wc, kc, order=positions)

        tokens = take(inputs, jnp.maximum(f, 0), ("batch", "length"))
        h, out, stats = vmap(one)(stage_params, carry["forward"], tokens, keys, chunk, stage)
        carry["stats"] = _add_stats(carry["stats"], stats, jnp.maximum(f, 0), f >= 0)
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
    return carry["loss"].sum() * scale, _stats_metrics(cfg, carry["stats"]), grads
