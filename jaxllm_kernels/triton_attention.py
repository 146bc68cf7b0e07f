"""Flash attention written in the Triton language, called from JAX through ``jax_triton``.

The same algorithm and semantics as :mod:`jaxllm_kernels.pallas_attention`
(FlashAttention-2, Dao 2023, arXiv:2307.08691: forward = Algorithm 1 saving the
log-sum-exp; backward = Algorithm 2 split into a dK/dV kernel and a dQ kernel
that recompute the probabilities from the saved lse), but written directly as
``@triton.jit`` kernels with explicit pointer arithmetic, for comparison with the
Pallas lowering and as a base for hand tuning.  Forward AND backward are Triton
kernels here (``jax.custom_vjp``); nothing falls back to Pallas or XLA.

Features: causal/full, grouped-query and multi-query attention (kv head
``h // group`` in the pointer arithmetic, never materialised; dK/dV summed over
the group inside the kernel), segment ids, sliding window, explicit positions
(no block skipping then), float32 (IEEE dots) / bfloat16 / float16 inputs with
float32 statistics and accumulators, head_dim zero-padded to a power of two
(64 and 128 are native), any sequence length (tails masked in the loads, no
padding copies), ``return_lse`` (differentiable).  Causal and window block
skipping come from the loop bounds, as in the Pallas kernel.

Imports: ``triton`` and ``jax_triton`` need a GPU build of jaxlib (jax_triton
imports ``jax._src.lib.gpu_triton``).  Neither is imported at module import
time -- only when a kernel is first launched -- so this module always imports;
:func:`available` says whether it can run here and why not.  The kernels are
plain module functions turned into ``triton.jit`` functions on first use.

Launch convention (``jax_triton.triton_call``): the array arguments are the
kernel's leading pointer parameters, then one pointer per output, then every
``tl.constexpr`` parameter by keyword.  All sizes are constexpr (JAX shapes are
static, so there is one compilation per shape anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxllm_kernels import pallas_attention as _pa
from jaxllm_kernels import reference
from jaxllm_kernels.pallas_attention import DEFAULT_BLOCK_SIZES, BlockSizes, gpu_family

triton = None  # bound by _load(); the kernels below resolve ``tl`` from these module globals
tl = None

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def available() -> tuple[bool, str]:
    """``(True, "")`` if the Triton kernels can run here, else ``(False, reason)``."""
    try:
        import jax_triton  # noqa: F401
        import triton as _triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a jaxlib without gpu_triton
        return False, (f"jax_triton is not importable ({type(e).__name__}: {e}); "
                       "jax_triton needs triton and a GPU build of jaxlib")
    backend = jax.default_backend()
    if backend != "gpu":
        return False, f"jax_triton runs only on GPUs; the default JAX backend is {backend!r}"
    return True, ""


# ----------------------------------------------------------------------------- Triton kernels
# Plain functions; _load() wraps them with triton.jit.  `from __future__ import annotations`
# keeps the `tl.constexpr` annotations as strings, which Triton accepts.


def _tile_mask(q_idx, k_idx, q_seg, q_pos, KSEG, KPOS, b, KV_LEN: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_POS: tl.constexpr):
    """[BLOCK_Q, BLOCK_K] visibility: key in range, causal, window, same segment."""
    k_ok = k_idx < KV_LEN
    mask = k_ok[None, :] & (q_idx[:, None] >= 0)
    if HAS_POS:
        k_pos = tl.load(KPOS + b * KV_LEN + k_idx, mask=k_ok, other=0)
    else:
        k_pos = k_idx
    if CAUSAL:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    if WINDOW > 0:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < WINDOW)
    if HAS_SEG:
        k_seg = tl.load(KSEG + b * KV_LEN + k_idx, mask=k_ok, other=-2)
        mask = mask & (q_seg[:, None] == k_seg[None, :])
    return mask


def _q_side(QSEG, QPOS, b, q_idx, q_ok, Q_LEN: tl.constexpr, OFFSET: tl.constexpr, HAS_SEG: tl.constexpr,
            HAS_POS: tl.constexpr):
    """Segment ids and positions of a query tile."""
    if HAS_SEG:
        q_seg = tl.load(QSEG + b * Q_LEN + q_idx, mask=q_ok, other=-1)
    else:
        q_seg = q_idx
    if HAS_POS:
        q_pos = tl.load(QPOS + b * Q_LEN + q_idx, mask=q_ok, other=0)
    else:
        q_pos = q_idx + OFFSET
    return q_seg, q_pos


def _fwd_kernel(Q, K, V, QSEG, KSEG, QPOS, KPOS, O, LSE,
                SM_SCALE: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, Q_LEN: tl.constexpr,
                KV_LEN: tl.constexpr, OFFSET: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                HAS_SEG: tl.constexpr, HAS_POS: tl.constexpr, EXACT: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Algorithm 1.  Grid (cdiv(Q_LEN, BLOCK_Q), batch * H).  Q/O [B, Q_LEN, H, D], K/V [B, KV_LEN, H/GROUP, D],
    LSE [B, H, Q_LEN] float32 (natural log)."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = h // GROUP
    dd = tl.arange(0, HEAD_DIM)
    q_idx = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q_idx < Q_LEN
    q_off = b.to(tl.int64) * (Q_LEN * H * HEAD_DIM) + h * HEAD_DIM + q_idx[:, None] * (H * HEAD_DIM) + dd[None, :]
    kv_base = b.to(tl.int64) * (KV_LEN * (H // GROUP) * HEAD_DIM) + g * HEAD_DIM
    q = tl.load(Q + q_off, mask=q_ok[:, None], other=0.0)
    q_seg, q_pos = _q_side(QSEG, QPOS, b, q_idx, q_ok, Q_LEN, OFFSET, HAS_SEG, HAS_POS)
    scale = SM_SCALE * 1.4426950408889634  # log2(e): exp2 instead of exp

    m_i = tl.full([BLOCK_Q], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    lo = 0
    hi = tl.cdiv(KV_LEN, BLOCK_K)
    if not HAS_POS:
        if CAUSAL:  # key j visible iff j <= i + OFFSET
            hi = tl.minimum(hi, (tl.maximum(qb * BLOCK_Q + BLOCK_Q + OFFSET, 0) + BLOCK_K - 1) // BLOCK_K)
        if WINDOW > 0:  # ... and j >= i + OFFSET - WINDOW + 1
            lo = tl.maximum(qb * BLOCK_Q + OFFSET - WINDOW + 1, 0) // BLOCK_K
    for kb in range(lo, hi):
        k_idx = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        kv_off = kv_base + k_idx[:, None] * ((H // GROUP) * HEAD_DIM) + dd[None, :]
        k_ok = k_idx < KV_LEN
        k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
        if EXACT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        mask = _tile_mask(q_idx, k_idx, q_seg, q_pos, KSEG, KPOS, b, KV_LEN, CAUSAL, WINDOW, HAS_SEG, HAS_POS)
        s = tl.where(mask, s, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        p = tl.where(mask, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EXACT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + q_off, out.to(O.dtype.element_ty), mask=q_ok[:, None])
    lse = tl.where(empty, -1e30, m_i * 0.6931471805599453 + tl.log(l_safe))
    tl.store(LSE + bh * Q_LEN + q_idx, lse, mask=q_ok)


def _dkdv_kernel(Q, K, V, DO, LSE2, DELTA, QSEG, KSEG, QPOS, KPOS, DK, DV,
                 SM_SCALE: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, Q_LEN: tl.constexpr,
                 KV_LEN: tl.constexpr, OFFSET: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 HAS_SEG: tl.constexpr, HAS_POS: tl.constexpr, EXACT: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Algorithm 2, dK/dV half.  Grid (cdiv(KV_LEN, BLOCK_K), batch * H/GROUP); loops over the GROUP query
    heads of its kv head and the visible query tiles.  LSE2 = lse * log2(e) (+inf: query sees nothing),
    DELTA = rowsum(dO * O) - dlse, both [B, H, Q_LEN] float32."""
    kb = tl.program_id(0)
    bg = tl.program_id(1)
    b = bg // (H // GROUP)
    g = bg % (H // GROUP)
    dd = tl.arange(0, HEAD_DIM)
    k_idx = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k_idx < KV_LEN
    kv_off = (b.to(tl.int64) * (KV_LEN * (H // GROUP) * HEAD_DIM) + g * HEAD_DIM
              + k_idx[:, None] * ((H // GROUP) * HEAD_DIM) + dd[None, :])
    k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
    scale = SM_SCALE * 1.4426950408889634
    dk = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    lo = 0
    hi = tl.cdiv(Q_LEN, BLOCK_Q)
    if not HAS_POS:
        if CAUSAL:  # query i sees key j iff i >= j - OFFSET
            lo = tl.maximum(kb * BLOCK_K - OFFSET, 0) // BLOCK_Q
        if WINDOW > 0:  # ... and i < j + WINDOW - OFFSET
            hi = tl.minimum(hi, (tl.maximum(kb * BLOCK_K + BLOCK_K - 1 + WINDOW - OFFSET, 0) + BLOCK_Q - 1) // BLOCK_Q)
    for hh in range(0, GROUP):
        h = g * GROUP + hh
        q_base = b.to(tl.int64) * (Q_LEN * H * HEAD_DIM) + h * HEAD_DIM
        row = (b * H + h) * Q_LEN
        for qb in range(lo, hi):
            q_idx = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
            q_ok = q_idx < Q_LEN
            q_off = q_base + q_idx[:, None] * (H * HEAD_DIM) + dd[None, :]
            q = tl.load(Q + q_off, mask=q_ok[:, None], other=0.0)
            do = tl.load(DO + q_off, mask=q_ok[:, None], other=0.0)
            lse2 = tl.load(LSE2 + row + q_idx, mask=q_ok, other=float("inf"))
            delta = tl.load(DELTA + row + q_idx, mask=q_ok, other=0.0)
            q_seg, q_pos = _q_side(QSEG, QPOS, b, q_idx, q_ok, Q_LEN, OFFSET, HAS_SEG, HAS_POS)
            if EXACT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            mask = _tile_mask(q_idx, k_idx, q_seg, q_pos, KSEG, KPOS, b, KV_LEN, CAUSAL, WINDOW, HAS_SEG, HAS_POS)
            p = tl.where(mask, tl.exp2(s * scale - lse2[:, None]), 0.0)
            if EXACT:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            if EXACT:
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")
            else:
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    tl.store(DK + kv_off, (dk * SM_SCALE).to(DK.dtype.element_ty), mask=k_ok[:, None])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=k_ok[:, None])


def _dq_kernel(Q, K, V, DO, LSE2, DELTA, QSEG, KSEG, QPOS, KPOS, DQ,
               SM_SCALE: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, Q_LEN: tl.constexpr,
               KV_LEN: tl.constexpr, OFFSET: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               HAS_SEG: tl.constexpr, HAS_POS: tl.constexpr, EXACT: tl.constexpr,
               BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Algorithm 2, dQ half.  Grid (cdiv(Q_LEN, BLOCK_Q), batch * H)."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = h // GROUP
    dd = tl.arange(0, HEAD_DIM)
    q_idx = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q_idx < Q_LEN
    q_off = b.to(tl.int64) * (Q_LEN * H * HEAD_DIM) + h * HEAD_DIM + q_idx[:, None] * (H * HEAD_DIM) + dd[None, :]
    kv_base = b.to(tl.int64) * (KV_LEN * (H // GROUP) * HEAD_DIM) + g * HEAD_DIM
    q = tl.load(Q + q_off, mask=q_ok[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=q_ok[:, None], other=0.0)
    lse2 = tl.load(LSE2 + bh * Q_LEN + q_idx, mask=q_ok, other=float("inf"))
    delta = tl.load(DELTA + bh * Q_LEN + q_idx, mask=q_ok, other=0.0)
    q_seg, q_pos = _q_side(QSEG, QPOS, b, q_idx, q_ok, Q_LEN, OFFSET, HAS_SEG, HAS_POS)
    scale = SM_SCALE * 1.4426950408889634
    dq = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    lo = 0
    hi = tl.cdiv(KV_LEN, BLOCK_K)
    if not HAS_POS:
        if CAUSAL:
            hi = tl.minimum(hi, (tl.maximum(qb * BLOCK_Q + BLOCK_Q + OFFSET, 0) + BLOCK_K - 1) // BLOCK_K)
        if WINDOW > 0:
            lo = tl.maximum(qb * BLOCK_Q + OFFSET - WINDOW + 1, 0) // BLOCK_K
    for kb in range(lo, hi):
        k_idx = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        kv_off = kv_base + k_idx[:, None] * ((H // GROUP) * HEAD_DIM) + dd[None, :]
        k_ok = k_idx < KV_LEN
        k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
        if EXACT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))
        mask = _tile_mask(q_idx, k_idx, q_seg, q_pos, KSEG, KPOS, b, KV_LEN, CAUSAL, WINDOW, HAS_SEG, HAS_POS)
        p = tl.where(mask, tl.exp2(s * scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if EXACT:
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + q_off, (dq * SM_SCALE).to(DQ.dtype.element_ty), mask=q_ok[:, None])


@functools.cache
def _load():
    """Import triton and jit the kernels (helpers first: the kernels resolve them from module globals)."""
    global triton, tl, _tile_mask, _q_side
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl
    _tile_mask = triton.jit(_tile_mask)
    _q_side = triton.jit(_q_side)
    return {"fwd": triton.jit(_fwd_kernel), "dkdv": triton.jit(_dkdv_kernel), "dq": triton.jit(_dq_kernel)}


def _triton_call(*args, kernel, out_shape, grid, num_warps, num_stages, **meta):
    """``jax_triton.triton_call`` (the seam a CPU-side kernel check can replace)."""
    import jax_triton

    return jax_triton.triton_call(*args, kernel=kernel, out_shape=out_shape, grid=grid, num_warps=num_warps,
                                  num_stages=num_stages, **meta)


# ----------------------------------------------------------------------------- JAX side


@dataclasses.dataclass(frozen=True)
class _Cfg:
    sm_scale: float
    causal: bool
    window: int  # 0: no window
    group: int
    has_seg: bool
    has_pos: bool
    exact: bool
    blocks: BlockSizes


def _meta(cfg, q, k, block_q, block_k):
    b, sq, h, d = q.shape
    return dict(SM_SCALE=cfg.sm_scale, H=h, GROUP=cfg.group, Q_LEN=sq, KV_LEN=k.shape[1],
                OFFSET=k.shape[1] - sq, CAUSAL=cfg.causal, WINDOW=cfg.window, HAS_SEG=cfg.has_seg,
                HAS_POS=cfg.has_pos, EXACT=cfg.exact, BLOCK_Q=block_q, BLOCK_K=block_k, HEAD_DIM=d)


def _side(side):
    """The four int32 side arrays (segment ids, positions); a 1-element dummy stands in for absent ones."""
    dummy = jnp.zeros((1,), jnp.int32)
    segs, poss = side
    return (*(segs if segs is not None else (dummy, dummy)), *(poss if poss is not None else (dummy, dummy)))


def _forward(cfg, q, k, v, side):
    b, sq, h, d = q.shape
    bs = cfg.blocks
    return _triton_call(
        q, k, v, *_side(side), kernel=_load()["fwd"],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
        grid=(-(-sq // bs.block_q), b * h), num_warps=bs.num_warps, num_stages=bs.num_stages,
        **_meta(cfg, q, k, bs.block_q, bs.block_k))


def _backward(cfg, q, k, v, side, out, lse, dout, dlse):
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    bs = cfg.blocks
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
    lse2 = jnp.where(lse <= reference.MASKED, jnp.inf, lse * _LOG2E)
    ins = (q, k, v, dout, lse2, delta, *_side(side))
    dk, dv = _triton_call(
        *ins, kernel=_load()["dkdv"],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(-(-sk // bs.block_k_dkv), b * kvh), num_warps=bs.num_warps_bwd, num_stages=bs.num_stages_bwd,
        **_meta(cfg, q, k, bs.block_q_dkv, bs.block_k_dkv))
    dq = _triton_call(
        *ins, kernel=_load()["dq"], out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(-(-sq // bs.block_q_dq), b * h), num_warps=bs.num_warps_bwd, num_stages=bs.num_stages_bwd,
        **_meta(cfg, q, k, bs.block_q_dq, bs.block_k_dq))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, side, cfg):
    return _forward(cfg, q, k, v, side)


def _flash_fwd(q, k, v, side, cfg):
    out, lse = _forward(cfg, q, k, v, side)
    return (out, lse), (q, k, v, side, out, lse)


def _flash_bwd(cfg, res, cts):
    q, k, v, side, out, lse = res
    dq, dk, dv = _backward(cfg, q, k, v, side, out, lse, *cts)
    return dq, dk, dv, jax.tree.map(lambda _: None, side)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, causal=True, q_segment_ids=None, kv_segment_ids=None, window=None,
                    return_lse=False, block_q=None, block_k=None, interpret=None,
                    q_positions=None, kv_positions=None, block_sizes: BlockSizes | None = None):
    """FlashAttention-2 (Dao 2023, Algorithms 1 and 2) as Triton-language kernels via ``jax_triton``.

    Arguments, shapes, dtypes and results are those of
    :func:`jaxllm_kernels.pallas_attention.flash_attention` (q ``[batch, q_len, heads, head_dim]``,
    k/v ``[batch, kv_len, kv_heads, head_dim]``, out in q's dtype, lse ``[batch, heads, q_len]``
    float32).  Tile sizes default to the same per-GPU-family table (``default_block_sizes``).

    Args:
      interpret: must be None or False: jax_triton has no interpreter (use the Pallas kernel
        with ``interpret=True`` on CPU).
    Raises:
      ValueError: invalid arguments (see :func:`jaxllm_kernels.pallas_attention.check_inputs`),
        or ``interpret=True``.
      RuntimeError: jax_triton/triton cannot run here (the reason from :func:`available`).
    """
    if interpret:
        raise ValueError("the Triton-language kernels have no interpret mode under jax_triton; "
                         "use jaxllm_kernels.pallas_attention.flash_attention(..., interpret=True) on CPU")
    _pa.check_inputs(q, k, v, q_segment_ids, kv_segment_ids, window)
    ok, why = available()
    if not ok:
        raise RuntimeError(f"triton attention cannot run here: {why}")
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    bs = _pa._resolve_blocks(block_sizes, block_q, block_k, sq, sk, d, gpu_family())
    has_pos = q_positions is not None or kv_positions is not None
    if has_pos:
        q_positions, kv_positions = reference.default_positions(q_positions, kv_positions, b, sq, sk)
    segs = None
    if q_segment_ids is not None:
        segs = (jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32))
    poss = None
    if has_pos:
        poss = (jnp.asarray(q_positions, jnp.int32), jnp.asarray(kv_positions, jnp.int32))
    d_p = max(16, _pa._next_pow2(d))
    cfg = _Cfg(sm_scale=float(d) ** -0.5, causal=bool(causal), window=0 if window is None else int(window),
               group=h // kvh, has_seg=segs is not None, has_pos=has_pos, exact=q.dtype == jnp.float32, blocks=bs)
    out, lse = _flash(_pa._pad_axis(q, 3, d_p), _pa._pad_axis(k, 3, d_p), _pa._pad_axis(v, 3, d_p), (segs, poss), cfg)
    out = out[..., :d]
    return (out, lse) if return_lse else out


__all__ = ["available", "flash_attention", "BlockSizes", "DEFAULT_BLOCK_SIZES"]
