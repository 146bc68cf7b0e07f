"""Flash attention in Pallas for GPUs (Triton lowering; also what JAX uses on ROCm): the public entry
:func:`flash_attention` (checks, padding, tiles per GPU family); the kernels themselves, FlashAttention-2's
forward and two backward kernels, are :mod:`jaxllm_kernels.pallas_flash`.

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

On CPU the kernels run in Pallas interpret mode (a scan over the grid lowered
to plain XLA): that is for tests; it is slow.

Sharding: each kernel is one custom call that XLA's SPMD partitioner cannot
split; under a sharded ``jit`` call it inside ``shard_map`` (batch and heads
are independent, so per-device slices need no communication).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm_kernels import reference
from jaxllm_kernels.pallas_flash import BlockSizes, Cfg, flash

__all__ = ["DEFAULT_BLOCK_SIZES", "BlockSizes", "check_inputs", "default_block_sizes", "flash_attention", "gpu_family"]

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


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


def _is_pow2(n):
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def _num_warps(bs, d):
    default = 4 if d <= 64 else 8
    return dataclasses.replace(bs, num_warps=bs.num_warps or default, num_warps_bwd=bs.num_warps_bwd or default)


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
    cfg = Cfg(sm_scale=float(d) ** -0.5, causal=bool(causal), window=None if window is None else int(window),
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
    out, lse = flash(qp, kp, vp, segs, poss, cfg)
    out = out[:, :sq, :, :d]
    if return_lse:
        return out, lse[:, :, :sq]
    return out
