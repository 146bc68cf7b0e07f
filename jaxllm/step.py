"""The pure functions of training: loss, train step (with gradient accumulation), eval step.

State is a dict ``{"step": int32 [], "params": ..., "opt_state": ...}``.  A
batch is a pair of int32 arrays ``inputs, targets`` of shape
``[microbatches, micro_batch_size x data_parallel, seq]``: the leading axis is
the gradient-accumulation axis, scanned over inside the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxllm import model


def cross_entropy(logits, targets):
    """Per-token cross entropy in nats: float32 ``[batch, seq]`` from logits ``[batch, seq, vocab]``.

    The target logit is picked with a comparison against the vocabulary index rather than a
    gather, so with vocabulary-parallel logits every device reduces its own slice and only
    ``[batch, seq]`` partial sums cross the network (Megatron-LM's parallel cross entropy).
    """
    logits = logits.astype(jnp.float32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    target_logit = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def init_state(cfg, optimizer, seed):
    """Fresh training state (jit it with ``out_shardings`` to create it sharded)."""
    params = model.init(cfg, seed)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}


def make_train_step(cfg, graphdef, optimizer, schedule, grad_sharding=None):
    """``train_step(state, inputs, targets) -> (state, metrics)``.

    The loss is the mean over every token of the global batch: gradients of the
    ``microbatches`` micro batches are summed in float32 and divided by their
    count, which equals one step on the whole batch.  Dropout keys are
    ``fold_in(key(seed), step)``, so a step is a pure function of its inputs.
    Metrics (float32 scalars): ``loss`` (nats/token), ``grad_norm`` (global L2
    norm before clipping), ``lr``.  ``grad_sharding`` (optional) pins the gradient
    accumulator, which is where ZeRO-2 turns the all-reduce into a reduce-scatter.
    """
    pin = (lambda g: jax.lax.with_sharding_constraint(g, grad_sharding)) if grad_sharding else (lambda g: g)
    dropout = cfg.model.dropout > 0
    base_key = jax.random.key(cfg.train.seed)

    def loss_fn(params, inputs, targets, key):
        logits = model.forward(graphdef, params, inputs, dropout_key=key)
        return cross_entropy(logits, targets).mean()

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(state, inputs, targets):
        params = state["params"]
        keys = jax.random.split(jax.random.fold_in(base_key, state["step"]), inputs.shape[0])

        def micro_step(acc, xs):
            x, y, key = xs
            loss, grads = grad_fn(params, x, y, key if dropout else None)
            return jax.tree.map(jnp.add, acc, (loss, pin(grads))), None

        zeros = (jnp.zeros((), jnp.float32), pin(jax.tree.map(jnp.zeros_like, params)))
        (loss, grads), _ = jax.lax.scan(micro_step, zeros, (inputs, targets, keys))
        loss, grads = jax.tree.map(lambda g: g / inputs.shape[0], (loss, grads))
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        return new_state, metrics

    return train_step


def make_eval_step(graphdef):
    """``eval_step(params, inputs, targets) -> mean loss`` (nats/token) on a ``[batch, seq]`` batch."""

    def eval_step(params, inputs, targets):
        return cross_entropy(model.forward(graphdef, params, inputs), targets).mean()

    return eval_step
