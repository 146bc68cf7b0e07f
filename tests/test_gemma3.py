"""Gemma 3 (jaxllm.families.gemma3) against transformers' Gemma3ForCausalLM, float32 on the CPU: a tiny random model of
6 layers, two local ones (a window of 8 of the 32 positions, rotary base 100) before each global one (base 500,
linearly scaled by 2), (1 + w) norms before and after attention and the MLP, GeGLU, scaled embeddings, query/key norms
and query_pre_attn_scalar 24 (not the head size 16).  Its logits imported, exported and re-imported; each mechanism
switched off changes them; the period scan equals the layers written out; the layouts tensor x data x fsdp, ring
sequence parallelism and pipeline stages with the pattern train as one device; FLOPs and parameters counted by hand
and against transformers for the published sizes; the padding row (pad_token_id in the batch): every gradient is
transformers'."""

import dataclasses
import math

import jax
import numpy as np
import pytest
import torch
import transformers
from harness import assert_same_training, run_layouts
from test_convert import F32, SEQ, TOL, VOCAB, exports_back, hf_logits, jax_logits, randomize, tokens

from jaxllm import config
from jaxllm.errors import ConfigError, ConvertError
from jaxllm.families import gemma3, registry
from jaxllm.formats import hf_workdir
from jaxllm.formats.hf import hf_architecture, model_from_hf, to_hf
from jaxllm.model import gpt
from jaxllm.model.groups import LayerKind
from jaxllm.resolve import resolve, resolve_model
from jaxllm.runtime import flops

ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(directory, transformers' logits on tokens()) of the tiny random Gemma 3."""
    torch.manual_seed(0)
    m = randomize(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=SEQ, sliding_window=8,
        sliding_window_pattern=3, query_pre_attn_scalar=24, rope_parameters=ROPE)), seed=5)
    d = tmp_path_factory.mktemp("gemma3")
    m.save_pretrained(d, safe_serialization=True)
    return str(d), hf_logits(m, tokens())


def test_import_matches_transformers_and_exports_back(gemma, tmp_path):
    d, ref = gemma
    cfg, params = hf_workdir.from_hf(d, F32)
    m = cfg.model
    assert {k: getattr(m, k) for k in gemma3.PRESET} == gemma3.PRESET
    assert (m.window_attn_skip_freq, m.sliding_window, m.local_rotary_base, m.rotary_base,
            m.rotary_seq_len_interpolation_factor, m.head_dim) == ("3", 8, 100.0, 500.0, 2.0, 16)
    assert math.isclose(m.softmax_scale, 24 ** -0.5)
    local, full = LayerKind(False, 8, 100.0), LayerKind(False, 0, 0.0)
    assert [(g.name, g.pattern, g.num_layers) for g in gpt.layer_groups(m)] == [("layers", (local, local, full), 6)]
    out = jax_logits(m, params, tokens())
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(jax_logits(dataclasses.replace(m, layer_loop="unrolled"), params, tokens()), out,
                               rtol=1e-6, atol=1e-6)  # the period scan is the layers one by one
    for change in (dict(apply_layernorm_1p=False), dict(scale_embeddings=False), dict(softmax_scale=0.0),
                   dict(window_attn_skip_freq=""), dict(local_rotary_base=0.0),
                   dict(rotary_seq_len_interpolation_factor=1.0)):  # each mechanism changes these logits
        assert np.abs(jax_logits(dataclasses.replace(m, **change), params, tokens()) - ref).max() > 100 * TOL, change

    hf_config, _ = to_hf(m, params)
    assert hf_config["architectures"] == ["Gemma3ForCausalLM"] and hf_config["query_pre_attn_scalar"] == 24
    exports_back(m, params, d, ref, tmp_path / "back")


PAD = 7  # config.json's pad_token_id (transformers' default 0 would also be a common token here)


def test_the_padding_row_gets_transformers_gradients(tmp_path):
    """transformers' embedding is an nn.Embedding(padding_idx=pad_token_id): with the pad id in the batch, every
    gradient of the mean cross entropy on the imported model is transformers' (the zero pad row's too: only the tied
    output layer's part, none from the lookup), where the lookup's part of it, through the scaled embedding and the
    (1 + w) norm of a zero vector, is ~1e14; the row is zero in the import and in a fresh init, and exported back."""
    torch.manual_seed(0)
    hf = randomize(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=SEQ, sliding_window=8,
        sliding_window_pattern=2, query_pre_attn_scalar=24, rope_parameters=ROPE, pad_token_id=PAD)), seed=3)
    with torch.no_grad():
        hf.model.embed_tokens.weight[PAD] = 0  # as transformers initializes it (and Google's checkpoints hold it)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    toks = tokens(batch=2, seq=SEQ + 1, seed=1)
    toks[:, ::5] = PAD
    inputs, targets = toks[:, :-1], toks[:, 1:]

    def torch_grads():
        hf.zero_grad()
        logits = hf(torch.tensor(inputs, dtype=torch.long)).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.tensor(targets, dtype=torch.long).flatten(),
                                          ).backward()
        return {n: p.grad.numpy().copy() for n, p in hf.named_parameters()}

    ref = torch_grads()
    hf.model.embed_tokens.padding_idx = None  # the lookup's gradient of the row too: what jaxllm gave before
    lookup = torch_grads()["model.embed_tokens.weight"][PAD] - ref["model.embed_tokens.weight"][PAD]

    cfg, params = hf_workdir.from_hf(str(tmp_path), F32)
    m = cfg.model
    assert m.pad_token_id == PAD and not params["wte"][PAD].any() and not np.asarray(gpt.init(m, 0)["wte"][PAD]).any()
    graphdef = gpt.describe(m).graphdef
    grads = jax.jit(jax.grad(lambda p: gpt.loss(graphdef, p, inputs, targets) / inputs.size))(params)
    hf_config, ours = to_hf(m, grads)
    assert sorted(ours) == sorted(ref) and hf_config["pad_token_id"] == PAD
    for name in ref:
        np.testing.assert_allclose(ours[name], ref[name], atol=1e-4, rtol=0, err_msg=name)
    assert np.abs(lookup).max() > 1e6


def _model(**keys):
    m = config.get_config().model
    m.update(**{**gemma3.PRESET, **keys})
    return resolve_model(m, seq_length=32)


def test_groups_flops_and_parameters_count_by_kind(gemma):
    """Gemma-3-27B's 62 layers: 2 local ones, then 10 periods of 6; a tiny model's FLOPs count each local layer's
    attention over its window and its parameters are transformers'."""
    big = _model(**registry.SIZES["Gemma-3-27B"])
    assert [(len(g.pattern), g.first, g.num_layers) for g in gpt.layer_groups(big)] == [(1, 0, 2), (6, 2, 60)]
    assert [k.window for k in gpt.layer_groups(big)[1].pattern] == [1024] * 3 + [0] + [1024] * 2

    h, n, kv, d, f, V, s, w = 64, 4, 2, 16, 96, 128, 32, 8
    cfg, _ = hf_workdir.from_hf(gemma[0], F32)
    m = cfg.model
    local_keys, global_keys = w - w * w / (2 * s), s / 2  # keys a query attends to, on average
    keys = 4 * local_keys + 2 * global_keys
    forward = 6 * (2 * h * (n + 2 * kv) * d + 2 * n * d * h + 3 * 2 * h * f) + 2 * keys * n * d * 2
    assert math.isclose(flops.flops_per_token(m, s), 3 * forward + 3 * 2 * h * V, rel_tol=1e-12)
    params = gpt.init(m, 0)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(gemma[0]))
    real = gpt.num_params(params) - (m.padded_vocab_size - m.vocab_size) * h
    assert real == sum(p.numel() for p in reference.parameters()) == gpt.active_params(m, params) - (
        m.padded_vocab_size - m.vocab_size) * h


# google/gemma-3-1b-pt's and gemma-3-27b-pt's (text_config) config.json, from memory, not read from the Hub (no network
# here): see jaxllm/families/gemma3.py
HF_CONFIGS = {
    "Gemma-3-1B": dict(num_hidden_layers=26, hidden_size=1152, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=256, intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768,
                       sliding_window=512, query_pre_attn_scalar=256, rope_parameters={
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "Gemma-3-27B": dict(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, num_key_value_heads=16,
                        head_dim=128, intermediate_size=21504, vocab_size=262208, max_position_embeddings=131072,
                        sliding_window=1024, query_pre_attn_scalar=168, rope_parameters={
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@pytest.mark.parametrize("key,published", [("Gemma-3-1B", 999_885_952), ("Gemma-3-27B", None)])
def test_published_sizes_are_transformers(key, published):
    """A size's parameters are those transformers builds for its config.json (on the meta device; Gemma-3-1B's
    published 999,885,952), and importing that config.json gives the size's model keys."""
    hf_config = transformers.Gemma3TextConfig(**HF_CONFIGS[key])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    m = _model(**registry.SIZES[key], make_vocab_size_divisible_by=1)
    n = gpt.num_params(gpt.describe(m).params)
    assert n == sum(p.numel() for p in model.parameters()) and published in (None, n)
    _, imported = model_from_hf(hf_config.to_dict())
    assert {k: getattr(m, k) for k in imported} == imported


def _resolved(mesh=None, **keys):
    c = config.get_config()
    c.model.update(**gemma3.PRESET, hidden_size=64, num_attention_heads=4, vocab_size=128, **keys)
    c.mesh.update(**(mesh or {}))
    c.train.update(seq_length=16, micro_batch_size=1, global_batch_size=2)
    return resolve(c, num_devices=math.prod((mesh or {}).values()), data_files=False)


@pytest.mark.parametrize("keys,mesh,match", [
    (dict(num_layers=6, window_attn_skip_freq="6"), None, "model.window_attn_skip_freq.*set model.sliding_window"),
    (dict(num_layers=4, sliding_window=8, window_attn_skip_freq="[1,0]"), None, "model.window_attn_skip_freq"),
    (dict(num_layers=9, sliding_window=8, window_attn_skip_freq="3"), {"pipeline": 2}, "periods of 3"),
])
def test_bad_patterns_are_refused(keys, mesh, match):
    """A pattern without a window, of the wrong length, or whose periods the pipeline stages cannot split whole."""
    with pytest.raises(ConfigError, match=match):
        _resolved(mesh, **keys)


def test_bad_padding_rows_are_refused():
    """A pad id outside the vocabulary as a key and in config.json (a negative one counts from the end, as torch's
    padding_idx); GPT-2's table, whose embedding has no padding_idx, holds none."""
    for pad in (128, -2):
        with pytest.raises(ConfigError, match=r"model.pad_token_id=.*0 to model.vocab_size - 1 = 127"):
            _resolved(num_layers=2, pad_token_id=pad)
    hf_config = transformers.Gemma3TextConfig(vocab_size=VOCAB).to_dict()
    with pytest.raises(ConvertError, match=f"pad_token_id={VOCAB}"):
        model_from_hf({**hf_config, "pad_token_id": VOCAB})
    assert model_from_hf({**hf_config, "pad_token_id": -1})[1]["pad_token_id"] == VOCAB - 1
    assert model_from_hf({**hf_config, "pad_token_id": None})[1]["pad_token_id"] == -1
    m = config.get_config().model
    m.update(vocab_size=128, pad_token_id=3)
    with pytest.raises(ConvertError, match=r"GPT2LMHeadModel change model.pad_token_id=3 \(needs -1\)"):
        hf_architecture(resolve_model(m, seq_length=32))


def layout(mesh, micro, **parallel):
    """8 layers, every 3rd global (2 local ones, then 2 periods of local, local, global... as Gemma 3's 62), a
    window of 4 of the 16 positions, dropout on, a padding row (among the random tokens)."""
    return {"mesh": mesh, "parallel": parallel, "train": {"micro_batch_size": micro},
            "model": {**gemma3.PRESET, "num_layers": 8, "num_kv_heads": 4, "sliding_window": 4,
                      "window_attn_skip_freq": "3", "local_rotary_base": 100.0, "rotary_base": 500.0,
                      "rotary_seq_len_interpolation_factor": 2.0, "softmax_scale": 0.2, "dropout": 0.1,
                      "pad_token_id": 5}}


LAYOUTS = {"single": layout({}, 8),
           "tensor2_data2_fsdp2": layout({"tensor": 2, "data": 2, "fsdp": 2}, 2),
           "sequence2_ring": layout({"sequence": 2}, 8, sequence_impl="ring"),
           "pipeline2_data2_1f1b": layout({"pipeline": 2, "data": 2}, 4, pipeline_schedule="1f1b")}


def test_layouts_train_as_on_one_device():
    results = run_layouts(LAYOUTS, timeout=1200)
    for name in LAYOUTS:
        if name != "single":
            assert_same_training(results[name], results["single"])
