"""Attention kernels against the XLA reference, and the ``model.attention_impl`` dispatch.

On CPU the Pallas kernel runs in interpret mode (slow), so the cases are small (batch 1,
2-4 heads, large tiles) but together cover every feature: causal/full, MHA/GQA/MQA,
segment ids, sliding window, explicit positions, uneven and padded lengths, seq 128-1024,
head_dim 64 and 128, float32/bfloat16/float16, and ``return_lse`` (every case checks the
lse and differentiates through it).  Tests marked ``slow`` are the seq-1024 cases; they
still run in CI.  Tests needing a GPU (jax_triton, Pallas compiled, cuDNN) skip here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import config as jaxllm_config
from jaxllm.analysis import layouts
from jaxllm.model import attention as dispatch
from jaxllm.platform import hardware
from jaxllm_kernels import pallas_attention as pa
from jaxllm_kernels import pallas_flash, reference, triton_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    sq: int = 256
    sk: int | None = None  # None: = sq
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    dtype: object = jnp.float32
    causal: bool = True
    window: int | None = None
    segments: tuple[int, ...] | None = None  # segment lengths (packed documents), same for q and kv
    positions: bool = False  # explicit q/kv positions (a ring-attention-like chunk)
    blocks: pa.BlockSizes | None = None

    def __str__(self):
        return self.name


SMALL = pa.BlockSizes(32, 64, 32, 64, 64, 32)  # several loop steps; q/k tiles differ (skipping bounds)

CASES = [
    Case("causal-mha-128-d64", sq=128),
    Case("full-gqa-256-d128", heads=4, kv_heads=2, head_dim=128, causal=False),
    Case("causal-mqa-256-smalltiles", heads=4, kv_heads=1, blocks=SMALL),
    Case("segments-causal-gqa", heads=4, kv_heads=2, segments=(100, 60, 96), blocks=SMALL),
    Case("segments-full", segments=(30, 226), causal=False, blocks=SMALL),
    Case("window-causal-384", sq=384, window=100, blocks=SMALL),
    Case("window-full-d128", head_dim=128, window=33, causal=False, blocks=SMALL),
    Case("uneven-padded-200x328-window", sq=200, sk=328, heads=4, kv_heads=2, window=77, blocks=SMALL),
    Case("q-longer-than-kv-empty-rows", sq=160, sk=96, blocks=SMALL),
    Case("positions-chunk-window", sq=128, sk=384, positions=True, window=200, blocks=SMALL),
    Case("head-dim-80-padded", sq=128, head_dim=80, heads=3, kv_heads=1, causal=False),
    Case("bf16-causal-gqa-512-d128", sq=512, heads=4, kv_heads=2, head_dim=128, dtype=jnp.bfloat16),
    Case("bf16-segments-window", segments=(64, 64, 128), window=48, dtype=jnp.bfloat16, blocks=SMALL),
    Case("fp16-causal-128", sq=128, dtype=jnp.float16),
    # the ROCm tables (DEFAULT_BLOCK_SIZES["cdna"]): three different tile counts, lengths no tile divides
    Case("cdna-tiles-d128-gqa-300", sq=300, heads=4, kv_heads=2, head_dim=128,
         blocks=pa.default_block_sizes("cdna", 128)),
    Case("cdna-tiles-d64-segments-window", segments=(100, 156), window=70, blocks=pa.default_block_sizes("cdna", 64)),
]
SLOW_CASES = [
    Case("causal-gqa-1024-d128", sq=1024, heads=4, kv_heads=2, head_dim=128),
    Case("bf16-full-segments-1024-d64", sq=1024, segments=(300, 500, 224), causal=False, dtype=jnp.bfloat16),
    Case("window-mqa-1024-smalltiles", sq=1024, heads=4, kv_heads=1, window=200, blocks=SMALL),
]


def _inputs(c: Case, seed=0):
    sk = c.sk or c.sq
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (1, c.sq, c.heads, c.head_dim), jnp.float32).astype(c.dtype)
    k = jax.random.normal(ks[1], (1, sk, c.kv_heads, c.head_dim), jnp.float32).astype(c.dtype)
    v = jax.random.normal(ks[2], (1, sk, c.kv_heads, c.head_dim), jnp.float32).astype(c.dtype)
    do = jax.random.normal(ks[3], q.shape, jnp.float32)
    dlse = jax.random.normal(ks[4], (1, c.heads, c.sq), jnp.float32)
    kw = dict(causal=c.causal, window=c.window)
    if c.segments:
        seg = jnp.repeat(jnp.arange(len(c.segments)), jnp.array(c.segments), total_repeat_length=sum(c.segments))
        assert seg.shape[0] == c.sq == sk
        kw.update(q_segment_ids=seg[None], kv_segment_ids=seg[None])
    if c.positions:  # the last q_len keys' positions, offset as if this were a later chunk
        kw.update(q_positions=jnp.arange(sk - c.sq, sk)[None] + 1000, kv_positions=jnp.arange(sk)[None] + 1000)
    return (q, k, v), do, dlse, kw


def _value_and_grads(fn, qkv, do, dlse, kw):
    def loss(q, k, v):
        out, lse = fn(q, k, v, return_lse=True, **kw)
        seen = lse > -1e29  # a query that sees no key has lse -1e30 in both implementations
        total = jnp.sum(out.astype(jnp.float32) * do) + jnp.sum(jnp.where(seen, lse, 0.0) * dlse)
        return total, (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv)
    return out, lse, grads


def _assert_close(name, got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol,
                               err_msg=name)


def _check_against_reference(c: Case, fn):
    qkv, do, dlse, kw = _inputs(c)
    out, lse, grads = _value_and_grads(fn, qkv, do, dlse, kw)
    with jax.default_matmul_precision("highest"):  # XLA on a GPU multiplies float32 in TF32 by default
        r_out, r_lse, r_grads = _value_and_grads(reference.attention, qkv, do, dlse, kw)
    tol = TOL[c.dtype]
    assert out.dtype == qkv[0].dtype and out.shape == qkv[0].shape
    assert lse.dtype == jnp.float32 and lse.shape == (1, c.heads, c.sq)
    _assert_close("out", out, r_out, tol)
    _assert_close("lse", lse, r_lse, 1e-5 if c.dtype == jnp.float32 else tol)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, r_grads):
        assert g.dtype == rg.dtype and g.shape == rg.shape
        _assert_close(name, g, rg, tol)


def _pallas_interpret(c: Case):
    return lambda q, k, v, **kw: pa.flash_attention(q, k, v, interpret=True, block_sizes=c.blocks, **kw)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pallas_interpret_matches_reference(case):
    _check_against_reference(case, _pallas_interpret(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=str)
def test_pallas_interpret_matches_reference_long(case):
    _check_against_reference(case, _pallas_interpret(case))


def test_pallas_without_lse_and_empty_rows():
    """return_lse=False gives the output alone; queries that see no key give zeros (like the reference)."""
    c = Case("empty", sq=64, sk=32, blocks=pa.BlockSizes(16, 16, 16, 16, 16, 16))
    (q, k, v), *_ = _inputs(c)
    out = pa.flash_attention(q, k, v, interpret=True, block_sizes=c.blocks)
    assert isinstance(out, jax.Array) and out.shape == q.shape
    _assert_close("out", out, reference.attention(q, k, v), 1e-5)
    assert not np.asarray(out[:, :32]).any()  # query i sits at position i - 32 < 0: sees nothing


@pytest.mark.parametrize("causal,window", [(True, None), (False, 7), (True, 40), (False, None)])
@pytest.mark.parametrize("sq,sk,bq,bk", [(128, 128, 32, 16), (64, 200, 16, 32), (200, 64, 32, 16)])
def test_block_skipping_bounds_are_exact(causal, window, sq, sk, bq, bk):
    """The loop bounds visit every block with a visible pair and skip every fully masked one."""
    cfg = pallas_flash.Cfg(sm_scale=1.0, causal=causal, window=window, offset=sk - sq, q_len=sq, kv_len=sk,
                           kv_padded=False, group=1, has_seg=False, has_pos=False, exact=True, blocks=pa.BlockSizes(),
                           interpret=True)
    qp = np.arange(sq) + sk - sq
    kp = np.arange(sk)
    mask = np.ones((sq, sk), bool)
    if causal:
        mask &= kp[None] <= qp[:, None]
    if window:
        mask &= qp[:, None] - kp[None] < window
    nq, nk = -(-sq // bq), -(-sk // bk)
    for i in range(nq):
        lo, hi = (int(x) for x in pallas_flash._kv_range(cfg, i * bq, bq, bk, nk))
        want = [j for j in range(nk) if mask[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()]
        assert list(range(lo, hi)) == want or (not want and lo >= hi), (i, lo, hi, want)
    for j in range(nk):
        lo, hi = (int(x) for x in pallas_flash._q_range(cfg, j * bk, bq, bk, nq))
        want = [i for i in range(nq) if mask[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()]
        assert list(range(lo, hi)) == want or (not want and lo >= hi), (j, lo, hi, want)


def test_pallas_rejects_bad_arguments():
    q = jnp.zeros((1, 32, 3, 16))
    k = jnp.zeros((1, 32, 2, 16))
    with pytest.raises(ValueError, match="not a multiple of kv_heads"):
        pa.flash_attention(q, k, k, interpret=True)
    q = jnp.zeros((1, 32, 2, 16))
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        pa.flash_attention(q.astype(jnp.int32), k.astype(jnp.int32), k.astype(jnp.int32), interpret=True)
    seg = jnp.zeros((1, 32), jnp.int32)
    with pytest.raises(ValueError, match="together"):
        pa.flash_attention(q, k, k, q_segment_ids=seg, interpret=True)
    with pytest.raises(ValueError, match="window"):
        pa.flash_attention(q, k, k, window=0, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        pa.flash_attention(q, k, k, block_q=48, interpret=True)


def test_gpu_family_and_tables():
    assert pa.gpu_family(jax.devices("cpu")[0]) == "interpret"
    for fam, table in pa.DEFAULT_BLOCK_SIZES.items():
        for d, bs in table.items():
            assert bs.num_warps and bs.num_warps_bwd or fam == "interpret", (fam, d)
            for f in dataclasses.fields(bs):
                if f.name.startswith("block_"):
                    assert pa._is_pow2(getattr(bs, f.name)) and getattr(bs, f.name) >= 16, (fam, d, f.name)
    cdna = pa.DEFAULT_BLOCK_SIZES["cdna"]  # the entry of the smallest head size >= head_dim, else the largest
    assert pa.default_block_sizes("cdna", 32) == pa.default_block_sizes("cdna", 64) == cdna[64]
    assert pa.default_block_sizes("cdna", 80) == pa.default_block_sizes("cdna", 256) == cdna[128]
    assert pa._resolve_blocks(None, None, None, 4096, 4096, 128, "cdna").block_k == cdna[128].block_k == 32


# ----------------------------------------------------------------------------- GPU-only


def _require_jax_triton():
    try:
        import jax_triton  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or jaxlib without gpu_triton
        pytest.skip("jax_triton needs a GPU build of jaxlib")
    if not ON_GPU:
        pytest.skip("jax_triton needs a GPU build of jaxlib")


def test_triton_module_imports_and_reports_availability():
    ok, why = triton_attention.available()
    assert isinstance(ok, bool) and isinstance(why, str)
    if not ok:
        assert "jax_triton" in why
        with pytest.raises(RuntimeError, match="jax_triton"):
            triton_attention.flash_attention(jnp.zeros((1, 16, 1, 16)), jnp.zeros((1, 16, 1, 16)),
                                             jnp.zeros((1, 16, 1, 16)))


GPU_CASES = [CASES[1], CASES[3], CASES[7], CASES[9], CASES[11], CASES[12], SLOW_CASES[0]]


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_triton_matches_reference(case):
    _require_jax_triton()
    _check_against_reference(case, lambda q, k, v, **kw: triton_attention.flash_attention(q, k, v, **kw))


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_pallas_gpu_matches_reference(case):
    _check_against_reference(case, lambda q, k, v, **kw: pa.flash_attention(q, k, v, **kw))


@pytest.mark.skipif(not ON_GPU or hardware.backend_kind() != "cuda", reason="cuDNN needs an NVIDIA GPU")
@pytest.mark.parametrize("case", [Case("bf16-causal", sq=512, heads=4, kv_heads=2, head_dim=128, dtype=jnp.bfloat16),
                                  Case("bf16-window", sq=512, window=100, dtype=jnp.bfloat16)], ids=str)
def test_cudnn_matches_reference(case):
    qkv, do, _, kw = _inputs(case)
    got = dispatch.attention(*qkv, impl="cudnn", **kw)
    _assert_close("out", got, reference.attention(*qkv, **kw), TOL[case.dtype])


HOPPER = ON_GPU and hardware.backend_kind() == "cuda" and tuple(
    int(p) for p in str(getattr(jax.devices()[0], "compute_capability", "0.0")).split(".")[:2]) >= (9, 0)


@pytest.mark.skipif(not HOPPER, reason="cuDNN's packed attention needs an NVIDIA GPU of compute capability 9.0")
@pytest.mark.parametrize("bound", [512, 4], ids=["bound-seq", "bound-4"])
def test_cudnn_matches_reference_with_packed_documents(bound):
    """Megatron's segment ids through cuDNN's packed layout (the same array for queries and keys, as the
    model passes them): output and gradients against the reference, grouped-query heads, two rows of
    different documents (one ending at the last token, one-token documents)."""
    c = Case("bf16-packed", sq=512, heads=4, kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
    (q, k, v), do, _, kw = _inputs(c)
    q, k, v, do = (jnp.concatenate([a, a[:, ::-1]]) for a in (q, k, v, do))
    eod = np.zeros((2, 512), bool)
    eod[0, [99, 100, 300, 511]] = True
    eod[1, [0, 1, 2]] = True
    ids = jnp.asarray(np.concatenate([np.zeros((2, 1), np.int32), np.cumsum(eod[:, :-1], 1)], 1), jnp.int32)

    def run(fn):
        def loss(q, k, v):
            out = fn(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
            return jnp.sum(out.astype(jnp.float32) * do), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, out), grads = run(lambda *a, **kw_: dispatch.attention(*a, impl="cudnn", max_documents=bound, **kw_))
    (_, r_out), r_grads = run(reference.attention)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (r_out, *r_grads)):
        _assert_close(name, got, want, TOL[c.dtype])


# ----------------------------------------------------------------------------- attention sinks


def _sink_grads(fn, qkv, sinks, do, dlse, kw):
    """Output, lse and the gradients of q, k, v and the sinks of ``fn(q, k, v, sinks=..., return_lse=True, **kw)``."""
    def loss(q, k, v, s):
        out, lse = fn(q, k, v, sinks=s, return_lse=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * do) + jnp.sum(lse * dlse), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*qkv, sinks)
    return out, lse, grads


SINK_CASES = [Case("sinks-causal-gqa-window", sq=128, heads=4, kv_heads=2, window=40, blocks=SMALL),
              Case("sinks-positions-mqa", sq=64, sk=192, heads=4, kv_heads=1, positions=True, blocks=SMALL)]


def test_reference_sinks_are_a_softmax_logit():
    """The reference's sinks against the softmax of the scores with each head's sink logit as one more column,
    which takes no value (transformers' gpt-oss eager attention), on a causal grouped-query case."""
    (q, k, v), *_ = _inputs(Case("x", sq=16, heads=4, kv_heads=2, head_dim=16))
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    ks, vs = (jnp.repeat(a, 2, axis=2) for a in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, ks) / 4.0
    scores = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), scores, -jnp.inf)
    logits = jnp.concatenate([scores, jnp.broadcast_to(sinks[None, :, None, None], (1, 4, 16, 1))], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)[..., :-1]
    want = jnp.einsum("bhqk,bkhd->bqhd", probs, vs)
    _assert_close("out", reference.attention(q, k, v, sinks=sinks), want, 1e-6)


@pytest.mark.parametrize("impl", ["pallas", "triton"])
@pytest.mark.parametrize("case", SINK_CASES, ids=str)
def test_sinks_through_each_kernel_match_the_reference(impl, case):
    """Attention sinks on a flash kernel (its output merged with them by its log-sum-exp: ``merge_sinks``) against
    the reference's softmax, output, lse and the gradients of q, k, v and the sinks (Pallas interpreted on CPU;
    jax-triton needs a GPU: skipped without one)."""
    if impl == "triton" and not ON_GPU:
        pytest.skip("jax_triton needs a GPU")
    qkv, do, dlse, kw = _inputs(case)
    sinks = jax.random.normal(jax.random.key(7), (case.heads,))
    got = _sink_grads(lambda *a, **k: dispatch.attention(*a, impl=impl, **k), qkv, sinks, do, dlse, kw)
    with jax.default_matmul_precision("highest"):
        want = _sink_grads(reference.attention, qkv, sinks, do, dlse, kw)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (*got[:2], *got[2]), (*want[:2], *want[2])):
        _assert_close(name, g, w, 1e-5)
    assert np.abs(np.asarray(got[2][3])).max() > 1e-3  # the sinks' gradient is not vacuous


# ----------------------------------------------------------------------------- dispatch


def test_impls_match_config_choices():
    assert dispatch.CHOICES == ("auto", *dispatch.IMPLS)
    assert set(dispatch.CHOICES) == set(jaxllm_config.choices("model.attention_impl"))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU rules")
def test_dispatch_on_cpu():
    assert hardware.backend_kind() == "cpu"
    assert dispatch.available_impls() == ["xla", "pallas"]
    assert dispatch.resolve_impl("auto") == "xla"
    (q, k, v), *_ = _inputs(Case("x", sq=32, heads=2, kv_heads=1, head_dim=16))
    np.testing.assert_array_equal(dispatch.attention(q, k, v, impl="xla"), reference.attention(q, k, v))
    # the bound implementation the model calls: the same function
    np.testing.assert_array_equal(dispatch.Implementation("pallas")(q, k, v),
                                  dispatch.attention(q, k, v, impl="pallas"))
    assert not dispatch.Implementation().flash and dispatch.Implementation("pallas").flash
    with pytest.raises(ValueError, match=r"auto is decided once, by resolve_impl"):  # never below resolve()
        dispatch.attention(q, k, v, impl="auto")
    np.testing.assert_allclose(dispatch.attention(q, k, v, impl="pallas"), reference.attention(q, k, v), atol=1e-5)
    with pytest.raises(ValueError, match=r"'cudnn' is not available on the cpu backend: cuDNN exists only on NVIDIA"
                                         r".*Available here: auto, xla, pallas"):
        dispatch.attention(q, k, v, impl="cudnn")
    with pytest.raises(ValueError, match=r"'triton' is not available on the cpu backend: jax_triton"):
        dispatch.attention(q, k, v, impl="triton")
    with pytest.raises(ValueError, match=r"'flash' is unknown; choose one of auto, xla, cudnn, pallas, triton"):
        dispatch.attention(q, k, v, impl="flash")


def test_dispatch_rules_per_backend_kind():
    assert dispatch.resolve_impl("auto", "cuda") == "cudnn"
    assert dispatch.resolve_impl("auto", "cuda", sinks=True) == "pallas"  # jax's cuDNN attention takes no sinks
    assert dispatch.resolve_impl("auto", "rocm") == "pallas"
    assert dispatch.resolve_impl("auto", "tpu") == "xla"
    # every caller that has the model (resolve, check_config, tune's GPU attention, a layout's candidate) takes
    # its sinks into account: auto with sinks on an NVIDIA GPU is Pallas, the config check then passes
    sinks = jaxllm_config.Config()
    sinks.model.softmax_type, sinks.model.attention_impl = "learnable", "auto"
    assert dispatch.model_impl(sinks.model, "cuda") == dispatch.model_impl(sinks.model, "cuda", "auto") == "pallas"
    dispatch.check_config(sinks, "cuda")
    assert layouts.candidate_of(sinks, dict.fromkeys(jaxllm_config.MESH_AXES, 1), "cuda").attention == "pallas"
    sinks.model.softmax_type = "vanilla"
    assert layouts.candidate_of(sinks, dict.fromkeys(jaxllm_config.MESH_AXES, 1), "cuda").attention == "cudnn"
    cuda, rocm = dispatch.available_impls("cuda"), dispatch.available_impls("rocm")
    assert cuda[:3] == ["xla", "cudnn", "pallas"] and rocm[:2] == ["xla", "pallas"] and "cudnn" not in rocm
    assert dispatch.available_impls("tpu") == ["xla"]
    with pytest.raises(ValueError, match="'cudnn' is not available on the rocm backend.*Available here: auto, xla"):
        dispatch.resolve_impl("cudnn", "rocm")
    if not triton_attention.available()[0]:
        assert "triton" not in cuda
        with pytest.raises(ValueError, match="'triton' is not available on the cuda backend: jax_triton"):
            dispatch.resolve_impl("triton", "cuda")


def test_cudnn_falls_back_to_pallas_where_it_differs(monkeypatch):
    """Calls cuDNN cannot express exactly go to the Pallas kernel (interpret mode here)."""
    c = Case("fallback", sq=64, heads=2, kv_heads=1, segments=(20, 44), dtype=jnp.bfloat16)
    qkv, _, _, kw = _inputs(c)
    base = dict(causal=True, q_segment_ids=None, kv_segment_ids=None, window=None, q_positions=None,
                kv_positions=None, return_lse=False)
    q, k = qkv[0], qkv[1]
    ids = kw["q_segment_ids"]
    assert dispatch.cudnn_unsupported(q, k, **base) is None
    assert "return_lse" in dispatch.cudnn_unsupported(q, k, **{**base, "return_lse": True})
    assert "different query and key segment ids" in dispatch.cudnn_unsupported(
        q, k, **{**base, "q_segment_ids": ids, "kv_segment_ids": ids + 0})
    assert "window with segment ids" in dispatch.cudnn_unsupported(
        q, k, **{**base, "q_segment_ids": ids, "kv_segment_ids": ids, "window": 8})
    assert "without data.max_documents_per_sample" in dispatch.cudnn_unsupported(
        q, k, **{**base, "q_segment_ids": ids, "kv_segment_ids": ids})
    assert "before Hopper" in dispatch.cudnn_unsupported(  # this CPU has no compute capability
        q, k, **{**base, "q_segment_ids": ids, "kv_segment_ids": ids, "max_documents": 2})
    assert "positions" in dispatch.cudnn_unsupported(q, k, **{**base, "q_positions": jnp.zeros((1, 64), int)})
    assert "dtype" in dispatch.cudnn_unsupported(q.astype(jnp.float32), k, **base)
    assert "q_len != kv_len" in dispatch.cudnn_unsupported(q[:, :32], k, **base)
    assert "window without causal" in dispatch.cudnn_unsupported(q, k, **{**base, "causal": False, "window": 8})
    calls = []
    monkeypatch.setattr(dispatch, "_pallas", lambda *a, **kw_: calls.append(1) or pa.flash_attention(*a, **kw_))
    out, lse = dispatch.IMPLS["cudnn"](*qkv, return_lse=True, q_positions=None, kv_positions=None, **kw)
    assert calls
    r_out, r_lse = reference.attention(*qkv, return_lse=True, **kw)
    _assert_close("out", out, r_out, 2e-2)
    _assert_close("lse", lse, r_lse, 1e-5)


def _runs(ids):
    """(lengths, offsets) of the runs of equal ids in one row, by a plain loop."""
    starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]]
    return [e - b for b, e in zip(starts, starts[1:] + [len(ids)])], starts


def _eod_ids(rows, eod=0):
    """Megatron's segment ids (data.reset_attention_mask) of token rows, EOD token ``eod``."""
    from jaxllm.data.loader import document_masks
    return document_masks(np.array(rows, np.int32), eod, False, True, False)[1]


PACKED = {  # name -> segment ids [batch, seq]
    "one document; a document per token": np.array([[3] * 8, list(range(8))]),
    "uneven; a document ending at the last token": _eod_ids([[5, 0, 7, 7, 7, 0, 9, 0], [7, 7, 7, 7, 7, 7, 0, 0]]),
    "EODs padding the end; a one-token first document": _eod_ids([[7, 7, 0, 0, 0, 0, 0, 0], [0, 7, 7, 7, 0, 7, 7, 7]]),
}


@pytest.mark.parametrize("name", PACKED)
def test_packed_segments_are_the_segment_mask_cudnn_is_given(name):
    """:func:`packed_segments` against a plain loop over each row's runs, and the token ranges cuDNN reads
    (jax's own conversion to cuDNN's flattened element offsets, ``_fix_seqlen_offsets``) give exactly the
    reference's segment mask (causal and full) for Megatron's segment ids."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    ids = jnp.asarray(PACKED[name], jnp.int32)
    b, s = ids.shape
    lengths, offsets = dispatch.packed_segments(ids)
    assert lengths.shape == (b, s) and offsets.shape == (b, s + 1) and lengths.dtype == offsets.dtype == jnp.int32
    most = max(len(_runs(list(row))[0]) for row in np.asarray(ids))  # data.max_documents_per_sample, exactly
    bounded = dispatch.packed_segments(ids, most)
    np.testing.assert_array_equal(bounded[0], lengths[:, :most])
    np.testing.assert_array_equal(bounded[1], np.concatenate([offsets[:, :most], -np.ones((b, 1), int)], 1))
    for row, (got_len, got_off) in enumerate(zip(np.asarray(lengths), np.asarray(offsets))):
        want_len, want_off = _runs(list(np.asarray(ids[row])))
        n = len(want_len)
        assert list(got_len[:n]) == want_len and list(got_off[:n]) == want_off, (row, got_len, got_off)
        assert (got_len[n:] == -1).all() and (got_off[n:] == -1).all(), (row, got_len, got_off)
    heads, d = 2, 8
    q = jnp.zeros((b, s, heads, d), jnp.bfloat16)
    cu_len, _, cu_off, _ = fa._fix_seqlen_offsets(lengths, lengths, offsets, offsets, q, q)
    doc = np.full(b * s, -1)  # document of each flattened token, from cuDNN's (element offset, length) pairs
    for j, (o, n) in enumerate(zip(np.asarray(cu_off).ravel(), np.asarray(cu_len).ravel())):
        if n > 0:
            doc[o // (heads * d):o // (heads * d) + n] = j
    doc = doc.reshape(b, s)
    assert (doc >= 0).all()
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    for causal in (True, False):
        want = reference.attention_mask(pos, pos, causal=causal, q_segment_ids=ids, kv_segment_ids=ids)
        got = reference.attention_mask(pos, pos, causal=causal, q_segment_ids=doc, kv_segment_ids=doc)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------- benchmark


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(ROOT, "benchmarks", "attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_flop_counting():
    fwd, total = _bench_module().flops(2, 1024, 16, 128, causal=False)
    assert fwd == 4 * 2 * 1024 * 1024 * 16 * 128 and total == 3.5 * fwd
    assert _bench_module().flops(2, 1024, 16, 128, causal=True)[0] == fwd // 2


def test_benchmark_runs_on_cpu(tmp_path):
    out_file = tmp_path / "attention.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "attention.py"), "--seqs", "256", "--impls", "xla",
           "--heads", "2", "--iters", "1", "--warmup", "1", "--check", f"--output={out_file}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "| seq | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |" in out
    assert "backward = 2.5 x forward" in out
    row = [line for line in out.splitlines() if line.startswith("| 256 | xla |")]
    assert row and "error" not in row[0], out
    (rec,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert (rec["impl"], rec["seq"], rec["heads"], rec["device"]) == ("xla", 256, 2, "cpu")
    fwd, total = _bench_module().flops(1, 256, 2, 128, causal=True)
    assert rec["fwd_tflops"] == pytest.approx(fwd / rec["fwd_s"] / 1e12)
    assert rec["fwd_bwd_tflops"] == pytest.approx(total / rec["fwd_bwd_s"] / 1e12)
    assert f"{rec['fwd_tflops']:.2f}" in row[0] and rec["command"].startswith("python benchmarks/attention.py")


def test_benchmark_tunes_the_pallas_tiles(monkeypatch, capsys):
    """``--tune`` (interpret mode here, two candidates a stage, one of them not a tile the kernel takes): each
    candidate's record with its tiles, the broken one with its error, and the fastest printed."""
    mod = _bench_module()
    monkeypatch.setattr(mod, "FWD_GRID", [dict(block_q=48), dict(block_q=64, block_k=64)])
    monkeypatch.setattr(mod, "BWD_GRID", [dict(block_q_dkv=32, block_k_dkv=64), dict(block_q_dkv=64, block_k_dkv=64)])
    monkeypatch.setattr(sys, "argv", ["attention.py", "--tune", "--seqs", "128", "--heads", "2", "--iters", "1",
                                      "--warmup", "0"])
    records = mod.tune(mod._parse())
    assert [r["tune"] for r in records] == ["fwd", "fwd", "bwd", "bwd"]
    assert "power of two" in records[0]["error"] and "fwd_tflops" not in records[0]
    assert records[1]["block_sizes"]["block_q"] == 64 and "fwd_bwd_tflops" not in records[1]
    for r in records[2:]:  # the backward candidates start from the forward's only working one
        assert (r["block_sizes"]["block_q"], r["block_sizes"]["block_k"]) == (64, 64)
        assert r["bwd_tflops"] == pytest.approx(2.5 * r["fwd_tflops"] * r["fwd_s"] / (r["fwd_bwd_s"] - r["fwd_s"]))
    best = min(records[2:], key=lambda r: r["fwd_bwd_s"])["block_sizes"]
    assert f"interpret head_dim=128 seq=128: BlockSizes(block_q=64, block_k=64, block_q_dkv={best['block_q_dkv']}" \
        in capsys.readouterr().out
