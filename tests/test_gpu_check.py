"""benchmarks/gpu_check.py on the CPU: the dry run writes its whole report; without a GPU the real run
refuses before doing anything (exit 2, no report).  The GPU run itself is for a GPU machine."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_refuses_without_a_gpu(tmp_path):
    out = tmp_path / "report.md"
    r = subprocess.run([sys.executable, SCRIPT, f"--output={out}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "JAX has no GPU backend here" in r.stderr.strip().splitlines()[-1], r.stderr
    assert not out.exists()
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--models=GPT125M,GPT9"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "--models=GPT9: not one of GPT125M, GPT1_5B, GPT2_7B"), r.stderr


@pytest.mark.slow
def test_dry_run_writes_the_report(tmp_path):
    out = tmp_path / "sub" / "report.md"
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", f"--output={out}", "--models=GPT125M,GPT1_5B"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# GPU check -- DRY RUN (shortened, on the CPU: not GPU figures)\n")
    assert "| jax | " in text and "| ml-collections | " in text and "GPU settings of every" in text
    steps = [ln for ln in text.splitlines() if ln.startswith("| ") and ln.endswith(" | ok |")]
    assert [s.split(" | ")[0][2:] for s in steps] == [
        "devices", "GPU tests: compiled Pallas, Triton and cuDNN attention against the XLA reference, cuDNN's "
        "packed documents in training",
        "attention benchmark", "jaxllm.bench GPT125M", "torch reference GPT125M", "jaxllm.bench GPT1_5B",
        "torch reference GPT1_5B",  # not GPT2_7B: --models
        "GPT125M trained 20 steps, model.fp8=False", "GPT125M trained 20 steps, model.fp8=False"]  # no FP8 on CPUs
    # the GPU tests exist and skip on a CPU: 7 Pallas + 7 Triton + 2 cuDNN + 2 cuDNN packed + 1 packed training
    assert "19 skipped" in text
    assert "| 128 | xla | " in text and "| 128 | pallas | " in text  # the attention table, both rows measured
    assert text.count("| config | mesh | tokens/s |") == 2 and "| model.layer_loop=scan | 1 device |" in text
    assert not list(out.parent.glob("*.tmp"))
    # FP8 against bfloat16 in training: each run's losses beside the report, the table made from them (the dry
    # run trains twice without FP8, from one seed: the same losses)
    losses = [{r["step"]: r["loss"] for r in map(json.loads, (out.parent / "report-fp8_loss" / n / "metrics.jsonl")
                                                 .read_text().splitlines()) if r["kind"] == "train"}
              for n in ("bf16", "fp8")]
    assert sorted(losses[0]) == list(range(1, 21)) and losses[0] == losses[1]
    mean = sum(losses[0][s] for s in range(11, 21)) / 10
    assert f"| 11-20 (mean) | {mean:.4f} | {mean:.4f} | +0.00% |" in text
    # jaxllm's fastest variant against the PyTorch reference, from the records both wrote
    records = [json.loads(x) for x in (out.parent / "report.jsonl").read_text().splitlines()]
    assert [r.get("framework", "jax") for r in records] == ["jax", "jax", "torch"] * 2
    assert [r["config"]["model"]["layer_loop"] for r in records if "framework" not in r][:4] == [
        "unrolled", "scan", "scan", "unrolled"]  # GPT125M: the CPU's default, then scanned; GPT1_5B the reverse
    for key in ("GPT125M", "GPT1_5B"):
        mine = max(r["tokens_per_sec"] for r in records if r["config_file"].endswith(key) and "framework" not in r)
        ref = next(r["tokens_per_sec"] for r in records if r["config_file"].endswith(key) and "framework" in r)
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| configs/gpt3.py:{key} |"))
        assert row.endswith(f" | {mine / ref:.2f}x |") and f"| {ref:,.0f} |" in row
