"""jaxllm.runtime.flops, jaxllm.platform.hardware, jaxllm.runtime.metrics: FLOP counts against hand counts and
Megatron-LM's formulas, the peak table, the measured CPU peak, and MetricsLogger's files and lines."""

import glob
import json
import os
import select
import struct
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jaxllm import config
from jaxllm.platform import hardware
from jaxllm.resolve import resolve
from jaxllm.runtime import flops, metrics


def make_cfg(activation="gelu", remat="none", train=None, **model):
    """A resolved config; the vocabulary unpadded, so that the counts below see exactly ``V``."""
    cfg = config.get_config()
    cfg.model.update(activation=activation, remat=remat, make_vocab_size_divisible_by=1, **model)
    cfg.train.update(**(train or {}))
    return resolve(cfg, num_devices=1)


TINY = dict(num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1, ffn_hidden_size=32, vocab_size=10)
STEP = dict(seq_length=4, global_batch_size=6, micro_batch_size=6)


# --- flops_per_token: a hand count ---------------------------------------------------------
# L=2, h=8, heads n=2, kv heads k=1, head dim d=h/n=4, f=32, V=10, s=4; forward per token:
#   QKV      2*h*(n+2k)*d    = 2*8*4*4         = 256
#   attn     2*2*s*n*d / 2   = 2*2*4*2*4 / 2   = 64      (causal: half of 128)
#   out proj 2*h*h           = 2*8*8           = 128
#   MLP gelu 2*h*f*2         = 2*8*32*2        = 1024    -> layer 1472
#   MLP swiglu 2*h*f*3       = 2*8*32*3        = 1536    -> layer 1984
#   logits   2*h*V           = 2*8*10          = 160
# train = 3*(L*layer) + 3*logits; recompute = 4*(L*layer) + 3*logits:
#   gelu:   3*2944 + 480 = 9312,   4*2944 + 480 = 12256
#   swiglu: 3*3968 + 480 = 12384,  4*3968 + 480 = 16352
@pytest.mark.parametrize("activation, plain, recomputed", [("gelu", 9312, 12256), ("swiglu", 12384, 16352)])
def test_flops_per_token_hand_count(activation, plain, recomputed):
    m = make_cfg(activation, **TINY).model
    assert flops.flops_per_token(m, 4) == plain
    assert flops.flops_per_token(m, 4, recompute=True) == recomputed


def test_flops_per_token_with_a_sliding_window():
    """A window of w = 3 of s = 4 positions: queries attend to 1, 2, 3, 3 keys, 9/4 on average = w - w^2/(2s)
    (about: 3 - 9/8 = 1.875), against s/2 = 2 without; the attention matmuls scale by 1.875/2, the rest is the same;
    a window of at least s changes nothing."""
    m = make_cfg("gelu", **TINY).model
    windowed, full = (flops.flops_per_token(make_cfg("gelu", **TINY, sliding_window=w).model, 4) for w in (3, 4))
    attention = 3 * 2 * 64  # the causal attention matmuls of the hand count above: train = 3 x forward, 2 layers
    assert full == flops.flops_per_token(m, 4) == 9312
    assert windowed == 9312 - attention + attention * 1.875 / 2


def test_flops_per_token_with_wider_heads():
    """Heads of model.kv_channels = 8, twice h/n (as Qwen3-30B-A3B's 128 of 2048 / 32): QKV 2*8*4*8 = 512, attention
    2*2*4*2*8 / 2 = 128, out proj 2*(n*d)*h = 256, the MLP's 1024 and the logits' 160 as above:
    3*2*(512 + 128 + 256 + 1024) + 3*160 = 12000."""
    assert flops.flops_per_token(make_cfg("gelu", **TINY, kv_channels=8).model, 4) == 12000


# --- multi-head latent attention (DeepSeek-V2 section 2.1): a hand count ---------------------------------------
# TINY's L=2, h=8, n=2 heads, f=32 (gelu), V=10, s=4 with query latent rq=4, key/value latent rkv=6, per head
# dn=4 query/key dimensions without position, dr=2 rotary ones (dq = 6), values dv=3; forward per token and layer:
#   queries  2*rq*h + 2*rq*n*dq = 64 + 96          = 160   (no latent, rq=0: 2*h*n*dq = 192)
#   kv_a     2*h*(rkv + dr)     = 2*8*8            = 128
#   kv_b     2*rkv*n*(dn + dv)  = 2*6*2*7          = 168
#   scores   2*(s/2)*n*dq       = 2*2*2*6          = 48
#   values   2*(s/2)*n*dv       = 2*2*2*3          = 24
#   out proj 2*n*dv*h           = 2*2*3*8          = 96
#   MLP      2*h*f*2                               = 1024  -> layer 1648 (1680 without the query latent)
# train = 3*(2*layer) + 3*logits (160): 10368 (10560); Megatron-LM's uncausal attention adds 3*L*(48 + 24) = 432
MLA_TINY = dict(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=32, vocab_size=10,
                multi_latent_attention=True, position_embedding="rotary", use_bias=False, kv_lora_rank=6,
                qk_head_dim=4, qk_pos_emb_head_dim=2, v_head_dim=3)


@pytest.mark.parametrize("q_lora_rank, plain", [(4, 10368), (0, 10560)])
def test_multi_latent_attention_flops_hand_count(q_lora_rank, plain):
    cfg = make_cfg("gelu", train=STEP, q_lora_rank=q_lora_rank, **MLA_TINY)
    assert flops.flops_per_token(cfg.model, 4) == plain
    assert flops.flops_per_token(cfg.model, 4, recompute=True) == plain + (plain - 480) / 3
    assert flops.megatron_flops_per_step(cfg) == 24 * (plain + 432)  # 24 tokens a step
    assert flops.hardware_flops_by_kind(make_cfg("gelu", train=STEP, q_lora_rank=q_lora_rank, **MLA_TINY))[
        "attention"] == 24 * 3 * 2 * (48 + 24)


# Recomputed forward matmuls per token and layer by policy, from the hand count above (swiglu: the MLP's
# 1536 is up 512 + gate 512 + down 512; scores and values 32 each): full 1984; minimal and save_dots
# 64 (scores + values); minimal_with_context 32 (scores); save_dots_except_mlp 64 + 1536;
# save_qkv_proj 64 + 128 + 1536.
@pytest.mark.parametrize("remat, per_layer", [
    ("none", 0), ("full", 1984), ("minimal", 64), ("save_dots", 64), ("minimal_with_context", 32),
    ("save_dots_except_mlp", 1600), ("save_qkv_proj", 1728), ("minimal_offloaded", 64),
    ("qkv_proj_offloaded", 1728), ("offload", 1984)])
def test_recompute_flops_of_every_policy_hand_count(remat, per_layer):
    m = make_cfg("swiglu", **TINY).model
    assert flops.recompute_flops_per_token(m, 4, remat) == 2 * per_layer
    # the chunked MLP recomputes each chunk in its backward pass: one more forward of the MLP, 1536
    chunked = make_cfg("swiglu", train={"seq_length": 4}, mlp_chunks=2, **TINY).model
    assert flops.recompute_flops_per_token(chunked, 4, remat) == 2 * (per_layer + 1536)


def test_recompute_is_four_thirds_of_the_layer_part():
    # The layer part is everything but the logits (3 * 2*h*V per token, never recomputed).
    m = make_cfg("swiglu", num_layers=3, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=192, vocab_size=1000).model
    logits = 3 * 2 * 64 * 1000
    plain = flops.flops_per_token(m, 128) - logits
    recomputed = flops.flops_per_token(m, 128, recompute=True) - logits
    assert recomputed == pytest.approx(4 / 3 * plain, rel=1e-12)


def test_matches_megatron_after_adding_back_uncausal_attention():
    # Narayanan et al. 2021 (f = 4h, MHA): 72*B*s*L*h^2*(1 + s/(6h) + V/(12Lh)) FLOPs per
    # iteration without recompute, 96*B*s*L*h^2*(1 + s/(6h) + V/(16Lh)) with it. Per token
    # (divide by B*s). Megatron counts the full s x s attention; we count half, i.e.
    # 3*L*(2*s*h) less (4*L*(2*s*h) with recompute).
    L, h, n, V, s = 3, 64, 4, 1000, 128
    m = make_cfg("gelu", num_layers=L, hidden_size=h, num_attention_heads=n, num_kv_heads=n,
                 ffn_hidden_size=4 * h, vocab_size=V).model
    megatron = 72 * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    megatron_recompute = 96 * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert flops.flops_per_token(m, s) + 3 * L * 2 * s * h == pytest.approx(megatron, rel=1e-12)
    assert flops.flops_per_token(m, s, recompute=True) + 4 * L * 2 * s * h == pytest.approx(
        megatron_recompute, rel=1e-12)


def test_matches_megatron_code_formula_for_gqa_swiglu():
    # Megatron-LM's num_floating_point_operations (megatron/training/training.py), per token:
    # 12*L*h^2*(1 + (f/h)*3/2 + k/n + s/h + V/(2*L*h)), attention not halved.
    L, h, n, k, f, V, s = 2, 128, 8, 2, 352, 512, 256
    m = make_cfg("swiglu", num_layers=L, hidden_size=h, num_attention_heads=n, num_kv_heads=k,
                 ffn_hidden_size=f, vocab_size=V).model
    megatron = 12 * L * h**2 * (1 + f / h * 3 / 2 + k / n + s / h + V / (2 * L * h))
    assert flops.flops_per_token(m, s) + 3 * L * 2 * s * h == pytest.approx(megatron, rel=1e-12)


def test_flops_per_step_and_recompute_default():
    cfg = make_cfg("gelu", train=STEP, **TINY)
    assert flops.flops_per_step(cfg) == 6 * 4 * 9312
    assert flops.flops_per_step(cfg, recompute=True) == 6 * 4 * 12256
    assert flops.flops_per_step(make_cfg("gelu", "full", train=STEP, **TINY)) == 6 * 4 * 12256
    # save_dots keeps matmul outputs: no matmul is recomputed
    assert flops.flops_per_step(make_cfg("gelu", "save_dots", train=STEP, **TINY)) == 6 * 4 * 9312


def test_unresolved_config_raises():
    with pytest.raises(ValueError, match="resolved"):
        flops.flops_per_token(config.get_config().model, 16)


def test_throughput():
    cfg = make_cfg("gelu", remat="full", train=STEP, **TINY)
    out = flops.throughput(0.5, cfg, num_devices=2, peak_flops=1e6)
    assert out["tokens_per_sec"] == 48 and out["tokens_per_sec_per_device"] == 24
    assert out["mfu"] == pytest.approx(24 * 9312 / 1e6)  # model FLOPs: no recompute
    assert out["hfu"] == pytest.approx(24 * 12256 / 1e6)  # hardware FLOPs: remat=full
    assert out["tflops_per_device"] == pytest.approx(24 * 9312 / 1e12)


# --- peak FLOP/s ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind, bf16, fp32", [
    ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12),
    ("NVIDIA A100-PCIE-40GB", 312e12, 19.5e12),
    ("NVIDIA H100 80GB HBM3", 989e12, 67e12),
    ("NVIDIA H100 PCIe", 756e12, 51e12),
    ("NVIDIA H100 NVL", 835e12, 60e12),
    ("NVIDIA H200", 989e12, 67e12),
    ("NVIDIA GH200 480GB", 989e12, 67e12),
    ("Tesla V100-SXM2-16GB", 125e12, 15.7e12),
    ("AMD Instinct MI250X", 191.5e12, 47.85e12),
    ("AMD Instinct MI300X", 1307.4e12, 163.4e12),
])
def test_peak_table(kind, bf16, fp32):
    gpu = types.SimpleNamespace(device_kind=kind, platform="gpu")
    for dtype, want in (("bfloat16", bf16), (jnp.float16, bf16), ("float32", fp32)):
        peak, source = hardware.peak_flops_per_device(gpu, dtype)
        assert peak == pytest.approx(want, rel=1e-9), (kind, dtype)
        assert source.startswith("datasheet")


def test_unknown_gpu_is_measured(monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "_measure_matmul", lambda device, dtype, n: calls.append(n) or 1.5e12)
    monkeypatch.setattr(hardware, "_MEASURED", {})
    gpu = types.SimpleNamespace(device_kind="NVIDIA GeForce RTX 9090", platform="gpu")
    assert hardware.peak_flops_per_device(gpu) == (1.5e12, "measured matmul on 'NVIDIA GeForce RTX 9090' "
                                                            "(not in PEAK_FLOPS) (8192x8192 bfloat16)")
    hardware.peak_flops_per_device(gpu)
    assert calls == [8192]  # cached


def test_cpu_peak_is_measured_once():
    cpu = jax.devices("cpu")[0]
    peak, source = hardware.peak_flops_per_device(cpu, "bfloat16")
    assert source == "measured matmul on cpu (1024x1024 bfloat16)"
    assert 1e8 < peak < 1e14  # positive and plausible for a CPU
    start = time.perf_counter()
    again = hardware.peak_flops_per_device(cpu, jnp.bfloat16)
    assert time.perf_counter() - start < 0.05
    assert again == (peak, source)


# --- MetricsLogger -------------------------------------------------------------------------
def read_events(directory):
    """(tag, step, value) of every scalar in the TFRecord event files under ``directory``."""
    files = glob.glob(os.path.join(directory, "events.out.tfevents.*"))
    assert files and all(os.path.getsize(f) > 0 for f in files)
    scalars = []
    for name in files:
        data = open(name, "rb").read()
        pos = 0
        while pos < len(data):  # record: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                scalars.append((v.tag, event.step, v.simple_value))
    return scalars


def strict_json(line):
    def reject(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=reject)


def test_tensorboard_logging_leaves_torch_unimported_and_importable(tmp_path):
    """tensorboardX imports torch, where installed (1.5 s of every run's start here), only to accept torch tensors:
    a run's logger writes its events without it, and a later ``import torch`` still works."""
    code = ("import sys\nfrom jaxllm.runtime import metrics\n"
            f"with metrics.MetricsLogger({str(tmp_path / 'run')!r}) as log:\n    log.log(3, {{'loss': 1.5}})\n"
            "print('torch' in sys.modules)\nimport torch\nprint(float(torch.tensor(2.5)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0 and r.stdout.splitlines()[-2:] == ["False", "2.5"], r.stderr[-2000:]
    assert ("train/loss", 3, 1.5) in read_events(str(tmp_path / "run" / "tensorboard"))


def test_logger_writes_jsonl_tensorboard_and_lines(tmp_path, capsys):
    workdir = tmp_path / "run"
    with metrics.MetricsLogger(str(workdir), total_steps=600) as log:
        log.log(200, {"loss": jnp.float32(2.1034), "lr": np.float32(9.8e-4), "grad_norm": 0.83,
                      "tokens_per_sec": 12300.0, "tflops_per_device": 0.05, "mfu": 0.121,
                      "step_time_s": 0.061, "hfu": 0.121, "tokens_per_sec_per_device": 12300.0})
        log.log(200, {"eval_loss": jnp.asarray(1.9876), "eval_bpb": 2.8675}, kind="eval")
        log.log(201, {"loss": float("nan"), "tokens": np.int64(7)})
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    train, evaluation, diverged = map(strict_json, lines)
    assert train["step"] == 200 and train["kind"] == "train"
    assert type(train["loss"]) is float and train["loss"] == pytest.approx(2.1034, rel=1e-6)
    assert set(train) == {"step", "kind", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device",
                          "mfu", "step_time_s", "hfu", "tokens_per_sec_per_device"}
    assert evaluation == {"step": 200, "kind": "eval", "eval_loss": pytest.approx(1.9876), "eval_bpb": 2.8675}
    assert diverged == {"step": 201, "kind": "train", "loss": None, "tokens": 7}

    scalars = read_events(str(workdir / "tensorboard"))
    assert ("train/loss", 200, pytest.approx(2.1034, rel=1e-6)) in scalars
    assert ("eval/eval_bpb", 200, pytest.approx(2.8675, rel=1e-6)) in scalars
    assert ("train/tokens", 201, 7.0) in scalars
    assert sum(tag == "train/mfu" for tag, _, _ in scalars) == 1

    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("step   200 | loss 2.1034 | lr 9.8e-04 | grad 0.83 | 12.3k tok/s | 0.05 TFLOP/s/dev"
                      " | MFU 12.1% | 0.061 s/step")
    assert out[1] == "step   200 | eval loss 1.9876 | bpb 2.8675"
    assert out[2].startswith("step   201 | loss nan | tokens 7")


def test_logger_appends(tmp_path, capsys):
    for step in (1, 2):
        with metrics.MetricsLogger(str(tmp_path), tensorboard=False) as log:
            log.log(step, {"loss": 1.0})
    assert [strict_json(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (tmp_path / "tensorboard").exists()


def session_starts(directory):
    """Per event file in name order (TensorBoard's), the steps of its SessionLog.START events."""
    starts = []
    for name in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        data, pos, found = open(name, "rb").read(), 0, []
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            if event.session_log.status == event_pb2.SessionLog.START:
                found.append(event.step)
        starts.append(found)
    return starts


class WandbRun:
    """What the logger calls of a W&B run (``log``, ``finish``), recorded: W&B's own side is tests/test_wandb.py's."""

    def __init__(self):
        self.steps = []

    def log(self, values, step):
        self.steps.append(step)

    def finish(self, exit_code):
        pass


def test_a_resumed_run_supersedes_the_steps_it_runs_again(tmp_path, capsys):
    """Steps 1-5 logged, then the run resumes from its checkpoint at step 3 and logs 4-6 again: metrics.jsonl holds
    each step once (the resumed run's rows after 3), the resumed TensorBoard file starts a session at step 4 (whence
    TensorBoard drops the older files' events), and W&B, which holds 1-5 already, is sent only step 6."""
    def run(steps, resumed_at, wandb=None, base=0.0):
        with metrics.MetricsLogger(str(tmp_path), resumed_at=resumed_at, wandb=wandb) as log:
            for step in steps:
                log.log(step, {"loss": base + step})
                if step % 2 == 0:
                    log.log(step, {"eval_loss": base + step}, kind="eval")

    run(range(1, 6), 0)
    time.sleep(1.1)  # the next event file's name (its start second) sorts after the first's, as TensorBoard reads
    wandb = WandbRun()
    run(range(4, 7), 3, wandb, base=10.0)
    rows = [strict_json(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in rows] == [(1, "train"), (2, "train"), (2, "eval"), (3, "train"),
                                                      (4, "train"), (4, "eval"), (5, "train"), (6, "train"),
                                                      (6, "eval")]
    assert [r.get("loss", r.get("eval_loss")) for r in rows] == [1, 2, 2, 3, 14, 14, 15, 16, 16]
    assert session_starts(str(tmp_path / "tensorboard")) == [[1], [4]]
    assert wandb.steps == [6, 6]


def test_disabled_logger_does_nothing(tmp_path, capsys):
    workdir = tmp_path / "rank1"
    log = metrics.MetricsLogger(str(workdir), enabled=False, total_steps=10)
    log.log(1, {"loss": 1.0})
    log.log(1, {"eval_loss": 1.0}, kind="eval")
    log.advance()
    log.close()
    assert not workdir.exists()
    assert capsys.readouterr() == ("", "")


def test_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    """On a real terminal (a pseudo-terminal) that says it is 0 columns wide, as `script`'s and some batch consoles'
    are: the bar is drawn at a fixed width, the log lines above it."""
    master, slave = os.openpty()
    assert os.get_terminal_size(slave).columns == 0
    terminal = open(slave, "w", buffering=1)  # noqa: SIM115  (closed below)
    monkeypatch.setattr(sys, "stdout", terminal)
    with metrics.MetricsLogger(str(tmp_path), tensorboard=False, total_steps=10) as log:
        log.advance(3)
        log.log(3, {"loss": 1.5})
        log.advance(2)
    terminal.close()
    out = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            out += os.read(master, 1 << 16)
        except OSError:  # the other side closed
            break
    os.close(master)
    text = out.decode()
    assert "step     3 | loss 1.5000" in text
    assert "5/10 [" in text and "step/s" in text, text


def test_logger_rejects_bad_input(tmp_path, capsys):
    with metrics.MetricsLogger(str(tmp_path), tensorboard=False) as log:
        with pytest.raises(ValueError):
            log.log(1, {"loss": 1.0}, kind="test")
        with pytest.raises(ValueError):
            log.log(1, {"step": 1})
        with pytest.raises(TypeError):
            log.log(1, {"loss": np.ones(3)})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_plot_of_a_resumed_run(tmp_path, capsys):
    from jaxllm import plot

    with metrics.MetricsLogger(str(tmp_path), tensorboard=False) as log:
        for s in (1, 2, 3):
            log.log(s, {"loss": 9.0 - s})
        log.log(3, {"eval_loss": 6.5, "unigram_entropy": 7.0}, kind="eval")
    with metrics.MetricsLogger(str(tmp_path), tensorboard=False) as log:  # resumed from step 2: 3 again
        for s in (3, 4):
            log.log(s, {"loss": 8.0 - s})
        log.log(4, {"eval_loss": 5.25, "unigram_entropy": 7.0}, kind="eval")
    capsys.readouterr()
    runs = plot.read_metrics(str(tmp_path))
    assert {s: r["loss"] for s, r in runs["train"].items()} == {1: 8.0, 2: 7.0, 3: 5.0, 4: 4.0}  # later record wins
    assert plot.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 4: validation loss 5.2500 nats/token" in out and "1.7500 nats below it" in out
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert plot.main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl: not found" in err and len(err.splitlines()) == 1
