"""The pure functions of training: loss, train step (with gradient accumulation), eval step.

State is a dict ``{"step": int32 [], "params": ..., "opt_state": ...,
"nonfinite_steps": int32 [], "nonfinite_in_a_row": int32 []}`` (the last two count
skipped steps, see :func:`make_train_step`; they live in the state so that a
resumed run continues them exactly).  A
batch is a pair of int32 arrays ``inputs, targets`` of shape
``[microbatches, micro_batch_size x data_parallel, seq]``: the leading axis is
the gradient-accumulation axis, scanned over inside the step; with Megatron's
document options (``data.reset_position_ids``, ``data.reset_attention_mask``,
``data.eod_mask_loss``) a third argument ``docs``, a dict of arrays of the same
shape holding only what the options set on need (:data:`jaxllm.data.loader.DOCUMENT_ARRAYS`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxllm.config import Resolved
from jaxllm.model import gpt, layers
from jaxllm.parallel import context_parallel, pipeline, sharding
from jaxllm.runtime import optim


def _model_kwargs(docs, order):
    """The model's keyword arguments for a batch's ``docs`` and ring attention's ``order`` (or None)."""
    return {"positions": docs.get("positions", order), "order": order, "segment_ids": docs.get("segment_ids"),
            "loss_mask": docs.get("loss_mask")}


def token_count(targets, docs):
    """The loss's denominator: the tokens of ``targets`` (a Python int), or with a ``loss_mask`` in
    ``docs`` its sum (float32, at least 1: an all-masked batch has loss 0)."""
    if "loss_mask" not in docs:
        return targets.size
    return jnp.maximum(jnp.sum(docs["loss_mask"]), 1.0)


class Counts(NamedTuple):
    """The loss's denominators over the global batch (:func:`counts`).

    Attributes:
      tokens: :func:`token_count`.
      mtp: each multi-token prediction depth's (``model.mtp_num_layers``), float32 ``[depths]``: the tokens its
        rolled loss mask keeps (the last ``k`` places of each row dropped at depth ``k``), at least 1; None
        without depths.
      mtp_scale: ``model.mtp_loss_scaling_factor``.
    """

    tokens: Any
    mtp: Any = None
    mtp_scale: float = 0.0


def counts(model, targets, docs) -> Counts:
    """The :class:`Counts` of ``targets`` int32 ``[..., seq]`` and ``docs`` for the ``model`` section: depth ``k``'s
    loss is its tokens' mean over the global batch, ``sum(loss x rolled mask) / sum(rolled mask)`` (Megatron-LM's
    ``process_mtp_loss``, whose micro batches' means equal it where their counts are equal)."""
    depths = range(1, model.mtp_num_layers + 1)
    if not depths:
        return Counts(token_count(targets, docs))
    mask = docs.get("loss_mask", jnp.ones(targets.shape, jnp.float32))
    mtp = jnp.stack([jnp.maximum(jnp.sum(mask[..., k:]), 1.0) for k in depths])
    return Counts(token_count(targets, docs), mtp, model.mtp_loss_scaling_factor)


def row_keys(key, shape):
    """One PRNG key per row of a batch ``[microbatches, rows]`` (``shape``): ``fold_in(key, r)``
    with ``r`` the row's index in the global batch, whose row ``r`` is in micro batch
    ``r % microbatches`` (:meth:`jaxllm.runtime.run.Run.global_batch`)."""
    m, rows = shape
    return layers.row_keys(key, jnp.arange(m * rows).reshape(rows, m).T)


def init_state(params, optimizer) -> dict:
    """The training state at step 0 around ``params`` (jit it with ``out_shardings`` to create it
    sharded; ``jax.eval_shape`` it for the shapes)."""
    zero = jnp.zeros((), jnp.int32)
    return {"step": zero, "params": params, "opt_state": optimizer.init(params),
            "nonfinite_steps": zero, "nonfinite_in_a_row": zero}


def reduces_once(cfg) -> bool:
    """Whether the train step sums the data-parallel gradients once per step rather than once per micro batch.

    It does where every micro batch would otherwise all-reduce its gradients over ``data`` inside its
    backward: more than one micro batch and data-parallel device, with or without a pipeline, gradients
    not split by ZeRO (stage 2 reduce-scatters each micro batch's gradients to keep only a shard of them,
    as DeepSpeed's does).  Not with a mixture of experts or FP8, whose routing losses and scaling factors
    are statistics of a whole micro batch that one replica's rows would change.  With one micro batch the
    per-layer reductions stay: they overlap the backward.  Megatron-LM's data-parallel gradient buffer
    likewise reduces once, in the last micro batch (``DistributedDataParallel``'s ``no_sync``).
    """
    return (cfg.microbatches > 1 and cfg.mesh_shape["data"] > 1 and "grads" not in sharding.zero_tables(cfg).sharded
            and not cfg.model.num_experts and not cfg.model.fp8)


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """What the gradient strategies (:func:`accumulated`, :func:`pipelined`, :func:`replicated`) share.

    Attributes:
      cfg: the resolved config.
      spec: the model (:func:`jaxllm.model.gpt.describe`, with the mesh's ops).
      layout: the mesh and rules table (None: one device).
      grad_sharding: NamedShardings of the gradients (a tree shaped as the parameters), or None: where
        the gradient accumulator is pinned, which is where ZeRO-2 turns the all-reduce into a reduce-scatter.
      replica_layout, replica_spec: for :func:`replicated`, ``layout`` with ``batch`` not split over
        ``data`` and the model on it; else None.
    """

    cfg: Resolved
    spec: Any
    layout: sharding.Layout | None = None
    grad_sharding: Any = None
    replica_layout: sharding.Layout | None = None
    replica_spec: Any = None

    def pin(self, grads):
        """``grads`` constrained to :attr:`grad_sharding` (unchanged without one)."""
        return grads if self.grad_sharding is None else jax.lax.with_sharding_constraint(grads, self.grad_sharding)


def _micro_loss(graphdef, params, inputs, targets, order, docs, key, count: Counts):
    """One micro batch's objective, ``(objective, (losses, stats))``: ``losses["loss"]``, its summed token losses
    divided by the global batch's token ``count.tokens``, and with multi-token prediction ``losses["mtp_loss"]``,
    the depths' mean of their summed losses over their ``count.mtp``; the objective is ``loss + mtp_scale x
    mtp_loss`` (Megatron-LM's ``mtp_loss_scaling_factor / mtp_num_layers`` on each depth's mean); ``stats`` the
    routing statistics."""
    loss, stats = gpt.loss(graphdef, params, inputs, targets, **_model_kwargs(docs, order),
                           dropout_key=key, with_stats=True)
    losses = {"loss": loss / count.tokens}
    if "mtp" in stats:
        losses["mtp_loss"] = jnp.mean(stats.pop("mtp") / count.mtp)
    return losses["loss"] + count.mtp_scale * losses.get("mtp_loss", 0.0), (losses, stats)


def _zero_losses(cfg, shape=()) -> dict:
    """The zero sums of :func:`_micro_loss`'s ``losses``, float32 ``shape``."""
    return {k: jnp.zeros(shape, jnp.float32) for k in ("loss", "mtp_loss")[:1 + bool(cfg.model.mtp_num_layers)]}


_micro_grads = jax.value_and_grad(_micro_loss, argnums=1, has_aux=True)


def accumulated(setup: StepSetup, params, inputs, targets, order, docs, keys):
    """Loss, gradients and routing statistics of a step whose micro batches run one after another.

    Args:
      setup: the step's pieces.
      params: float32 parameters.
      inputs, targets: int32 ``[microbatches, rows, seq]``; order, docs, keys (or None): laid out alike,
        ``keys`` the dropout keys ``[microbatches, rows]`` (:func:`row_keys`; None without dropout).
    Returns:
      ``(loss, grads, stats)``: the float32 mean loss of the global batch, its gradients (float32 sums of
      the micro batches', pinned by :meth:`StepSetup.pin`; of the objective, with multi-token prediction's
      loss), and the mean of the micro batches' routing statistics (:data:`jaxllm.model.gpt.MOE_STATS` with
      experts) and the multi-token prediction loss ``mtp_loss`` (with ``model.mtp_num_layers``), else ``{}``.
    """
    cfg = setup.cfg
    count = counts(cfg.model, targets, docs)  # of the global batch: the micro batches' sums add up to its mean
    held = gpt.cast_layers(cfg.model, params)  # the layers in the compute dtype, cast once per step
    add = lambda a, b: a + b.astype(a.dtype)  # noqa: E731 - float32 sums of the cast copies' gradients

    def micro_step(acc, xs):
        (_, (losses, stats)), grads = _micro_grads(setup.spec.graphdef, held, *xs, count)
        stats = {k: v / cfg.microbatches for k, v in stats.items()}  # their mean over the micro batches
        return jax.tree.map(add, acc, (losses, setup.pin(grads), stats)), None

    stats = {k: jnp.zeros((), jnp.float32) for k in (gpt.MOE_STATS if cfg.model.num_experts else ())}
    zeros = (_zero_losses(cfg), setup.pin(jax.tree.map(jnp.zeros_like, params)), stats)
    losses, grads, stats = jax.lax.scan(micro_step, zeros, (inputs, targets, order, docs, keys))[0]
    return losses.pop("loss"), grads, {**stats, **losses}


def pipelined(setup: StepSetup, params, inputs, targets, order, docs, keys):
    """As :func:`accumulated`, the micro batches through the pipeline stages (:func:`jaxllm.parallel.pipeline.loss`;
    no ``docs``: :func:`jaxllm.resolve.resolve` refuses the document options with a pipeline)."""
    (loss, stats), grads = jax.value_and_grad(lambda p: pipeline.loss(
        setup.cfg, setup.layout, setup.spec, p, inputs, targets, order, keys), has_aux=True)(params)
    return loss, setup.pin(grads), stats


def replicated(setup: StepSetup, params, inputs, targets, order, docs, keys):
    """As :func:`accumulated` (no routing statistics: :func:`reduces_once` excludes a mixture of experts),
    each data-parallel replica's gradients computed and accumulated apart (a ``vmap`` over the replicas,
    ``spmd_axis_name="data"``) and the replicas' sums added once, after the last micro batch: one
    all-reduce per step instead of one per micro batch."""
    per_replica = _replicas_pipelined if setup.cfg.stages > 1 else _replicas_accumulated
    losses, grads = per_replica(setup, params, inputs, targets, order, docs, keys)
    losses = {k: jnp.sum(v) for k, v in losses.items()}
    return losses.pop("loss"), setup.pin(jax.tree.map(lambda g: jnp.sum(g, 0), grads)), losses


def _by_replica(a, n):
    """``[microbatches, rows, ...]`` -> ``[microbatches, n, rows / n, ...]``: the rows split data-major."""
    return None if a is None else a.reshape(a.shape[0], n, a.shape[1] // n, *a.shape[2:])


def _spread(setup: StepSetup, grads):
    """``[data, ...]`` gradients, one per replica, each on its replica's devices."""
    return jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, jax.sharding.NamedSharding(
        setup.layout.mesh, jax.sharding.PartitionSpec("data", *s.spec))), grads, setup.grad_sharding)


def _replicas_pipelined(setup: StepSetup, params, inputs, targets, order, docs, keys):
    """Each replica's rows through the pipeline: per replica its mean loss (and multi-token prediction's), 1/n of the
    batch's, and gradients."""
    n = setup.cfg.mesh_shape["data"]

    def replica(x, y, o, k):
        (loss, stats), grads = jax.value_and_grad(lambda p: pipeline.loss(
            setup.cfg, setup.replica_layout, setup.replica_spec, p, x, y, o, k), has_aux=True)(params)
        return jax.tree.map(lambda a: a / n, {"loss": loss, **stats}), jax.tree.map(lambda g: g / n, grads)

    losses, grads = jax.vmap(replica, in_axes=1, spmd_axis_name="data")(
        *(_by_replica(a, n) for a in (inputs, targets, order, keys)))
    return losses, _spread(setup, grads)


def _replicas_accumulated(setup: StepSetup, params, inputs, targets, order, docs, keys):
    """Each replica's micro batches one after another: per replica its summed losses (:func:`_micro_loss`'s) and
    gradients."""
    n, count = setup.cfg.mesh_shape["data"], counts(setup.cfg.model, targets, docs)
    replica = jax.vmap(_micro_grads, in_axes=(None, None, 0, 0, 0, 0, 0, None), spmd_axis_name="data")

    def micro_step(acc, xs):
        (_, (losses, _)), grads = replica(setup.replica_spec.graphdef, params, *xs, count)
        return jax.tree.map(jnp.add, acc, (losses, _spread(setup, grads))), None

    zeros = (_zero_losses(setup.cfg, (n,)),
             _spread(setup, jax.tree.map(lambda p: jnp.zeros((n, *p.shape), p.dtype), params)))
    xs = jax.tree.map(lambda a: _by_replica(a, n), (inputs, targets, order, docs, keys))
    return jax.lax.scan(micro_step, zeros, xs)[0]


def _is_expert_bias(path) -> bool:
    return getattr(path[-1], "key", None) == "expert_bias"


def _balanced(params, grads, rate):
    """``(params, grads)`` with each MoE layer's expert bias moved by ``-rate x sign`` of its "gradient" (the step's
    summed ``load - mean``, :func:`jaxllm.model.moe.balance_bias`) and that gradient zeroed for the optimizer (which
    then leaves the bias as it is: no weight decay, zero moments)."""
    params = jax.tree_util.tree_map_with_path(
        lambda path, p, g: p - rate * jnp.sign(g) if _is_expert_bias(path) else p, params, grads)
    return params, jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if _is_expert_bias(path) else g, grads)


def apply_gradients(optimizer, schedule, state, loss, grads, stats, bias_update_rate=None):
    """The optimizer's update of ``state`` by ``grads``, guarded against a non-finite step.

    ``bias_update_rate``: with expert biases (``model.moe_router_enable_expert_bias``), their step
    (``model.moe_router_bias_update_rate``, :func:`_balanced`); None: none.  ``stats``: the step's statistics
    (routing, ``mtp_loss``), added to the metrics.
    Returns:
      ``(new_state, metrics)`` as :func:`make_train_step`'s ``train_step`` (``schedule``: the learning
      rate per update, :func:`jaxllm.runtime.optim.lr_schedule`).
    """
    params = state["params"]
    with jax.named_scope("optimizer"):  # the profile's category (jaxllm.analysis.profile)
        balanced = params
        if bias_update_rate is not None:
            balanced, grads = _balanced(params, grads, bias_update_rate)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # A select rather than lax.cond: XLA fuses it into the update, and both sides are computed anyway.
        keep_if_bad = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        new_params = jax.tree.map(keep_if_bad, optax.apply_updates(balanced, updates), params)
        opt_state = jax.tree.map(keep_if_bad, opt_state, state["opt_state"])
    skipped = (~finite).astype(jnp.int32)
    new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state,
                 "nonfinite_steps": state["nonfinite_steps"] + skipped,
                 "nonfinite_in_a_row": (state["nonfinite_in_a_row"] + 1) * skipped}
    # the learning rate this step applies: optax's count, the updates applied so far (skipped steps not counted)
    lr = schedule(state["step"] - state["nonfinite_steps"])
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr,
               "nonfinite_steps": new_state["nonfinite_steps"],
               "nonfinite_in_a_row": new_state["nonfinite_in_a_row"], **stats}
    return new_state, metrics


def make_train_step(cfg, spec, optimizer, layout=None, grad_sharding=None, replica_layout=None, replica_spec=None):
    """``train_step(state, inputs, targets[, docs]) -> (state, metrics)`` of the resolved config ``cfg``.

    The loss is the mean over every token of the global batch: each of the
    ``microbatches`` micro batches' summed token losses is divided by the global batch's
    token count, and their losses and gradients are summed in float32, which equals one
    step on the whole batch for every micro-batch split.  With ``docs["loss_mask"]``
    (``data.eod_mask_loss``) the count is ``sum(mask)`` over the whole global batch
    (Megatron-LM's ``--calculate-per-token-loss``).  Dropout keys are
    ``fold_in(fold_in(key(seed), step), row)`` for each row of the global batch (its
    index before the split into micro batches, see :func:`row_keys`), so a step is a pure
    function of its inputs, and its dropout masks do not depend on the layout.
    With ``model.mtp_num_layers`` the gradients are of the objective with the multi-token prediction loss
    (:func:`_micro_loss`), whose depths' mean is the metric ``mtp_loss``; ``loss`` stays the main one.
    Metrics (float32 scalars): ``loss`` (nats/token), ``grad_norm`` (global L2
    norm before clipping), ``lr`` (the learning rate this step applies, see
    :func:`jaxllm.runtime.optim.lr_schedule`), and the int32 counters ``nonfinite_steps`` (total
    skipped steps of the run) and ``nonfinite_in_a_row`` (consecutive ones, ending at
    this step).  ``spec``, ``layout``, ``grad_sharding``, ``replica_layout``, ``replica_spec``: as
    :class:`StepSetup` holds them.  The gradients come from one strategy: :func:`replicated` where given
    ``replica_spec`` (:func:`reduces_once`), else :func:`pipelined` with pipeline stages, else
    :func:`accumulated`.

    Non-finite guard: when the loss or the gradient norm is NaN or inf, the step keeps
    ``params`` and ``opt_state`` unchanged (so the optimizer's own count, and with it the
    learning-rate schedule, does not advance either, as Megatron-LM's skipped iterations)
    but still increments ``step``, so the next step sees the next batch.
    """
    setup = StepSetup(cfg, spec, layout, grad_sharding, replica_layout, replica_spec)
    loss_and_grads = replicated if replica_spec is not None else pipelined if cfg.stages > 1 else accumulated
    ring = context_parallel.ring_devices(layout, cfg.parallel)
    base_key = jax.random.key(cfg.train.seed)
    schedule = optim.lr_schedule(cfg.train)
    bias_rate = cfg.model.moe_router_bias_update_rate if cfg.model.moe_router_enable_expert_bias else None

    def train_step(state, inputs, targets, docs=None):
        keys = (row_keys(jax.random.fold_in(base_key, state["step"]), inputs.shape[:2])
                if cfg.model.dropout > 0 else None)
        inputs, targets, order, docs = context_parallel.zigzag(ring, inputs, targets, docs)
        loss, grads, stats = loss_and_grads(setup, state["params"], inputs, targets, order, docs, keys)
        return apply_gradients(optimizer, schedule, state, loss, grads, stats, bias_rate)

    return train_step


def make_eval_step(cfg, spec, layout=None):
    """``eval_step(params, inputs, targets[, docs]) -> mean loss`` (nats/token) on a ``[batch, seq]`` batch
    (``docs``: as the train step's, ``[batch, seq]``; with a ``loss_mask``, ``sum(loss x mask) / sum(mask)``).

    Ring attention (and usp) reorders the batch as the train step does; with pipeline stages the batch
    goes through the pipeline as ``cfg.microbatches`` micro batches (row ``r`` in micro batch
    ``r % microbatches``, as in training).
    """
    m, ring = cfg.microbatches, context_parallel.ring_devices(layout, cfg.parallel)

    def eval_step(params, inputs, targets, docs=None):
        inputs, targets, order, docs = context_parallel.zigzag(ring, inputs, targets, docs)
        if cfg.stages == 1:
            loss = gpt.loss(spec.graphdef, params, inputs, targets, **_model_kwargs(docs, order))
            return loss / token_count(targets, docs)
        split = lambda a: None if a is None else a.reshape(-1, m, a.shape[-1]).swapaxes(0, 1)  # noqa: E731
        return pipeline.loss(cfg, layout, spec, params, split(inputs), split(targets), split(order), None)[0]

    return eval_step
