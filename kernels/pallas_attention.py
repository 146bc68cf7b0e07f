"""Flash attention in Pallas for GPUs (Triton lowering; also what JAX uses on ROCm).

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

Features: causal or full attention (causal aligned bottom-right like
:func:`jaxllm_kernels.reference.attention`: query ``i`` sits at position
``i + kv_len - q_len``), grouped-query / multi-query attention (the key/value
head of query head ``h`` is ``h // group``, chosen in the BlockSpec index map,
so repeated keys/values are never built), segment ids for packed documents, an
optional sliding window, explicit query/key positions, float32 / bfloat16 /
float16 inputs with float32 softmax statistics and accumulators, any head_dim
(64 and 128 are the native sizes; others are zero-padded to a power of two), any
sequence length (padded to the block size and masked), and the log-sum-exp as a
second, differentiable output (``return_lse``; ring attention merges partial
results with it).

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

On CPU the kernels run in Pallas interpret mode (a scan over the grid lowered
to plain XLA): that is for tests; it is slow.

Sharding: each kernel is one custom call that XLA's SPMD partitioner cannot
split; under a sharded ``jit`` call it inside ``shard_map`` (batch and heads
are independent, so per-device slices need no communication).
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
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


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


# Defaults per GPU family and head size: ``{family: {head_dim: BlockSizes}}``, the entry of the
# smallest key >= the head size (the largest key beyond it), see default_block_sizes.
# NVIDIA: UNTUNED, starting points from the shapes FlashAttention-2 and the Triton fused-attention
# tutorial use (large query tile forward; small iterated tile, large owned tile backward), not
# measured on this code; compiled offline (triton 3.9) they spill no register on sm_80/sm_90.
# CDNA (MI250X gfx90a, MI300X gfx942): chosen offline, never run on an AMD GPU, from
# ``python benchmarks/triton_offline.py --sweep`` (docs/performance.md has the table): the same
# shapes, with the iterated tile halved where the kernel spilled on either target (head_dim 128:
# forward key tile 64 -> 32, dK/dV query tile 32 -> 16); every kernel then compiles without
# spilling a VGPR or SGPR, no scratch, at 2 waves per SIMD or more.  tests/test_gpu_lowering.py
# fails if a kernel of these tables spills on any of the four targets (bfloat16, head_dim 64 and
# 128).  Float32 inputs use IEEE dots (no tensor cores) and spill with the same tiles: float32 is
# for checks, not speed.
_HOPPER = BlockSizes(128, 64, 32, 64, 128, 32, num_stages=3, num_warps_bwd=8, num_stages_bwd=3)
_AMPERE = BlockSizes(64, 64, 32, 64, 64, 32, num_stages=2, num_warps_bwd=8, num_stages_bwd=2)
_OTHER = BlockSizes(64, 64, 32, 64, 64, 32, num_stages=2, num_stages_bwd=2)
DEFAULT_BLOCK_SIZES = {
    "hopper": {64: dataclasses.replace(_HOPPER, num_warps=4), 128: dataclasses.replace(_HOPPER, num_warps=8)},  # sm_90+
    "ampere": {64: dataclasses.replace(_AMPERE, num_warps=4), 128: dataclasses.replace(_AMPERE, num_warps=8)},  # sm_8x
    "cdna": {  # AMD Instinct MI200/MI300 (ROCm)
        64: BlockSizes(128, 64, 32, 64, 64, 32, num_warps=4, num_stages=1, num_warps_bwd=4, num_stages_bwd=1),
        128: BlockSizes(128, 32, 16, 64, 64, 32, num_warps=8, num_stages=1, num_warps_bwd=8, num_stages_bwd=1),
    },
    "default": {64: dataclasses.replace(_OTHER, num_warps=4, num_warps_bwd=4),  # other/older GPUs
                128: dataclasses.replace(_OTHER, num_warps=8, num_warps_bwd=8)},
    "interpret": {128: BlockSizes(128, 128, 128, 128, 128, 128)},  # CPU interpret mode: few, large steps
}


def default_block_sizes(family: str, head_dim: int) -> BlockSizes:
    """The :data:`DEFAULT_BLOCK_SIZES` of GPU family ``family`` for ``head_dim``: the entry of the
    smallest head size >= ``head_dim``, the largest entry above every key.

    Raises:
      KeyError: ``family`` is not a key of :data:`DEFAULT_BLOCK_SIZES`.
    """
    table = DEFAULT_BLOCK_SIZES[family]
    return table[min((k for k in table if k >= head_dim), default=max(table))]


def gpu_family(device=None) -> str:
    """The :data:`DEFAULT_BLOCK_SIZES` key for ``device`` (default: the first device).

    ``"interpret"`` for CPU, ``"cdna"`` for ROCm devices, ``"hopper"``/``"ampere"``
    from the CUDA compute capability (>= 9 / 8), else ``"default"``.
    """
    device = jax.devices()[0] if device is None else device
    if device.platform == "cpu":
        return "interpret"
    kind = str(getattr(device, "device_kind", "")).lower()
    try:
        version = str(device.client.platform_version).lower()
    except Exception:  # noqa: BLE001 - a client without platform_version
        version = ""
    if "rocm" in version or "hip" in version or "amd" in kind or "instinct" in kind or "gfx" in kind:
        return "cdna"
    cc = getattr(device, "compute_capability", None)
    if cc:
        try:
            major = int(str(cc).split(".")[0])
        except ValueError:
            major = 0
        if major >= 9:
            return "hopper"
        if major == 8:
            return "ampere"
    return "default"


@dataclasses.dataclass(frozen=True)
class _Cfg:
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


def _is_pow2(n):
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a, b):
    """Ceil division of a non-negative traced int by a static positive int (Triton-safe)."""
    return lax.div(a + (b - 1), np.int32(b))


def _floordiv(a, b):
    return lax.div(a, np.int32(b))


def _dot(a, b, exact, trans_a=False, trans_b=False):
    """``a @ b`` (optionally transposed) with a float32 result."""
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b,
                     precision=lax.Precision.HIGHEST if exact else None)


def _mask(cfg, q_idx, k_idx, q_seg=None, k_seg=None, q_pos=None, k_pos=None):
    """Boolean ``[len(q_idx), len(k_idx)]`` visibility of one tile, or None when nothing is masked."""
    if cfg.has_pos:
        qp, kp = q_pos[:, None], k_pos[None, :]
    else:
        qp, kp = q_idx[:, None] + cfg.offset, k_idx[None, :]
    conds = []
    if cfg.causal:
        conds.append(kp <= qp)
    if cfg.window is not None:
        conds.append(qp - kp < cfg.window)
    if cfg.has_seg:
        conds.append(q_seg[:, None] == k_seg[None, :])
    if cfg.kv_padded:
        conds.append(k_idx[None, :] < cfg.kv_len)
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


def _num_warps(bs, d):
    default = 4 if d <= 64 else 8
    return dataclasses.replace(bs, num_warps=bs.num_warps or default, num_warps_bwd=bs.num_warps_bwd or default)


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
                s = _dot(q, k, cfg.exact, trans_b=True) * scale  # [bq, bk]
                p = jnp.exp2(s - lse[:, None])
                mask = _mask(cfg, q_start + jnp.arange(bq, dtype=jnp.int32), k_idx, q_seg, k_seg, q_pos, k_pos)
                if mask is not None:
                    p = jnp.where(mask, p, 0.0)
                dv = dv + _dot(p.astype(do.dtype), do, cfg.exact, trans_a=True)  # dV += P^T dO
                dp = _dot(do, v, cfg.exact, trans_b=True)  # dP = dO V^T
                ds = p * (dp - delta[:, None])  # dS = P o (dP - D)
                dk = dk + _dot(ds.astype(q.dtype), q, cfg.exact, trans_a=True)  # dK += dS^T Q (scale later)
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
def _flash(q, k, v, segs, poss, cfg):
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


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public API


def check_inputs(q, k, v, q_segment_ids=None, kv_segment_ids=None, window=None):
    """Validate the arguments shared by the kernels; raises ValueError with the reason."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, len, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be [batch={b}, kv_len, kv_heads, head_dim={d}]; got {k.shape}, {v.shape}")
    if h % kvh:
        raise ValueError(f"heads={h} is not a multiple of kv_heads={kvh}")
    if q.dtype != k.dtype or q.dtype != v.dtype or not any(q.dtype == t for t in _DTYPES):
        raise ValueError(f"q, k, v must share one of float32/bfloat16/float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if window is not None and (int(window) != window or window < 1):
        raise ValueError(f"window must be an int >= 1 or None; got {window!r}")


def _resolve_blocks(block_sizes, block_q, block_k, sq, sk, d, family):
    bs = block_sizes if block_sizes is not None else default_block_sizes(family, d)
    if block_q is not None:
        bs = dataclasses.replace(bs, block_q=block_q)
    if block_k is not None:
        bs = dataclasses.replace(bs, block_k=block_k)
    qcap, kcap = max(16, _next_pow2(sq)), max(16, _next_pow2(sk))
    changes = {}
    for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
        val = getattr(bs, name)
        if not (isinstance(val, int) and _is_pow2(val) and val >= 16):
            raise ValueError(f"{name}={val!r} must be a power of two >= 16 (a Triton tile)")
        changes[name] = min(val, qcap if name.startswith("block_q") else kcap)
    return _num_warps(dataclasses.replace(bs, **changes), d)


def _pad_axis(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def flash_attention(q, k, v, *, causal=True, q_segment_ids=None, kv_segment_ids=None, window=None,
                    return_lse=False, block_q=None, block_k=None, interpret=None,
                    q_positions=None, kv_positions=None, block_sizes: BlockSizes | None = None):
    """FlashAttention-2 (Dao 2023, Algorithms 1 and 2) in Pallas; same semantics as the reference.

    Args:
      q: ``[batch, q_len, heads, head_dim]``, float32, bfloat16 or float16.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``, q's dtype; ``heads % kv_heads == 0``
        (grouped-query attention; ``kv_heads == 1`` is multi-query attention).
      causal: mask keys after the query (queries aligned to the end of the keys).
      q_segment_ids, kv_segment_ids: int ``[batch, q_len]`` / ``[batch, kv_len]``, both or
        neither; tokens of different segments never attend to each other.
      window: int >= 1 or None; a query attends only to keys at most ``window - 1`` back.
      return_lse: also return the float32 log-sum-exp ``[batch, heads, q_len]`` (natural log,
        ``-1e30`` for a query that sees no key); it is differentiable.
      block_q, block_k: forward tile sizes (powers of two >= 16); override ``block_sizes``.
      interpret: run the Pallas interpreter; None means "the default backend is cpu".
      q_positions, kv_positions: int ``[batch, len]``; None means ``arange`` as in the
        reference.  Explicit positions are supported exactly but lose the static loop
        bounds (tiles are skipped by a runtime range check instead).
      block_sizes: all tile sizes and launch parameters; default from
        :func:`default_block_sizes` of :func:`gpu_family` and the head size.
    Returns:
      ``out`` ``[batch, q_len, heads, head_dim]`` in q's dtype, and with ``return_lse``
      ``(out, lse)``.
    Raises:
      ValueError: bad shapes, dtypes, head counts, segment ids given for only one side,
        window < 1, or tile sizes that are not powers of two >= 16.
    """
    check_inputs(q, k, v, q_segment_ids, kv_segment_ids, window)
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    family = "interpret" if interpret else gpu_family()

    has_pos = q_positions is not None or kv_positions is not None
    if has_pos:
        q_positions, kv_positions = reference.default_positions(q_positions, kv_positions, b, sq, sk)
    has_seg = q_segment_ids is not None

    bs = _resolve_blocks(block_sizes, block_q, block_k, sq, sk, d, family)
    sq_p = -(-sq // max(bs.block_q, bs.block_q_dkv, bs.block_q_dq)) * max(bs.block_q, bs.block_q_dkv, bs.block_q_dq)
    sk_p = -(-sk // max(bs.block_k, bs.block_k_dkv, bs.block_k_dq)) * max(bs.block_k, bs.block_k_dkv, bs.block_k_dq)
    d_p = max(16, _next_pow2(d))
    cfg = _Cfg(sm_scale=float(d) ** -0.5, causal=bool(causal), window=None if window is None else int(window),
               offset=sk - sq, q_len=sq, kv_len=sk, kv_padded=sk_p != sk, group=h // kvh, has_seg=has_seg,
               has_pos=has_pos, exact=q.dtype == jnp.float32, blocks=bs, interpret=bool(interpret))

    qp = _pad_axis(_pad_axis(q, 1, sq_p), 3, d_p)
    kp = _pad_axis(_pad_axis(k, 1, sk_p), 3, d_p)
    vp = _pad_axis(_pad_axis(v, 1, sk_p), 3, d_p)
    segs = None
    if has_seg:
        segs = (_pad_axis(jnp.asarray(q_segment_ids, jnp.int32), 1, sq_p),
                _pad_axis(jnp.asarray(kv_segment_ids, jnp.int32), 1, sk_p))
    poss = None
    if has_pos:
        poss = (_pad_axis(jnp.asarray(q_positions, jnp.int32), 1, sq_p),
                _pad_axis(jnp.asarray(kv_positions, jnp.int32), 1, sk_p))
    out, lse = _flash(qp, kp, vp, segs, poss, cfg)
    out = out[:, :sq, :, :d]
    if return_lse:
        return out, lse[:, :, :sq]
    return out
