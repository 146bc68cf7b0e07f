"""The pure functions of training: loss, train step (with gradient accumulation), eval step.

State is a dict ``{"step": int32 [], "params": ..., "opt_state": ...,
"nonfinite_steps": int32 [], "nonfinite_in_a_row": int32 []}`` (the last two count
skipped steps, see :func:`make_train_step`; they live in the state so that a
resumed run continues them exactly).  A
batch is a pair of int32 arrays ``inputs, targets`` of shape
``[microbatches, micro_batch_size x data_parallel, seq]``: the leading axis is
the gradient-accumulation axis, scanned over inside the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxllm import context_parallel, model, optim, pipeline


def init_state(params, optimizer) -> dict:
    """The training state at step 0 around ``params`` (jit it with ``out_shardings`` to create it
    sharded; ``jax.eval_shape`` it for the shapes)."""
    zero = jnp.zeros((), jnp.int32)
    return {"step": zero, "params": params, "opt_state": optimizer.init(params),
            "nonfinite_steps": zero, "nonfinite_in_a_row": zero}


def make_train_step(cfg, spec, optimizer, layout=None, grad_sharding=None):
    """``train_step(state, inputs, targets) -> (state, metrics)`` of the resolved config ``cfg``.

    The loss is the mean over every token of the global batch: gradients of the
    ``microbatches`` micro batches are summed in float32 and divided by their
    count, which equals one step on the whole batch.  Dropout keys are
    ``fold_in(key(seed), step)``, so a step is a pure function of its inputs.
    Metrics (float32 scalars): ``loss`` (nats/token), ``grad_norm`` (global L2
    norm before clipping), ``lr``, and the int32 counters ``nonfinite_steps`` (total
    skipped steps of the run) and ``nonfinite_in_a_row`` (consecutive ones, ending at
    this step).  ``spec`` is the model (:func:`jaxllm.model.describe`, with the mesh's
    ops); ``layout`` the mesh and rules table (None: one device); ``grad_sharding``
    (optional) pins the gradient accumulator, which is where ZeRO-2 turns the all-reduce
    into a reduce-scatter.

    Non-finite guard: when the loss or the gradient norm is NaN or inf, the step keeps
    ``params`` and ``opt_state`` unchanged (so the optimizer's own count, and with it the
    learning-rate schedule, does not advance either, as Megatron-LM's skipped iterations)
    but still increments ``step``, so the next step sees the next batch.
    """
    pin = (lambda g: jax.lax.with_sharding_constraint(g, grad_sharding)) if grad_sharding else (lambda g: g)
    dropout = cfg.model.dropout > 0
    base_key = jax.random.key(cfg.train.seed)
    schedule = optim.lr_schedule(cfg.train)

    def loss_fn(params, inputs, targets, positions, key):
        return model.loss(spec.graphdef, params, inputs, targets, positions=positions, dropout_key=key) / targets.size

    grad_fn = jax.value_and_grad(loss_fn)

    def accumulated(params, inputs, targets, positions, keys):  # micro batches one after another
        def micro_step(acc, xs):
            x, y, pos, key = xs
            loss, grads = grad_fn(params, x, y, pos, key if dropout else None)
            return jax.tree.map(jnp.add, acc, (loss, pin(grads))), None

        zeros = (jnp.zeros((), jnp.float32), pin(jax.tree.map(jnp.zeros_like, params)))
        (loss, grads), _ = jax.lax.scan(micro_step, zeros, (inputs, targets, positions, keys))
        return jax.tree.map(lambda g: g / inputs.shape[0], (loss, grads))

    def pipelined(params, inputs, targets, positions, keys):  # micro batches through the pipeline stages
        loss, grads = jax.value_and_grad(lambda p: pipeline.loss(
            cfg, layout, spec, p, inputs, targets, positions, keys if dropout else None))(params)
        return loss, pin(grads)

    loss_and_grads = pipelined if cfg.stages > 1 else accumulated

    def train_step(state, inputs, targets):
        params = state["params"]
        keys = jax.random.split(jax.random.fold_in(base_key, state["step"]), inputs.shape[0])
        inputs, targets, positions = context_parallel.zigzag(layout, cfg.parallel.sequence_impl, inputs, targets)
        loss, grads = loss_and_grads(params, inputs, targets, positions, keys)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # A select rather than lax.cond: XLA fuses it into the update, and both sides are computed anyway.
        keep_if_bad = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        skipped = (~finite).astype(jnp.int32)
        new_state = {"step": state["step"] + 1,
                     "params": jax.tree.map(keep_if_bad, optax.apply_updates(params, updates), params),
                     "opt_state": jax.tree.map(keep_if_bad, opt_state, state["opt_state"]),
                     "nonfinite_steps": state["nonfinite_steps"] + skipped,
                     "nonfinite_in_a_row": (state["nonfinite_in_a_row"] + 1) * skipped}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]),
                   "nonfinite_steps": new_state["nonfinite_steps"],
                   "nonfinite_in_a_row": new_state["nonfinite_in_a_row"]}
        return new_state, metrics

    return train_step


def make_eval_step(cfg, spec, layout=None):
    """``eval_step(params, inputs, targets) -> mean loss`` (nats/token) on a ``[batch, seq]`` batch.

    Ring attention reorders the batch as the train step does; with pipeline stages the batch
    goes through the pipeline as ``cfg.microbatches`` micro batches (row ``r`` in micro batch
    ``r % microbatches``, as in training).
    """
    m = cfg.microbatches

    def eval_step(params, inputs, targets):
        inputs, targets, positions = context_parallel.zigzag(layout, cfg.parallel.sequence_impl, inputs, targets)
        if cfg.stages == 1:
            return model.loss(spec.graphdef, params, inputs, targets, positions=positions) / targets.size
        split = lambda a: None if a is None else a.reshape(-1, m, a.shape[-1]).swapaxes(0, 1)  # noqa: E731
        return pipeline.loss(cfg, layout, spec, params, split(inputs), split(targets), split(positions), None)

    return eval_step
