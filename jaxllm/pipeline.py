"""Pipeline parallelism over the ``pipeline`` mesh axis, inside one SPMD program.

The layer stack is split into ``p`` stages (the size of the mesh axis the rules
table gives the logical ``stage`` axis), each holding ``v`` chunks of
``num_layers / (p v)`` consecutive layers (``parallel.pipeline_virtual_stages``):

* ``gpipe`` (Huang et al. 2019, GPipe), ``v = 1``: stage ``s`` holds layers
  ``[s L/p, (s+1) L/p)``, which is how the ``layers`` axis of the parameters is
  sharded anyway, so the stage layout costs nothing;
* ``interleaved`` (Narayanan et al. 2021, section 2.2; the circular schedule of
  GSPMD, Xu et al. 2021, section 3.3), ``v > 1``: stage ``s`` holds chunks
  ``s, s + p, s + 2p, ...``, and every micro batch passes the ring of stages ``v``
  times.  The bubble shrinks ``v``-fold; the price is that the parameters, stored in
  layer order (so that checkpoints do not depend on the layout), are regrouped into
  the stage layout at each step (an all-to-all over ``pipeline``, and its transpose for
  the gradients).

The step's micro batches (global batch / (micro batch x data-parallel size), the
gradient-accumulation count of a run without pipeline) are the pipeline's
microbatches.  All ``p`` stages run every iteration as one ``vmap`` over the
stage axis, whose dimension is sharded over ``pipeline``; moving the activations
one stage on is a roll of that axis, which XLA turns into one collective permute.
Iteration ``t`` feeds microbatch ``t mod m`` to stage 0 (its embedding in the
first pass, the last stage's output of the previous pass after that), so
``v m + p - 1`` iterations run, of which the fraction ``(p - 1) / (v m + p - 1)``
of each stage's time is bubble.  The backward pass is the automatic transpose of
that loop: all forward iterations, then all backward ones (GPipe's schedule), so
activation memory grows with ``m`` (remat bounds it per layer; 1F1B would bound it
by ``p``).

The embedding runs before the pipeline for all microbatches, and the final norm,
output layer and loss after it, with the microbatches split over the stages so
that each device computes the head for ``m / p`` of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.errors import ConfigError
from jaxllm.sharding import Layout

ACTIVATION = ("stage", "batch", "residual", "act_embed")


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


def bubble_fraction(stages: int, virtual_stages: int, microbatches: int) -> float:
    """The schedule's idle fraction ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021, section 2.2)."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def schedule_bubble(cfg) -> float:
    """:func:`bubble_fraction` of a resolved config's pipeline (0 without one)."""
    return bubble_fraction(cfg.stages, cfg.parallel.pipeline_virtual_stages, cfg.microbatches)


def _stage_layout(w, p, v):
    """``[layers, ...]`` -> ``[p, v, layers / (p v), ...]``: stage ``s``, pass ``r`` holds chunk ``r p + s``."""
    return w.reshape(v, p, w.shape[0] // (p * v), *w.shape[1:]).swapaxes(0, 1)


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
      dropout_keys: one PRNG key per microbatch ``[microbatches]``, or None (no dropout).
    Returns:
      float32 scalar: the mean cross entropy over every token (the model's fused output loss,
      :meth:`jaxllm.model.GPT.output_loss`), as the same batch gives without pipeline.
    """
    p, v, (m, mb, seq) = cfg.stages, cfg.parallel.pipeline_virtual_stages, inputs.shape
    stage_axis, constrain = layout.mesh_axes("stage"), layout.constrain
    gpt = nnx.merge(spec.graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(seq) if positions is None else positions[0], (mb, seq))

    if dropout_keys is None:
        x, layer_keys = jax.vmap(lambda t: gpt.embed(t, positions)[0])(inputs), None
    else:  # [m, layers] -> per stage [p, m, v, layers / (p v)]
        x, layer_keys = jax.vmap(lambda t, k: gpt.embed(t, positions, k))(inputs, dropout_keys)
        layer_keys = _stage_layout(layer_keys.swapaxes(0, 1), p, v).transpose(0, 3, 1, 2)

    stage_params = jax.tree.map(lambda w, axes: constrain(_stage_layout(w, p, v), ("stage", None, None) + axes[1:]),
                                params["layers"], spec.axes["layers"])

    stage = jnp.arange(p)
    first, last = stage == 0, stage == p - 1

    def select(tree, index):  # per stage: tree[s][index[s]]
        take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
        return jax.vmap(lambda t, i: jax.tree.map(lambda a: take(a, i), t), spmd_axis_name=stage_axis)(tree, index)

    def store(buffers, slot, value, where):  # per stage: buffers[s][slot] = value[s] where where[s]
        def one(b, i, x, w):
            return jax.lax.dynamic_update_index_in_dim(b, jnp.where(w, x, b[i]), i, 0)
        return jax.vmap(one, spmd_axis_name=stage_axis)(buffers, jnp.broadcast_to(slot, (p,)), value, where)

    def run_stage(w, h, keys):
        return gpt.run_layers(h, positions, w, keys)[0]

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
    buffers = constrain(jnp.broadcast_to(x, (p, *x.shape)), ("stage", None, *ACTIVATION[1:]))
    out = jnp.zeros((p, mb, seq, x.shape[-1]), x.dtype)
    (_, buffers), _ = jax.lax.scan(iteration, (out, buffers), jnp.arange(v * m + p - 1))
    hidden = buffers[-1]

    hidden = constrain(hidden.reshape(p, m // p, mb, seq, -1), ("stage", None, *ACTIVATION[1:]))
    # each stage: the summed token losses of its m / p microbatches
    totals = jax.vmap(gpt.output_loss, spmd_axis_name=stage_axis)(hidden, targets.reshape(p, m // p, mb, seq))
    return totals.sum() / targets.size
