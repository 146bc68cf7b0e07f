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


SCHEDULED = """HloModule jit_train_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (arg: (s32[], bf16[2048,4096], bf16[512,4096])) -> (s32[], bf16[2048,4096], bf16[512,4096]) {
  %arg = (s32[], bf16[2048,4096], bf16[512,4096]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[2048,4096]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[512,4096]{1,0} get-tuple-element(%arg), index=2
  %all-gather-start = ((bf16[512,4096]{1,0}), bf16[4096,4096]{1,0}) all-gather-start(%w), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":false}}
  %gemm.1 = (bf16[2048,4096]{1,0}, s8[4194304]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %all-gather-done = bf16[4096,4096]{1,0} all-gather-done(%all-gather-start)
  %y = bf16[2048,4096]{1,0} get-tuple-element(%gemm.1), index=0
  ROOT %t = (s32[], bf16[2048,4096], bf16[512,4096]) tuple(%i, %y, %w)
}

%cond (arg: (s32[], bf16[2048,4096], bf16[512,4096])) -> pred[] {
  %arg = (s32[], bf16[2048,4096], bf16[512,4096]) parameter(0)
  ROOT %p = pred[] constant(true)
}

%scatter (g: f32[8388608]) -> f32[1048576] {
  %g = f32[8388608]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[1048576]{0} reduce-scatter(%g), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: bf16[2048,4096], w: bf16[512,4096], g: f32[8388608], h: f32[16], x2: bf16[16384,4096]) -> (f32[1048576], f32[16]) {
  %x = bf16[2048,4096]{1,0} parameter(0)
  %x2 = bf16[16384,4096]{1,0} parameter(4)
  %w = bf16[512,4096]{1,0} parameter(1)
  %g = f32[8388608]{0} parameter(2)
  %h = f32[16]{0} parameter(3)
  %z = s32[] constant(0)
  %init = (s32[], bf16[2048,4096], bf16[512,4096]) tuple(%z, %x, %w)
  %while.1 = (s32[], bf16[2048,4096], bf16[512,4096]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %async-start = ((f32[8388608]{0}), f32[1048576]{0}) async-start(%g), calls=%scatter, backend_config={"collective_backend_config":{"is_sync":false}}
  %all-reduce-start = ((f32[16]{0}), f32[16]{0}) all-reduce-start(%h), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %gemm.2 = (bf16[16384,4096]{1,0}, s8[4194304]{0}) custom-call(%x2, %x), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %async-done = f32[1048576]{0} async-done(%async-start)
  %all-reduce.9 = ((f32[16]{0}), f32[16]{0}) all-reduce-start(%h), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  %all-reduce-done.9 = f32[16]{0} all-reduce-done(%all-reduce.9)
  %gemm.3 = (bf16[2048,4096]{1,0}, s8[4194304]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %all-reduce-done = f32[16]{0} all-reduce-done(%all-reduce-start)
  ROOT %r = (f32[1048576], f32[16]) tuple(%async-done, %all-reduce-done.9)
}
"""  # noqa: E501


def test_collectives_are_priced_where_the_schedule_places_them():
    """Worked by hand from the kernels' prices: in the loop (3 trips) each all-gather flies under one GEMM and
    leaves the rest exposed; after it the reduce-scatter and then the all-reduce queue on the network while a
    GEMM runs; a synchronous all-reduce (a start and done XLA marked ``is_sync``, while the other is in flight)
    holds the kernels' stream for its whole time.  The predicted step is the
    kernels, the gaps and what the collectives leave exposed, and the same program with every collective counted
    whole is slower by what the schedule hides."""
    mesh = {"fsdp": 8}
    kernels = gpu_time.census(SCHEDULED, mesh)
    dev = gpu_time.device("H100")
    price = {k.name: gpu_time.kernel_time(k, dev, mesh) for k in kernels}
    gap = gpu_time.FITTED["gap"]["overhead_s"]
    gemm, big, gather, scatter = price["gemm.1"], price["gemm.2"], price["all-gather-start"], price["reduce-scatter.1"]
    small, sync = price["all-reduce-start"], price["all-reduce.9"]
    assert gather > gemm + gap > 0 and scatter + small < big  # one exposed in part, the others hidden
    timeline = gpu_time.timeline(SCHEDULED, kernels, dev, mesh)
    by = {tr.name: tr for tr in timeline["transfers"]}
    assert set(by) == {"all-gather-start", "reduce-scatter.1", "all-reduce-start", "all-reduce.9"}
    g = by["all-gather-start"]  # starts after its launch gap; the GEMM's gap and run beside it
    assert (g.runs, g.asynchronous, g.kernels_between) == (3, True, 3)
    assert g.time_s == pytest.approx(3 * gather)
    assert g.overlapped_s == pytest.approx(3 * (gap + gemm))
    assert g.exposed_s == pytest.approx(3 * (gather - gap - gemm))
    s, a = by["reduce-scatter.1"], by["all-reduce-start"]
    assert (s.kind, s.axes, s.bytes, s.exposed_s) == ("reduce-scatter", ("fsdp",), 8388608 * 4, 0.0)
    # queued behind the scatter, hidden; the synchronous all-reduce started and done while it is in flight
    assert a.exposed_s == 0.0 and a.overlapped_s == pytest.approx(gap + big + gap + sync + gap + gemm)
    assert s.kernels_between == 2 and a.kernels_between == 3
    w = by["all-reduce.9"]
    assert (w.asynchronous, w.exposed_s, w.hidden_s) == (False, pytest.approx(sync), pytest.approx(0.0))
    launches = 3 * 2 + 5  # a gather and a GEMM per trip; the scatter, two all-reduces and two GEMMs
    exposed = 3 * (gather - gap - gemm) + sync
    assert timeline["step_s"] == pytest.approx(launches * gap + 4 * gemm + big + exposed)
    predicted = gpu_time.predict(kernels, dev, mesh, hlo_text=SCHEDULED)
    assert predicted["step_s"] == pytest.approx(timeline["step_s"])
    assert predicted["exposed_communication_s"] == pytest.approx(exposed)
    assert predicted["communication_s"] == pytest.approx(3 * gather + scatter + small + sync)
    assert predicted["communication"]["fsdp"]["exposed_s"] == pytest.approx(exposed)
    serial = gpu_time.predict(kernels, dev, mesh)  # no schedule: every collective whole
    assert serial["step_s"] - predicted["step_s"] == pytest.approx(predicted["communication_s"] - exposed)


PALLAS = """HloModule jit_train_step, is_scheduled=true

ENTRY %main (q: bf16[1,2048,16,64], x: bf16[2048,4096]) -> (bf16[1,2048,16,64], bf16[2048,4096]) {
  %q = bf16[1,2048,16,64]{3,2,1,0} parameter(0)
  %x = bf16[2048,4096]{1,0} parameter(1)
  %custom-call.7 = bf16[1,2048,16,64]{3,2,1,0} custom-call(%q, %q, %q), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = "jaxllm_flash_fwd", num_warps = 4 : i32}
  %gemm.1 = (bf16[2048,4096]{1,0}, s8[4194304]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %y = bf16[2048,4096]{1,0} get-tuple-element(%gemm.1), index=0
  ROOT %r = (bf16[1,2048,16,64], bf16[2048,4096]) tuple(%custom-call.7, %y)
}
"""  # noqa: E501


def test_a_kernel_the_model_cannot_price_or_a_step_above_the_peak_gets_no_prediction():
    """A Pallas attention kernel (a Triton custom call that is no GEMM) has no cost in the model: its time would be
    missing, so the report and the plan's record say why instead of a step; a priced program whose model FLOPs
    would need more than the peak is refused too, and one within it is printed."""
    kernels = {k.name: k for k in gpu_time.census(PALLAS)}
    assert kernels["custom-call.7"].kind == "unpriced" and kernels["gemm.1"].kind == "gemm"
    predicted = gpu_time.predict(list(kernels.values()), gpu_time.device("H100"), hlo_text=PALLAS)
    assert predicted["unpriced"] == {"custom-call.7": 1}
    why = gpu_time.refusal(predicted, 1.0, 1, "H100")
    assert why == "no step predicted: 1 kernel runs a step the model cannot price (custom calls: custom-call.7 x1)"
    text = gpu_time.report(predicted, "H100", 2048, 1.0)
    assert why in text and "tokens/s" not in text and "%" not in text  # no share of a step it withholds
    priced = gpu_time.predict([kernels["gemm.1"]], gpu_time.device("H100"))
    peak = gpu_time.device("H100").peaks["bf16"] * priced["step_s"]  # FLOPs at 100 % MFU in that step
    assert gpu_time.refusal(priced, 0.99 * peak, 1, "H100") is None
    assert "MFU of 150%, above the peak" in gpu_time.refusal(priced, 1.5 * peak, 1, "H100")
    assert "MFU 99.0%" in gpu_time.report(priced, "H100", 2048, 0.99 * peak)
