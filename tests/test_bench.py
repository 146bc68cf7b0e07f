"""jaxllm.bench: the arithmetic of its numbers against hand counts and an independent timing,
bench vs the training log, --compare on 2 devices, and bad flags (exit 2)."""

import importlib.util
import json
import os
import time
from pathlib import Path

import forkserver
import jax
import numpy as np
import pytest

from jaxllm import bench, config, train
from jaxllm.resolve import resolve
from jaxllm.runtime import flops
from jaxllm.runtime.run import Run

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare.txt"  # public domain (tests/data/README.md)
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

L, H, N, V, S = 2, 64, 4, 256, 32  # layers, hidden, heads, vocabulary, sequence


def tiny(remat="none"):
    c = config.get_config()
    c.model.update(num_layers=L, hidden_size=H, num_attention_heads=N, vocab_size=V, dtype="float32", remat=remat)
    c.train.update(seq_length=S, micro_batch_size=4, global_batch_size=8)
    return c


def hand_flops_per_token(remat):
    """Matmul FLOPs per token counted by hand for ``tiny()`` (gelu MLP 4h, multi-head attention)."""
    layer = 2 * H * 3 * H + 2 * S * H + 2 * H * H + 2 * 2 * H * 4 * H  # qkv, causal attention, out proj, MLP up+down
    logits = 2 * H * V
    model = 3 * L * layer + 3 * logits
    extra = {"none": 0, "full": L * layer, "save_dots": L * 2 * S * H}[remat]  # save_dots: scores + values
    return model, model + extra


@pytest.mark.parametrize("remat, schedule", [("none", None), ("full", None), ("save_dots", None), ("none", "1f1b"),
                                             ("full", "zb_h1"), ("none", "gpipe")])
def test_hardware_flops_hand_count(remat, schedule):
    cfg = tiny(remat)
    if schedule:  # 2 pipeline stages; the 1F1B family recomputes each stage's forward once more
        cfg.mesh.pipeline = 2
        cfg.parallel.pipeline_schedule = schedule
    cfg = resolve(cfg, num_devices=cfg.mesh.pipeline)
    model_fpt, hardware_fpt = hand_flops_per_token(remat)
    if schedule in ("1f1b", "zb_h1"):
        hardware_fpt += hand_flops_per_token("full")[1] - model_fpt
    assert flops.flops_per_step(cfg, recompute=False) == 8 * S * model_fpt
    assert flops.hardware_flops_per_step(cfg) == 8 * S * hardware_fpt
    out = flops.throughput(0.5, cfg, num_devices=2, peak_flops=1e9)
    assert out["hfu"] / out["mfu"] == pytest.approx(hardware_fpt / model_fpt, rel=1e-12)


def test_megatron_convention_is_megatron_lms_formula():
    """Megatron-LM's FLOPs of a GPT-3-style step (Narayanan et al. 2021, eq. 3, attention not halved):
    ``72 B s L h^2 (1 + s / 6h + V / 12 L h)``, for every configs/gpt3.py size of GPT-3's shape (f = 4h)."""
    spec = importlib.util.spec_from_file_location("gpt3", ROOT / "configs" / "gpt3.py")
    gpt3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt3)
    for key in ("GPT125M", "GPT1_5B", "GPT2_7B", "GPT175B"):
        c = gpt3.get_config(key)
        c.train.update(micro_batch_size=1, global_batch_size=8)
        cfg = resolve(c, num_devices=1, vocab_size=50257)
        B, s, L, h, V = 8, cfg.train.seq_length, cfg.model.num_layers, cfg.model.hidden_size, 50304
        megatron = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
        assert flops.megatron_flops_per_step(cfg) == pytest.approx(megatron, rel=1e-12), key
        out = flops.throughput(2.0, cfg, num_devices=4, peak_flops=1e15)
        assert out["megatron_mfu"] == pytest.approx(megatron / 2.0 / 4 / 1e15, rel=1e-12)


def test_bench_numbers_against_hand_count_and_independent_timing():
    cfg, _ = bench.prepare(tiny("save_dots"), 1)
    t0 = time.perf_counter()
    r = bench.benchmark(cfg, num_devices=1, steps=6, warmup=1)
    wall = time.perf_counter() - t0
    times = r["step_times_s"]
    assert len(times) == 6 and r["steps"] == 6 and r["microbatches"] == 2
    assert r["step_time_s"] == pytest.approx(np.mean(times), rel=1e-12)
    assert r["tokens_per_sec"] == pytest.approx(8 * S / np.mean(times), rel=1e-12)
    model_fpt, hardware_fpt = hand_flops_per_token("save_dots")
    peak = r["peak_flops_per_device"]
    assert r["tflops_per_device"] == pytest.approx(8 * S * model_fpt / r["step_time_s"] / 1e12, rel=1e-9)
    assert r["mfu"] == pytest.approx(8 * S * model_fpt / r["step_time_s"] / peak, rel=1e-9)
    assert r["hfu"] == pytest.approx(8 * S * hardware_fpt / r["step_time_s"] / peak, rel=1e-9)
    assert r["hfu"] > r["mfu"]
    # The timed steps lie inside the call: their sum is below its wall time, the compile time too.
    assert sum(times) + r["compile_s"] < wall
    # CPU reports no peak_bytes_in_use: the compiled executable's figure, at least params + 2 Adam moments.
    assert r["peak_memory_source"] == "compiled memory_analysis"
    assert r["peak_memory_bytes"] == r["compiled_memory_bytes"] >= 3 * 4 * r["num_params"]
    assert np.isfinite(r["final_loss"]) and json.loads(json.dumps(r))["name"] == ""

    # Independent timing of the same step, outside bench: a fresh Run, compiled, 6 steps timed one by one.
    # Another test process's load slows stretches of either run, never speeds one up: each side's fastest
    # step is compared, within a factor 3, which still catches unit errors (ms/s, per device), compile time
    # or warm-up inside the timed steps.
    run = Run(cfg, devices=jax.devices()[:1])
    state = run.initial_state()
    rng = np.random.default_rng(0)
    tok = rng.integers(0, V, (8, S + 1), dtype=np.int32)
    batch = run.global_batch(tok[:, :-1], tok[:, 1:])
    step = run.train_step.lower(state, *batch).compile()
    state, m = step(state, *batch)
    jax.block_until_ready(m)
    reference = []
    for _ in range(6):
        start = time.perf_counter()
        state, m = step(state, *batch)
        jax.block_until_ready(m)
        reference.append(time.perf_counter() - start)
    assert 1 / 3 < min(times) / min(reference) < 3, (times, reference)


def test_bench_matches_the_training_log(tmp_path):
    """The 10% agreement is measured in docs/performance.md.  Here the two runs share a 2-core machine with
    another test process, whose load slows whole stretches of either: each side's fastest step (the trainer
    logging every step) is compared, a statistic that load cannot lower, within a factor 2."""
    assert SHAKESPEARE.is_file(), f"missing {SHAKESPEARE}"
    spec = importlib.util.spec_from_file_location("shakespeare_char", ROOT / "configs" / "shakespeare_char.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg = recipe.get_config()
    cfg.train.update(train_iters=24, log_interval=1, eval_interval=0)
    cfg.log.update(samples=0, tensorboard=False, progress_bar=False)
    train.train(cfg, str(tmp_path / "train"))
    lines = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 25))
    trained = min(x["step_time_s"] for x in lines[2:])  # the first two: compilation and warm-up
    resolved, data = bench.prepare(cfg, 1, data="real", workdir=str(tmp_path / "train"))
    r = bench.benchmark(resolved, num_devices=1, steps=22, warmup=2, data=data)
    assert r["data"] == "real" and r["tokens_per_step"] == 12 * 64 and len(r["step_times_s"]) == 22
    assert 0.5 < min(r["step_times_s"]) / trained < 2, (min(r["step_times_s"]), trained)


def cli(*args):
    return forkserver.run(["-m", "jaxllm.bench", *args], ENV, ROOT, 600)


TINY_FLAGS = [f"--config.model.num_layers={L}", f"--config.model.hidden_size={H}",
              f"--config.model.num_attention_heads={N}", f"--config.model.vocab_size={V}",
              f"--config.train.seq_length={S}", "--config.train.micro_batch_size=2",
              "--config.train.global_batch_size=4", "--config.model.dtype=float32"]


def test_compare_on_two_devices_writes_one_json_line_per_config(tmp_path):
    out = tmp_path / "b.jsonl"
    r = cli("--devices=2", "--config.mesh.data=2", *TINY_FLAGS, "--steps=2", "--warmup=1", f"--output={out}",
            "--compare=mesh.data=1,mesh.tensor=2,model.remat=full;mesh.data=1,mesh.pipeline=2,"
            "parallel.pipeline_schedule=1f1b")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["name"] for x in recs] == ["", "mesh.data=1,mesh.tensor=2,model.remat=full",
                                         "mesh.data=1,mesh.pipeline=2,parallel.pipeline_schedule=1f1b"]
    assert [(x["mesh"]["data"], x["mesh"]["tensor"], x["mesh"]["pipeline"]) for x in recs] == [
        (2, 1, 1), (1, 2, 1), (1, 1, 2)]
    assert [x["remat"] for x in recs] == ["none", "full", "none"] and all(x["devices"] == 2 for x in recs)
    # what a record says of its run: the command, the config and its overrides, versions, numerics
    assert recs[1]["overrides"] == ["--config.mesh.data=2", *TINY_FLAGS, "--config.mesh.data=1",
                                    "--config.mesh.tensor=2", "--config.model.remat=full"]
    assert recs[0]["command"].startswith("python -m jaxllm.bench --devices=2 --config.mesh.data=2")
    assert recs[0]["config_file"] == "jaxllm/default_config.py"
    assert all(x["fp8"] is False and x["jaxlib"] == jax.__version__ and x["date"] for x in recs)
    assert all(x["attention_impl"] == "xla" and x["dtype"] == "float32" for x in recs)  # resolved: auto on a CPU
    # the pipelined config's schedule: 2 microbatches through 2 stages, bubble 1/3, both in flight
    assert [x["pipeline_schedule"] for x in recs] == [None, None, "1f1b"]
    assert recs[2]["pipeline_bubble"] == pytest.approx(1 / 3) and recs[2]["pipeline_in_flight"] == 2
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "x |" in ln]
    assert len(rows) == 3 and "pipeline2 (1f1b, bubble 33.3%, 2 in flight)" in rows[2], rows
    for row, rec in zip(rows, recs, strict=True):  # the printed ratio is tokens/s against the base config
        assert f"{rec['tokens_per_sec'] / recs[0]['tokens_per_sec']:.2f}x" in row
    # a variant out of memory (on a GPU: xla attention at long sequences) is a row; ratios are to the first that ran
    oom = {"name": "model.attention_impl=xla", "error": "out of memory"}
    rows = bench.table([oom, *recs[1:]]).splitlines()
    assert rows[2] == "| model.attention_impl=xla | out of memory |" + " |" * 8 and "| 1.00x |" in rows[3]
    assert f"{recs[2]['tokens_per_sec'] / recs[1]['tokens_per_sec']:.2f}x" in rows[4]


@pytest.mark.parametrize("flag,message", [("--steps=0", "--steps=0"), ("--steps=abc", "steps"),
                                          ("--compare=mesh.data", "SECTION.KEY=VALUE"),
                                          ("--data=web", "--data='web'"),
                                          ("--config.model.hidden_size=102", "model.hidden_size")])
def test_bad_flags_one_line_exit_2(flag, message):
    r = cli(flag, "--output=")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
