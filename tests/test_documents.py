"""Megatron's document options in the model and the steps: data.reset_position_ids,
data.reset_attention_mask, data.eod_mask_loss (jaxllm.data.document_masks gives the arrays).

The defining property of the first two: in a sample packed from several documents, every
document's tokens get exactly the logits that document gets alone.  The third: the loss is
sum(loss x mask) / sum(mask) over the whole global batch, whatever the micro-batch split or
layout."""

import functools
import json
import os
from pathlib import Path

import forkserver
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import assert_same_training, run_layouts

from jaxllm import config
from jaxllm.data.loader import document_masks, documents
from jaxllm.errors import DataError
from jaxllm.model import attention, gpt
from jaxllm.resolve import resolve
from jaxllm.runtime import optim, step
from jaxllm.runtime.run import Run

ROOT = Path(__file__).resolve().parents[1]
EOD = 0
DOCS = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}


def small_cfg(data=None, train=None, **model_overrides):
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, dtype="float32", vocab_size=97)
    c.model.update(**model_overrides)
    c.train.update(seq_length=24, micro_batch_size=8, global_batch_size=8, warmup_iters=0, lr=1e-3, min_lr=1e-3)
    c.train.update(**(train or {}))
    c.data.update(**(data or {}))
    return resolve(c, num_devices=1)


def packed_batch(seed, rows=8, seq=24):
    """Random tokens [rows, seq + 1] with about one end-of-document token (EOD) in five."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 97, (rows, seq + 1))
    return np.where(rng.random(tokens.shape) < 0.2, EOD, tokens).astype(np.int32)


def token_losses(graphdef, params, x, y, **kwargs):
    """Per-token cross entropy [batch, seq] from the model's full logits (plain jax.numpy)."""
    logits = jax.jit(functools.partial(gpt.forward, graphdef))(params, jnp.asarray(x), **kwargs)[..., :97]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(y)[..., None], -1)[..., 0]


@pytest.mark.parametrize("position_embedding,impl", [("learned", "xla"), ("rotary", "xla"), ("rotary", "pallas")])
def test_each_packed_document_gets_the_logits_it_gets_alone(position_embedding, impl):
    cfg = small_cfg(position_embedding=position_embedding, attention_impl=impl, num_kv_heads=2)
    graphdef, params = gpt.describe(cfg.model).graphdef, gpt.init(cfg.model, 0)
    rng = np.random.default_rng(1)
    lengths = [5, 9, 1, 9]  # four documents, each ending in EOD; 24 tokens
    docs = [np.r_[rng.integers(1, 97, n - 1), EOD].astype(np.int32) for n in lengths]
    packed = np.concatenate(docs)[None]
    positions, segments, _ = document_masks(packed, EOD, True, True, False)
    forward = jax.jit(functools.partial(gpt.forward, graphdef))
    got = forward(params, jnp.asarray(packed), positions=positions, segment_ids=segments)
    start = 0
    for doc in docs:
        alone = forward(params, jnp.asarray(doc)[None])
        np.testing.assert_allclose(got[0, start:start + len(doc)], alone[0], atol=2e-5)
        start += len(doc)
    # and without the options the later documents see the earlier ones: the test can fail
    plain = forward(params, jnp.asarray(packed))
    assert np.abs(plain[0, 5:] - got[0, 5:]).max() > 1e-2


def test_masked_loss_and_gradient_equal_the_hand_computed_token_mean():
    cfg = small_cfg(DOCS)
    spec, params = gpt.describe(cfg.model), gpt.init(cfg.model, 0)
    tokens = packed_batch(2)
    x, y = tokens[:, :-1], tokens[:, 1:]
    positions, segments, mask = document_masks(x, EOD, True, True, True)
    assert 0 < mask.sum() < mask.size
    kw = dict(positions=positions, segment_ids=segments)

    def reference(p):  # sum(loss x mask) / sum(mask) from the full logits, autodiff's gradient
        return jnp.sum(token_losses(spec.graphdef, p, x, y, **kw) * mask) / mask.sum()

    def fused(p):  # the model's chunked output loss with its own gradient
        return gpt.loss(spec.graphdef, p, x, y, **kw, loss_mask=mask) / mask.sum()

    (want, want_g), (got, got_g) = (jax.jit(jax.value_and_grad(f))(params) for f in (reference, fused))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got_g, want_g)


def test_micro_batches_give_the_global_token_mean():
    """Rows with very different mask counts: averaging per-micro-batch means would differ; the global
    token mean does not depend on the split.  Plain SGD at lr 1: each parameter moves by its gradient, so
    the parameters compare the gradients (Adam's first step, g / (|g| + eps), would turn a gradient near 0,
    whose float32 cancellation error of ~1e-11 the split moves, into steps that differ by lr x 1e-3)."""
    cfg = small_cfg(DOCS, train={"optimizer": "sgd", "sgd_momentum": 0.0, "lr": 1.0, "min_lr": 1.0})
    spec = gpt.describe(cfg.model)
    opt = optim.make_optimizer(cfg.train, spec.decay)
    train_step = jax.jit(step.make_train_step(cfg, spec, opt))
    tokens = packed_batch(3)
    tokens[:2, :-1:2] = EOD  # the first micro batch of four has many masked tokens
    x, y = tokens[:, :-1], tokens[:, 1:]
    arrays = dict(zip(("positions", "segment_ids", "loss_mask"), document_masks(x, EOD, True, True, True)))
    split = lambda a, m: a.reshape(m, -1, a.shape[-1])  # noqa: E731
    params = gpt.init(cfg.model, 0)
    losses = token_losses(spec.graphdef, params, x, y, positions=arrays["positions"],
                          segment_ids=arrays["segment_ids"])
    mask = arrays["loss_mask"]
    one, m1 = train_step(step.init_state(gpt.init(cfg.model, 0), opt), x[None], y[None],
                         {k: v[None] for k, v in arrays.items()})
    four, m4 = train_step(step.init_state(gpt.init(cfg.model, 0), opt), split(x, 4), split(y, 4),
                          {k: split(v, 4) for k, v in arrays.items()})
    want = float(jnp.sum(losses * mask) / mask.sum())  # by hand from the full logits
    np.testing.assert_allclose(m1["loss"], want, rtol=1e-6)
    np.testing.assert_allclose(m4["loss"], want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), four["params"], one["params"])
    # the mean of the micro batches' (rows 0-1, 2-3, ...) own means is another number
    per_micro = np.mean([float(jnp.sum(losses[i:i + 2] * mask[i:i + 2]) / mask[i:i + 2].sum()) for i in range(0, 8, 2)])
    assert abs(per_micro - want) > 1e-3


class Validation:
    """``eval_batch(i)`` as jaxllm.data.loader.Batches gives it with the three options."""

    def eval_batch(self, i):
        tokens = packed_batch(10 + i)
        x = tokens[:, :-1]
        arrays = dict(zip(("positions", "segment_ids", "loss_mask"), document_masks(x, EOD, True, True, True)))
        return x, tokens[:, 1:], arrays


def test_evaluation_is_the_masked_token_mean_over_every_batch():
    cfg = small_cfg(DOCS, train={"eval_iters": 3})
    run = Run(cfg)
    assert run.documents == ("positions", "segment_ids", "loss_mask")
    state = run.initial_state()
    params = jax.device_get(state["params"])
    total = count = 0.0
    for i in range(3):
        x, y, d = Validation().eval_batch(i)
        losses = token_losses(run.spec.graphdef, params, x, y, positions=d["positions"], segment_ids=d["segment_ids"])
        total += float(jnp.sum(losses * d["loss_mask"]))
        count += float(d["loss_mask"].sum())
    assert run.evaluate(state["params"], Validation()) == pytest.approx(total / count, rel=1e-6)
    with pytest.raises(ValueError, match="positions"):  # a batch without the arrays the options ask for
        run.global_batch(*Validation().eval_batch(0)[:2])


def test_no_options_no_docs_argument():
    run = Run(small_cfg())
    assert run.documents == ()
    tokens = packed_batch(4)
    assert len(run.global_batch(tokens[:, :-1], tokens[:, 1:])) == 2


def test_pipeline_parallelism_refuses_the_options():
    c = config.get_config()
    c.data.reset_attention_mask = True
    c.mesh.pipeline = 2
    with pytest.raises(config.ConfigError) as e:
        resolve(c, num_devices=2)
    assert e.value.key == "data.reset_attention_mask" and "mesh.pipeline=1" in str(e.value)


def test_max_documents_per_sample_is_checked():
    """``data.max_documents_per_sample``: at most ``train.seq_length`` (before anything compiles), and a
    batch with a sample of more documents stops the run before its step (the bound is cuDNN's shapes')."""
    c = config.get_config()
    c.data.max_documents_per_sample = c.train.seq_length + 1
    with pytest.raises(config.ConfigError) as e:
        resolve(c, num_devices=1)
    assert e.value.key == "data.max_documents_per_sample" and f"<= {c.train.seq_length}" in str(e.value)
    tokens = np.array([[5, EOD, 6, EOD, 7, 7], [5, 5, 5, 5, EOD, EOD]], np.int32)  # 3 documents, then 2
    options = config.Data(reset_attention_mask=True, max_documents_per_sample=3)
    np.testing.assert_array_equal(documents(tokens, EOD, options)["segment_ids"], [[0, 0, 1, 1, 2, 2],
                                                                                  [0, 0, 0, 0, 0, 1]])
    options.max_documents_per_sample = 2
    with pytest.raises(DataError, match="holds 3 documents, more than data.max_documents_per_sample=2"):
        documents(tokens, EOD, options)


HOPPER = jax.default_backend() == "gpu" and tuple(
    int(p) for p in str(getattr(jax.devices()[0], "compute_capability", "0.0")).split(".")[:2]) >= (9, 0)


@pytest.mark.skipif(not HOPPER, reason="cuDNN's packed attention needs an NVIDIA GPU of compute capability 9.0")
def test_cudnn_packed_documents_train_as_the_xla_reference():
    """``data.reset_attention_mask`` in bfloat16 on the GPU: five Adam steps with ``attention_impl=cudnn`` and
    a bound on documents per sample (its compiled step calls cuDNN's packed attention and no Triton kernel)
    give the ``xla`` reference's losses."""
    losses = {}
    batches = [packed_batch(seed, seq=256) for seed in range(5)]
    for impl in ("xla", "cudnn"):
        cfg = small_cfg({"reset_attention_mask": True, "max_documents_per_sample": 256}, {"seq_length": 256},
                        attention_impl=impl, hidden_size=256, num_attention_heads=4, num_kv_heads=2, dtype="bfloat16")
        kernel = attention.implementation(cfg.model, cfg.data.max_documents_per_sample)  # as Run's ops bind it
        spec = gpt.describe(cfg.model, gpt.Ops(attention=gpt.PlainAttention(kernel)))
        opt = optim.make_optimizer(cfg.train, spec.decay)
        train_step = jax.jit(step.make_train_step(cfg, spec, opt))
        state = step.init_state(gpt.init(cfg.model, 0), opt)
        args = [(t[None, :, :-1], t[None, :, 1:], {"segment_ids": document_masks(t[:, :-1], EOD, False, True,
                                                                               False)[1][None]}) for t in batches]
        if impl == "cudnn":
            hlo = train_step.lower(state, *args[0]).compile().as_text()
            assert "__cudnn$fmha" in hlo and "triton" not in hlo.lower()
        losses[impl] = []
        for batch in args:
            state, metrics = train_step(state, *batch)
            losses[impl].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["cudnn"], losses["xla"], rtol=1e-2)


LAYOUTS = {
    "single": {"data": DOCS, "eval": True},
    "data2_fsdp2_tensor2": {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "data": DOCS, "eval": True},
    "zero3_fsdp4_tensor2": {"mesh": {"fsdp": 4, "tensor": 2}, "parallel": {"zero_stage": 3}, "data": DOCS},
    # sequence parallelism: segment ids gathered (allgather, ulysses) or sent round with the keys (ring, whose
    # zigzag order reorders the positions, segment ids and loss mask while the causal mask follows the sequence)
    "sequence2_data2_tensor2_ring": {"mesh": {"sequence": 2, "data": 2, "tensor": 2},
                                     "parallel": {"sequence_impl": "ring"}, "data": DOCS, "eval": True},
    "sequence4_fsdp2_allgather": {"mesh": {"sequence": 4, "fsdp": 2}, "parallel": {"sequence_impl": "allgather"},
                                  "data": DOCS},
    "sequence4_tensor2_ulysses": {"mesh": {"sequence": 4, "tensor": 2}, "parallel": {"sequence_impl": "ulysses"},
                                  "data": DOCS},
    "sequence4_data2_usp2": {"mesh": {"sequence": 4, "data": 2},  # ids gathered in a group, sent round the ring
                             "parallel": {"sequence_impl": "usp", "ulysses_degree": 2}, "data": DOCS, "eval": True},
}


@pytest.fixture(scope="module")
def layouts():
    return run_layouts(LAYOUTS, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_layouts_with_documents_match_one_device(layouts, name):
    assert_same_training(layouts[name], layouts["single"])
    if LAYOUTS[name].get("eval"):
        assert layouts[name]["eval_loss"] == pytest.approx(layouts["single"]["eval_loss"], rel=1e-5)


def cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return forkserver.run(["-m", "jaxllm.train", *args], env, ROOT, 600)


def test_training_cli_with_the_options_on_real_documents(shakespeare_gpt2, tmp_path):
    """Tiny Shakespeare's speeches (GPT-2 BPE, an EOD after each): several documents per sample."""
    flags = [f"--config.data.input={shakespeare_gpt2}", "--config.data.tokenizer=gpt2",  # the shipped GPT-2 files
             f"--config.data.cache_dir={tmp_path}",
             "--config.model.num_layers=2", "--config.model.hidden_size=64", "--config.model.num_attention_heads=4",
             "--config.model.dtype=float32", "--config.train.seq_length=64", "--config.train.micro_batch_size=2",
             "--config.train.global_batch_size=4", "--config.train.train_iters=4", "--config.train.warmup_iters=1",
             "--config.train.eval_interval=4", "--config.train.eval_iters=2", "--config.train.log_interval=2",
             "--config.log.samples=0", *(f"--config.data.{k}=True" for k in DOCS)]
    r = cli(f"--workdir={tmp_path / 'run'}", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [m["loss"] for m in lines if m["kind"] == "train"]
    evals = [m["eval_loss"] for m in lines if m["kind"] == "eval"]
    assert len(train_losses) == 2 and len(evals) == 1 and all(np.isfinite(train_losses + evals))


def test_options_without_an_eod_token_are_one_line_exit_2(stdlib_byte, tmp_path):
    r = cli(f"--workdir={tmp_path / 'run'}", f"--config.data.input={stdlib_byte}", "--config.data.tokenizer=byte",
            "--config.data.eod_mask_loss=True")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("data error:") and "end-of-document" in lines[0], r.stderr
