"""The training CLI and loop end to end: config errors, a short real run, resume, metrics, generate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import optimized_env

from jaxllm import config, train
from jaxllm.resolve import resolve, resolve_model

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare.txt"  # public domain (tests/data/README.md)
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def cli(module, *args, cwd=ROOT, env=ENV):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


BAD = [
    ("model.hidden_size=100", "model.num_attention_heads=3", "model.hidden_size"),
    ("model.num_kv_heads=3", None, "model.num_kv_heads"),
    ("model.norm=batchnorm", None, "model.norm"),
    ("model.dropout=1.5", None, "model.dropout"),
    ("model.num_layers=0", None, "model.num_layers"),
    ("model.position_embedding=rotary", "model.hidden_size=36", "model.position_embedding"),
    ("model.use_rope_scaling=True", None, "model.use_rope_scaling"),  # learned positions
    ("model.use_rope_scaling=True", "model.rope_high_freq_factor=1.0", "model.rope_high_freq_factor"),
    ("train.global_batch_size=20", "train.micro_batch_size=8", "train.global_batch_size"),
    ("train.min_lr=0.1", None, "train.min_lr"),
    ("train.warmup_iters=500", "train.train_iters=100", "train.warmup_iters"),
    ("train.beta2=1.0", None, "train.beta2"),
    ("mesh.tensor=2", None, "mesh"),
    ("mesh.data=0", None, "mesh.data"),
    ("data.tokenizer=/no/such/tokenizer.json", None, "data.tokenizer"),
    ("data.tokenizer=gpt2", "data.gpt2_dir=/tmp", "data.gpt2_dir"),
    ("data.sampling=random", None, "data.sampling"),
    ("parallel.zero_stage=4", None, "parallel.zero_stage"),
]


@pytest.mark.parametrize("first,second,key", BAD, ids=[b[2] + ":" + b[0] for b in BAD])
def test_each_config_error_names_its_key(first, second, key):
    cfg = config.get_config()
    for override in filter(None, (first, second)):
        config.override(cfg, *override.split("="))
    with pytest.raises(config.ConfigError) as e:
        resolve(cfg, num_devices=1)
    assert e.value.key == key
    assert e.value.fix and str(e.value).startswith(f"config error: {key}=")


def test_megatrons_llama2_tokenizer_is_its_file():
    cfg = config.get_config()
    config.override(cfg, "data.tokenizer", "Llama2Tokenizer")
    with pytest.raises(config.ConfigError, match="Megatron's Llama2Tokenizer is the tokenizer.model's path here"):
        resolve(cfg, num_devices=1)


MLA = {"multi_latent_attention": True, "position_embedding": "rotary", "use_bias": False}


@pytest.mark.parametrize("overrides,key", [
    ({"position_embedding": "learned"}, "model.multi_latent_attention"),
    ({"qk_pos_emb_head_dim": 5}, "model.qk_pos_emb_head_dim"),
    ({"num_kv_heads": 2}, "model.num_kv_heads"),
    ({"use_bias": True}, "model.use_bias"),
    ({"qk_layernorm": True}, "model.qk_layernorm"),
    ({"add_qkv_bias": True}, "model.add_qkv_bias"),
    ({"attention_impl": "pallas", "v_head_dim": 200}, "model.v_head_dim"),  # wider than qk 128 + 64
])
def test_each_multi_latent_attention_error_names_its_key(overrides, key):
    """Multi-head latent attention's keys resolve (with the xla and a flash implementation), and each option it
    cannot take is a ConfigError naming its key."""
    cfg = config.get_config()
    cfg.model.update(**MLA, attention_impl="pallas")
    assert resolve(cfg, num_devices=1).model.attention_head_dims == (192, 128)  # Megatron-LM's defaults
    cfg.model.update(**overrides)
    with pytest.raises(config.ConfigError) as e:
        resolve(cfg, num_devices=1)
    assert e.value.key == key
    assert e.value.fix and str(e.value).startswith(f"config error: {key}=")


def test_tools_that_read_no_data_need_no_data_files():
    # GPU machines that plan or benchmark on synthetic batches have no GPT-2 files: only training checks them
    cfg = config.get_config()
    for override in ("data.tokenizer=gpt2", "data.gpt2_dir=/tmp", "data.input=/no/such/corpus"):
        config.override(cfg, *override.split("="))
    assert resolve(cfg, num_devices=1, vocab_size=50257, data_files=False).model.padded_vocab_size == 50304
    with pytest.raises(config.ConfigError, match="data.gpt2_dir"):
        resolve(cfg, num_devices=1, vocab_size=50257)


@pytest.mark.parametrize("vocab, divisible_by, tensor, padded", [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 8, 51200), (65, 1, 2, 66), (32000, 128, 3, 32256)])
def test_vocabulary_padded_as_megatron_pads(vocab, divisible_by, tensor, padded):
    """Megatron-LM's _vocab_size_with_padding: a multiple of make_vocab_size_divisible_by x tensor-parallel size."""
    cfg = config.get_config()
    cfg.model.update(make_vocab_size_divisible_by=divisible_by, num_attention_heads=24, hidden_size=384)
    cfg.mesh.tensor = tensor
    cfg.train.update(micro_batch_size=1, global_batch_size=1)
    assert resolve(cfg, num_devices=tensor, vocab_size=vocab, data_files=False).model.padded_vocab_size == padded


def test_vocab_smaller_than_tokenizer_is_a_config_error():
    cfg = config.get_config()
    cfg.model.vocab_size = 100
    with pytest.raises(config.ConfigError, match="model.vocab_size=100.*256"):
        resolve(cfg, num_devices=1, vocab_size=256)


@pytest.mark.parametrize("flag,key", [("--config.model.hidden_size=102", "model.hidden_size"),
                                      ("--config.train.global_batch_size=10", "train.global_batch_size"),
                                      ("--config.model.attention_impl=cudnn", "model.attention_impl")])
def test_cli_config_error_is_one_line_exit_2(tmp_path, flag, key):
    r = cli("jaxllm.train", f"--workdir={tmp_path}", flag)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}="), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "checkpoints").exists()


def test_cli_data_error_exit_2(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    r = cli("jaxllm.train", f"--workdir={tmp_path}", f"--config.data.input={tmp_path / 'empty.txt'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("data error:"), r.stderr


def tiny_shakespeare(iters):
    cfg = config.get_config()
    cfg.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, dtype="float32",
                     make_vocab_size_divisible_by=1)
    cfg.train.update(seq_length=32, micro_batch_size=4, global_batch_size=8, train_iters=iters, warmup_iters=5,
                     lr=3e-3, min_lr=3e-4, lr_decay_iters=60, eval_interval=20, eval_iters=2, log_interval=10)
    cfg.data.update(input=str(SHAKESPEARE), tokenizer="char", sampling="uniform", split="9,1")
    cfg.checkpoint.interval = 20
    cfg.log.update(samples=1, sample_tokens=40)
    return cfg


def read_metrics(workdir):
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def test_short_run_logs_resumes_and_generates(tmp_path, capsys):
    out = train.train(tiny_shakespeare(40), str(tmp_path))
    printed = capsys.readouterr().out
    assert "--- sample ---" in printed and "2 microbatch(es)/step" in printed
    lines = read_metrics(tmp_path)
    train_lines = [m for m in lines if m["kind"] == "train"]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu", "step_time_s"):
        assert key in train_lines[0]
    assert [m["step"] for m in train_lines] == [10, 20, 30, 40]
    assert train_lines[-1]["loss"] < train_lines[0]["loss"] - 0.1
    evals = [m for m in lines if m["kind"] == "eval"]
    assert [m["step"] for m in evals] == [20, 40] and evals[-1]["eval_loss"] == pytest.approx(out["eval_loss"])
    assert evals[-1]["eval_bpb"] == pytest.approx(out["eval_loss"] / 0.6931471805599453, rel=1e-6)  # 1 char = 1 byte
    assert list((tmp_path / "tensorboard").iterdir())
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["20", "40"]

    # Rerunning with more iterations resumes from step 40 and continues the same schedule.
    resumed = train.train(tiny_shakespeare(60), str(tmp_path))
    assert "resuming at step 40" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(tmp_path) if m["kind"] == "train"][-2:] == [50, 60]
    assert resumed["eval_loss"] < out["eval_loss"] + 0.05

    r = cli("jaxllm.generate", f"--workdir={tmp_path}", "--prompt=ROMEO:", "--num_tokens=30", "--num_samples=2")
    assert r.returncode == 0, r.stderr
    samples = [s for s in r.stdout.split("-" * 40) if s.strip()]
    assert len(samples) == 2 and all(s.strip().startswith("ROMEO:") and len(s.strip()) > 30 for s in samples)


def test_generate_without_checkpoint_is_a_clear_error(tmp_path):
    r = cli("jaxllm.generate", f"--workdir={tmp_path}")
    assert r.returncode == 2 and "no checkpoint" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_default_job_trains_on_the_standard_library(tmp_path):
    """`python -m jaxllm.train` with only a shorter schedule: the default corpus and model."""
    r = cli("jaxllm.train", f"--workdir={tmp_path}", "--config.train.train_iters=20",
            "--config.train.warmup_iters=5", "--config.train.log_interval=5", "--config.train.eval_interval=20",
            "--config.log.sample_tokens=20", env=optimized_env(ENV))  # bfloat16: -O0 would double its time
    assert r.returncode == 0, r.stderr[-3000:]
    assert "byte" in r.stdout and "--- sample ---" in r.stdout
    losses = [m["loss"] for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert losses[-1] < losses[0] < 6.0


def test_host_runs_ahead_of_the_device():
    """The loop's non-finite check (train.NonFiniteStop, lag 2) reads only steps two back or older:
    after each step's dispatch and check the host goes on while that step is still computing, with
    the last two steps unread; settling (at a log, evaluation or checkpoint step) reads all."""
    from jaxllm.runtime.run import Run  # noqa: PLC0415

    spec = config.get_config()
    spec.model.update(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=256, dtype="float32")
    spec.train.update(seq_length=128, micro_batch_size=8, global_batch_size=8)
    run = Run(resolve(spec, num_devices=1))
    state = run.initial_state()
    tokens = np.random.default_rng(0).integers(0, 256, (8, 129)).astype(np.int32)
    batch = run.global_batch(tokens[:, :-1], tokens[:, 1:])
    state, m = jax.block_until_ready(run.train_step(state, *batch))  # compiled
    stop = train.NonFiniteStop(limit=3, lag=2)
    for done in range(1, 7):
        state, m = run.train_step(state, *batch)
        assert stop.add(done, m) is None
        assert not m["loss"].is_ready()  # the host is ahead: this step is still running
        assert [d for d, _ in stop.pending] == list(range(max(1, done - 1), done + 1))
    assert stop.add(7, run.train_step(state, *batch)[1], settle=True) is None and not stop.pending


def test_model_dtype_auto_is_float32_on_cpus_only():
    """The default compute dtype: float32 where bfloat16 is emulated (CPUs), bfloat16 on accelerators;
    an explicit dtype is kept."""
    spec = config.get_config()
    assert spec.model.dtype == "auto"
    assert resolve(spec, num_devices=1).model.dtype == "float32"  # this machine's CPU
    for backend, dtype in (("cpu", "float32"), ("cuda", "bfloat16"), ("rocm", "bfloat16"), ("tpu", "bfloat16")):
        assert resolve_model(spec.model, seq_length=64, backend=backend).dtype == dtype
    spec.model.dtype = "bfloat16"
    assert resolve(spec, num_devices=1).model.dtype == "bfloat16"
