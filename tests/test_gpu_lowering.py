"""Every GPU path, checked on this CPU machine: lowered for NVIDIA (``cuda``) and AMD (``rocm``) with
``jax.export``, and the Pallas kernels' Triton IR compiled to machine code (sm_80, sm_90, gfx90a).

* Pallas flash attention, forward and backward, over the features (causal/full, GQA/MQA, segment
  ids, window, explicit positions, uneven lengths, bfloat16/float16/float32, head_dim 64/128):
  exactly the three Triton kernels, with the GPU family's tiles, warps, stages and grid;
* cuDNN attention (``cuda``): the cuDNN fused-attention calls, forward and backward (packed
  documents too, for Hopper), and the Pallas fallback where cuDNN cannot express the call;
  refused for ``rocm``;
* the whole train step of a small GPT with ``attention_impl`` ``pallas`` and ``cudnn``, on one
  device and on 8-device meshes (FSDP x tensor, and ring sequence parallelism), exported in a
  subprocess (``tests/gpu_lowering_steps.py``) because the CPU device count is fixed at start-up;
* the Triton compiler (``triton`` package) turns the lowered kernels into sm_80/sm_90/gfx90a/gfx942 code
  within the shared-memory limit of each, without spills, with the target's matrix instructions
  (``benchmarks/triton_offline.py``).

A kernel change that cannot lower or compile for a GPU fails here, without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxllm.model import attention
from jaxllm_kernels import grouped_matmul, lowering
from jaxllm_kernels import pallas_attention as pa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("jaxllm_flash_fwd", "jaxllm_flash_bwd_dkdv", "jaxllm_flash_bwd_dq")
# jax asks the CUDA plugin for the cuDNN version while tracing; there is no plugin here, so the
# version is stated: 9.28, the cuDNN that `pip install ".[cuda]"` resolved on 2026-11-22 (jax-cuda12-plugin
# 0.10.2 requires nvidia-cudnn-cu12 >= 9.8, < 10); cudnnGetVersion() encodes it as 9 * 10000 + 28 * 100.
CUDNN_VERSION = 92800


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    dtype: object = jnp.bfloat16
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    sq: int = 256
    sk: int | None = None
    causal: bool = True
    window: int | None = None
    segments: bool = False
    positions: bool = False

    def __str__(self):
        return self.name


VARIANTS = [
    Variant("bf16-causal-gqa-d128", heads=8, kv_heads=2, head_dim=128),
    Variant("fp16-causal-d64", dtype=jnp.float16),
    Variant("bf16-full-mqa-segments-d64", kv_heads=1, causal=False, segments=True),
    Variant("fp16-causal-window-segments-d128", dtype=jnp.float16, head_dim=128, window=100, segments=True),
    Variant("bf16-uneven-200x328-window-gqa", heads=4, kv_heads=2, sq=200, sk=328, window=77),
    Variant("f32-positions-window-d64", dtype=jnp.float32, positions=True, window=64),
    Variant("bf16-full-d80-padded", heads=3, kv_heads=1, head_dim=80, causal=False),  # head_dim padded to 128
]


def _fwd_bwd(v: Variant, impl="pallas"):
    """(function of q, k, v, ids, returning the three gradients; its abstract arguments)."""
    sk = v.sk or v.sq

    def f(q, k, vv, qids, kids):
        kw = dict(causal=v.causal, window=v.window)
        if v.segments:
            kw.update(q_segment_ids=qids, kv_segment_ids=kids)
        if v.positions:
            kw.update(q_positions=qids, kv_positions=kids)

        def loss(q, k, vv):
            out = attention.attention(q, k, vv, impl=impl, **kw)
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, vv)

    args = [jax.ShapeDtypeStruct((2, v.sq, v.heads, v.head_dim), v.dtype),
            jax.ShapeDtypeStruct((2, sk, v.kv_heads, v.head_dim), v.dtype),
            jax.ShapeDtypeStruct((2, sk, v.kv_heads, v.head_dim), v.dtype),
            jax.ShapeDtypeStruct((2, v.sq), jnp.int32), jax.ShapeDtypeStruct((2, sk), jnp.int32)]
    return f, args


def expected_launches(v: Variant, family: str) -> dict[str, tuple[int, int, tuple[int, int, int]]]:
    """``{kernel: (num_warps, num_stages, grid)}`` the kernel must be launched with for ``family``."""
    sk = v.sk or v.sq
    d = max(16, pa._next_pow2(v.head_dim))
    bs = pa._resolve_blocks(None, None, None, v.sq, sk, d, family)
    pad = lambda n, blocks: -(-n // max(blocks)) * max(blocks)  # noqa: E731 - as flash_attention pads
    sq_p = pad(v.sq, (bs.block_q, bs.block_q_dkv, bs.block_q_dq))
    sk_p = pad(sk, (bs.block_k, bs.block_k_dkv, bs.block_k_dq))
    return {"jaxllm_flash_fwd": (bs.num_warps, bs.num_stages, (sq_p // bs.block_q, 2, v.heads)),
            "jaxllm_flash_bwd_dkdv": (bs.num_warps_bwd, bs.num_stages_bwd, (sk_p // bs.block_k_dkv, 2, v.kv_heads)),
            "jaxllm_flash_bwd_dq": (bs.num_warps_bwd, bs.num_stages_bwd, (sq_p // bs.block_q_dq, 2, v.heads))}


@pytest.mark.parametrize("platform", lowering.PLATFORMS)
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_pallas_flash_attention_lowers(platform, variant):
    f, args = _fwd_bwd(variant)
    with attention.lowering_target(platform):
        exported = lowering.export_for(f, args, platform)
    assert exported.platforms == (platform,)
    assert lowering.custom_call_targets(exported) == {lowering.TRITON_CALL: 3}
    kernels = lowering.triton_kernels(exported)
    assert [k.name for k in kernels] == list(NAMES)
    want = expected_launches(variant, attention.TARGET_FAMILY[platform])
    for k in kernels:
        assert (k.num_warps, k.num_stages, k.grid) == want[k.name], k.name
        ttir = k.ttir()
        assert f"tt.func public @{k.name}(" in ttir and "tt.dot" in ttir
        math = "__nv_" if platform == "cuda" else "__ocml_"  # each vendor's device math library
        assert math in ttir or "math.exp2" in ttir


def test_lowering_target_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="choose a kind of cuda, rocm"):
        with attention.lowering_target("tpu"):
            pass
    with pytest.raises(ValueError, match="family of hopper, ampere, cdna"):
        with attention.lowering_target("cuda", "volta"):
            pass
    assert attention.resolve_impl("auto") == "xla"  # outside the block: the real (CPU) backend again


@pytest.fixture
def cudnn_version(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: CUDNN_VERSION)


@pytest.mark.parametrize("variant", [Variant("bf16-causal-gqa-d128", heads=8, kv_heads=2, head_dim=128),
                                     Variant("fp16-causal-window-d64", dtype=jnp.float16, window=100)], ids=str)
def test_cudnn_lowers(variant, cudnn_version):
    f, args = _fwd_bwd(variant, impl="cudnn")
    with attention.lowering_target("cuda"):
        exported = lowering.export_for(f, args, "cuda")
    assert lowering.custom_call_targets(exported) == {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}


@pytest.mark.parametrize("kv_heads,bound", [(4, 256), (2, 8)], ids=["mha-bound-seq", "gqa-bound-8"])
def test_cudnn_lowers_packed_documents_for_hopper(kv_heads, bound, cudnn_version):
    """Segment ids (the same for queries and keys, as the model passes them) reach cuDNN as packed
    documents for Hopper with a bound on documents per row: its forward and backward with the lengths and
    offsets, no Triton kernel; before Hopper (jax's packed layout needs compute capability 9.0), or without a
    bound (cuDNN's statistics would grow with the sequence's square), they go to the Pallas kernel."""
    b, s, heads, d = 2, 256, 4, 64

    def f(q, k, v, ids, bound=bound):
        def loss(q, k, v):
            out = attention.attention(q, k, v, impl="cudnn", q_segment_ids=ids, kv_segment_ids=ids,
                                      max_documents=bound)
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct((b, s, heads, d), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((b, s, kv_heads, d), jnp.bfloat16)] * 2, jax.ShapeDtypeStruct((b, s), jnp.int32)]
    with attention.lowering_target("cuda", "hopper"):
        exported = lowering.export_for(f, args, "cuda")
    assert lowering.custom_call_targets(exported) == {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}
    text, m = exported.mlir_module(), bound
    # both calls take per row m document lengths and m + 1 offsets, K/V repeated to the query heads, and the
    # softmax statistics float32 [batch * m, heads, seq]
    for call in ("fmhaSoftmax(", "fmhaSoftmaxBackward("):
        line = next(x for x in text.splitlines() if f"@__cudnn${call}" in x)
        assert ((f"tensor<{b}x{s}x{heads}x{d}xbf16>, " * 3) in line
                and f"tensor<{b}x{m}xi32>, tensor<{b}x{m}xi32>, tensor<{b}x{m + 1}xi32>, tensor<{b}x{m + 1}xi32>)"
                in line and f"tensor<{b * m}x{heads}x{s}xf32>" in line
                and f"max_seg_per_batch\\22: {m}" in line), line[-600:]
    with attention.lowering_target("cuda", "ampere"):
        exported = lowering.export_for(f, args, "cuda")
    assert lowering.custom_call_targets(exported) == {lowering.TRITON_CALL: 3}
    with attention.lowering_target("cuda", "hopper"):
        exported = lowering.export_for(functools.partial(f, bound=None), args, "cuda")
    assert lowering.custom_call_targets(exported) == {lowering.TRITON_CALL: 3}


def test_cudnn_falls_back_to_pallas_and_is_refused_on_rocm(cudnn_version):
    f, args = _fwd_bwd(Variant("bf16-segments", segments=True), impl="cudnn")  # different q and kv ids
    with attention.lowering_target("cuda"):
        exported = lowering.export_for(f, args, "cuda")
    assert lowering.custom_call_targets(exported) == {lowering.TRITON_CALL: 3}
    f, args = _fwd_bwd(Variant("bf16"), impl="cudnn")
    with attention.lowering_target("rocm"), pytest.raises(ValueError, match="'cudnn' is not available on the rocm"):
        lowering.export_for(f, args, "rocm")


# ----------------------------------------------------------------------------- the train step


@pytest.fixture(scope="module")
def steps():
    """The train-step exports of tests/gpu_lowering_steps.py (8 fake CPU devices), by layout name."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_lowering_steps.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_train_step_lowers_on_one_device(steps):
    for platform, impl in (("cuda", "pallas"), ("cuda", "cudnn"), ("rocm", "pallas")):
        s = steps[f"{platform}-{impl}-1"]
        assert s["nr_devices"] == 1 and s["platforms"] == [platform]
        if impl == "pallas":
            # one layer scan: fwd in it, dk/dv and dq in its transpose
            assert s["calls"] == {lowering.TRITON_CALL: 3}, s
            assert s["kernels"] == sorted(NAMES)
        else:
            assert s["calls"] == {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}, s


def test_train_step_lowers_on_a_mesh(steps):
    for platform, impl in (("cuda", "pallas"), ("cuda", "cudnn"), ("rocm", "pallas")):
        s = steps[f"{platform}-{impl}-fsdp2-tensor2-data2"]
        assert s["nr_devices"] == 8 and s["manual"] >= 1, s  # the kernel runs per shard under shard_map
        assert all(f'"{axis}"=2' in s["mesh"] for axis in ("data", "fsdp", "tensor")), s
        assert s["sharded_inputs"] > 10, s  # parameters, optimizer state and batch split over the mesh
        want = {lowering.TRITON_CALL: 3} if impl == "pallas" else {"__cudnn$fmhaSoftmax": 1,
                                                                   "__cudnn$fmhaSoftmaxBackward": 1}
        assert s["calls"] == want, s
    ring = steps["cuda-pallas-ring2-tensor2-data2"]  # ring attention: the kernel per step, with its lse
    assert ring["nr_devices"] == 8 and ring["manual"] >= 1 and ring["kernels"] == sorted(NAMES)
    assert '"sequence"=2' in ring["mesh"]
    assert ring["calls"][lowering.TRITON_CALL] > 3, ring
    assert all(not s["float8"] for name, s in steps.items() if "fp8" not in name)


def test_fp8_train_step_lowers_with_float8_matmul_operands(steps):
    """model.fp8: the exported step carries e4m3 (inputs, weights) and e5m2 (gradients) values, which
    XLA's GPU compiler turns into FP8 GEMMs; sharded as the bfloat16 step."""
    s = steps["cuda-cudnn-fp8-tensor2-data2"]
    assert s["nr_devices"] == 4 and s["sharded_inputs"] > 10, s
    assert s["float8"].get("f8E4M3FN", 0) > 0 and s["float8"].get("f8E5M2", 0) > 0, s


# ----------------------------------------------------------------------------- machine code


def _offline():
    path = os.path.join(ROOT, "benchmarks", "triton_offline.py")
    spec = importlib.util.spec_from_file_location("triton_offline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx90a", "gfx942"])
def test_pallas_kernels_compile_to_machine_code(target):
    """The Triton compiler turns the lowered kernels into GPU code within the architecture's shared memory,
    without a register spill (no spill store/load on NVIDIA, no spilled VGPR or SGPR and no scratch on AMD),
    with the target's matrix instructions: Hopper's ``wgmma`` on sm_90, ``mma.sync`` on sm_80, ``v_mfma`` on
    CDNA (a kernel whose products fall back to the ordinary cores fails here).

    GPT head size 64 and head size 128, bfloat16, the family's default tiles (``DEFAULT_BLOCK_SIZES``;
    docs/performance.md has the table)."""
    pytest.importorskip("triton", reason="the Triton compiler (pip install -e '.[test]' installs it on Linux)")
    mod = _offline()
    a = mod._parse(["--seq", "1024", "--heads", "4"])
    backend, _, _, family, platform, limit = mod.TARGETS[target]
    for d in (64, 128):
        kernels = mod.pallas_ttir(platform, family, a, d)
        assert sorted(kernels) == sorted(mod.KERNELS)
        bs = mod.tiles(family, d)
        for name, k in kernels.items():
            assert (k.num_warps, k.num_stages) == mod._launch(bs, name), (name, d)  # the table's launch
            res = mod.compile_pallas(k, target)
            assert 0 < res["smem"] <= limit, (name, d, res)
            assert 0 < res["regs"] <= (255 if backend == "cuda" else 512), (name, d, res)
            assert res["spill"] == 0 and res["scratch"] in (None, 0), (name, d, res)
            assert res["matrix"].get(mod.MATRIX[target], 0) > 0 and mod.problem(
                dict(res, target=target)) is None, (name, d, res)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx90a", "gfx942"])
def test_grouped_gemm_kernels_compile_to_machine_code(target):
    """The mixture of experts' grouped GEMM kernels (jaxllm_kernels.grouped_matmul: the product, its input and its
    weight gradient), lowered for a Qwen3-30B-A3B expert matmul (hidden 2048, FFN 768, 16 local experts), bfloat16,
    compile to the target's code within its shared memory, without spills, on its matrix instructions."""
    pytest.importorskip("triton", reason="the Triton compiler (pip install -e '.[test]' installs it on Linux)")
    mod = _offline()
    platform, limit = mod.TARGETS[target][4], mod.TARGETS[target][5]
    args = (jax.ShapeDtypeStruct((32768, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((16, 2048, 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((16,), jnp.int32))
    value = lambda x, w, g: grouped_matmul.gmm(x, w, g)  # noqa: E731
    grads = jax.grad(lambda x, w, g: value(x, w, g).astype(jnp.float32).sum(), (0, 1))
    kernels = [k for f in (value, grads) for k in lowering.triton_kernels(lowering.export_for(f, args, platform))]
    assert sorted(k.name for k in kernels) == ["jaxllm_grouped_matmul", "jaxllm_grouped_matmul_dw",
                                               "jaxllm_grouped_matmul_dx"]
    for k in kernels:
        res = mod.compile_pallas(k, target)
        assert 0 < res["smem"] <= limit and res["spill"] == 0 and res["scratch"] in (None, 0), (k.name, res)
        assert res["matrix"].get(mod.MATRIX[target], 0) > 0, (k.name, res)
