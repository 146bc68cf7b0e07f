"""The layers of the GPT (:mod:`jaxllm.model.gpt` assembles them): the pre-norm transformer
:class:`Block` of :class:`Norm`, :class:`Attention` (or :class:`LatentAttention`) and an :class:`MLP` or
:class:`MoE`, and the pieces they share (the float32 :func:`param`, :func:`dense`, :func:`rotary`, :func:`gelu`, per-row
:func:`dropout`).

Parameters are float32; matmuls run in ``model.dtype``; norms and softmax are float32.  Every parameter
carries its logical axis names (``out_sharding`` metadata) and large activations pass through
``ops.constrain``; every operation where a parallel layout enters comes from the ``ops``
(:class:`jaxllm.model.gpt.Ops`) each layer is built with.  Each layer's activations are named
(``checkpoint_name``) for the remat policies (:mod:`jaxllm.model.remat`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxllm.model import attention as dispatch
from jaxllm.model import moe
from jaxllm.model import rotary as scalings


def dense(x, w, b, spec, dtype):
    """``einsum(spec, x, w) + b`` with the matmul in ``dtype`` (``b``: an array or None)."""
    y = jnp.einsum(spec, x.astype(dtype), w.astype(dtype))
    return y if b is None else y + b.astype(dtype)


def param(key, shape, std, axes, pad=None):
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


def rotary_frequencies(cfg, half: int, base: float = 0.0):
    """The rotary embedding's inverse wavelengths, float32 ``[half]`` (radians per position): ``base ** (-i / half)``
    for a layer of its own ``base`` (:attr:`jaxllm.model.groups.LayerKind.rotary_base`), unscaled; else ``rotary_base
    ** (-i / half)``, divided by ``rotary_seq_len_interpolation_factor`` (linear scaling); with
    ``cfg.use_rope_scaling`` Llama 3.1's scaling of them (Megatron-LM's
    ``RotaryEmbedding._apply_scaling``, transformers' ``_compute_llama3_parameters``): wavelengths longer than
    ``rope_original_max_position_embeddings / rope_low_freq_factor`` divided by ``rope_scaling_factor``, those
    shorter than ``... / rope_high_freq_factor`` kept, the ones between interpolated linearly in the inverse; with
    ``cfg.rope_type="yarn"`` YaRN's (:func:`jaxllm.model.rotary.yarn`)."""
    if base:
        return base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    inv_freq = cfg.rotary_base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if cfg.rotary_seq_len_interpolation_factor != 1:
        inv_freq = inv_freq / cfg.rotary_seq_len_interpolation_factor
    if cfg.rope_type == "yarn":
        return scalings.yarn(inv_freq, cfg)
    if not cfg.use_rope_scaling:
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_position_embeddings
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rotary(x, positions, inv_freq):
    """Rotary position embedding (Su et al. 2021, eq. 34), GPT-NeoX / Llama half-split layout.

    Args:
      x: ``[batch, len, heads, head_dim]``.
      positions: int ``[batch, len]``.
      inv_freq: float32 ``[head_dim / 2]``, :func:`rotary_frequencies`.
    Returns:
      ``x`` rotated, same shape and dtype.
    """
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


def quick_geglu(y, offset=0.0, clamp=0.0):
    """Megatron-LM's quick GeGLU (``--quick-geglu``, ``--glu-linear-offset``, ``--activation-func-clamp-value``;
    gpt-oss's clamped SwiGLU, transformers' ``GptOssExperts._apply_gate``): of ``y`` ``[..., 2f]`` whose even columns
    are the gates ``g`` and odd ones the linear units ``u`` (interleaved, as gpt-oss stores them, so that any split of
    the columns in even parts keeps each pair together), ``g sigmoid(1.702 g) (u + offset)`` with ``g`` clamped to at
    most ``clamp`` and ``u`` to ``[-clamp, clamp]`` (``clamp`` 0: neither): ``[..., f]`` in ``y``'s dtype."""
    gate, up = y[..., ::2], y[..., 1::2]
    if clamp:
        gate, up = jnp.minimum(gate, clamp), jnp.clip(up, -clamp, clamp)
    return gate * jax.nn.sigmoid(1.702 * gate) * (up + offset)


def activation(cfg):
    """The activation of an MLP's first matmul where it has no separate gate (``wg``): GPT-2's GELU, or
    ``model.activation="quick_geglu"``'s :func:`quick_geglu` (``[..., 2f]`` to ``[..., f]``)."""
    if cfg.activation != "quick_geglu":
        return gelu
    return functools.partial(quick_geglu, offset=cfg.glu_linear_offset, clamp=cfg.activation_func_clamp_value)


def dropout(x, rate, keys, order=None):
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


def split_rows(keys, n):
    """Per-row keys ``[batch]`` -> ``n`` of them ``[n, batch]``."""
    return jax.vmap(lambda k: jax.random.split(k, n), out_axes=1)(keys)


class Norm(nnx.Module):
    """LayerNorm (Ba et al. 2016) or RMSNorm (Zhang & Sennrich 2019) over the last axis, ``embed`` (or
    ``axis`` of ``size``: each head's ``head_dim`` for ``model.qk_layernorm``; or the last axes, ``size`` and
    ``axis`` tuples: all heads' ``[heads, head_dim]`` together), in float32; with ``model.apply_layernorm_1p`` scaled
    by ``1 + scale``, the scale from 0 (Megatron-LM's zero-centered gamma; Gemma's RMSNorm)."""

    def __init__(self, cfg, size=None, axis="embed"):
        self.kind, self.eps, size = cfg.norm, cfg.norm_eps, size or cfg.hidden_size
        shape = size if isinstance(size, tuple) else (size,)
        axes = axis if isinstance(axis, tuple) else (axis,)
        self.naxes = len(shape)  # the trailing axes normalized over
        self.one_plus = cfg.apply_layernorm_1p
        self.scale = param(None, shape, 0 if self.one_plus else None, axes)
        with_bias = cfg.norm == "layernorm" and cfg.use_bias
        self.bias = param(None, shape, 0, axes) if with_bias else None

    def __call__(self, x):
        scale = 1 + self.scale[...] if self.one_plus else self.scale[...]
        return norm(x, scale, None if self.bias is None else self.bias[...], self.kind == "layernorm", self.eps,
                    self.naxes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def norm(x, scale, bias, center: bool, eps: float, naxes: int = 1):
    """LayerNorm (``center``) or RMSNorm of ``x`` ``[..., *n]`` over its last ``naxes`` axes in float32, times
    ``scale`` (float32 ``[*n]``) plus ``bias`` (float32 ``[*n]`` or None), in ``x``'s dtype.

    Its gradient keeps what PyTorch's fused LayerNorm keeps (``aten::native_layer_norm``): ``x`` in its own
    dtype and each row's mean and reciprocal standard deviation (float32 ``[..., 1]``), not autodiff's
    float32 copies of the centred input; the backward pass is the usual ``dx = r (g - mean(g) - x^ mean(g x^))``
    with ``g = dy scale``, ``x^ = (x - mean) r`` (``mean(g)`` left out for RMSNorm).
    """
    return _norm_fwd(x, scale, bias, center, eps, naxes)[0]


def _norm_fwd(x, scale, bias, center, eps, naxes):
    axes = tuple(range(-naxes, 0))
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axes, keepdims=True) if center else jnp.zeros(x32.shape[:-naxes] + (1,) * naxes, jnp.float32)
    centred = x32 - mean
    r = jax.lax.rsqrt((centred * centred).mean(axes, keepdims=True) + eps)
    y = centred * r * scale
    y = y if bias is None else y + bias
    return y.astype(x.dtype), (x, mean, r, scale, bias)


def _norm_bwd(center, eps, naxes, res, dy):
    x, mean, r, scale, bias = res
    # read the saved statistics: XLA would otherwise fuse the forward's reductions into these consumers again,
    # and a kernel that reduces rows cannot also reduce the columns (d scale)
    x, mean, r = jax.lax.optimization_barrier((x, mean, r))
    axes = tuple(range(-naxes, 0))
    xhat = (x.astype(jnp.float32) - mean) * r
    dy32 = dy.astype(jnp.float32)
    g = dy32 * scale
    inner = g - xhat * (g * xhat).mean(axes, keepdims=True)
    dx = r * (inner - g.mean(axes, keepdims=True) if center else inner)
    rows = tuple(range(x.ndim - naxes))
    return (dx.astype(x.dtype), (dy32 * xhat).sum(rows), None if bias is None else dy32.sum(rows))


norm.defvjp(_norm_fwd, _norm_bwd)


class Attention(nnx.Module):
    """Causal self-attention with ``num_kv_heads`` key/value heads (GQA when fewer than query heads)."""

    def __init__(self, cfg, rngs, ops):
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.cfg, self.ops = cfg, ops
        self.wq = param(rngs.params(), (h, nh, d), std, ("embed", "heads", "head_dim"))
        self.wk = param(rngs.params(), (h, nkv, d), std, ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs.params(), (h, nkv, d), std, ("embed", "kv_heads", "head_dim"))
        self.wo = param(rngs.params(), (nh, d, h), out_std, ("heads", "head_dim", "embed"))
        qkv_bias = cfg.use_bias or cfg.add_qkv_bias
        self.bq = param(None, (nh, d), 0, ("heads", "head_dim")) if qkv_bias else None
        self.bk = param(None, (nkv, d), 0, ("kv_heads", "head_dim")) if qkv_bias else None
        self.bv = param(None, (nkv, d), 0, ("kv_heads", "head_dim")) if qkv_bias else None
        self.bo = param(None, (h,), 0, ("embed",)) if cfg.use_bias else None
        # attention sinks (model.softmax_type learnable): a logit per head in its softmax's denominator
        self.sinks = param(None, (nh,), 0, ("heads",)) if cfg.softmax_type == "learnable" else None
        # Megatron-LM's qk_layernorm (Dehghani et al. 2023): one norm of each head's queries, one of its keys; or
        # (qk_layernorm_per_head False) one of all heads' queries, one of all heads' keys
        if not cfg.qk_layernorm:
            self.q_norm = self.k_norm = None
        elif cfg.qk_layernorm_per_head:
            self.q_norm, self.k_norm = Norm(cfg, d, "head_dim"), Norm(cfg, d, "head_dim")
        else:
            self.q_norm, self.k_norm = (Norm(cfg, (n, d), (heads, "head_dim"))
                                        for n, heads in ((nh, "heads"), (nkv, "kv_heads")))

    def qkv(self, x, positions, rotary_base=0.0):
        """Queries ``[batch, len, heads, head_dim]``, keys and values ``[batch, len, kv_heads, head_dim]`` of ``x``
        ``[batch, len, embed]``, normed and rotated as configured (``rotary_base``: the layer's own, unscaled; 0:
        the model's rotary)."""
        cfg, dt, constrain = self.cfg, jnp.dtype(self.cfg.dtype), self.ops.constrain
        q = checkpoint_name(_dense(self.ops, x, self.wq[...], self.bq, "bse,ehd->bshd", dt), "query_proj")
        k = checkpoint_name(_dense(self.ops, x, self.wk[...], self.bk, "bse,ehd->bshd", dt), "key_proj")
        v = checkpoint_name(_dense(self.ops, x, self.wv[...], self.bv, "bse,ehd->bshd", dt), "value_proj")
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.position_embedding == "rotary":
            inv_freq = rotary_frequencies(cfg, q.shape[-1] // 2, rotary_base)
            q, k = (_rotary_scaled(cfg, a, positions, inv_freq, scaled=not rotary_base) for a in (q, k))
        return _scale_queries(cfg, q), k, v

    def __call__(self, x, positions, cache=None, order=None, segment_ids=None, kind=None):
        """``(out, cache)``: the attention's output ``[batch, len, embed]`` of ``x`` ``[batch, len, embed]`` at
        int32 ``positions`` ``[batch, len]``, and when decoding (``cache`` the layer's keys and values) the
        cache with this chunk's written at ``positions``; ``kind``: the layer's (its window and rotary base,
        :class:`jaxllm.model.groups.LayerKind`), None: ``model.sliding_window`` and the model's rotary."""
        cfg, dt, constrain = self.cfg, jnp.dtype(self.cfg.dtype), self.ops.constrain
        window = cfg.sliding_window if kind is None else kind.window
        q, k, v = self.qkv(x, positions, 0.0 if kind is None else kind.rotary_base)
        # the layer's window where it is not the model's (which the attention has bound), its sinks
        layer = {} if window == cfg.sliding_window else {"window": window or None}
        if cfg.softmax_type != "vanilla":
            layer["sinks"] = jnp.zeros(q.shape[2], jnp.float32) if self.sinks is None else self.sinks[...]
        if cache is None:
            out = self.ops.attention(q, k, v, order, segment_ids, **layer)
        else:
            # Decoding: write this chunk's keys/values at `positions` and attend to the whole
            # cache; slots not yet written hold later positions and are masked as the future.
            k_cache, v_cache = cache
            start = positions[0, 0]
            k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
            v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
            kv_positions = jnp.broadcast_to(jnp.arange(k_cache.shape[1]), k_cache.shape[:2])
            out = dispatch.attention(q, k_cache, v_cache, impl="xla", causal=True, window=window or None,
                                     q_positions=positions, kv_positions=kv_positions, sinks=layer.get("sinks"))
            cache = (k_cache, v_cache)
        out = checkpoint_name(constrain(out, ("batch", "length", "heads", "head_dim")), "context")
        return checkpoint_name(_dense(self.ops, out, self.wo[...], self.bo, "bshd,hde->bse", dt), "out_proj"), cache


def _rotary_scaled(cfg, x, positions, inv_freq, scaled=True):
    """:func:`rotary` times YaRN's factor (:func:`jaxllm.model.rotary.attention_factor`; none without YaRN, or for a
    layer of its own rotary base, ``scaled`` False)."""
    factor = scalings.attention_factor(cfg) if scaled else 1.0
    x = rotary(x, positions, inv_freq)
    return x if factor == 1 else (x * factor).astype(x.dtype)


def _scale_queries(cfg, q):
    """``q`` ``[..., width]`` scaled so that the attention's ``1 / sqrt(width)`` gives the model's scores: times
    ``model.softmax_scale x sqrt(width)`` (Gemma 3's ``query_pre_attn_scalar``) and YaRN's
    :func:`jaxllm.model.rotary.score_factor` (unchanged without them)."""
    factor = scalings.score_factor(cfg) * (cfg.softmax_scale * q.shape[-1] ** 0.5 if cfg.softmax_scale else 1.0)
    return q if factor == 1 else (q * factor).astype(q.dtype)


class LatentAttention(Attention):
    """Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024, section 2.1, eqs. 9-19; Megatron-LM's
    ``MLASelfAttention``, transformers' ``DeepseekV3Attention``), ``model.multi_latent_attention``.

    With ``n`` heads, ``dn`` = ``qk_head_dim``, ``dr`` = ``qk_pos_emb_head_dim``, ``dv`` = ``v_head_dim``: the
    keys and values come from one latent per token, ``c = norm(x W_kv_a[:, :kv_lora_rank])`` (eq. 9; the norm is
    DeepSeek's released code's, not the paper's), decompressed per head, ``[k_nope, v] = c W_kv_b`` (eqs. 10-11:
    ``[n, dn + dv]`` per token); each key's rotary part is one projection shared by the heads,
    ``k_rope = RoPE(x W_kv_a[:, kv_lora_rank:])`` (eq. 15); the queries go through their own latent
    ``norm(x W_q_a) W_q_b`` (eqs. 12-13; one projection ``x W_q`` when ``q_lora_rank`` is 0), the last ``dr`` of each
    head rotated (eq. 14).  Keys ``[k_nope, k_rope]`` and queries are ``dn + dr`` wide, values
    ``dv``; attention is the model's (scores scaled by ``1 / sqrt(dn + dr)``), the output projection ``n * dv`` to
    ``embed``.  Parameters: ``wq`` ``[embed, heads, dn + dr]`` or ``wq_a`` ``[embed, q_lora]``, ``q_a_norm``,
    ``wq_b`` ``[q_lora, heads, dn + dr]``; ``wkv_a`` ``[embed, kv_lora + dr]``, ``kv_a_norm``, ``wkv_b``
    ``[kv_lora, heads, dn + dv]``; ``wo`` ``[heads, dv, embed]``.  The latent axes ``q_lora``, ``kv_lora`` are
    not split (the rules table); heads split over tensor parallelism as ordinary attention's.
    """

    def __init__(self, cfg, rngs, ops):
        h, n, rq, rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        dq, dv = cfg.attention_head_dims
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.cfg, self.ops = cfg, ops
        if rq:
            self.wq_a = param(rngs.params(), (h, rq), std, ("embed", "q_lora"))
            self.q_a_norm = Norm(cfg, rq, "q_lora")
            self.wq_b = param(rngs.params(), (rq, n, dq), std, ("q_lora", "heads", "head_dim"))
        else:
            self.wq = param(rngs.params(), (h, n, dq), std, ("embed", "heads", "head_dim"))
        self.wkv_a = param(rngs.params(), (h, rkv + cfg.qk_pos_emb_head_dim), std, ("embed", "kv_lora"))
        self.kv_a_norm = Norm(cfg, rkv, "kv_lora")
        self.wkv_b = param(rngs.params(), (rkv, n, cfg.qk_head_dim + dv), std, ("kv_lora", "heads", "head_dim"))
        self.wo = param(rngs.params(), (n, dv, h), out_std, ("heads", "head_dim", "embed"))
        self.bo = None  # resolve refuses model.use_bias with MLA
        self.sinks = param(None, (n,), 0, ("heads",)) if cfg.softmax_type == "learnable" else None

    def qkv(self, x, positions, rotary_base=0.0):
        """Queries, keys ``[batch, len, heads, dn + dr]`` and values ``[batch, len, heads, dv]`` of ``x``
        ``[batch, len, embed]`` (the class's equations; ``rotary_base`` as :meth:`Attention.qkv`'s)."""
        cfg, dt, ops = self.cfg, jnp.dtype(self.cfg.dtype), self.ops
        rkv, dn = cfg.kv_lora_rank, cfg.qk_head_dim
        # the latents whole on every tensor device (Megatron-LM duplicates the down projections there); the query
        # latent named as the queries: a policy that keeps them keeps both matmuls' outputs (none recomputed)
        if cfg.q_lora_rank:
            cq = _dense(ops, x, self.wq_a[...], None, "bse,er->bsr", dt)
            cq = checkpoint_name(ops.constrain(cq, ("batch", "length", "q_lora")), "query_proj")
            q = _dense(ops, self.q_a_norm(cq), self.wq_b[...], None, "bsr,rhd->bshd", dt)
        else:
            q = _dense(ops, x, self.wq[...], None, "bse,ehd->bshd", dt)
        q = checkpoint_name(ops.constrain(q, ("batch", "length", "heads", "head_dim")), "query_proj")
        ckv = _dense(ops, x, self.wkv_a[...], None, "bse,er->bsr", dt)
        ckv = checkpoint_name(ops.constrain(ckv, ("batch", "length", "kv_lora")), "key_proj")
        kv = _dense(ops, self.kv_a_norm(ckv[..., :rkv]), self.wkv_b[...], None, "bsr,rhd->bshd", dt)
        kv = checkpoint_name(ops.constrain(kv, ("batch", "length", "heads", "head_dim")), "value_proj")
        inv_freq, scaled = rotary_frequencies(cfg, cfg.qk_pos_emb_head_dim // 2, rotary_base), not rotary_base
        q = jnp.concatenate([q[..., :dn], _rotary_scaled(cfg, q[..., dn:], positions, inv_freq, scaled)], axis=-1)
        k_rope = _rotary_scaled(cfg, ckv[:, :, None, rkv:], positions, inv_freq, scaled)  # [batch, len, 1, dr]
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_rope, (*kv.shape[:3], k_rope.shape[-1]))], axis=-1)
        return _scale_queries(cfg, q), k, kv[..., dn:]


class MLP(nnx.Module):
    """GELU (tanh approximation, as GPT-2), SwiGLU or GeGLU (Shazeer 2020: ``gelu(x W_g) * x W_1``, Gemma's), or quick
    GeGLU (:func:`quick_geglu`: ``w1`` ``[embed, 2 x ffn]`` holds its gates and linear units interleaved)
    feed-forward block, ``[batch, len, embed]`` to the same.

    With ``model.mlp_chunks`` = m > 1 the tokens go through in m chunks, one after another, each
    under ``jax.checkpoint``: only one chunk's ``[batch, len / m, ffn]`` intermediates are live, in the
    forward and the backward pass, for one more forward of the MLP (the tiled MLP of Arctic Long
    Sequence Training, Bekman et al. 2025).  Chunk j holds tokens j, j + m, ... so that every device's
    sequence shard splits into m local chunks.  A length m does not divide runs whole.
    """

    def __init__(self, cfg, rngs, ops):
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.cfg, self.ops = cfg, ops
        gated, width = cfg.activation in ("swiglu", "geglu"), 2 * f if cfg.activation == "quick_geglu" else f
        self.w1 = param(rngs.params(), (h, width), cfg.init_std, ("embed", "mlp"))  # quick_geglu: gates, units
        self.wg = param(rngs.params(), (h, f), cfg.init_std, ("embed", "mlp")) if gated else None
        self.w2 = param(rngs.params(), (f, h), cfg.init_std / (2 * cfg.num_layers) ** 0.5, ("mlp", "embed"))
        self.b1 = param(None, (width,), 0, ("mlp",)) if cfg.use_bias else None
        self.b2 = param(None, (h,), 0, ("embed",)) if cfg.use_bias else None

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
            y = activation(self.cfg)(y)
        else:
            gate = checkpoint_name(_dense(self.ops, x, self.wg[...], None, "bse,ef->bsf", dt), "mlpwi_gate")
            y = (gelu(gate) if self.cfg.activation == "geglu" else jax.nn.silu(gate)) * y
        y = self.ops.constrain(y, ("batch", "length", "mlp"))
        return checkpoint_name(_dense(self.ops, y, self.w2[...], self.b2, "bsf,fe->bse", dt), "mlpwo")


class MoE(nnx.Module):
    """Mixture of experts in place of the MLP (``model.num_experts`` > 0): a float32 router picks each token's
    ``moe_router_topk`` experts (:func:`jaxllm.model.moe.route`; the router's logits plus a learned bias with
    ``model.moe_router_bias``), each an MLP of ``moe_ffn_hidden_size`` with the model's activation (quick GeGLU's
    ``w1`` ``[experts, embed, 2 x ffn]``, as :class:`MLP`'s), combined by the router's weights; plus a shared dense
    MLP of ``moe_shared_expert_intermediate_size`` that every token takes (Qwen-MoE, DeepSeekMoE), if set.

    The router's losses (``moe_aux_loss_coeff`` x load-balancing loss + ``moe_z_loss_coeff`` x z-loss) join the
    objective through ``ops.router_loss``; the call returns the output ``[batch, len, embed]`` and the
    routing statistics (float32 scalars, :func:`jaxllm.model.moe.route`).
    """

    def __init__(self, cfg, rngs, ops):
        h, f, e = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.cfg, self.ops = cfg, ops
        width = 2 * f if cfg.activation == "quick_geglu" else f  # its gates and linear units in one matrix
        self.router = param(rngs.params(), (h, e), std, ("embed", None))
        self.router_bias = param(None, (e,), 0, (None,)) if cfg.moe_router_bias else None
        self.w1 = param(rngs.params(), (e, h, width), std, ("experts", "expert_embed", "expert_mlp"))
        self.wg = (param(rngs.params(), (e, h, f), std, ("experts", "expert_embed", "expert_mlp"))
                   if cfg.activation == "swiglu" else None)
        self.w2 = param(rngs.params(), (e, f, h), out_std, ("experts", "expert_mlp", "expert_embed"))
        self.b1 = param(None, (e, width), 0, ("experts", "expert_mlp")) if cfg.use_bias else None
        self.b2 = param(None, (e, h), 0, ("experts", "expert_embed")) if cfg.use_bias else None
        self.expert_bias = param(None, (e,), 0, (None,)) if cfg.moe_router_enable_expert_bias else None
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared = MLP(dataclasses.replace(cfg, ffn_hidden_size=shared), rngs, ops) if shared else None

    def __call__(self, x):
        cfg, value = self.cfg, lambda p: None if p is None else p[...]  # noqa: E731
        logits = jnp.einsum("bse,ex->bsx", x.astype(jnp.float32), self.router[...])
        if self.router_bias is not None:
            logits = logits + self.router_bias[...]
        bias = None if self.expert_bias is None else jax.lax.stop_gradient(self.expert_bias[...])
        ids, weights, stats = moe.route(
            logits, cfg.moe_router_topk, cfg.moe_capacity_factor, score_function=cfg.moe_router_score_function,
            pre_softmax=cfg.moe_router_pre_softmax, scaling_factor=cfg.moe_router_topk_scaling_factor,
            num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk, bias=bias)
        y = self.ops.experts(x, ids, weights, self.w1[...], value(self.wg), self.w2[...], value(self.b1),
                             value(self.b2), activation=activation(cfg), dtype=jnp.dtype(cfg.dtype))
        y = self.ops.router_loss(y, cfg.moe_aux_loss_coeff * stats["aux_loss"] + cfg.moe_z_loss_coeff * stats["z_loss"])
        if self.expert_bias is not None:  # the tokens each expert took (dropped copies, id num_experts, left out)
            load = jax.nn.one_hot(ids, cfg.num_experts, dtype=jnp.float32).sum((0, 1, 2))
            y = moe.balance_bias(y, self.expert_bias[...], load)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, stats


class Block(nnx.Module):
    """One transformer layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (pre-norm; the MLP a mixture of
    experts when ``kind.moe``: the layer's kind, :class:`jaxllm.model.groups.LayerKind`); by ``model.norm_placement``
    ``x + norm(attn(x))`` (post: OLMo 2's reordered norm, Walsh et al. 2025 section 3.2) or ``x + norm(attn(norm(x)))``
    (sandwich: Gemma 2's; Ding et al. 2021), the MLP's alike, each norm its own (``post_attn_norm``,
    ``post_mlp_norm``)."""

    def __init__(self, cfg, rngs, ops, *, kind):
        self.dropout, self.ops = cfg.dropout, ops
        pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"
        self.ln1 = Norm(cfg) if pre else None
        self.attn = (LatentAttention if cfg.multi_latent_attention else Attention)(cfg, rngs, ops)
        self.ln2, self.mlp = Norm(cfg) if pre else None, (MoE(cfg, rngs, ops) if kind.moe else MLP(cfg, rngs, ops))
        self.post_attn_norm, self.post_mlp_norm = (Norm(cfg), Norm(cfg)) if post else (None, None)

    def __call__(self, x, positions, key=None, cache=None, order=None, segment_ids=None, kind=None):
        """``(x, out)``: the layer's output and, when decoding, the updated ``cache``, else the mixture of
        experts' routing statistics (:func:`jaxllm.model.moe.route`; None for a dense MLP); ``kind``: the layer's
        (its attention's window and rotary: :meth:`Attention.__call__`)."""
        x = checkpoint_name(x, "decoder_layer_input")  # every use below reads it through the name
        k1, k2 = split_rows(key, 2) if key is not None else (None, None)
        y, cache = self.attn(_norm(self.ln1, x), positions, cache, order, segment_ids, kind)
        x = self.ops.constrain(x + dropout(_norm(self.post_attn_norm, y), self.dropout, k1, order), RESIDUAL)
        y, stats = self.mlp(_norm(self.ln2, x)), None
        if isinstance(self.mlp, MoE):
            y, stats = y
        x = x + dropout(_norm(self.post_mlp_norm, y), self.dropout, k2, order)
        return self.ops.constrain(x, RESIDUAL), (cache if cache is not None else stats)


RESIDUAL = ("batch", "residual", "act_embed")  # the residual stream between blocks


def _norm(norm, x):
    """``norm(x)``, or ``x`` where the layer has no such norm (None: ``model.norm_placement``)."""
    return x if norm is None else norm(x)


class MTPLayer(nnx.Module):
    """One multi-token prediction module (DeepSeek-V3, DeepSeek-AI 2024, arXiv:2412.19437, section 2.2, eqs. 21-22;
    Megatron-LM's ``MultiTokenPredictionLayer``, ``megatron/core/transformer/multi_token_prediction.py``):
    ``norm(Block(eh_proj([enorm(e); hnorm(h)])))`` of the previous depth's hidden states ``h`` and the embedding
    ``e`` of the token ``k`` ahead, both ``[batch, len, embed]``.

    The concatenation comes first the embedding, then the hidden states, as Megatron-LM's and DeepSeek-V3's
    checkpoints (``eh_proj`` ``[2 x hidden, hidden]``); it is held as ``eh_proj`` ``[2, embed, embed]``, ``[0]``
    the embedding's half, so that the two halves are two matmuls and nothing is concatenated.  The layer is a
    :class:`Block` of the kind ``kind``; ``norm`` is the module's own final norm (Megatron-LM's
    ``final_layernorm``, DeepSeek-V3's ``shared_head.norm``), whose output feeds both the shared output layer and
    the next depth.
    """

    def __init__(self, cfg, rngs, ops, *, kind):
        self.cfg, self.ops = cfg, ops
        self.enorm, self.hnorm = Norm(cfg), Norm(cfg)
        h = cfg.hidden_size
        self.eh_proj = param(rngs.params(), (2, h, h), cfg.init_std, (None, "embed", None))
        self.block = Block(cfg, rngs, ops, kind=kind)
        self.norm = Norm(cfg)

    def project(self, h, e):
        """``eh_proj([enorm(e); hnorm(h)])``: ``[batch, len, embed]`` in ``model.dtype``."""
        dt, w = jnp.dtype(self.cfg.dtype), self.eh_proj[...]
        x = (self.ops.dense(self.enorm(e), w[0], None, "bse,ef->bsf", dt)
             + self.ops.dense(self.hnorm(h), w[1], None, "bse,ef->bsf", dt))
        return self.ops.constrain(x, RESIDUAL)
