"""jaxllm.tune: the search space (jaxllm.analysis.layouts), constraint and memory pruning counts against hand
counts and jaxllm.plan, the measured candidates, and the CLI's outputs on 2 devices (Optuna) and bad flags."""

import contextlib
import csv
import dataclasses
import importlib.util
import io
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm import config, plan, tune
from jaxllm.analysis import layouts

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.mark.parametrize("n,k", [(8, 5), (12, 3), (1, 4), (7, 2)])
def test_factorizations_brute_force(n, k):
    brute = sorted(t for t in itertools.product(range(1, n + 1), repeat=k) if math.prod(t) == n)
    assert sorted(layouts.factorizations(n, k)) == brute
    assert len(set(layouts.factorizations(n, k))) == len(brute)


def test_candidates_and_configs_are_inverses():
    base = tiny()
    c = layouts.Candidate((2, 1, 1, 2, 2, 1), 2, "full", "xla", 2, "ring", "interleaved")
    cfg = layouts.candidate_config(base, c)
    assert layouts.candidate_of(cfg, {a: getattr(cfg.mesh, a) for a in config.MESH_AXES}) == c
    assert base.train.micro_batch_size == 1  # the base is left as it was
    base.mesh.update(data=-1, tensor=2)
    assert tune.baseline_candidate(base, 8).mesh == (4, 1, 1, 1, 2, 1)  # the -1 axis filled
    dims = layouts.values([c, layouts.Candidate((8, 1, 1, 1, 1, 1), 1, "none", "xla")])
    assert list(dims) == [f.name for f in dataclasses.fields(layouts.Candidate)]
    assert dims["mesh"] == [(2, 1, 1, 2, 2, 1), (8, 1, 1, 1, 1, 1)] and dims["remat"] == ["full", "none"]


def test_dimensions_from_text():
    dims = layouts.dimensions(tiny(), axes="data,tensor", micro_batch="auto", remat="none", attention="xla",
                              virtual_stages="1,2", pipeline_schedules="gpipe", sequence_impls="ring")
    assert dims == {"axes": ["data", "tensor"], "micro_batches": [1, 2, 4, 8], "remats": ["none"],
                    "attentions": ["xla"], "virtual_stages": [1, 2], "schedules": ["gpipe"], "sequence_impls": ["ring"],
                    "layer_loops": [tiny().model.layer_loop]}
    assert len(layouts.space(tiny(), 4, **dims)) == 3 * 4  # (1,4), (2,2), (4,1) x 4 micro batches
    loops = layouts.dimensions(tiny(), axes="data", micro_batch="1", remat="none", attention="xla", virtual_stages="1",
                               pipeline_schedules="gpipe", sequence_impls="ring", layer_loop="scan,unrolled")
    assert [c.layer_loop for c in layouts.space(tiny(), 1, **loops)] == ["scan", "unrolled"]
    with pytest.raises(ValueError, match="--virtual_stages='0'"):
        layouts.dimensions(tiny(), axes="data", micro_batch="1", remat="none", attention="xla", virtual_stages="0",
                           pipeline_schedules="gpipe", sequence_impls="ring")


def test_budget_parsing():
    assert tune.parse_budget("20") == (20, None)
    assert tune.parse_budget("10m") == (None, 600.0) and tune.parse_budget("90s") == (None, 90.0)
    for bad in ("0", "abc", "1.5", "-3m", "5h"):
        with pytest.raises(ValueError, match="--budget"):
            tune.parse_budget(bad)


DENSE_AXES = [a for a in config.MESH_AXES if a != "expert"]  # tune's default axes for a dense model


def test_constraints_count_rejections_by_key():
    base = tiny()
    cands = layouts.space(base, 8, axes=DENSE_AXES, micro_batches=[1, 2], remats=["none"], attentions=["xla"],
                       virtual_stages=[1, 2], sequence_impls=["allgather"], schedules=["gpipe", "interleaved"])
    got = {}
    for c in cands:
        why = tune.constraint(layouts.candidate_config(base, c), 8)
        got[why] = got.get(why, 0) + 1
    # Hand counts, 8 devices: 35 meshes over 5 axes, 20 of them without pipeline; x 2 micro batches,
    # x 2 virtual stages where pipeline > 1: 20*2 + 15*4 = 100 candidates.
    assert len(cands) == 100 and len(set(cands)) == 100
    assert got["model.num_attention_heads"] == 2  # tensor 8 splits 4 heads: mesh (1,1,1,8,1), 2 micro batches
    # Pipeline (2 layers): stages x virtual stages must divide 2, so only pipeline 2 without virtual
    # stages runs: 10 meshes x 2 micro batches with virtual 2, 4 x 2 x 2 with pipeline 4, 1 x 2 x 2 with 8.
    assert got["model.num_layers"] == 20 + 16 + 4
    # global 8 % (micro 2 x data-parallel 8) on 4 meshes; with pipeline 2, micro 2 x data-parallel 4
    # leaves 1 microbatch, not a multiple of 2 stages, on 3 meshes
    assert got["train.global_batch_size"] == 4 + 3
    assert got[None] == 100 - 2 - 7 - 40
    # every schedule: per pipeline mesh and micro batch gpipe, 1f1b, zb_h1 (1 virtual stage), interleaved and
    # interleaved_1f1b (2); each validates as its gpipe / interleaved twin does
    every = layouts.space(base, 8, axes=DENSE_AXES, micro_batches=[1, 2], remats=["none"], attentions=["xla"],
                       virtual_stages=[1, 2], sequence_impls=["allgather"],
                       schedules=config.choices("parallel.pipeline_schedule"))
    assert len(every) == 20 * 2 + 15 * 2 * 5
    twin = {"1f1b": "gpipe", "zb_h1": "gpipe", "interleaved_1f1b": "interleaved"}
    for c in every:
        plain = dataclasses.replace(c, schedule=twin.get(c.schedule, c.schedule))
        assert (tune.constraint(layouts.candidate_config(base, c), 8)
                == tune.constraint(layouts.candidate_config(base, plain), 8)), c
    ulysses = layouts.Candidate((1, 1, 1, 1, 2, 4), 1, "none", "xla", 1, "ulysses")  # 4 heads % (4 x 2)
    assert tune.constraint(layouts.candidate_config(base, ulysses), 8) == "model.num_attention_heads"
    allgather = dataclasses.replace(ulysses, sequence_impl="allgather")
    assert tune.constraint(layouts.candidate_config(base, allgather), 8) is None
    short = tiny()
    short.train.seq_length = 8
    ring = layouts.Candidate((1, 1, 1, 1, 1, 8), 1, "none", "xla", 1, "ring")  # 8 % (2 x 8)
    assert tune.constraint(layouts.candidate_config(short, ring), 8) == "train.seq_length"


L, H, N, V, S = 2, 64, 4, 256, 32


def tiny():
    c = config.get_config()
    c.model.update(num_layers=L, hidden_size=H, num_attention_heads=N, vocab_size=V, dtype="float32")
    c.train.update(seq_length=S, micro_batch_size=1, global_batch_size=8)
    return c


def test_plan_for_a_gpu_resolves_auto_dtype_for_it():
    c = tiny()
    c.model.dtype = "auto"
    cpu, gpu = plan.plan(c, 1), plan.plan(c, 1, backend="cuda")
    assert (cpu["dtype"], gpu["dtype"]) == ("float32", "bfloat16 (compiled as float16, the same bytes)")
    assert gpu["params"] == cpu["params"]  # float32 master weights either way
    assert gpu["temp"] != cpu["temp"]  # a different program (XLA:CPU's bfloat16 temporaries are no GPU's figure)


def test_gpu_plan_has_flash_attention_memory():
    """A GPU's plan keeps attention's memory linear in the sequence (its flash kernel's residuals), where
    this machine's xla attention holds the [seq, seq] scores: 4x the tokens, at most 5x the temporaries
    on a GPU, about 16x on the CPU.  ``cudnn``, what ``auto`` is on NVIDIA GPUs, is accepted and planned alike."""
    temps = {}
    for backend, impl, seq in (("cuda", "auto", 1024), ("cuda", "auto", 4096), ("cuda", "cudnn", 4096),
                               (None, "auto", 1024), (None, "auto", 4096)):
        c = tiny()
        c.model.update(attention_impl=impl, remat="full")
        c.train.update(seq_length=seq, global_batch_size=1)
        temps[backend, impl, seq] = plan.plan(c, 1, backend=backend)["temp"]
    assert temps["cuda", "auto", 4096] <= 5 * temps["cuda", "auto", 1024], temps
    assert temps["cuda", "cudnn", 4096] == temps["cuda", "auto", 4096], temps
    assert temps[None, "auto", 4096] >= 10 * temps[None, "auto", 1024], temps


def test_gpu_plan_keeps_a_layer_input_in_two_bytes():
    """With full remat each more layer keeps its input, ``[seq, embed]`` in bfloat16 on a GPU, and its share
    of the weights' gradients.  XLA:CPU compiling bfloat16 itself adds a float32 copy of the stacked inputs
    (1.35 MB per layer here, against 0.52 MB of input); the GPU plan, compiled in float16 (the same bytes),
    does not (0.81 MB)."""
    temps = {}
    for layers in (2, 6):
        c = tiny()
        c.model.update(num_layers=layers, dtype="bfloat16", remat="full")
        c.train.update(seq_length=4096, global_batch_size=1)
        temps[layers] = plan.plan(c, 1, backend="cuda")["temp"]
    assert (temps[6] - temps[2]) / 4 < 2 * 4096 * H * 2, temps


def test_gpu_plan_takes_the_offloaded_layer_inputs_off_the_device():
    """``model.remat=offload`` planned for a GPU: this machine's compile keeps the layer inputs where a
    GPU moves them to host memory, so the plan takes off exactly what JAX lists as kept in host memory
    (its saved residuals marked ``<host>``: the stacked layer inputs), and judges the rest."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxllm.model import attention, gpt  # noqa: PLC0415
    from jaxllm.resolve import resolve  # noqa: PLC0415

    plans = {}
    for remat in ("full", "offload"):
        c = tiny()
        c.model.update(remat=remat, dtype="bfloat16", num_layers=4)
        plans[remat] = plan.plan(c, 1, backend="cuda")
    cfg = resolve(c, num_devices=1, backend="cuda", data_files=False)
    spec, tokens = gpt.describe(cfg.model), jnp.zeros((cfg.train.micro_batch_size, cfg.train.seq_length), jnp.int32)
    out = io.StringIO()  # traced as the plan traces it: the config's attention (cuDNN) is the GPU's
    with contextlib.redirect_stdout(out), attention.lowering_target("cuda", interpret=True):
        jax.ad_checkpoint.print_saved_residuals(lambda p: gpt.loss(spec.graphdef, p, tokens, tokens),
                                                gpt.init(cfg.model, 0))
    host = sum(int(bits) // 8 * math.prod(map(int, shape.split(",")))  # e.g. bf16<host>[4,1,32,64]
               for bits, shape in re.findall(r"[a-z]+(\d+)<host>\[([\d,]+)\]", out.getvalue()))
    assert host == 4 * S * H * 2  # 4 layers' [1, seq, embed] inputs in bfloat16
    assert plans["offload"]["host"] == host and plans["full"]["host"] == 0
    assert plans["offload"]["total"] == plans["full"]["total"]  # the CPU's compile: the same program
    assert plans["offload"]["device"] == plans["full"]["device"] - host


def test_tuner_prunes_by_the_plan_and_measures_the_rest(tmp_path):
    base = tiny()
    small, large = (plan.plan(layouts.candidate_config(base, layouts.Candidate((1,) * 6, mb, "none", "xla")),
                              1)["total"] for mb in (1, 8))
    assert large > small
    limit = (small + large) / 2
    tuner = tune.Tuner(base, 1, memory_limit=limit, steps=1, warmup=0, log=lambda line: None)
    tuner.filter(layouts.space(base, 1, axes=config.MESH_AXES, micro_batches=[1, 3, 8], remats=["none"],
                            attentions=["xla"], virtual_stages=[1], sequence_impls=["allgather"], schedules=["gpipe"]))
    assert tuner.space_size == 3 and tuner.rejected == {"train.global_batch_size": 1}  # 8 % 3
    tuner.run(trials=5, seconds=None, sampler="auto", confirm=0)
    assert tuner.sampler == "grid"
    by_mb = {r.candidate.micro_batch: r for r in tuner.results.values()}
    assert set(by_mb) == {1, 8}
    assert by_mb[8].status == "pruned (memory)" and by_mb[8].memory == large and not by_mb[8].tokens_per_sec
    measured = by_mb[1]
    assert measured.status == "measured" and measured.baseline and measured.memory == small
    # the plan (abstract state) and the real compilation of the measurement agree on memory
    assert measured.record["compiled_memory_bytes"] == small
    assert len(measured.tokens_per_sec) == 1
    assert tuner.best() is measured
    paths = tuner.write(str(tmp_path), "python -m jaxllm.tune ...")
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [(r["status"], r["micro_batch"]) for r in rows] == [("measured [baseline]", "1"), ("pruned (memory)", "8")]
    assert float(rows[0]["tokens_per_sec"]) == pytest.approx(measured.throughput, rel=1e-3)
    text = open(paths["md"]).read()
    assert "pruned by the memory plan" in text and "--config.train.micro_batch_size=1" in text
    assert "- planned (ahead-of-time memory plan): 2 of 2 valid\n" in text  # the baseline is one of them
    tuner.valid.remove(tuner.baseline)  # a baseline outside the search space is not counted as a valid candidate
    assert "- planned (ahead-of-time memory plan): 1 of 1 valid, and the baseline (the config as given: not a " \
           "candidate)" in tuner.summary()
    assert open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# the tiny model of the CLI tests, as flags
TINY = [f"--config.model.num_layers={L}", f"--config.model.hidden_size={H}", f"--config.model.num_attention_heads={N}",
        f"--config.model.vocab_size={V}", f"--config.train.seq_length={S}"]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxllm.tune", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)


def test_cli_two_devices_with_optuna(tmp_path):
    r = cli("--devices=2", *TINY, "--config.train.micro_batch_size=2",
            "--config.train.global_batch_size=4", "--config.model.dtype=float32", "--axes=data,tensor",
            "--micro-batch=2", "--remat=none", "--sampler=optuna", "--budget=3", "--steps=1", "--warmup=0",
            "--confirm=0", f"--output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "tune.csv")))
    assert sorted((row["data"], row["tensor"], row["status"].split(" [")[0]) for row in rows) == [
        ("1", "2", "measured"), ("2", "1", "measured")]
    assert "baseline: mesh.data=2" in r.stdout and "chosen: --config.mesh.data=" in r.stdout
    assert "sampler optuna" in r.stdout
    assert (tmp_path / "tune.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_ranks_by_the_step_time_model_on_a_cluster(tmp_path):
    r = cli("--devices=2", *TINY, "--config.train.micro_batch_size=2",
            "--config.train.global_batch_size=4", "--axes=data,tensor", "--micro-batch=2", "--remat=none",
            "--budget=3", "--cluster=frontier", "--mfu=0.4", f"--output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "tune.csv")))
    assert sorted((row["data"], row["tensor"], row["status"].split(" [")[0], row["attention"]) for row in rows) == [
        ("1", "2", "modeled", "pallas"), ("2", "1", "modeled", "pallas")]  # the GPU's attention, planned for ROCm
    assert float(rows[0]["tokens_per_sec"]) >= float(rows[1]["tokens_per_sec"]) > 0
    assert all(row["measurements"] == "1" for row in rows)  # a model is not re-measured
    assert "ranked by the step-time MODEL on frontier at MFU 40%" in (tmp_path / "tune.md").read_text()


def test_cli_ranks_a_cluster_beyond_one_process(tmp_path):
    # 4,096 devices: this process's 2,048 and a stand-in process's (cli.stand_in_processes)
    r = cli("--devices=4096", *TINY, "--config.train.micro_batch_size=1",
            "--config.train.global_batch_size=4096", "--axes=data,tensor", "--micro-batch=1", "--remat=none",
            "--budget=2", "--cluster=frontier", "--mfu=0.4", f"--output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "tune.csv")))
    assert len(rows) == 2 and all(row["status"].startswith("modeled") for row in rows)
    assert all(int(row["data"]) * int(row["tensor"]) == 4096 and float(row["tokens_per_sec"]) > 0 for row in rows)


@pytest.mark.parametrize("flag,message", [("--budget=abc", "--budget"), ("--axes=data,model", "--axes"),
                                          ("--device=Z80", "--device='Z80'"), ("--cluster=frontier", "--mfu"),
                                          ("--cluster=summit", "--cluster='summit'")])
def test_bad_flags_one_line_exit_2(flag, message):
    r = cli(flag)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr


def test_optuna_tries_the_baselines_layout_under_the_other_schedules_first(tmp_path):
    # baseline: pipeline 2 with gpipe; before Optuna's draws the same mesh with 1f1b and zb_h1 (budget 3)
    r = cli("--devices=2", *TINY, "--config.train.micro_batch_size=1", "--config.train.global_batch_size=4",
            "--config.mesh.pipeline=2", "--axes=data,pipeline,tensor", "--micro-batch=1", "--remat=none",
            "--virtual_stages=1", "--pipeline_schedules=gpipe,1f1b,zb_h1", "--sampler=optuna", "--budget=3",
            "--cluster=frontier", "--mfu=0.4", f"--output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "tune.csv")))
    assert sorted((row["pipeline"], row["pipeline_schedule"]) for row in rows) == [
        ("2", "1f1b"), ("2", "gpipe"), ("2", "zb_h1")]


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins") is None, reason="JAX's CUDA plugin is not installed")
def test_cli_ranks_by_the_predicted_step_time_without_the_gpu(tmp_path):
    # --device=H100 on this machine (no GPU): each candidate compiled by XLA:GPU for an H100 and ranked by the step
    # time jaxllm.analysis.gpu_time predicts (plan's prediction and its record: tests/test_gpu_program.py)
    r = cli(*TINY, "--config.train.micro_batch_size=2", "--config.train.global_batch_size=4",
            "--config.model.remat=full", "--axes=data", "--micro-batch=2", "--remat=none,full", "--budget=2",
            "--device=H100", f"--output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "tune.csv")))
    assert {row["status"].split(" [")[0] for row in rows} == {"predicted"}, rows
    assert sorted(row["remat"] for row in rows) == ["full", "none"]
    assert all(row["attention"] == "cudnn" for row in rows)  # the H100's attention, not this machine's
    speeds = [float(row["tokens_per_sec"]) for row in rows]
    assert speeds == sorted(speeds, reverse=True) and speeds[-1] > 0
    assert "ranked by the step time PREDICTED" in (tmp_path / "tune.md").read_text()
    # each row's tokens/s is its predicted step's: micro batch 2 of 4 tokens rows, S tokens each
    assert all(float(row["step_time_s"]) == pytest.approx(4 * S / float(row["tokens_per_sec"]), rel=1e-3)
               for row in rows)
