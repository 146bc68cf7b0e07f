"""jaxllm.analysis.profile: the categories of a real compiled step's operations, the per-step arithmetic of the
table, and ``jaxllm.bench --profile`` writing a trace."""

import glob
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxllm import bench, config
from jaxllm.analysis import profile
from jaxllm.runtime import flops
from jaxllm.runtime.run import Run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def step_hlo():
    """The optimized HLO of a tiny bfloat16 train step (2 micro batches, biases, tied embeddings)."""
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, dtype="bfloat16")
    c.train.update(seq_length=32, micro_batch_size=2, global_batch_size=4)
    cfg, _ = bench.prepare(c, 1)
    run = Run(cfg, devices=jax.devices()[:1])
    state = run.initial_state()
    tok = np.random.default_rng(0).integers(0, 256, (4, 33), dtype=np.int32)
    return run.train_step.lower(state, *run.global_batch(tok[:, :-1], tok[:, 1:])).compile().as_text()


def test_the_step_scopes_reach_the_compiled_program(step_hlo):
    prog = profile.program(step_hlo)
    cats = {name: profile.categorize(i) for name, i in prog.items() if i.kind is not None}
    names = [i.op_name for i in prog.values()]
    # the output layer and loss, forward and backward, and the optimizer are named in the program
    assert any("jvp(output_loss)" in n for n in names) and any("transpose(jvp(output_loss))" in n for n in names)
    assert any(prog[n].root == "dot" for n, c in cats.items() if c == "loss"), "the loss's matmuls are the loss's"
    assert sum(c == "optimizer" for c in cats.values()) >= 5
    # every layer matmul outside those scopes is a GEMM: q, k, v, out, up, down forward (6) and two gradients each
    # (12), at least, in the layer loop
    dots = [n for n, i in prog.items() if i.root == "dot" and n in cats and not profile._scope(i.op_name)]
    assert len(dots) >= 18 and all(cats[n] == "gemm" for n in dots)
    assert {"copy", "elementwise"} <= set(cats.values())


# A GPU program's instructions as XLA:GPU prints them, each kind the profiles meet
FUSED = """%fused_add (p0: bf16[4,2048,1536], p1: bf16[4,2048,1536]) -> bf16[4,2048,1536] {
  %p0 = bf16[4,2048,1536]{2,1,0} parameter(0)
  %p1 = bf16[4,2048,1536]{2,1,0} parameter(1)
  ROOT %add.1 = bf16[4,2048,1536]{2,1,0} add(%p0, %p1)
}

%fused_concatenate (p0: bf16[8192,1536], p1: bf16[8192,1536]) -> bf16[8192,3072] {
  %p0 = bf16[8192,1536]{1,0} parameter(0)
  %p1 = bf16[8192,1536]{1,0} parameter(1)
  ROOT %concatenate.1 = bf16[8192,3072]{1,0} concatenate(%p0, %p1), dimensions={1}
}

%fused_convert (p0: f32[48,1536,6144], p1: s32[]) -> bf16[1,1536,6144] {
  %p0 = f32[48,1536,6144]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %dynamic-slice.1 = f32[1,1536,6144]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,1536,6144}
  ROOT %convert.1 = bf16[1,1536,6144]{2,1,0} convert(%dynamic-slice.1)
}

%fused_stack (p0: f32[48,1536], p1: f32[1536], p2: s32[]) -> f32[48,1536] {
  %p0 = f32[48,1536]{1,0} parameter(0)
  %p1 = f32[1536]{0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %b = f32[1,1536]{1,0} bitcast(%p1)
  ROOT %dynamic-update-slice.1 = f32[48,1536]{1,0} dynamic-update-slice(%p0, %b, %p2, %c)
}

ENTRY %main (a: bf16[4,2048,1536], w: f32[48,1536,6144], g: f32[48,1536], d: f32[1536], i: s32[]) -> bf16[] {
  %a = bf16[4,2048,1536]{2,1,0} parameter(0)
  %w = f32[48,1536,6144]{2,1,0} parameter(1)
  %g = f32[48,1536]{1,0} parameter(2)
  %d = f32[1536]{0} parameter(3)
  %i = s32[] parameter(4)
  %x = bf16[8192,1536]{1,0} bitcast(%a)
  %loop_add_fusion.2 = bf16[4,2048,1536]{2,1,0} fusion(%a, %a), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/while/body/add"}
  %loss_add = bf16[4,2048,1536]{2,1,0} fusion(%a, %a), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/while/body/transpose(jvp(output_loss))/add"}
  %opt_add = bf16[4,2048,1536]{2,1,0} fusion(%a, %a), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/optimizer/add"}
  %wrapped_concatenate.3 = bf16[8192,3072]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_concatenate
  %loop_convert_fusion.1 = bf16[1,1536,6144]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_convert
  %loop_dynamic_update_slice_fusion.5 = f32[48,1536]{1,0} fusion(%g, %d, %i), kind=kLoop, calls=%fused_stack
  %custom-call.9 = (bf16[8192,3072]{1,0}, s8[33554432]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul"
  %custom-call.3 = (bf16[4,24,2048,64]{3,2,1,0}, u8[0]{0}) custom-call(%a, %a, %a), custom_call_target="__cudnn$fmhaSoftmax"
  %all-reduce-start = f32[1536]{0} all-reduce-start(%d), replica_groups={{0,1}}
  %copy.7 = bf16[4,2048,1536]{2,1,0} copy(%a)
  ROOT %r = bf16[] constant(0)
}
"""  # noqa: E501


@pytest.mark.parametrize("name, category", [
    ("loop_add_fusion_2", "elementwise"), ("loss_add", "loss"), ("opt_add", "optimizer"),
    ("wrapped_concatenate_3", "copy"), ("loop_convert_fusion_1", "elementwise"),
    ("loop_dynamic_update_slice_fusion_5", "copy"), ("custom-call.9", "gemm"), ("custom-call.3", "attention"),
    ("all-reduce-start", "collective"), ("copy.7", "copy"),
    # library kernels by their names (an H100's trace), not in the program
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x64_4x1x1", "attention"),
    ("memcpy128", "copy"), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "collective")])
def test_categories_of_gpu_kernels(name, category):
    prog = profile.program(FUSED)
    assert profile.categorize(profile._instruction(name, prog), name) == category


def test_bytes_of_gpu_kernels():
    """Operands and results once; a scanned layer's slice, not the stack; an in-place update, not the buffer."""
    prog = profile.program(FUSED)
    assert prog["loop_add_fusion.2"].bytes == 3 * 4 * 2048 * 1536 * 2
    assert prog["loop_convert_fusion.1"].bytes == 1536 * 6144 * (4 + 2) + 4  # the layer, and its int32 index
    assert prog["loop_dynamic_update_slice_fusion.5"].bytes == 1536 * 4 + 4 + 1536 * 4
    assert prog["copy.7"].bytes == 2 * 4 * 2048 * 1536 * 2


def test_summary_arithmetic():
    """Two profiled steps of 10 ms: a 6 ms GEMM (3 TFLOP) and 2 ms of copies a step, the rest idle."""
    prog = profile.program(FUSED)
    runs = [{"name": "nvjet_a", "us": 6_000.0, "graph": "g"}, {"name": "copy.7", "us": 3_000.0, "graph": "g"},
            {"name": "nvjet_a", "us": 6_000.0, "graph": "g"}, {"name": "copy.7", "us": 1_000.0, "graph": "g"}]
    table = {r["category"]: r for r in profile.summary(runs, prog, steps=2, step_time_s=0.010,
                                                      flops={"gemm": 3e12}, peak_flops=1e15, peak_bandwidth=4e12)}
    assert list(table) == ["gemm", "copy", "idle"]
    assert table["gemm"]["ms_per_step"] == pytest.approx(6.0) and table["gemm"]["share"] == pytest.approx(0.6)
    assert table["gemm"]["tflops"] == pytest.approx(500.0) and table["gemm"]["flops_fraction"] == pytest.approx(0.5)
    copy_bytes = 2 * 4 * 2048 * 1536 * 2  # per run; two runs in two steps: one a step, in 2 ms
    assert table["copy"]["ms_per_step"] == pytest.approx(2.0) and table["copy"]["kernels"] == 1
    assert table["copy"]["tbps"] == pytest.approx(copy_bytes / 2e-3 / 1e12)
    assert table["idle"]["ms_per_step"] == pytest.approx(2.0) and table["idle"]["tflops"] is None
    md = profile.markdown(list(table.values())).splitlines()
    assert md[2] == "| GEMMs (layer matmuls) | 6.00 | 60 % | 1 | 500 | 50 % | - | - |"


RESULTS = ROOT / "benchmarks" / "results" / "2026-11-26-h100"


def _committed(name):
    """A committed H100 trace: its kernels and program."""
    with gzip.open(RESULTS / f"{name}.step.hlo.txt.gz", "rt") as f:
        hlo = f.read()
    return profile.kernels(str(RESULTS / f"{name}.perfetto_trace.json.gz")), profile.program(hlo)


def test_the_table_of_a_real_h100_trace():
    """GPT1_5B, remat full, 2 micro batches of 4, two profiled steps on an H100 (call2.jsonl's first record)."""
    record = json.loads((RESULTS / "call2.jsonl").read_text().splitlines()[0])
    runs, prog = _committed("call2-GPT1_5B-full-micro4")
    with gzip.open(RESULTS / "call2-GPT1_5B-full-micro4.perfetto_trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e["pid"] == 1]  # /device:GPU:0, read directly
    assert len(runs) == len(gpu) and sum(r["us"] for r in runs) == pytest.approx(sum(e["dur"] for e in gpu))
    spec = importlib.util.spec_from_file_location("gpt3", ROOT / "configs" / "gpt3.py")
    gpt3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt3)
    c = gpt3.get_config("GPT1_5B")
    c.model.remat = "full"
    c.train.update(micro_batch_size=4, global_batch_size=8)
    cfg, _ = bench.prepare(c, 1)
    assert flops.hardware_flops_per_step(cfg) == record["hardware_flops_per_step"]
    table = profile.summary(runs, prog, 2, record["step_time_median_s"], flops.hardware_flops_by_kind(cfg),
                            989e12, 3.35e12)
    rows = {r["category"]: r for r in table}
    # cuBLAS's kernels (nvjet_*) and XLA's Triton GEMM fusions are the GEMMs and most of the output layer's time
    gemms = sum(r["us"] for r in runs if r["name"].startswith(("nvjet", "gemm_fusion"))) / 2e3
    assert rows["gemm"]["ms_per_step"] < gemms < rows["gemm"]["ms_per_step"] + rows["loss"]["ms_per_step"]
    # every kernel in one category; with the idle time they fill the two steps
    assert sum(r["ms_per_step"] for r in table) == pytest.approx(1e3 * record["step_time_median_s"])
    assert sum(r["kernels"] for r in table) == len(runs) // 2
    # cuDNN attention: 48 layers x 2 micro batches x (forward, recomputed forward, backward)
    assert rows["attention"]["kernels"] == 48 * 2 * 3
    # the layer matmuls run near an H100's peak, the loss's chunks (1,024 tokens) at about half of it
    assert 0.7 < rows["gemm"]["flops_fraction"] < 0.9 and 0.35 < rows["loss"]["flops_fraction"] < 0.6
    assert 0.8 < rows["optimizer"]["bandwidth_fraction"] < 1.0  # AdamW: memory-bound, near the bandwidth


def test_profile_table_of_the_h200_trace_with_padded_layer_gradients():
    """``benchmarks/profile_table.py`` on a record whose config names cuDNN (not runnable here): GPT1_5B with the
    layers written out on an H200, before their gradients were stacked (2026-11-27): the AdamW step's gradient
    norm read every layer's gradient padded to the 48-layer stack, 42 % of the step in six such kernels."""
    spec = importlib.util.spec_from_file_location("profile_table", ROOT / "benchmarks" / "profile_table.py")
    profile_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_table)
    h200 = ROOT / "benchmarks" / "results" / "2026-11-27-h200"
    record = json.loads((h200 / "call1.jsonl").read_text().splitlines()[2])
    assert (record["config"]["model"]["attention_impl"], record["config"]["model"]["layer_loop"]) == ("cudnn",
                                                                                                    "unrolled")
    rows = {r["category"]: r for r in profile_table.table(record, str(h200 / "call1-GPT1_5B-none-micro8-unrolled"))}
    assert sum(r["ms_per_step"] for r in rows.values()) == pytest.approx(1e3 * record["step_time_median_s"])
    assert rows["optimizer"]["ms_per_step"] == pytest.approx(231.0, abs=0.1) and rows["optimizer"]["share"] > 0.4
    runs = profile.kernels(str(h200 / "call1-GPT1_5B-none-micro8-unrolled.perfetto_trace.json.gz"))
    padded = sum(r["us"] for r in runs if r["name"].startswith("input_add_reduce_fusion")) / 2e3
    assert 0.95 * rows["optimizer"]["ms_per_step"] < padded < rows["optimizer"]["ms_per_step"]


def test_bench_profile_writes_a_trace_and_the_program(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "b.jsonl"
    r = subprocess.run([sys.executable, "-m", "jaxllm.bench", "--config.model.num_layers=1",
                        "--config.model.hidden_size=32", "--config.model.num_attention_heads=2",
                        "--config.model.vocab_size=256", "--config.train.seq_length=16",
                        "--config.train.micro_batch_size=2", "--config.train.global_batch_size=2", "--steps=1",
                        "--warmup=0", f"--output={out}", f"--profile={tmp_path / 'prof'}", "--profile_steps=1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    folder = rec["profile_trace"]
    assert glob.glob(os.path.join(folder, "*.xplane.pb")) and os.path.getsize(folder + "/perfetto_trace.json.gz")
    assert "HloModule" in (Path(folder) / "step.hlo.txt").read_text()
    # XLA:CPU's operations are not traced: no table, and the command says so
    assert rec["profile"] is None and "holds no device kernels" in r.stdout
