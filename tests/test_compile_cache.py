"""JAX's persistent compilation cache through the real CLI: a rerun in the same workdir reads the
train step from WORKDIR/compile_cache, another run shares an absolute cache directory, "" turns it
off; the start-up line and metrics.jsonl say where the time to the first step went."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# without the suite's cache (tests/conftest.py): these runs check train.compile_cache_dir's own folders
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))},
       "JAX_PLATFORMS": "cpu"}
# A tiny byte-level run on the json package's sources (six files, one document each): no data to fetch.
# lr_decay_iters is fixed: derived from train_iters, it would make the rerun's program another one.
TINY = [f"--config.data.input={Path(sysconfig.get_paths()['stdlib']) / 'json'}", "--config.data.tokenizer=byte",
        "--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.num_attention_heads=2",
        "--config.train.seq_length=32", "--config.train.micro_batch_size=4", "--config.train.global_batch_size=4",
        "--config.train.warmup_iters=1", "--config.train.lr_decay_iters=100", "--config.train.eval_interval=0",
        "--config.train.log_interval=1", "--config.checkpoint.interval=2", "--config.log.samples=0",
        "--config.log.tensorboard=False", "--config.log.progress_bar=False",
        "--config.train.compile_cache_min_compile_s=0"]  # every program cached, however fast it compiled
STARTUP_KEYS = {"startup_s", "startup_data_s", "startup_index_s", "startup_index_built", "startup_compile_s",
                "startup_first_step_s", "compile_cache"}


def train(workdir, iters, *extra, env=ENV):
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", f"--workdir={workdir}", *TINY,
                        f"--config.train.train_iters={iters}", *extra], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("jaxllm: first step ")]
    assert len(lines) == 1, r.stdout
    records = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    first = [m for m in records if "startup_s" in m][-1]  # this start's: the first train record it logged
    return lines[0], first


def test_rerun_hits_the_compilation_cache(tmp_path):
    run = tmp_path / "run"
    line, first = train(run, 2)
    assert first["compile_cache"] == "miss" and "compilation cache miss" in line, line
    assert STARTUP_KEYS | {"startup_init_s"} <= first.keys() and "startup_restore_s" not in first
    assert first["step"] == 1 and first["startup_index_built"] is True
    parts = ("startup_data_s", "startup_init_s", "startup_compile_s", "startup_first_step_s")
    assert 0 < sum(first[k] for k in parts) <= first["startup_s"]
    assert any(p.name.startswith("jit_train_step-") for p in (run / "compile_cache").iterdir())
    for word in ("after start: data", "sample indices", "built", "init", "compile", "first step", "other"):
        assert word in line, line

    line, again = train(run, 4)  # resumes at step 2: the same programs, read from the cache
    assert again["compile_cache"] == "hit" and f"compilation cache hit: {run / 'compile_cache'}" in line, line
    assert again["step"] == 3 and "startup_restore_s" in again and "startup_init_s" not in again
    assert "restore" in line and "(step 2)" in line, line  # (the indices are new: more samples)

    # Another run of the same model shares the cache by an absolute path (a cluster's shared directory).
    line, shared = train(tmp_path / "other", 2, f"--config.train.compile_cache_dir={run / 'compile_cache'}")
    assert shared["compile_cache"] == "hit" and "startup_init_s" in shared, line
    assert not (tmp_path / "other" / "compile_cache").exists()

    line, off = train(tmp_path / "off", 2, "--config.train.compile_cache_dir=")
    assert off["compile_cache"] == "off" and "no compilation cache" in line, line
    assert not (tmp_path / "off" / "compile_cache").exists()


def test_jaxs_own_cache_directory_takes_the_defaults_place(tmp_path):
    """JAX_COMPILATION_CACHE_DIR set (a cluster's cache for every JAX program): the default train.compile_cache_dir
    gives way to it; a directory given on the command line still wins."""
    jax_cache = tmp_path / "jax_cache"
    env = {**ENV, "JAX_COMPILATION_CACHE_DIR": str(jax_cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    line, first = train(tmp_path / "a", 2, env=env)
    assert first["compile_cache"] == "miss" and f"compilation cache miss: {jax_cache}" in line, line
    assert not (tmp_path / "a" / "compile_cache").exists()
    line, other = train(tmp_path / "b", 2, env=env)
    assert other["compile_cache"] == "hit" and f"compilation cache hit: {jax_cache}" in line, line
    line, given = train(tmp_path / "c", 2, f"--config.train.compile_cache_dir={tmp_path / 'mine'}", env=env)
    assert given["compile_cache"] == "miss" and f"compilation cache miss: {tmp_path / 'mine'}" in line, line


def test_an_unwritable_cache_directory_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", f"--workdir={tmp_path / 'run'}", *TINY,
                        "--config.train.compile_cache_dir=/proc/jaxllm_cache"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("config error: train.compile_cache_dir='/proc/jaxllm_cache': cannot create "
                               "/proc/jaxllm_cache (")
    assert lines[0].endswith('give a directory you can write, or "" to turn the compilation cache off')
