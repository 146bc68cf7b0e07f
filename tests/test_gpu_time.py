"""The GPU step-time model (jaxllm.analysis.gpu_time) and its fit (jaxllm.analysis.gpu_fit).

* what the census reads off a program: a loop body's kernels times its trip count, a GEMM's ``2 m n k``, cuDNN
  attention's causal FLOPs, a slice's bytes through bitcasts, a collective's ring traffic; each against the
  numbers worked out by hand from the shapes;
* the constants in the source are what the fit gives on the committed traces: the kernel constants on the H100's
  of 2026-11-26, the H200's bandwidth factor on the H200's of 2026-11-27 (its kernels outside the optimizer);
* on a committed (HLO, trace) pair the model reproduces the step and every category above 5 % of it within
  the issue's bounds (10 % and 25 %): a pair of the fit (the only traced steps of a program that still
  exists; the held-out H200 step's padded gradients are benchmarks/step_time_check.py's record).
"""

import json
import os

import pytest

from jaxllm.analysis import gpu_fit, gpu_time, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "benchmarks", "results", "2026-11-26-h100")
H200 = os.path.join(ROOT, "benchmarks", "results", "2026-11-27-h200")
TRACES = [("call1.jsonl", 0, "call1-GPT1_5B-full-micro4"), ("call2.jsonl", 0, "call2-GPT1_5B-full-micro4"),
          ("call2.jsonl", 1, "call2-GPT1_5B-full-micro8"), ("call2.jsonl", 2, "call2-GPT1_5B-save_dots-micro8")]

PROGRAM = """HloModule jit_train_step

%fused_slice (p0: f32[12,256,512], p1: s32[]) -> bf16[256,512] {
  %p0 = f32[12,256,512]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %b = f32[512,12,256]{2,1,0} bitcast(%p0)
  %c = s32[] constant(0)
  %dynamic-slice.1 = f32[512,1,256]{2,1,0} dynamic-slice(%b, %c, %p1, %c), dynamic_slice_sizes={512,1,256}
  %cv = bf16[512,1,256]{2,1,0} convert(%dynamic-slice.1)
  ROOT %r = bf16[256,512]{1,0} bitcast(%cv)
}

%fused_gelu (p0: bf16[1024,512]) -> bf16[1024,512] {
  %p0 = bf16[1024,512]{1,0} parameter(0)
  %t = bf16[1024,512]{1,0} tanh(%p0)
  ROOT %m = bf16[1024,512]{1,0} multiply(%p0, %t)
}

%body (arg: (s32[], bf16[1024,256], f32[12,256,512])) -> (s32[], bf16[1024,256], f32[12,256,512]) {
  %arg = (s32[], bf16[1024,256], f32[12,256,512]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[1024,256]{1,0} get-tuple-element(%arg), index=1
  %w = f32[12,256,512]{2,1,0} get-tuple-element(%arg), index=2
  %loop_convert_fusion = bf16[256,512]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %custom-call.1 = (bf16[1024,512]{1,0}, s8[4194304]{0}) custom-call(%x, %loop_convert_fusion), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %y = bf16[1024,512]{1,0} get-tuple-element(%custom-call.1), index=0
  %loop_multiply_fusion = bf16[1024,512]{1,0} fusion(%y), kind=kLoop, calls=%fused_gelu
  ROOT %t = (s32[], bf16[1024,256], f32[12,256,512]) tuple(%i, %x, %w)
}

%cond (arg: (s32[], bf16[1024,256], f32[12,256,512])) -> pred[] {
  %arg = (s32[], bf16[1024,256], f32[12,256,512]) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: bf16[1024,256], w: f32[12,256,512], q: bf16[2,512,4,64], g: f32[4096]) -> f32[4096] {
  %x = bf16[1024,256]{1,0} parameter(0)
  %w = f32[12,256,512]{2,1,0} parameter(1)
  %q = bf16[2,512,4,64]{3,2,1,0} parameter(2)
  %g = f32[4096]{0} parameter(3)
  %z = s32[] constant(0)
  %init = (s32[], bf16[1024,256], f32[12,256,512]) tuple(%z, %x, %w)
  %while.1 = (s32[], bf16[1024,256], f32[12,256,512]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %fmha = (bf16[2,4,512,64]{3,1,2,0}, f32[2,4,512]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "512", "512"]}, "mask_type": "CAUSAL"}}
  %all-reduce-start = f32[4096]{0} all-reduce-start(%g), replica_groups={{0,1,2,3}}, to_apply=%cond
  ROOT %all-reduce-done = f32[4096]{0} all-reduce-done(%all-reduce-start)
}
"""  # noqa: E501


def test_census_reads_the_work_of_each_kernel():
    kernels = {k.name: k for k in gpu_time.census(PROGRAM, {"data": 4})}
    gemm = kernels["custom-call.1"]
    assert (gemm.kind, gemm.runs, gemm.flops) == ("gemm", 12, 2 * 1024 * 512 * 256)
    # one layer's float32 slice read (through a bitcast), its bfloat16 copy written; and the int32 index
    assert kernels["loop_convert_fusion"].bytes == 256 * 512 * (4 + 2) + 4
    gelu = kernels["loop_multiply_fusion"]
    assert (gelu.kind, gelu.ops) == ("loop", 1024 * 512 * (4 + 1))  # a tanh counts 4, a multiply 1
    attention = kernels["fmha"]  # causal: each query sees half the keys on average
    assert (attention.kind, attention.runs, attention.flops) == ("attention_fwd", 1, 4 * 2 * 4 * 512 * 256 * 64)
    reduce = kernels["all-reduce-start"]
    kind, axes, n, size, wire, hops = reduce.collective
    assert (kind, axes, n, size, wire, hops) == ("all-reduce", ("data",), 4, 4096 * 4, 2 * 3 / 4 * 4096 * 4, 6)
    assert set(kernels) == {"custom-call.1", "loop_convert_fusion", "loop_multiply_fusion", "fmha",
                            "all-reduce-start"}


def test_a_collective_takes_a_ring_over_nvlink():
    c = ("all-reduce", ("data",), 8, 2**30, 2 * 7 / 8 * 2**30, 14)
    dev = gpu_time.device("H100")
    nccl = gpu_time.NCCL
    rate = 450e9 * nccl["efficiency"] * 2**30 / (2**30 + nccl["half_bytes"])
    assert gpu_time.collective_time(c, dev, {"data": 8}) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * 2**30 / rate)
    off = gpu_time.collective_time(c, dev, {"data": 16})  # 16 GPUs: the ring leaves the node, InfiniBand
    assert off == pytest.approx(14 * 10e-6 + 2 * 7 / 8 * 2**30 / (50e9 * nccl["efficiency"] * 2**30 /
                                                                   (2**30 + nccl["half_bytes"])))


def _steps():
    out = []
    for name, line, prefix in TRACES:
        with open(os.path.join(H100, name), encoding="utf-8") as f:
            record = json.loads(f.read().splitlines()[line])
        out.append((*gpu_fit.load(os.path.join(H100, prefix)), record["step_time_s"]))
    return out


def test_the_fit_gives_the_constants_of_the_source():
    assert gpu_fit.fit(_steps()) == gpu_time.FITTED


def test_the_h200_bandwidth_factor_is_its_traces_fit():
    """The H200's kernels outside its padded optimizer reach less of the datasheet's bandwidth than the H100's:
    the factor in the source is the fit's, below 1, and an H200 is priced with it (an H100 with none)."""
    with open(os.path.join(H200, "call1.jsonl"), encoding="utf-8") as f:
        step = json.loads(f.read().splitlines()[2])["step_time_s"]
    steps = [(*gpu_fit.load(os.path.join(H200, "call1-GPT1_5B-none-micro8-unrolled")), step)]
    factor = gpu_fit.bandwidth(steps, "H200", skip=("optimizer",))
    assert gpu_time.BANDWIDTH == {"H200": factor} and 0.5 < factor < 1
    assert gpu_time.device("H200").bandwidth == pytest.approx(4.8e12 * factor)
    assert gpu_time.device("H100").bandwidth == 3.35e12


def test_a_traced_step_and_its_categories_are_reproduced():
    hlo_text, trace, step = _steps()[-1]  # GPT1_5B, micro batch 8 of 8, save_dots, H100 (call 2)
    measured = {r["category"]: r["ms_per_step"] / 1e3 for r in
                profile.summary(profile.kernels(trace), profile.program(hlo_text), 2, step)}
    predicted = gpu_time.predict(gpu_time.census(hlo_text), gpu_time.device("H100"))
    assert predicted["step_s"] == pytest.approx(step, rel=0.10)
    big = {c for c, t in measured.items() if t > 0.05 * step}
    assert big == {"gemm", "elementwise", "attention", "copy"}
    for category in big:
        assert predicted["categories"][category] == pytest.approx(measured[category], rel=0.25), category
