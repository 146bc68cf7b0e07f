"""A GPT decoder in Flax NNX (Radford et al. 2019; Megatron-LM's pre-norm layout).

Options: learned or rotary positions (Su et al. 2021), LayerNorm or RMSNorm,
GELU or SwiGLU MLP (Shazeer 2020), multi-head or grouped-query attention
(Ainslie et al. 2023), tied or untied embeddings, dropout on the embedding and
on each residual branch.  Layers are stacked on a leading ``layers`` axis and
run with ``jax.lax.scan``, so compile time does not grow with depth, or written
out one after another (``model.layer_loop``).

Parameters are float32; matmuls run in ``model.dtype``; norms, softmax and
logits are float32.  Every parameter carries logical axis names in its
``out_sharding`` metadata, and large activations pass through
``ops.constrain(x, logical_names)``.  The model knows nothing of parallelism: the
operations where a layout enters (that constraint; attention, which sequence
parallelism replaces; the embedding lookup and the loss, which are split over the
vocabulary; the layer matmuls, which the zb_h1 pipeline schedule splits) come in an
:class:`Ops` object, by default the plain single-device ones; :class:`jaxllm.runtime.run.Run`
gives the mesh's.  The loss (:meth:`GPT.loss`) is the
output layer and cross entropy fused in chunks (:mod:`jaxllm.model.fused_loss`): training never
holds the ``[batch, len, vocab]`` logits; :meth:`GPT.__call__` gives them (sampling).

Parameters are handled as a plain nested dict (``params``) outside this file:
``describe(cfg)`` gives the graph definition, parameter shapes, logical axes and
weight-decay mask in one pass (:class:`Spec`), ``init(cfg, seed)`` the parameters,
and ``forward(graphdef, params, tokens)`` runs the model.  ``cfg`` is the ``model``
section of a resolved config (:class:`jaxllm.config.Model`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxllm.model import attention as dispatch
from jaxllm.model import fused_loss, moe
from jaxllm_kernels.reference import MASKED

if TYPE_CHECKING:
    from jaxllm.config import Model as ModelConfig


def _unconstrained(x, axes):
    return x


def dense(x, w, b, spec, dtype):
    """``einsum(spec, x, w) + b`` with the matmul in ``dtype`` (``b``: an array or None)."""
    y = jnp.einsum(spec, x.astype(dtype), w.astype(dtype))
    return y if b is None else y + b.astype(dtype)


def _plain_attention(q, k, v, order, segment_ids, impl):
    return dispatch.attention(q, k, v, impl=impl, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)


def _plain_embed(table, ids):
    return table[ids]


@dataclasses.dataclass(frozen=True)
class Ops:
    """The operations through which a parallel layout enters the model.

    Attributes:
      constrain: ``(x, axes) -> x``: pins activation ``x``, whose dimensions have the
        logical names ``axes``, to its layout (identity on one device).
      attention: ``(q, k, v, order, segment_ids, impl) -> out``: causal self-attention of q
        ``[batch, len, heads, head_dim]`` and k, v ``[batch, len, kv_heads, head_dim]`` by
        ``model.attention_impl`` ``impl``; ``order`` int32 ``[batch, len]`` is each token's index
        in the sequence, which the causal mask follows (None: the array's order; ring attention's
        reordered batch gives it), ``segment_ids`` int32 ``[batch, len]`` or None: a token attends
        only to tokens of its segment (its document, ``data.reset_attention_mask``); returns
        ``[batch, len, heads, head_dim]``.
      embed: ``(table, ids) -> x``: the rows of ``table`` ``[padded_vocab, embed]`` at int32 ``ids``
        ``[batch, len]``: ``[batch, len, embed]``.
      cross_entropy: ``(h, table, targets, vocab_size, weights=None) -> float32 []``: the summed
        next-token cross entropy of the output layer ``table`` ``[padded_vocab, embed]`` applied to ``h``
        ``[..., batch, len, embed]``, targets int32 ``[..., batch, len]``, each token's loss times
        ``weights`` float32 ``[..., batch, len]`` (None: 1), logits of ids ``>= vocab_size`` masked
        (:func:`jaxllm.model.fused_loss.cross_entropy`).
      param: ``(w, axes) -> w``: pins a parameter cast to the compute dtype to the parameters' own
        layout, so that a table consumed whole (the embeddings, the loss's output layer) is gathered
        after the cast, in the compute dtype (identity on one device).
      dense: ``(x, w, b, spec, dtype) -> y``: every layer matmul with a weight (q, k, v,
        attention output, MLP), :func:`dense` by default; ``w`` and ``b`` (or None) are the very
        parameter values of the layer (the zb_h1 pipeline schedule takes input and weight
        gradients apart here, :mod:`jaxllm.parallel.pipeline`).
      experts: ``(x, ids, weights, w1, wg, w2, b1, b2, *, activation, dtype) -> y``: the mixture of
        experts' expert computation, ``x`` ``[batch, len, embed]``, routing ``[batch, len, topk]``
        (:func:`jaxllm.model.moe.local_experts`; expert parallelism replaces it).
      router_loss: ``(x, loss) -> x``: joins a router's auxiliary loss to the objective
        (:func:`jaxllm.model.moe.attach_loss`, its gradient the step's 1 / micro batches).
    """

    constrain: Callable = _unconstrained
    attention: Callable = _plain_attention
    embed: Callable = _plain_embed
    cross_entropy: Callable = fused_loss.cross_entropy
    param: Callable = _unconstrained
    dense: Callable = dense
    experts: Callable = moe.local_experts
    router_loss: Callable = moe.loss_scaler(1.0)


LOCAL = Ops()


def _param(key, shape, std, axes, pad=None):
    """A float32 parameter: normal(0, std), or zeros (std=0), or ones (std=None); ``pad``
    ``(axis, size)`` appends zeros along ``axis`` up to ``size`` (the padded vocabulary rows, so
    that padding draws no random numbers: the real rows do not depend on it)."""
    if std is None:
        value = jnp.ones(shape, jnp.float32)
    elif std == 0:
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = std * jax.random.normal(key, shape, jnp.float32)
    if pad is not None:
        axis, size = pad
        value = jnp.pad(value, [(0, size - n if i == axis else 0) for i, n in enumerate(shape)])
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _dense(ops, x, w, b, spec, dtype):
    """``ops.dense`` of the weight ``w`` and the bias parameter ``b`` (or None)."""
    return ops.dense(x, w, None if b is None else b[...], spec, dtype)


def rotary(x, positions, base):
    """Rotary position embedding (Su et al. 2021, eq. 34), GPT-NeoX / Llama half-split layout.

    Args:
      x: ``[batch, len, heads, head_dim]``.
      positions: int ``[batch, len]``.
    Returns:
      ``x`` rotated, same shape and dtype.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, len, half]
    sin, cos = jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


_GELU_C = (2 / 3.141592653589793) ** 0.5


@jax.custom_jvp
def gelu(x):
    """GPT-2's GELU, tanh approximation (Hendrycks & Gimpel 2016, eq. 2), as ``jax.nn.gelu(approximate=True)``.

    Its derivative ``0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)`` (``t = tanh(c (x + a x^3))``,
    ``c = sqrt(2/pi)``, ``a = 0.044715``) is computed in the forward pass from ``x``: the backward
    pass keeps that one array instead of autodiff's five intermediates.
    """
    return jax.nn.gelu(x, approximate=True)


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x32 = x.astype(jnp.float32)
    t = jnp.tanh(_GELU_C * (x32 + 0.044715 * x32 ** 3))
    slope = 0.5 * (1 + t) + 0.5 * x32 * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * x32 * x32)
    return gelu(x), (slope * dx).astype(x.dtype)


def _dropout(x, rate, keys, order=None):
    """Inverted dropout of ``x`` ``[batch, len, ...]`` with one key per row ``keys`` ``[batch]``.

    Each token's mask is drawn from ``fold_in(its row's key, its index in the sequence)``
    (``order`` int32 ``[batch, len]``, ring attention's reordering; None: ``arange(len)``), so
    that how the batch is split into micro batches, devices or a reordered sequence does not
    change which activations are dropped.
    """
    if keys is None or rate == 0.0:
        return x
    index = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2]) if order is None else order
    token_mask = lambda key, i: jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - rate, x.shape[2:])  # noqa: E731
    keep = jax.vmap(jax.vmap(token_mask, in_axes=(None, 0)))(keys, index)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def row_keys(key, rows):
    """``fold_in(key, r)`` for every row index ``r`` of the int array ``rows`` (any shape): the
    dropout keys ``[*rows.shape]`` of those rows."""
    return jax.vmap(jax.random.fold_in, (None, 0))(key, rows.reshape(-1)).reshape(rows.shape)


def _split_rows(keys, n):
    """Per-row keys ``[batch]`` -> ``n`` of them ``[n, batch]``."""
    return jax.vmap(lambda k: jax.random.split(k, n), out_axes=1)(keys)


class Norm(nnx.Module):
    """LayerNorm (Ba et al. 2016) or RMSNorm (Zhang & Sennrich 2019) over ``embed``, in float32."""

    def __init__(self, cfg):
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.scale = _param(None, (cfg.hidden_size,), None, ("embed",))
        with_bias = cfg.norm == "layernorm" and cfg.use_bias
        self.bias = _param(None, (cfg.hidden_size,), 0, ("embed",)) if with_bias else None

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        if self.kind == "layernorm":
            x32 = x32 - x32.mean(-1, keepdims=True)
        y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + self.eps) * self.scale[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype)


class Attention(nnx.Module):
    """Causal self-attention with ``num_kv_heads`` key/value heads (GQA when fewer than query heads)."""

    def __init__(self, cfg, rngs, ops):
        h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads
        d = h // nh
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.cfg, self.ops = cfg, ops
        self.wq = _param(rngs.params(), (h, nh, d), std, ("embed", "heads", "head_dim"))
        self.wk = _param(rngs.params(), (h, nkv, d), std, ("embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs.params(), (h, nkv, d), std, ("embed", "kv_heads", "head_dim"))
        self.wo = _param(rngs.params(), (nh, d, h), out_std, ("heads", "head_dim", "embed"))
        if cfg.use_bias:
            self.bq = _param(None, (nh, d), 0, ("heads", "head_dim"))
            self.bk = _param(None, (nkv, d), 0, ("kv_heads", "head_dim"))
            self.bv = _param(None, (nkv, d), 0, ("kv_heads", "head_dim"))
            self.bo = _param(None, (h,), 0, ("embed",))
        else:
            self.bq = self.bk = self.bv = self.bo = None

    def __call__(self, x, positions, cache=None, order=None, segment_ids=None):
        cfg, dt, constrain = self.cfg, jnp.dtype(self.cfg.dtype), self.ops.constrain
        q = checkpoint_name(_dense(self.ops, x, self.wq[...], self.bq, "bse,ehd->bshd", dt), "query_proj")
        k = checkpoint_name(_dense(self.ops, x, self.wk[...], self.bk, "bse,ehd->bshd", dt), "key_proj")
        v = checkpoint_name(_dense(self.ops, x, self.wv[...], self.bv, "bse,ehd->bshd", dt), "value_proj")
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        if cfg.position_embedding == "rotary":
            q, k = rotary(q, positions, cfg.rotary_base), rotary(k, positions, cfg.rotary_base)
        if cache is None:
            out = self.ops.attention(q, k, v, order, segment_ids, cfg.attention_impl)
        else:
            # Decoding: write this chunk's keys/values at `positions` and attend to the whole
            # cache; slots not yet written hold later positions and are masked as the future.
            k_cache, v_cache = cache
            start = positions[0, 0]
            k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
            v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
            kv_positions = jnp.broadcast_to(jnp.arange(k_cache.shape[1]), k_cache.shape[:2])
            out = dispatch.attention(q, k_cache, v_cache, impl="xla", causal=True,
                                     q_positions=positions, kv_positions=kv_positions)
            cache = (k_cache, v_cache)
        out = checkpoint_name(constrain(out, ("batch", "length", "heads", "head_dim")), "context")
        return checkpoint_name(_dense(self.ops, out, self.wo[...], self.bo, "bshd,hde->bse", dt), "out_proj"), cache


class MLP(nnx.Module):
    """GELU (tanh approximation, as GPT-2) or SwiGLU feed-forward block, ``[batch, len, embed]`` to the same.

    With ``model.mlp_chunks`` = m > 1 the tokens go through in m chunks, one after another, each
    under ``jax.checkpoint``: only one chunk's ``[batch, len / m, ffn]`` intermediates are live, in the
    forward and the backward pass, for one more forward of the MLP (the tiled MLP of Arctic Long
    Sequence Training, Bekman et al. 2025).  Chunk j holds tokens j, j + m, ... so that every device's
    sequence shard splits into m local chunks.  A length m does not divide runs whole.
    """

    def __init__(self, cfg, rngs, ops):
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.cfg, self.ops = cfg, ops
        self.w1 = _param(rngs.params(), (h, f), cfg.init_std, ("embed", "mlp"))
        self.wg = _param(rngs.params(), (h, f), cfg.init_std, ("embed", "mlp")) if cfg.activation == "swiglu" else None
        self.w2 = _param(rngs.params(), (f, h), cfg.init_std / (2 * cfg.num_layers) ** 0.5, ("mlp", "embed"))
        self.b1 = _param(None, (f,), 0, ("mlp",)) if cfg.use_bias else None
        self.b2 = _param(None, (h,), 0, ("embed",)) if cfg.use_bias else None

    def __call__(self, x):
        m, (b, s, e) = self.cfg.mlp_chunks, x.shape
        if m == 1 or s % m:  # generation's prompts and single tokens run whole: the same values
            return self._mlp(x)
        chunks = jnp.moveaxis(x.reshape(b, s // m, m, e), 2, 0)  # [m, batch, len / m, embed]
        out = jax.lax.map(jax.checkpoint(self._mlp), chunks)
        return jnp.moveaxis(out, 0, 2).reshape(b, s, e)

    def _mlp(self, x):
        dt = jnp.dtype(self.cfg.dtype)
        y = checkpoint_name(_dense(self.ops, x, self.w1[...], self.b1, "bse,ef->bsf", dt), "mlpwi")
        if self.wg is None:
            y = gelu(y)
        else:
            gate = checkpoint_name(_dense(self.ops, x, self.wg[...], None, "bse,ef->bsf", dt), "mlpwi_gate")
            y = jax.nn.silu(gate) * y
        y = self.ops.constrain(y, ("batch", "length", "mlp"))
        return checkpoint_name(_dense(self.ops, y, self.w2[...], self.b2, "bsf,fe->bse", dt), "mlpwo")


class MoE(nnx.Module):
    """Mixture of experts in place of the MLP (``model.num_experts`` > 0): a float32 router picks each token's
    ``moe_router_topk`` experts (:func:`jaxllm.model.moe.route`), each an MLP of ``moe_ffn_hidden_size`` with
    the model's activation, combined by the router's weights; plus a shared dense MLP of
    ``moe_shared_expert_intermediate_size`` that every token takes (Qwen-MoE, DeepSeekMoE), if set.

    The router's losses (``moe_aux_loss_coeff`` x load-balancing loss + ``moe_z_loss_coeff`` x z-loss) join the
    objective through ``ops.router_loss``; the call returns the output ``[batch, len, embed]`` and the
    routing statistics (float32 scalars, :func:`jaxllm.model.moe.route`).
    """

    def __init__(self, cfg, rngs, ops):
        h, f, e = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.cfg, self.ops = cfg, ops
        self.router = _param(rngs.params(), (h, e), std, ("embed", None))
        self.w1 = _param(rngs.params(), (e, h, f), std, ("experts", "expert_embed", "expert_mlp"))
        self.wg = (_param(rngs.params(), (e, h, f), std, ("experts", "expert_embed", "expert_mlp"))
                   if cfg.activation == "swiglu" else None)
        self.w2 = _param(rngs.params(), (e, f, h), out_std, ("experts", "expert_mlp", "expert_embed"))
        self.b1 = _param(None, (e, f), 0, ("experts", "expert_mlp")) if cfg.use_bias else None
        self.b2 = _param(None, (e, h), 0, ("experts", "expert_embed")) if cfg.use_bias else None
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared = MLP(dataclasses.replace(cfg, ffn_hidden_size=shared), rngs, ops) if shared else None

    def __call__(self, x):
        cfg, value = self.cfg, lambda p: None if p is None else p[...]  # noqa: E731
        logits = jnp.einsum("bse,ex->bsx", x.astype(jnp.float32), self.router[...])
        ids, weights, stats = moe.route(logits, cfg.moe_router_topk, cfg.moe_capacity_factor)
        y = self.ops.experts(x, ids, weights, self.w1[...], value(self.wg), self.w2[...], value(self.b1),
                             value(self.b2), activation=gelu, dtype=jnp.dtype(cfg.dtype))
        y = self.ops.router_loss(y, cfg.moe_aux_loss_coeff * stats["aux_loss"] + cfg.moe_z_loss_coeff * stats["z_loss"])
        if self.shared is not None:
            y = y + self.shared(x)
        return y, stats


class Block(nnx.Module):
    """One pre-norm transformer layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (the MLP a
    mixture of experts when ``model.num_experts`` > 0)."""

    def __init__(self, cfg, rngs, ops):
        self.dropout, self.ops = cfg.dropout, ops
        self.ln1, self.attn = Norm(cfg), Attention(cfg, rngs, ops)
        self.ln2, self.mlp = Norm(cfg), (MoE(cfg, rngs, ops) if cfg.num_experts else MLP(cfg, rngs, ops))

    def __call__(self, x, positions, key=None, cache=None, order=None, segment_ids=None):
        """``(x, out)``: the layer's output and, when decoding, the updated ``cache``, else the mixture of
        experts' routing statistics (:func:`jaxllm.model.moe.route`; None for a dense MLP)."""
        x = checkpoint_name(x, "decoder_layer_input")  # every use below reads it through the name
        k1, k2 = _split_rows(key, 2) if key is not None else (None, None)
        y, cache = self.attn(self.ln1(x), positions, cache, order, segment_ids)
        x = self.ops.constrain(x + _dropout(y, self.dropout, k1, order), RESIDUAL)
        y, stats = self.mlp(self.ln2(x)), None
        if isinstance(self.mlp, MoE):
            y, stats = y
        x = x + _dropout(y, self.dropout, k2, order)
        return self.ops.constrain(x, RESIDUAL), (cache if cache is not None else stats)


RESIDUAL = ("batch", "residual", "act_embed")  # the residual stream between blocks
MOE_STATS = ("moe_aux_loss", "moe_z_loss", "moe_max_load", "moe_dropped")  # the logged routing statistics

# The layer's named activations (``checkpoint_name``, MaxText's names): its input (``decoder_layer_input``),
# each matmul's output and the attention output (``context``).  A remat policy saves some for the backward
# pass and recomputes the rest.
QKV = ("query_proj", "key_proj", "value_proj")
MATMULS = (*QKV, "out_proj", "mlpwi", "mlpwi_gate", "mlpwo")
_names = jax.checkpoint_policies.save_only_these_names


def _offloaded(*names):
    """Save ``names`` in host memory (pinned) instead of device memory; recompute the rest."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host")


# ``model.remat``: what each layer keeps for its backward pass (MaxText's policy names; "none": everything).
# ``full`` keeps only the layer's input (the checkpointed function's argument); ``offload`` keeps that in
# host memory (MaxText's ``decoder_layer_input: offload``): nothing of the layer stays on the device, so
# device memory no longer grows with layers x tokens.  The saved sets, by size: offload < full < save_qkv_proj
# < save_dots_except_mlp < minimal ~ save_dots (the same matmuls, whose outputs have no dot batch dimension;
# minimal keeps them after the bias) < minimal_with_context.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": _names(*MATMULS),
    "minimal_with_context": _names(*MATMULS, "context"),
    "save_qkv_proj": _names(*QKV),
    "save_dots_except_mlp": _names(*QKV, "out_proj"),
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal_offloaded": _offloaded(*MATMULS),
    "qkv_proj_offloaded": _offloaded(*QKV),
    "offload": _offloaded("decoder_layer_input"),
}


class GPT(nnx.Module):
    """GPT decoder.

    Args:
      cfg: the ``model`` section of a resolved config (:class:`jaxllm.config.Model`).
      rngs: ``nnx.Rngs`` for initialization: normal(0, ``init_std``), output projections
        of each layer scaled by ``1/sqrt(2 * num_layers)`` (GPT-2, Megatron-LM).
      ops: how a parallel layout enters (:class:`Ops`); default: one device.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: Ops = LOCAL):
        self.cfg, self.ops = cfg, ops
        vocab, padded = cfg.vocab_size, cfg.padded_vocab_size
        self.wte = _param(rngs.params(), (vocab, cfg.hidden_size), cfg.init_std, ("vocab", "embed"), (0, padded))
        self.wpe = (_param(rngs.params(), (cfg.max_position_embeddings, cfg.hidden_size), cfg.init_std,
                           (None, "embed")) if cfg.position_embedding == "learned" else None)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs):
            return Block(cfg, rngs, ops)

        self.layers = stack(rngs)
        self.ln_f = Norm(cfg)
        self.lm_head = (None if cfg.tie_embeddings else
                        _param(rngs.params(), (cfg.hidden_size, vocab), cfg.init_std, ("embed", "vocab"), (1, padded)))

    def __call__(self, tokens, *, positions=None, order=None, segment_ids=None, dropout_key=None, cache=None):
        """Logits of the next token.

        Args:
          tokens: int32 ``[batch, len]``.
          positions: int32 ``[batch, len]``, each token's position for the position embedding
            (learned or rotary); default ``arange(len)``.
          order: int32 ``[batch, len]``, each token's index in the sequence, for the causal mask,
            when the batch is reordered (ring attention's zigzag order); None: the array's order.
          segment_ids: int32 ``[batch, len]``: a token attends only to earlier tokens of the same
            segment (its document); None: one segment.
          dropout_key: PRNG keys ``[batch]``, one per row (the training step derives each from the
            row's index in the global batch), or one key, folded with each row's index here;
            None disables dropout (evaluation, decoding).
          cache: None, or the decoding cache from :func:`init_cache`; its keys and
            values are written at ``positions`` (which must be contiguous).
        Returns:
          float32 logits ``[batch, len, vocab]``, and the updated cache when one was given.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, keys = self.embed(tokens, positions, dropout_key, order)
        x, cache_out = self.run_layers(x, positions, nnx.to_pure_dict(nnx.state(self.layers)), keys, cache,
                                       order=order, segment_ids=segment_ids)
        logits = self.head(x)
        return logits if cache is None else (logits, cache_out)

    def loss(self, tokens, targets, *, positions=None, order=None, segment_ids=None, loss_mask=None,
             dropout_key=None, with_stats=False):
        """Summed next-token cross entropy (nats, float32 scalar) of ``targets`` int32 ``[batch, len]``
        after ``tokens``, each token's loss times ``loss_mask`` float32 ``[batch, len]`` (None: 1), the
        other arguments as :meth:`__call__`, without the logits (:meth:`output_loss`).  ``with_stats``:
        ``(loss, stats)`` with the mixture of experts' statistics (:meth:`moe_stats`; ``{}`` when dense)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, keys = self.embed(tokens, positions, dropout_key, order)
        x, stats = self.run_layers(x, positions, nnx.to_pure_dict(nnx.state(self.layers)), keys, order=order,
                                   segment_ids=segment_ids)
        loss = self.output_loss(x, targets, loss_mask)
        return (loss, self.moe_stats(stats)) if with_stats else loss

    @staticmethod
    def moe_stats(stats) -> dict:
        """The logged routing statistics from the layers' ``[layers]`` ones (:func:`jaxllm.model.moe.route`):
        ``moe_aux_loss`` and ``moe_z_loss`` (the layers' mean, without their coefficients), ``moe_max_load``
        (the largest over the layers: the busiest expert's tokens over the mean) and ``moe_dropped`` (the
        layers' mean fraction of dropped token copies); ``{}`` for a dense model (``stats`` None)."""
        if stats is None:
            return {}
        return dict(zip(MOE_STATS, (stats["aux_loss"].mean(), stats["z_loss"].mean(), stats["max_load"].max(),
                                    stats["dropped"].mean())))

    def embed(self, tokens, positions, dropout_key=None, order=None):
        """Token (+ learned position) embeddings ``[batch, len, embed]`` in ``model.dtype``, with
        dropout, and the per-layer dropout keys ``[layers, batch]`` (None without ``dropout_key``;
        the arguments as :meth:`__call__`)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x = self.ops.embed(self.ops.param(self.wte[...].astype(dt), ("vocab", "embed")), tokens)
        if self.wpe is not None:  # a small table, gathered whole (the partitioner cannot split a gather on `embed`)
            wpe = self.ops.param(self.wpe[...].astype(dt), (None, "embed"))
            x = x + self.ops.constrain(wpe, (None, None))[positions]
        keys = None
        if dropout_key is not None:
            if dropout_key.ndim == 0:
                dropout_key = row_keys(dropout_key, jnp.arange(tokens.shape[0]))
            keys = _split_rows(dropout_key, cfg.num_layers + 1)
            x, keys = _dropout(x, cfg.dropout, keys[0], order), keys[1:]
        return self.ops.constrain(x, RESIDUAL), keys

    def run_layers(self, x, positions, layer_params, keys=None, cache=None, *, order=None, segment_ids=None):
        """Applies the layers whose parameters are ``layer_params`` (a slice of ``params["layers"]``
        along its leading ``layers`` axis: all of them, or one pipeline stage's) in order.

        Args:
          x: ``[batch, len, embed]``; positions, order, segment_ids: int32 ``[batch, len]`` (or None
            for the last two), as :meth:`__call__`.
          keys: dropout keys ``[layers, batch]``, per layer of ``layer_params`` and row, or None.
          cache: decoding cache of these layers, or None.
        Returns:
          ``(x, cache)``.

        ``model.layer_loop="scan"`` runs them as one ``jax.lax.scan`` (compile time independent of
        depth); ``"unrolled"`` one after another (which backend gets which: :mod:`jaxllm.runtime.cpu`).
        """
        graphdef = nnx.graphdef(self.layers)

        def layer(x, xs):
            params, key, layer_cache = xs
            return nnx.merge(graphdef, params)(x, positions, key, layer_cache, order, segment_ids)

        if self.cfg.remat != "none":
            # outside a scan XLA's common-subexpression elimination would merge the recomputation back
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.cfg.remat],
                                   prevent_cse=self.cfg.layer_loop == "unrolled")
        if self.cfg.layer_loop != "unrolled":
            return jax.lax.scan(layer, x, (layer_params, keys, cache))
        outs = []
        for i in range(jax.tree.leaves(layer_params)[0].shape[0]):
            x, out = layer(x, jax.tree.map(lambda a, i=i: a[i], (layer_params, keys, cache)))
            outs.append(out)
        return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)

    def head(self, x):
        """Final norm and output layer: float32 logits ``[batch, len, padded_vocab]`` from ``[batch, len,
        embed]``; the padded entries (ids >= ``vocab_size``) are ``MASKED`` (-1e30), so the softmax, the
        loss and sampling see exactly the ``vocab_size`` real tokens whatever the padding."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x = self.ln_f(x)
        if self.lm_head is None:
            logits = jnp.einsum("bse,ve->bsv", x, self.wte[...].astype(dt), preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("bse,ev->bsv", x, self.lm_head[...].astype(dt), preferred_element_type=jnp.float32)
        if cfg.padded_vocab_size > cfg.vocab_size:
            ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
            logits = jnp.where(ids < cfg.vocab_size, logits, MASKED)
        return self.ops.constrain(logits, ("batch", "length", "vocab"))

    def output_loss(self, x, targets, loss_mask=None):
        """Final norm, output layer and summed cross entropy (nats, float32 scalar) of ``targets``
        int32 ``[..., batch, len]`` from the last layer's ``x`` ``[..., batch, len, embed]``, each
        token's loss times ``loss_mask`` float32 ``[..., batch, len]`` (None: 1): the loss of
        :meth:`head`'s logits (padded ids masked alike), computed in chunks with its gradient
        (:func:`jaxllm.model.fused_loss.cross_entropy`)."""
        dt = jnp.dtype(self.cfg.dtype)
        with jax.named_scope("output_loss"):  # the profile's category (jaxllm.runtime.profile)
            if self.lm_head is None:
                table = self.ops.param(self.wte[...].astype(dt), ("vocab", "embed"))
            else:
                table = self.ops.param(self.lm_head[...].astype(dt), ("embed", "vocab")).T
            return self.ops.cross_entropy(self.ln_f(x), table, targets, self.cfg.vocab_size, loss_mask)


@dataclasses.dataclass(frozen=True)
class Spec:
    """The model without its values, from one trace (:func:`describe`).

    Attributes:
      graphdef: the NNX graph definition (to :func:`forward` or ``nnx.merge`` with params).
      params: the parameters' ``jax.ShapeDtypeStruct`` (float32), a nested dict as :func:`init` gives.
      axes: each parameter's logical axis names, a dict shaped as ``params`` with tuple leaves.
      decay: which parameters get weight decay (the matrices that multiply the ``embed``
        axis: embeddings, projections, routers and experts, not norms or biases), bool leaves.
    """

    graphdef: Any
    params: dict
    axes: dict
    decay: dict


def describe(cfg: ModelConfig, ops: Ops = LOCAL) -> Spec:
    """The :class:`Spec` of the model ``cfg`` describes (nothing is allocated)."""
    gpt = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0), ops))
    graphdef, state = nnx.split(gpt, nnx.Param)
    axes = nnx.to_pure_dict(jax.tree.map(
        lambda v: tuple(v.get_metadata()["out_sharding"] or (None,) * v.value.ndim), state,
        is_leaf=lambda v: isinstance(v, nnx.Variable)))
    decay = jax.tree.map(lambda a: bool({"embed", "expert_embed"} & set(a))
                         and len([n for n in a if n not in ("layers", "experts")]) >= 2, axes,
                         is_leaf=lambda x: isinstance(x, tuple))
    return Spec(graphdef, nnx.to_pure_dict(state), axes, decay)


def logical_sizes(cfg: ModelConfig, seq_length: int) -> dict[str, tuple[int, str]]:
    """Each logical axis the rules table may split: ``{name: (size, the config key that sets it)}``
    (for the divisibility checks of :func:`jaxllm.parallel.sharding.check`)."""
    return {
        "heads": (cfg.num_attention_heads, "model.num_attention_heads"),
        "kv_heads": (cfg.num_kv_heads, "model.num_kv_heads"),
        "mlp": (cfg.ffn_hidden_size, "model.ffn_hidden_size"),
        "vocab": (cfg.padded_vocab_size, "model.vocab_size"),
        "embed": (cfg.hidden_size, "model.hidden_size"),
        "layers": (cfg.num_layers, "model.num_layers"),
        "experts": (cfg.num_experts, "model.num_experts"),
        "expert_embed": (cfg.hidden_size, "model.hidden_size"),
        "expert_mlp": (cfg.moe_ffn_hidden_size, "model.moe_ffn_hidden_size"),
        "length": (seq_length, "train.seq_length"),
        "residual": (seq_length, "train.seq_length"),
    }


FLOAT32_PARAMS = ("ln1", "ln2", "ln_f", "router")  # what the model reads in float32: the norms, the MoE router


def cast_layers(cfg: ModelConfig, params: dict) -> dict:
    """``params`` with the layers' parameters that the model reads only in ``model.dtype`` (every projection,
    MLP and expert weight and bias: all but :data:`FLOAT32_PARAMS`) cast to it, once, so that a step of several
    micro batches, and the recomputation and backward pass of each layer, do not cast them again.  The same
    values reach every matmul, and a gradient with respect to a cast copy is the one the model's own cast
    gives before it is converted to float32.  Unchanged with ``model.fp8`` (whose scaling reads the float32
    weights) and for float32 models."""
    if cfg.fp8 or jnp.dtype(cfg.dtype) == jnp.float32 or "layers" not in params:
        return params
    dt = jnp.dtype(cfg.dtype)

    def cast(tree, keep=False):
        if isinstance(tree, dict):
            return {k: cast(v, keep or k in FLOAT32_PARAMS) for k, v in tree.items()}
        return tree if keep or tree is None else tree.astype(dt)

    return {**params, "layers": cast(params["layers"])}


def init(cfg: ModelConfig, seed) -> dict:
    """The initialized float32 parameters as a nested dict of arrays (jit it with
    ``out_shardings`` to create them sharded)."""
    return nnx.to_pure_dict(nnx.state(GPT(cfg, nnx.Rngs(params=seed)), nnx.Param))


def forward(graphdef, params, tokens, **kwargs):
    """Runs the model held in ``params`` (see :meth:`GPT.__call__` for the arguments)."""
    return nnx.merge(graphdef, params)(tokens, **kwargs)


def loss(graphdef, params, tokens, targets, **kwargs):
    """The summed next-token cross entropy of the model held in ``params`` (see :meth:`GPT.loss`)."""
    return nnx.merge(graphdef, params).loss(tokens, targets, **kwargs)


def init_cache(cfg: ModelConfig, batch: int, max_length: int):
    """An empty decoding cache: per layer keys and values ``[layers, batch, max_length, kv_heads, head_dim]``."""
    shape = (cfg.num_layers, batch, max_length, cfg.num_kv_heads, cfg.head_dim)
    return (jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


def num_params(params, *, exclude_positions: bool = False) -> int:
    """Parameter count; ``exclude_positions`` leaves out the learned position table."""
    n = sum(x.size for x in jax.tree.leaves(params))
    if exclude_positions and "wpe" in params:
        n -= params["wpe"].size
    return n


def active_params(cfg: ModelConfig, params) -> int:
    """Parameters one token uses (:func:`num_params` for a dense model): a mixture of experts' weights count
    ``moe_router_topk / num_experts`` of theirs, the token's experts (Mixtral-8x7B: 12.9B of 46.7B)."""
    n = num_params(params)
    if cfg.num_experts:
        mlp = params["layers"]["mlp"]
        experts = sum(mlp[k].size for k in ("w1", "wg", "w2", "b1", "b2") if mlp.get(k) is not None)
        n -= experts * (cfg.num_experts - cfg.moe_router_topk) // cfg.num_experts
    return n
