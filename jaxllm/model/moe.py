"""Mixture-of-experts routing and expert computation, as pure functions (the layer is :class:`jaxllm.model.layers.MoE`).

Token-choice top-k routing (Shazeer et al. 2017; Fedus et al. 2022, Switch Transformer), as Megatron-LM's
``megatron/core/transformer/moe/router.py``: float32 logits; by default the top k by logit and their
softmax as the combine weights (equal to Mixtral's softmax, top k, renormalize), or its other score functions
and group-limited routing (DeepSeek-V2/V3, :func:`route`); the load-balancing loss
of ``switch_load_balancing_loss_func`` (Switch eq. 4 over the top-k routing map) and the router z-loss of
ST-MoE (Zoph et al. 2022, eq. 5), each over the tokens of one micro batch.  Dropless by default: every
token reaches its k experts.  With a capacity factor an expert takes at most
``ceil(capacity_factor x tokens x k / experts)`` tokens, those of highest router probability (Megatron's
``--moe-token-drop-policy probs``), so which tokens are dropped does not depend on their order.

The experts run as grouped matmuls (:func:`grouped_matmul`: on GPUs grouped GEMM kernels, on CPUs one matmul per
tile of a few rows of one expert) over the token copies sorted by expert (MegaBlocks, Gale et al. 2023; MaxText's
sparse matmul): no capacity padding, no ``[tokens, experts]`` dispatch tensor, and buffers that grow with the
routed tokens, not with experts x tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.model import attention
from jaxllm_kernels import grouped_matmul as grouped_gemm


def _tile_rows(rows: int, groups: int) -> int:
    """Rows of one tile of :func:`grouped_matmul`: a power of two from 8 to 128, the largest whose at most
    ``groups`` partly filled tiles add no more than an eighth to ``rows`` (or 8)."""
    tile = 128
    while tile > 8 and groups * tile > rows // 8:
        tile //= 2
    return tile


def _tiles(group_sizes, rows: int, tile: int):
    """The tiled layout of ``rows`` rows sorted by group: each group's rows from the start of a tile of its own.

    Returns ``(pos, tile_group, used)``: int32 ``[rows]``, each row's place among the ``tiles x tile`` tiled rows
    (``tiles x tile``, out of range, for the rows past ``sum(group_sizes)``); int32 ``[tiles]``, each tile's group
    (the last group for the empty tiles at the end); int32 scalar, the tiles the groups fill (the first ``used``).
    ``tiles`` is ``ceil(rows / tile) + groups``, static: a group of ``s`` rows fills ``ceil(s / tile)`` tiles, at
    most ``s / tile + 1``."""
    groups = group_sizes.shape[0]
    tiles = -(-rows // tile) + groups
    tile_end = jnp.cumsum(-(-group_sizes // tile))
    tile_start = jnp.concatenate([jnp.zeros(1, tile_end.dtype), tile_end[:-1]])
    row_end = jnp.cumsum(group_sizes)
    row = jnp.arange(rows, dtype=row_end.dtype)
    g = jnp.searchsorted(row_end, row, side="right")  # each row's group, ``groups`` past the last
    gc = jnp.minimum(g, groups - 1)
    pos = jnp.where(g < groups, tile_start[gc] * tile + row - (row_end[gc] - group_sizes[gc]), tiles * tile)
    tile_group = jnp.searchsorted(tile_end, jnp.arange(tiles, dtype=tile_end.dtype), side="right")
    return pos.astype(jnp.int32), jnp.minimum(tile_group, groups - 1).astype(jnp.int32), tile_end[-1].astype(jnp.int32)


def _to_tiles(x, pos, tiles: int, tile: int):
    """``x`` ``[rows, d]`` placed at ``pos`` (:func:`_tiles`) -> ``[tiles, tile, d]``, zeros elsewhere."""
    out = jnp.zeros((tiles * tile, x.shape[1]), x.dtype).at[pos].set(x, mode="drop", unique_indices=True)
    return out.reshape(tiles, tile, x.shape[1])


def _tiled_matmul(x, w, group_sizes):
    """:func:`grouped_matmul`'s value: one ``[tile, in] x [in, out]`` matmul per filled tile (a loop of as many
    steps as the groups fill: the rows past the groups, another device's experts' copies, cost nothing), float32
    accumulation."""
    tile = _tile_rows(x.shape[0], w.shape[0])
    pos, tile_group, used = _tiles(group_sizes, x.shape[0], tile)
    xt = _to_tiles(x, pos, tile_group.shape[0], tile)
    dtype = jnp.result_type(x, w)

    def one(i, yt):
        return yt.at[i].set(jnp.matmul(xt[i], w[tile_group[i]], preferred_element_type=jnp.float32).astype(dtype))

    yt = jax.lax.fori_loop(0, used, one, jnp.zeros((*xt.shape[:2], w.shape[2]), dtype))
    return yt.reshape(-1, w.shape[2]).at[pos].get(mode="fill", fill_value=0)


@jax.custom_vjp
def tiled_matmul(x, w, group_sizes):
    """:func:`grouped_matmul` tile by tile, as XLA compiles it well on CPUs (MegaBlocks' block-sparse layout, Gale
    et al. 2023): each group's rows padded to whole tiles of 8 to 128 rows (:func:`_tile_rows`), one matmul per
    tile with its group's weight in a loop of as many steps as the groups fill, the weight gradient summed over the
    tiles into ``[groups, in, out]``.  So the compiled program's buffers grow with the rows plus ``groups`` tiles; on
    a GPU each tile would be a GEMM launch of its own.  The gradients are the same tiled products (also under
    ``vmap``, the pipeline's stages)."""
    return _tiled_matmul(x, w, group_sizes)


def _tiled_fwd(x, w, group_sizes):
    return tiled_matmul(x, w, group_sizes), (x, w, group_sizes)


def _tiled_bwd(res, dy):
    x, w, group_sizes = res
    dx = _tiled_matmul(dy, jnp.swapaxes(w, 1, 2), group_sizes)
    tile = _tile_rows(x.shape[0], w.shape[0])
    pos, tile_group, used = _tiles(group_sizes, x.shape[0], tile)
    tiles = tile_group.shape[0]
    xt, dyt = _to_tiles(x, pos, tiles, tile), _to_tiles(dy, pos, tiles, tile)

    def add(i, dw):  # dw[g] += x_tile^T dy_tile over the filled tiles, in place in the loop
        return dw.at[tile_group[i]].add(jnp.matmul(xt[i].T, dyt[i], preferred_element_type=jnp.float32))

    dw = jax.lax.fori_loop(0, used, add, jnp.zeros(w.shape, jnp.float32))
    return dx.astype(x.dtype), dw.astype(w.dtype), None


tiled_matmul.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_matmul(x, w, group_sizes):
    """Row block ``g`` of ``x`` times ``w[g]``: ``x`` ``[rows, in]`` sorted by group, ``w`` ``[groups, in, out]``,
    group_sizes int32 ``[groups]`` -> ``[rows, out]`` (dtype: ``x``'s and ``w``'s promoted, float32
    accumulation), zero for the rows past ``sum(group_sizes)``: ``jax.lax.ragged_dot``'s product.

    The one place its implementation is chosen, by the platform the program is lowered for
    (``jax.lax.platform_dependent``): on CPUs :func:`tiled_matmul`; on GPUs (CUDA, ROCm) the grouped GEMM
    kernels of :func:`jaxllm_kernels.grouped_matmul.gmm`, one launch each for the product, its input gradient and
    its weight gradient (Pallas through Triton); in a GPU's plan compiled here
    (:func:`jaxllm.model.attention.planned_gpu`) the same kernels interpreted.  Not ``jax.lax.ragged_dot``:
    jaxlib 0.10.2's XLA rewrites it, on the CPU and for the GPU, into dense dots over a ``[groups, rows, in]``
    masked copy of ``x`` (``groups`` times the memory and the FLOPs); with
    ``--xla_gpu_experimental_use_ragged_dot_fusion`` (cuDNN's grouped GEMM) and a cuDNN 9 target its deviceless
    compile for an H100 aborts; jax 0.10.2's wheel lacks the module that
    ``jax_ragged_dot_use_gpu_pallas_triton_lowering`` imports (docs/moe.md).
    """
    dtype = jnp.result_type(x, w)
    x, w = x.astype(dtype), w.astype(dtype)
    if attention.planned_gpu():  # a GPU's step compiled here for its memory: the kernels interpreted
        return grouped_gemm.gmm(x, w, group_sizes, grouped_gemm.Tiles(), True)
    return jax.lax.platform_dependent(x, w, group_sizes, cpu=tiled_matmul, default=grouped_gemm.gmm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def attach_loss(x, loss, scale):
    """``x`` unchanged, with the auxiliary ``loss`` (float32 scalar) joined to the objective: the backward pass
    gives ``loss`` the gradient ``scale`` whatever reaches ``x`` (Megatron-LM's ``MoEAuxLossAutoScaler``).  So a
    router's losses train it under every pipeline schedule without travelling with the activations;
    ``scale`` is d(objective)/d(loss), ``1 / microbatches`` for a step's mean over its micro batches."""
    return x


def _attach_fwd(x, loss, scale):
    return x, jnp.zeros_like(loss)


def _attach_bwd(scale, zero, g):
    return g, zero + scale


attach_loss.defvjp(_attach_fwd, _attach_bwd)


def loss_scaler(scale: float):
    """``(x, loss) -> x``: :func:`attach_loss` with gradient ``scale`` (``Ops.router_loss``, :mod:`jaxllm.model`)."""
    return lambda x, loss: attach_loss(x, loss, scale)


@jax.custom_vjp
def balance_bias(x, bias, load):
    """``x`` unchanged; the backward pass gives the expert ``bias`` ``[experts]`` the "gradient" ``load - mean(load)``
    (``load`` float32 ``[experts]``: the tokens each expert took), whatever reaches ``x``.  So the sums that gradients
    go through (micro batches, data-parallel replicas, pipeline stages) add up the step's loads, and the train step
    moves the bias by ``-rate x sign`` of that sum (:func:`jaxllm.runtime.step.apply_gradients`): Megatron-LM's
    ``get_updated_expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing, section 2.1.2)."""
    return x


def _balance_fwd(x, bias, load):
    return x, load


def _balance_bwd(load, g):
    return g, load - load.mean(), jnp.zeros_like(load)


balance_bias.defvjp(_balance_fwd, _balance_bwd)


def capacity(tokens: int, experts: int, topk: int, factor: float) -> int:
    """Tokens an expert takes from a micro batch of ``tokens`` with capacity factor ``factor`` (0: all)."""
    return tokens if factor == 0 else min(tokens, math.ceil(factor * tokens * topk / experts))


def _top_k(scores, topk: int, num_groups: int, group_topk: int):
    """The ``topk`` largest ``scores`` ``[..., experts]`` and their ids (ties: the lower id); with ``group_topk``
    taken only from the ``group_topk`` of ``num_groups`` expert groups (consecutive ids) whose ``topk /
    group_topk`` largest scores sum highest (Megatron-LM's ``group_limited_topk``; DeepSeek-V3 section 2.1.2)."""
    if not group_topk:
        return jax.lax.top_k(scores, topk)
    e = scores.shape[-1]
    grouped = scores.reshape(*scores.shape[:-1], num_groups, e // num_groups)
    _, chosen = jax.lax.top_k(jax.lax.top_k(grouped, topk // group_topk)[0].sum(-1), group_topk)
    keep = jnp.repeat(jax.nn.one_hot(chosen, num_groups, dtype=bool).any(-2), e // num_groups, axis=-1)
    return jax.lax.top_k(jnp.where(keep, scores, -jnp.inf), topk)


def route(logits, topk: int, capacity_factor: float = 0.0, *, score_function: str = "softmax",
          pre_softmax: bool = False, scaling_factor: float = 0.0, num_groups: int = 0, group_topk: int = 0,
          bias=None):
    """Top-k routing of a micro batch, as Megatron-LM's ``topk_routing_with_score_function``
    (``megatron/core/transformer/moe/moe_utils.py``).

    Args:
      logits: float32 router logits ``[batch, len, experts]`` (every token of the micro batch).
      topk: experts per token (``model.moe_router_topk``).
      capacity_factor: ``model.moe_capacity_factor`` (0: dropless).
      score_function: ``"softmax"`` (the top k by logit, the softmax of those as the weights; with
        ``pre_softmax`` the softmax over all experts, the top k of it unnormalized) or ``"sigmoid"`` (the top k
        sigmoid scores, renormalized to sum to 1 when ``topk`` > 1; DeepSeek-V3).
      scaling_factor: the weights times this (0: unscaled).
      num_groups, group_topk: group-limited routing (:func:`_top_k`; 0: none).
      bias: float32 ``[experts]`` added to the sigmoid scores for the choice of the top k only (the weights are
        the unbiased scores'; :func:`balance_bias`), or None.
    Returns:
      ``(ids, weights, stats)``: int32 ``[batch, len, topk]`` expert of each of a token's k copies (distinct;
      ties to the lower id), ``experts`` for a dropped copy; float32 ``[batch, len, topk]`` combine weights
      (0 for a dropped copy); ``stats`` float32 scalars: ``aux_loss`` (Megatron's
      ``switch_load_balancing_loss_func`` without its coefficient: ``E / (T^2 k) sum_e tokens_e sum_t p_te``, p
      the softmax over all experts (sigmoid: the sigmoids normalized per token), tokens_e of the plain top k,
      1 when balanced), ``z_loss`` (``mean_t logsumexp(logits_t)^2``), ``max_load`` (the busiest expert's tokens
      over the mean, before drops) and ``dropped`` (the fraction of copies dropped).
    """
    b, s, e = logits.shape
    if score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        top, ids = _top_k(scores if bias is None else scores + bias, topk, num_groups, group_topk)
        top = top if bias is None else jnp.take_along_axis(scores, ids, axis=-1)
        weights = top / (top.sum(-1, keepdims=True) + 1e-20) if topk > 1 else top
        probs = scores / (scores.sum(-1, keepdims=True) + 1e-20)
    else:
        top, ids = _top_k(jax.nn.softmax(logits, axis=-1) if pre_softmax else logits, topk, num_groups, group_topk)
        weights = top if pre_softmax else jax.nn.softmax(top, axis=-1)
        probs = jax.nn.softmax(logits, axis=-1)
    if scaling_factor:
        weights = weights * scaling_factor
    one_hot = lambda i: jax.nn.one_hot(i, e, dtype=jnp.float32).sum(-2)  # noqa: E731  [batch, len, experts], 0/1
    routed = one_hot(ids)
    load = routed.sum((0, 1))  # tokens per expert
    # the load-balancing loss counts the plain top k (Megatron's compute_routing_scores_for_aux_loss): the same
    # experts as the routing's unless it is group-limited (every score function is monotone in the logits)
    aux_load = one_hot(jax.lax.top_k(logits, topk)[1]).sum((0, 1)) if group_topk else load
    t = b * s
    stats = {"aux_loss": e / (t * t * topk) * jnp.sum(aux_load * probs.sum((0, 1))),
             "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
             "max_load": jnp.max(load) / (t * topk / e)}
    c = capacity(t, e, topk, capacity_factor)
    if c < t:
        # per expert, the c tokens of highest probability among those routed to it (ties: the earlier token)
        score = jnp.where(routed > 0, probs, -1.0).reshape(t, e).T  # [experts, tokens]
        _, kept = jax.lax.top_k(score, c)
        keep = jnp.zeros((e, t), bool).at[jnp.arange(e)[:, None], kept].set(True)
        keep = keep & (score >= 0)
        keep_copy = jnp.take_along_axis(keep.T.reshape(b, s, e), ids, axis=-1)  # [batch, len, topk]
        stats["dropped"] = 1.0 - keep_copy.sum() / (t * topk)
        ids = jnp.where(keep_copy, ids, e)
        weights = jnp.where(keep_copy, weights, 0.0)
    else:
        stats["dropped"] = jnp.zeros((), jnp.float32)
    return ids.astype(jnp.int32), weights, stats


def experts(x, ids, weights, w1, wg, w2, b1, b2, *, activation, dtype, first=0):
    """The experts ``first, ..., first + w1.shape[0] - 1`` applied to the token copies routed to them.

    Args:
      x: ``[tokens, embed]``; ids: int32 ``[tokens, topk]`` each copy's expert (copies of other experts, or
        dropped ones, contribute nothing); weights: float32 ``[tokens, topk]`` combine weights.
      w1, wg: ``[experts, embed, ffn]`` (wg: the SwiGLU gate, or None); w2: ``[experts, ffn, embed]``;
        b1 ``[experts, ffn]``, b2 ``[experts, embed]`` or None.
      activation: the activation without a gate (``wg`` None; the model's GELU); dtype: the matmuls' dtype.
      first: the global id of ``w1[0]``'s expert (the experts of one expert-parallel device).
    Returns:
      ``[tokens, embed]`` in ``dtype``: ``sum_j weights[:, j] expert_{ids[:, j]}(x)`` over these experts.
    """
    n, (t, k) = w1.shape[0], ids.shape
    local = ids.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < n), local, n)  # other experts' copies sort last, into no group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=n + 1)[:n].astype(jnp.int32)
    sorted_key = key[order]
    xs = x[order // k].astype(dtype)
    y = grouped_matmul(xs, w1.astype(dtype), sizes)
    if b1 is not None:
        y = y + jnp.take(b1.astype(dtype), sorted_key, axis=0, mode="fill", fill_value=0)
    if wg is None:
        y = activation(y)
    else:
        y = jax.nn.silu(grouped_matmul(xs, wg.astype(dtype), sizes)) * y
    y = grouped_matmul(y, w2.astype(dtype), sizes)
    if b2 is not None:
        y = y + jnp.take(b2.astype(dtype), sorted_key, axis=0, mode="fill", fill_value=0)
    w = jnp.where(sorted_key < n, weights.reshape(-1)[order], 0.0)
    y = (y.astype(jnp.float32) * w[:, None]).astype(dtype)
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # back to token order
    return y.reshape(t, k, -1).sum(1, dtype=jnp.float32).astype(dtype)


def local_experts(x, ids, weights, w1, wg, w2, b1, b2, *, activation, dtype):
    """:func:`experts` of every expert on ``x`` ``[batch, len, embed]`` (ids, weights ``[batch, len, topk]``):
    one device's experts operation (the ``experts`` of :class:`jaxllm.model.gpt.Ops`)."""
    b, s, e = x.shape
    flat = lambda a: a.reshape(b * s, a.shape[-1])  # noqa: E731
    y = experts(flat(x), flat(ids), flat(weights), w1, wg, w2, b1, b2, activation=activation, dtype=dtype)
    return y.reshape(b, s, e)
