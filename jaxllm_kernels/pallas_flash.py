"""The FlashAttention-2 kernels in Pallas behind :func:`jaxllm_kernels.pallas_attention.flash_attention`
(which checks, pads and picks the tiles; this module takes padded arrays and a static :class:`Cfg`).

FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", arXiv:2307.08691):

* forward = Algorithm 1: one program per (query block, batch, head) streams the
  key/value blocks through an online softmax (running max ``m``, running sum
  ``l``, un-normalised accumulator), normalises once at the end and saves the
  log-sum-exp ``lse = m + log(l)`` for the backward pass;
* backward = Algorithm 2, split as in the paper's section 3.2 into two kernels
  that recompute the probabilities ``P = exp(S - lse)`` from the saved lse
  instead of storing them: one program per key/value block accumulates dK, dV
  over the query blocks (and, for grouped-query attention, over the query heads
  of its group, so dK/dV are never materialised per query head); one program per
  query block accumulates dQ over the key/value blocks.  ``D = rowsum(dO * O)``
  (the paper's ``D_i``) is computed by XLA before the kernels.

Block skipping: with the default (arange) positions the loops over key blocks
(forward, dQ) and query blocks (dK/dV) run only over blocks that the causal mask
and the window leave visible -- the bounds are computed from the program id, so
fully masked blocks cost nothing; causal attention does about half the work of
full attention.  With explicit positions the loops cover every block but skip
the body (``lax.cond``) of a block whose position range (and segment-id range)
proves it fully masked; this is exact for any positions and cheap for sorted
ones.  Masks are applied elementwise on every visited block (not only on the
diagonal ones); splitting the loop into unmasked and masked parts is a possible
later optimisation.

Precision: float32 inputs use IEEE float32 dots (``Precision.HIGHEST``; TF32
would be faster but loses the 1e-5 agreement with the reference), half-precision
inputs use the tensor cores' native half x half -> float32 dots.  The
probabilities are cast to the value dtype before ``P @ V`` exactly like the
reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm_kernels import reference

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the three kernels (all tiles powers of two, >= 16).

    Attributes:
      block_q, block_k: forward tiles: query rows per program, key rows per loop step.
      block_q_dkv, block_k_dkv: dK/dV kernel: query rows per loop step, key rows per program.
      block_q_dq, block_k_dq: dQ kernel: query rows per program, key rows per loop step.
      num_warps, num_stages: forward Triton launch parameters (``num_warps=None``:
        4 for head_dim <= 64, else 8).
      num_warps_bwd, num_stages_bwd: the same for both backward kernels.
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 32
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 32
    num_warps: int | None = None
    num_stages: int = 2
    num_warps_bwd: int | None = None
    num_stages_bwd: int = 2


@dataclasses.dataclass(frozen=True)
class Cfg:
    """Everything static about one call (hashable: a ``custom_vjp`` nondiff argument)."""

    sm_scale: float
    causal: bool
    window: int | None
    offset: int  # query i is at position i + offset (default positions): kv_len - q_len
    q_len: int  # unpadded lengths
    kv_len: int
    kv_padded: bool
    group: int  # query heads per key/value head
    has_seg: bool
    has_pos: bool
    exact: bool  # float32 inputs: IEEE dots
    blocks: BlockSizes
    interpret: bool



def _cdiv(a, b):
    """Ceil division of a non-negative traced int by a static positive int (Triton-safe)."""
    return lax.div(a + (b - 1), np.int32(b))


def _floordiv(a, b):
    return lax.div(a, np.int32(b))


def _dot(a, b, exact, trans_a=False, trans_b=False):
    """``a @ b`` (optionally transposed) with a float32 result."""
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b,
                     precision=lax.Precision.HIGHEST if exact else None)


def _mask(cfg, q_idx, k_idx, q_seg=None, k_seg=None, q_pos=None, k_pos=None, transposed=False):
    """Boolean ``[len(q_idx), len(k_idx)]`` visibility of one tile (``transposed``: ``[len(k_idx), len(q_idx)]``),
    or None when nothing is masked."""
    qa, ka = ((None, slice(None)), (slice(None), None)) if transposed else ((slice(None), None), (None, slice(None)))
    if cfg.has_pos:
        qp, kp = q_pos[qa], k_pos[ka]
    else:
        qp, kp = q_idx[qa] + cfg.offset, k_idx[ka]
    conds = []
    if cfg.causal:
        conds.append(kp <= qp)
    if cfg.window is not None:
        conds.append(qp - kp < cfg.window)
    if cfg.has_seg:
        conds.append(q_seg[qa] == k_seg[ka])
    if cfg.kv_padded:
        conds.append(k_idx[ka] < cfg.kv_len)
    if not conds:
        return None
    mask = conds[0]
    for c in conds[1:]:
        mask = jnp.logical_and(mask, c)
    return mask


def _tile_visible(cfg, q_seg, k_seg, q_pos, k_pos):
    """Scalar bool: False only if the tile is provably fully masked (explicit positions path)."""
    vis = jnp.bool_(True)
    if cfg.causal:
        vis = jnp.logical_and(vis, jnp.min(k_pos) <= jnp.max(q_pos))
    if cfg.window is not None:
        vis = jnp.logical_and(vis, jnp.min(q_pos) - jnp.max(k_pos) < cfg.window)
    if cfg.has_seg:
        vis = jnp.logical_and(vis, jnp.logical_and(jnp.min(k_seg) <= jnp.max(q_seg), jnp.min(q_seg) <= jnp.max(k_seg)))
    return vis


def _kv_range(cfg, q_start, bq, bk, num_kv_blocks):
    """Key-block loop bounds ``[lo, hi)`` for a query tile starting at row ``q_start`` (default positions)."""
    hi = min(num_kv_blocks, -(-cfg.kv_len // bk))  # blocks that are pure padding are never visited
    lo = 0
    if cfg.has_pos:
        return lo, hi
    if cfg.causal:  # key j visible iff j <= i + offset
        hi = jnp.minimum(hi, _cdiv(jnp.maximum(q_start + bq + cfg.offset, 0), bk))
    if cfg.window is not None:  # key j visible iff j >= i + offset - window + 1
        lo = _floordiv(jnp.maximum(q_start + cfg.offset - cfg.window + 1, 0), bk)
    return lo, hi


def _q_range(cfg, k_start, bq, bk, num_q_blocks):
    """Query-block loop bounds ``[lo, hi)`` for a key tile starting at row ``k_start`` (default positions)."""
    hi = min(num_q_blocks, -(-cfg.q_len // bq))
    lo = 0
    if cfg.has_pos:
        return lo, hi
    if cfg.causal:  # query i sees key j iff i >= j - offset
        lo = _floordiv(jnp.maximum(k_start - cfg.offset, 0), bq)
    if cfg.window is not None:  # iff i < j + window - offset, for the last key of the tile
        hi = jnp.minimum(hi, _cdiv(jnp.maximum(k_start + bk - 1 + cfg.window - cfg.offset, 0), bq))
    return lo, hi


def _split_refs(cfg, refs, n_main):
    """Unpack ``(*main, [q_seg, k_seg], [q_pos, k_pos], *outs)`` refs."""
    main, rest = list(refs[:n_main]), list(refs[n_main:])
    q_seg = k_seg = q_pos = k_pos = None
    if cfg.has_seg:
        q_seg, k_seg, *rest = rest
    if cfg.has_pos:
        q_pos, k_pos, *rest = rest
    return main, (q_seg, k_seg, q_pos, k_pos), rest


def _maybe_skip(cfg, step, q_seg, k_seg, q_pos, k_pos):
    """Wrap a loop step so that, with explicit positions, a provably masked tile is skipped."""
    if not cfg.has_pos:
        return step

    def guarded(carry, *step_args):
        vis = _tile_visible(cfg, q_seg, k_seg, q_pos, k_pos)
        return lax.cond(vis, lambda c: step(c, *step_args), lambda c: c, carry)

    return guarded


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(*refs, cfg):
    """Algorithm 1 for one (query block, batch, head): refs q [bq, d], k/v [kv_len, d] -> o [bq, d], lse [bq]."""
    (q_ref, k_ref, v_ref), (q_seg_ref, k_seg_ref, q_pos_ref, k_pos_ref), (o_ref, lse_ref) = _split_refs(cfg, refs, 3)
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    q_start = pl.program_id(0) * bq
    q_idx = q_start + jnp.arange(bq, dtype=jnp.int32)
    q = q_ref[...]
    q_seg = q_seg_ref[...] if cfg.has_seg else None
    q_pos = q_pos_ref[...] if cfg.has_pos else None
    scale = cfg.sm_scale * _LOG2E  # exp2 instead of exp: exp(x) = 2^(x log2 e)

    def body(kb, carry):
        k_start = kb * bk
        ks = pl.ds(k_start, bk)
        k_seg = k_seg_ref[ks] if cfg.has_seg else None
        k_pos = k_pos_ref[ks] if cfg.has_pos else None

        def step(carry):
            acc, m, l = carry
            k = k_ref[ks, :]
            v = v_ref[ks, :]
            s = _dot(q, k, cfg.exact, trans_b=True) * scale  # [bq, bk] float32, log2 units
            mask = _mask(cfg, q_idx, k_start + jnp.arange(bk, dtype=jnp.int32), q_seg, k_seg, q_pos, k_pos)
            if mask is not None:
                s = jnp.where(mask, s, reference.MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            if mask is not None:  # a row masked so far has m_new == MASKED and exp2(0) == 1
                p = jnp.where(mask, p, 0.0)
            l = alpha * l + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, cfg.exact)
            return acc, m_new, l

        return _maybe_skip(cfg, step, q_seg, k_seg, q_pos, k_pos)(carry)

    d = q.shape[-1]
    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), reference.MASKED, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    lo, hi = _kv_range(cfg, q_start, bq, bk, k_ref.shape[0] // bk)
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    empty = l == 0.0  # the query sees no key: output 0, lse MASKED, like the reference
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, reference.MASKED, m * _LN2 + jnp.log(l_safe))


def _launch(cfg, bwd):
    bs = cfg.blocks
    return dict(
        interpret=cfg.interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=(bs.num_warps_bwd if bwd else bs.num_warps),
            num_stages=(bs.num_stages_bwd if bwd else bs.num_stages)),
    )


def _side_inputs(cfg, segs, poss, q_spec, k_spec):
    """Segment-id / position arrays and their BlockSpecs, in the kernels' ref order."""
    args, specs = [], []
    if cfg.has_seg:
        args += list(segs)
        specs += [q_spec, k_spec]
    if cfg.has_pos:
        args += list(poss)
        specs += [q_spec, k_spec]
    return args, specs


def _forward(cfg, q, k, v, segs, poss):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    bq = cfg.blocks.block_q
    group = cfg.group
    side, side_specs = _side_inputs(
        cfg, segs, poss,
        pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i)),
        pl.BlockSpec((None, sk), lambda i, bi, hi: (bi, 0)))
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        pl.BlockSpec((None, sk, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, np.int32(group)), 0)),
        pl.BlockSpec((None, sk, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, np.int32(group)), 0)),
        *side_specs,
    ]
    out_specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
    ]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)]
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(sq // bq, b, h),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="jaxllm_flash_fwd",
        **_launch(cfg, bwd=False),
    )(q, k, v, *side)
    return out, lse


# ----------------------------------------------------------------------------- backward


def _dkdv_kernel(*refs, cfg):
    """dK, dV for one (key block, batch, kv head), summed over the group's query heads.

    refs: k/v [bk, d]; q/do [q_len, group, d]; lse2/delta [group, q_len] -> dk/dv [bk, d].
    Every product is computed transposed, ``S^T = K Q^T`` ``[bk, bq]`` and the rest from it (as Triton's
    fused-attention tutorial's ``_attn_bwd_dkdv``), so that each has the owned key tile as its rows: with
    the query tile as rows (``bq`` 16 or 32) Triton gives sm_90 the older ``mma.sync`` in place of Hopper's
    ``wgmma``, which needs 64 rows per warp group (``benchmarks/triton_offline.py`` counts them).
    """
    main, side, (dk_ref, dv_ref) = _split_refs(cfg, refs, 6)
    k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref = main
    q_seg_ref, k_seg_ref, q_pos_ref, k_pos_ref = side
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    k_start = pl.program_id(0) * bk
    k_idx = k_start + jnp.arange(bk, dtype=jnp.int32)
    k = k_ref[...]
    v = v_ref[...]
    k_seg = k_seg_ref[...] if cfg.has_seg else None
    k_pos = k_pos_ref[...] if cfg.has_pos else None
    scale = cfg.sm_scale * _LOG2E
    lo, hi = _q_range(cfg, k_start, bq, bk, q_ref.shape[0] // bq)

    def head_body(hh, carry):
        def body(qb, carry):
            q_start = qb * bq
            qs = pl.ds(q_start, bq)
            q_seg = q_seg_ref[qs] if cfg.has_seg else None
            q_pos = q_pos_ref[qs] if cfg.has_pos else None

            def step(carry):
                dk, dv = carry
                q = q_ref[qs, hh, :]
                do = do_ref[qs, hh, :]
                lse = lse_ref[hh, qs]
                delta = delta_ref[hh, qs]
                st = _dot(k, q, cfg.exact, trans_b=True) * scale  # S^T = K Q^T: [bk, bq]
                pt = jnp.exp2(st - lse[None, :])
                mask = _mask(cfg, q_start + jnp.arange(bq, dtype=jnp.int32), k_idx, q_seg, k_seg, q_pos, k_pos,
                             transposed=True)
                if mask is not None:
                    pt = jnp.where(mask, pt, 0.0)
                dv = dv + _dot(pt.astype(do.dtype), do, cfg.exact)  # dV += P^T dO
                dpt = _dot(v, do, cfg.exact, trans_b=True)  # dP^T = V dO^T
                dst = pt * (dpt - delta[None, :])  # dS^T = P^T o (dP^T - D)
                dk = dk + _dot(dst.astype(q.dtype), q, cfg.exact)  # dK += dS^T Q (scale later)
                return dk, dv

            return _maybe_skip(cfg, step, q_seg, k_seg, q_pos, k_pos)(carry)

        return lax.fori_loop(lo, hi, body, carry)

    d = k.shape[-1]
    init = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32))
    dk, dv = lax.fori_loop(0, cfg.group, head_body, init)
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, cfg):
    """dQ for one (query block, batch, head): refs q/do [bq, d], k/v [kv_len, d], lse2/delta [bq] -> dq [bq, d]."""
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (q_seg_ref, k_seg_ref, q_pos_ref, k_pos_ref), (dq_ref,) = (
        _split_refs(cfg, refs, 6))
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    q_start = pl.program_id(0) * bq
    q_idx = q_start + jnp.arange(bq, dtype=jnp.int32)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_seg = q_seg_ref[...] if cfg.has_seg else None
    q_pos = q_pos_ref[...] if cfg.has_pos else None
    scale = cfg.sm_scale * _LOG2E

    def body(kb, carry):
        k_start = kb * bk
        ks = pl.ds(k_start, bk)
        k_seg = k_seg_ref[ks] if cfg.has_seg else None
        k_pos = k_pos_ref[ks] if cfg.has_pos else None

        def step(dq):
            k = k_ref[ks, :]
            v = v_ref[ks, :]
            s = _dot(q, k, cfg.exact, trans_b=True) * scale
            p = jnp.exp2(s - lse[:, None])
            mask = _mask(cfg, q_idx, k_start + jnp.arange(bk, dtype=jnp.int32), q_seg, k_seg, q_pos, k_pos)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dp = _dot(do, v, cfg.exact, trans_b=True)
            ds = p * (dp - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k, cfg.exact)  # dQ += dS K (scale later)

        return _maybe_skip(cfg, step, q_seg, k_seg, q_pos, k_pos)(carry)

    lo, hi = _kv_range(cfg, q_start, bq, bk, k_ref.shape[0] // bk)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _backward(cfg, q, k, v, segs, poss, out, lse, dout, dlse):
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    group = cfg.group
    # D_i = rowsum(dO_i * O_i) (Algorithm 2 line 4); a cotangent on lse adds P * dlse to dS,
    # i.e. subtracts dlse from D.
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
    # lse in log2 units; +inf for queries that see nothing, so exp2(s - lse) == 0 there.
    lse2 = jnp.where(lse <= reference.MASKED, jnp.inf, lse * _LOG2E)

    # dK, dV: grid over key blocks and kv heads; the group's query heads are a block of size `group`.
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    side, side_specs = _side_inputs(
        cfg, segs, poss,
        pl.BlockSpec((None, sq), lambda j, bi, g: (bi, 0)),
        pl.BlockSpec((None, bk), lambda j, bi, g: (bi, j)))
    kv_spec = pl.BlockSpec((None, bk, None, d), lambda j, bi, g: (bi, j, g, 0))
    qg_spec = pl.BlockSpec((None, sq, group, d), lambda j, bi, g: (bi, 0, g, 0))
    stat_spec = pl.BlockSpec((None, group, sq), lambda j, bi, g: (bi, g, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg),
        grid=(sk // bk, b, kvh),
        in_specs=[kv_spec, kv_spec, qg_spec, qg_spec, stat_spec, stat_spec, *side_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="jaxllm_flash_bwd_dkdv",
        **_launch(cfg, bwd=True),
    )(k, v, q, dout, lse2, delta, *side)

    # dQ: grid over query blocks and query heads; the kv head is h // group.
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    side, side_specs = _side_inputs(
        cfg, segs, poss,
        pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i)),
        pl.BlockSpec((None, sk), lambda i, bi, hi: (bi, 0)))
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    kvfull_spec = pl.BlockSpec((None, sk, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, np.int32(group)), 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(sq // bq, b, h),
        in_specs=[q_spec, kvfull_spec, kvfull_spec, q_spec, row_spec, row_spec, *side_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="jaxllm_flash_bwd_dq",
        **_launch(cfg, bwd=True),
    )(q, k, v, dout, lse2, delta, *side)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash(q, k, v, segs, poss, cfg):
    """``(out, lse)``: out ``[b, sq_p, h, d_p]`` in q's dtype, float32 lse ``[b, h, sq_p]``, of the padded
    q ``[b, sq_p, h, d_p]`` and k, v ``[b, sk_p, kv_heads, d_p]`` under the static :class:`Cfg`; ``segs`` and
    ``poss`` are ``(q side, kv side)`` int32 ``[b, len_p]`` pairs or None.  Differentiable in q, k, v."""
    return _forward(cfg, q, k, v, segs, poss)


def _flash_fwd(q, k, v, segs, poss, cfg):
    out, lse = _forward(cfg, q, k, v, segs, poss)
    return (out, lse), (q, k, v, segs, poss, out, lse)


def _flash_bwd(cfg, res, cts):
    q, k, v, segs, poss, out, lse = res
    dout, dlse = cts
    dq, dk, dv = _backward(cfg, q, k, v, segs, poss, out, lse, dout, dlse)
    none = lambda t: None if t is None else tuple(None for _ in t)  # noqa: E731 - integer inputs
    return dq, dk, dv, none(segs), none(poss)


flash.defvjp(_flash_fwd, _flash_bwd)

