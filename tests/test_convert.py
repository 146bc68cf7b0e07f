"""Hugging Face conversion (the tables of jaxllm.formats.hf, the workdirs and CLI of jaxllm.convert) against real
transformers + PyTorch (CPU, float32, small random models).

Import: transformers' GPT-2 / Llama (and Llama 3.1's rotary scaling) / Qwen2 / Qwen3 / Mistral (a sliding window) /
Mixtral / Qwen3-MoE (a dense layer among MoE ones, heads wider than hidden / heads, both routers) logits == jaxllm's
on the imported parameters (the experts also in transformers 5's fused layout).
Export: transformers loads what jaxllm writes (from an import, through a real workdir and the
CLI, and from a jaxllm-initialized model with a padded vocabulary) and gives jaxllm's logits,
with exactly the tensors transformers itself saves, which import as the same parameters bit for bit; a jaxllm
mixture of experts trained a few steps exports as Mixtral, whose cross entropy on the run's validation batches is
the run's eval_loss.  The imported workdir's config.py loads through the training CLI's --config flag.  Bad inputs:
pickle-only directories, unsupported configs both ways, options the import cannot honour, a tokenizer larger than
the embedding (refused with transformers' resize as the fix, which then imports and trains).
"""

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import forkserver
import jax
import numpy as np
import pytest
import torch
import transformers

from jaxllm import config, convert
from jaxllm.errors import DataError
from jaxllm.families import llama as llama_family
from jaxllm.formats import hf_workdir
from jaxllm.formats.hf import ConvertError, to_hf
from jaxllm.model import gpt
from jaxllm.resolve import resolve
from jaxllm.runtime import checkpoint, optim, step
from jaxllm.runtime.run import Run
from jaxllm_kernels.reference import MASKED

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
TOL = 1e-4
VOCAB, SEQ = 101, 32
F32 = {"model.dtype": "float32"}


def gpt2(tied=True):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None))


def llama(tied=False):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied, rope_theta=500.0))


def llama3(tied=False):
    """Llama 3.1's rotary scaling with thresholds inside the test's 32 positions: head dim 16's wavelengths are
    6.3 (kept: < 32 / 4), 13.6 and 29.4 (interpolated), 64 to 1388 (stretched 8x: > 32 / 1)."""
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": SEQ}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied, rope_parameters=rope))


def qwen2(tied=False):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied, rope_theta=500.0))


def qwen3(tied=False):
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied, rope_theta=500.0))


def mistral(tied=False):
    """A window of 8 of the test's 32 positions."""
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied, rope_theta=500.0,
        sliding_window=8))


def mixtral(tied=False):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
        tie_word_embeddings=tied, rope_theta=500.0, router_aux_loss_coef=0.02))


def qwen3_moe(tied=False):
    """4 experts (top 2, renormalized), layer 1 of 3 a dense MLP (mlp_only_layers): layer groups of 1, 1 and 1; heads
    of 32 (model.kv_channels), twice hidden / heads, as Qwen3-30B-A3B's 128 of 2048 / 32."""
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        head_dim=32, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied, rope_theta=500.0,
        router_aux_loss_coef=0.02))


# DeepSeek-V3's own YaRN (its config.json's mscale and mscale_all_dim both 1: its rotary unscaled, its scores times
# mscale(40, 1)^2), its frequencies interpolated from the 8th of the test's 32 positions on, mscale_all_dim 0.8
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def deepseek_v3(q_lora_rank, tied=False, rope=None):
    """Multi-head latent attention (with a query latent or, as Moonlight, without; DeepSeek's interleaved rotary rows),
    layer 0 of 3 dense, then 4 routed experts in 2 groups (top 2 from the best group, sigmoid scores, the expert bias
    nonzero, renormalized and scaled by 2) and a shared expert; rms_norm_eps 1e-5 as Moonlight's (transformers'
    latent norms keep 1e-6, jaxllm's take the model's: within TOL here); ``rope``: its rope_parameters."""
    m = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(rope_parameters=rope,
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.0, first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, vocab_size=VOCAB,
        max_position_embeddings=SEQ, rms_norm_eps=1e-5, tie_word_embeddings=tied, rope_theta=500.0))
    with torch.no_grad():  # a buffer, which randomize() leaves at 0
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.2 * torch.randn(4))
    return m


def olmo2(tied=False):
    """Norms after attention and the MLP (none before), query and key norms over all heads together."""
    return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied, rope_theta=500.0))


MODELS = {"gpt2-tied": lambda: gpt2(True), "gpt2-untied": lambda: gpt2(False),
          "llama-gqa-untied": lambda: llama(False), "llama-gqa-tied": lambda: llama(True),
          "llama-ropescaled-untied": lambda: llama3(False), "qwen2-gqa-untied": lambda: qwen2(False),
          "qwen3-gqa-tied": lambda: qwen3(True), "mistral-gqa-untied": lambda: mistral(False),
          "mixtral-gqa-untied": lambda: mixtral(False), "qwen3moe-gqa-untied": lambda: qwen3_moe(False),
          "deepseekv3-qlora-untied": lambda: deepseek_v3(12), "deepseekv3-mla-untied": lambda: deepseek_v3(None),
          "olmo2-gqa-untied": lambda: olmo2(False),
          "deepseekv3-qlora-yarnmtp-untied": lambda: deepseek_v3(12, rope=YARN)}
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
              "qwen3moe": "Qwen3MoeForCausalLM", "deepseekv3": "DeepseekV3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}


def add_mtp_layer(d, seed):
    """DeepSeek-V3's multi-token prediction layer (transformers neither builds nor saves one) added to the checkpoint
    of 3 layers in ``d`` as its file holds it: ``model.layers.3``, a copy of layer 2's tensors (an MoE layer, the
    last layer's kind), random ``enorm``, ``hnorm``, ``eh_proj`` ``[h, 2h]`` and ``shared_head.norm``, copies of the
    embedding and output layer; ``num_nextn_predict_layers`` 1."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(d, "model.safetensors"))
    rng = np.random.default_rng(seed)
    mtp = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if "layers.2." in k}
    mtp.update({f"model.layers.3.{n}.weight": (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
                for n in ("enorm", "hnorm", "shared_head.norm")})
    mtp["model.layers.3.eh_proj.weight"] = (0.1 * rng.standard_normal((64, 128))).astype(np.float32)
    mtp["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file({**tensors, **mtp}, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    Path(d, "config.json").write_text(json.dumps({**json.loads(Path(d, "config.json").read_text()),
                                                  "num_nextn_predict_layers": 1}))


def randomize(m, seed):
    """Every parameter random (biases and norm weights too, so that no mapping hides behind 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            base = 1.0 if name.endswith("weight") and ("ln" in name or "norm" in name) else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
    return m.eval()


def tokens(batch=2, seq=SEQ, vocab=VOCAB, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq)).astype(np.int32)


def hf_logits(m, toks):
    with torch.no_grad():
        return m(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()


def jax_logits(m, params, toks, **kwargs):
    """Logits of the (resolved) model section ``m`` over its real vocabulary: the padding entries,
    checked to be masked (probability 0), are cut off."""
    out = np.asarray(gpt.forward(gpt.describe(m).graphdef, params, toks, **kwargs))
    assert out.shape[-1] == m.padded_vocab_size and (out[..., m.vocab_size:] == MASKED).all()
    return out[..., :m.vocab_size]


def load_hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def cli(*args, cwd=ROOT):
    return forkserver.run(["-m", "jaxllm.convert", *args], ENV, cwd, 600)


@pytest.fixture(scope="module", params=list(MODELS))
def hf_dir(request, tmp_path_factory):
    """(name, directory, logits of the transformers model on tokens()) for each small random model."""
    torch.manual_seed(0)
    m = randomize(MODELS[request.param](), seed=len(request.param))
    d = tmp_path_factory.mktemp(request.param)
    m.save_pretrained(d, safe_serialization=True)
    if "mtp" in request.param:
        add_mtp_layer(d, seed=1)
    return request.param, str(d), hf_logits(m, tokens())


def test_import_matches_transformers_and_exports_back(hf_dir, tmp_path):
    name, d, ref = hf_dir
    cfg, params = hf_workdir.from_hf(d, F32)
    m = cfg.model
    assert (m.vocab_size, m.padded_vocab_size) == (VOCAB, 128)  # padded as jaxllm pads, the padding masked
    assert cfg.train.seq_length == m.max_position_embeddings == SEQ
    assert (m.position_embedding, m.norm, m.activation) == (("learned", "layernorm", "gelu") if "gpt2" in name
                                                            else ("rotary", "rmsnorm", "swiglu"))
    assert m.tie_embeddings == ("untied" not in name)
    if "gpt2" not in name:
        assert (m.num_kv_heads, m.rotary_base, m.use_bias) == (4 if "deepseek" in name else 2, 500.0, False)
    assert (m.add_qkv_bias, m.qk_layernorm, m.sliding_window) == ("qwen2" in name, "qwen3" in name or "olmo2" in name,
                                                                   8 if "mistral" in name else 0)
    assert (m.norm_placement, m.qk_layernorm_per_head) == (("post", False) if "olmo2" in name else ("pre", True))
    if "deepseek" not in name:
        assert (m.kv_channels, m.head_dim) == ((32, 32) if "qwen3moe" in name else (0, 16))
    scaling = (m.use_rope_scaling, m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
               m.rope_original_max_position_embeddings)
    assert scaling == ((True, 8.0, 1.0, 4.0, SEQ) if "ropescaled" in name else (False, 8.0, 1.0, 4.0, 8192))
    if "mixtral" in name:  # dropless top-2 of 4 experts of 48, as Mixtral
        assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (4, 2, 48, 48)
        assert (m.moe_aux_loss_coeff, m.moe_capacity_factor, m.moe_shared_expert_intermediate_size) == (0.02, 0, 0)
    elif "qwen3moe" in name:  # the same experts, and layer 1 a dense MLP of 96
        assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (4, 2, 48, 96)
        assert (m.moe_layer_freq, m.moe_router_pre_softmax, m.moe_aux_loss_coeff) == ("[1,0,1]", False, 0.02)
        assert [g.kind.moe for g in gpt.layer_groups(m)] == [True, False, True]
    elif "deepseek" in name:  # MLA; layer 0 dense (96), then sigmoid-routed experts of 48 and a shared one
        assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
                m.v_head_dim, m.kv_channels, m.norm_eps) == (True, 12 if "qlora" in name else 0, 16, 8, 4, 6, 0, 1e-5)
        assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (4, 2, 48, 96)
        assert (m.moe_layer_freq, m.moe_shared_expert_intermediate_size, m.moe_router_score_function,
                m.moe_router_enable_expert_bias, m.moe_router_topk_scaling_factor, m.moe_router_num_groups,
                m.moe_router_group_topk) == ("[0,1,1]", 48, "sigmoid", True, 2.0, 2, 1)
        assert np.abs(params["layers_1"]["mlp"]["expert_bias"]).min() > 0
    else:
        assert m.num_experts == 0
    assert (m.rope_type, m.mtp_num_layers) == (("yarn", 1) if "yarnmtp" in name else ("rope", 0))
    out = jax_logits(m, params, tokens())
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    # the scalings and the window change these logits
    for key, off in (("use_rope_scaling", False), ("sliding_window", 0), ("rope_type", "rope")):
        if getattr(m, key) != off:
            plain = jax_logits(dataclasses.replace(m, **{key: off}), params, tokens())
            assert np.abs(plain - ref).max() > 100 * TOL

    hf_config, _ = to_hf(m, params)
    assert hf_config["architectures"] == [HF_CLASSES[name.split("-")[0]]]
    exports_back(m, params, d, ref, tmp_path / "back")


def exports_back(m, params, d, ref, back):
    """``save_hf`` of an imported model into ``back``: transformers loads it and gives the logits ``ref`` of the
    original in ``d``, the file holds exactly the tensors transformers itself saved there (a tied head is not
    stored), and importing it gives the same parameters, bit for bit."""
    from safetensors.numpy import load_file

    hf_workdir.save_hf(m, params, str(back))
    np.testing.assert_allclose(hf_logits(load_hf(back), tokens()), ref, atol=TOL, rtol=0)
    original, written = (load_file(os.path.join(p, "model.safetensors")) for p in (d, back))
    assert sorted(written) == sorted(original)
    for k in original:
        np.testing.assert_array_equal(written[k], original[k], err_msg=k)
    _, again = hf_workdir.from_hf(str(back), F32)
    jax.tree.map(np.testing.assert_array_equal, again, params)


@pytest.mark.parametrize("hf_dir", ["llama-gqa-untied", "llama-ropescaled-untied"], indirect=True)
def test_rotary_layout_is_hf_llamas(hf_dir):
    """jaxllm's half-split rotary is HF Llama's (checked, not assumed): logits match on arbitrary
    positions, and the same weights read as the interleaved (GPT-J) layout would not."""
    _, d, _ = hf_dir
    cfg, params = hf_workdir.from_hf(d, F32)
    m = load_hf(d)
    toks = tokens(batch=1, seq=8, seed=3)
    positions = (20 + 3 * np.arange(8, dtype=np.int32))[None]  # shifted, with gaps
    with torch.no_grad():
        ref = m(torch.tensor(toks, dtype=torch.long), position_ids=torch.tensor(positions, dtype=torch.long))
    out = jax_logits(cfg.model, params, toks, positions=positions)
    np.testing.assert_allclose(out, ref.logits.numpy(), atol=TOL, rtol=0)
    # Interleaved pairs (0,1),(2,3),... instead of halves: the test above would catch that mix-up.
    hd = params["layers"]["attn"]["wq"].shape[-1]
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    wrong = jax.tree.map(lambda x: x, params)
    for w in ("wq", "wk"):
        wrong["layers"]["attn"][w] = params["layers"]["attn"][w][..., perm]
    assert np.abs(jax_logits(cfg.model, wrong, toks, positions=positions) - out).max() > 1e-2


@pytest.mark.parametrize("hf_dir", ["mixtral-gqa-untied", "qwen3moe-gqa-untied"], indirect=True)
def test_fused_experts_import(hf_dir, tmp_path):
    """transformers 5's own layout of Mixtral's and Qwen3-MoE's experts (``save_original_format=False``: the
    router as ``mlp.gate.weight``, each layer's experts as ``gate_up_proj [E, 2f, h]`` and ``down_proj
    [E, h, f]``) imports as the per-expert layout of the Hub's checkpoints does; a wrong shape is named."""
    from safetensors.numpy import load_file, save_file

    _, d, ref = hf_dir
    load_hf(d).save_pretrained(tmp_path / "fused", safe_serialization=True, save_original_format=False)
    fused = load_file(str(tmp_path / "fused" / "model.safetensors"))
    last = f"model.layers.{load_hf(d).config.num_hidden_layers - 1}.mlp.experts"  # a mixture of experts in both
    assert fused[f"{last}.gate_up_proj"].shape == (4, 2 * 48, 64)
    assert not any("block_sparse_moe" in k or ".experts.0." in k for k in fused)
    cfg, params = hf_workdir.from_hf(str(tmp_path / "fused"), F32)
    np.testing.assert_allclose(jax_logits(cfg.model, params, tokens()), ref, atol=TOL, rtol=0)
    fused[f"{last}.down_proj"] = fused[f"{last}.down_proj"][:3]
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    with pytest.raises(ConvertError, match=rf"{last}.down_proj has shape \[3, 64, 48\], "
                                           r"config.json implies \[4, 64, 48\]"):
        hf_workdir.from_hf(str(tmp_path / "fused"), F32)


@pytest.mark.parametrize("hf_dir", ["deepseekv3-qlora-untied"], indirect=True)
def test_deepseek_v3_rotary_routing_and_mtp_layers(hf_dir, tmp_path):
    """What DeepSeek-V3's import gets right is not vacuous: the rotary rows read without de-interleaving, the router
    without its groups or without its expert bias each give other logits; a checkpoint's multi-token-prediction
    layer (model.layers.{num_hidden_layers}..., which transformers does not load) is model.mtp_num_layers' module,
    its layer that layer's parameters (layer 2's copy here), its eh_proj [h, 2h] the embedding's half first; dropped
    with model.mtp_num_layers=0, and a layer without its module's own tensors is none; the export says what
    transformers reads: its dense layers first, one shared expert, the groups, the renormalized, scaled top k."""
    import shutil

    from safetensors.numpy import load_file, save_file

    _, d, ref = hf_dir
    cfg, params = hf_workdir.from_hf(d, F32)
    m = cfg.model
    attn = params["layers_0"]["attn"]
    interleaved = jax.tree.map(lambda x: x, params)  # our rotary rows as HF stores them: pairs (0, 1) and (2, 3)
    interleaved["layers_0"]["attn"] = {**attn, "wq_b": attn["wq_b"][..., [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 9, 11]],
                                       "wkv_a": attn["wkv_a"][..., [*range(16), 16, 18, 17, 19]]}
    for wrong, changes in ((interleaved, {}), (params, dict(moe_router_num_groups=0, moe_router_group_topk=0))):
        assert np.abs(jax_logits(dataclasses.replace(m, **changes), wrong, tokens()) - ref).max() > 100 * TOL
    unbiased = jax.tree.map(lambda x: x, params)
    unbiased["layers_1"]["mlp"]["expert_bias"] = np.zeros_like(params["layers_1"]["mlp"]["expert_bias"])
    assert np.abs(jax_logits(m, unbiased, tokens()) - ref).max() > 100 * TOL

    shutil.copytree(d, tmp_path / "mtp")
    add_mtp_layer(tmp_path / "mtp", seed=2)
    cfg_mtp, with_mtp = hf_workdir.from_hf(str(tmp_path / "mtp"), F32)
    assert cfg_mtp.model.mtp_num_layers == 1
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in with_mtp.items() if k != "mtp"}, params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[0], b[1]), with_mtp["mtp"]["block"], params["layers_1"])
    eh_proj = load_file(str(tmp_path / "mtp" / "model.safetensors"))["model.layers.3.eh_proj.weight"]
    np.testing.assert_array_equal(with_mtp["mtp"]["eh_proj"][0], eh_proj.T.reshape(2, 64, 64))
    _, dropped = hf_workdir.from_hf(str(tmp_path / "mtp"), {**F32, "model.mtp_num_layers": "0"})
    jax.tree.map(np.testing.assert_array_equal, dropped, params)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    partial = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if "layers.2." in k}
    save_file({**tensors, **partial}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**json.loads(Path(d, "config.json").read_text()),
                                                      "num_nextn_predict_layers": 1}))
    _, again = hf_workdir.from_hf(str(tmp_path), F32)
    jax.tree.map(np.testing.assert_array_equal, again, params)
    hf, _ = to_hf(m, params)
    assert (hf["first_k_dense_replace"], hf["n_shared_experts"], hf["n_group"], hf["topk_group"],
            hf["norm_topk_prob"], hf["routed_scaling_factor"], hf["q_lora_rank"], hf["rope_interleave"]) == (
        1, 1, 2, 1, True, 2.0, 12, True)


def test_qwen3_moe_unnormalized_routing_and_sparse_step(tmp_path):
    """Qwen3-MoE's other router (norm_topk_prob false: the top k of the softmax over all experts, not renormalized)
    is model.moe_router_pre_softmax, and decoder_sparse_step 2 (layers 1 and 3 of 4 mixtures of experts, as
    transformers counts) is moe_layer_freq [0,1,0,1]: transformers' logits both ways, the export written with
    mlp_only_layers."""
    torch.manual_seed(5)
    m = randomize(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=SEQ, rope_theta=500.0)), seed=6)
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ref = hf_logits(m, tokens())
    cfg, params = hf_workdir.from_hf(str(tmp_path / "hf"), F32)
    assert (cfg.model.moe_router_pre_softmax, cfg.model.moe_layer_freq) == (True, "[0,1,0,1]")
    out = jax_logits(cfg.model, params, tokens())
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    renormalized = jax_logits(dataclasses.replace(cfg.model, moe_router_pre_softmax=False), params, tokens())
    assert np.abs(renormalized - ref).max() > 100 * TOL
    hf = hf_workdir.save_hf(cfg.model, params, str(tmp_path / "back"))
    assert (hf["norm_topk_prob"], hf["decoder_sparse_step"], hf["mlp_only_layers"]) == (False, 1, [0, 2])
    np.testing.assert_allclose(hf_logits(load_hf(tmp_path / "back"), tokens()), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_cli_round_trip_through_workdir(arch, tmp_path):
    """--from-hf writes a real step-0 training checkpoint; --to-hf exports it; transformers agrees."""
    torch.manual_seed(1)
    m = randomize({"gpt2": lambda: gpt2(True), "llama": llama, "mixtral": mixtral}[arch](), seed=7)
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ref = hf_logits(m, tokens())
    work = tmp_path / "work"
    r = cli("--from-hf", str(tmp_path / "hf"), str(work), "--config.train.train_iters=5",
            "--config.train.warmup_iters=1", "--config.model.dtype=float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"imported {HF_CLASSES[arch]} from ")
    assert "jaxllm.train --config=" in r.stdout and (work / "config.py").is_file()
    assert "the data must be tokenized as the model expects" in r.stderr

    saved = checkpoint.load_config(str(work))
    assert saved.train.train_iters == 5 and saved.model.vocab_size == VOCAB
    assert saved.data.to_dict() == config.get_config().data.to_dict()  # no tokenizer in the dir: the defaults
    # The checkpoint is what training resumes from: full state, step 0, HF's parameters.
    cfg = resolve(saved, num_devices=jax.device_count())
    ckpt = checkpoint.Checkpointer(str(work), cfg)
    state = Run(cfg).initial_state(ckpt)
    ckpt.close()
    assert int(state["step"]) == 0
    optimizer = optim.make_optimizer(cfg.train, gpt.describe(cfg.model).decay)
    assert jax.tree.structure(state["opt_state"]) == jax.tree.structure(
        jax.eval_shape(lambda: optimizer.init(state["params"])))
    np.testing.assert_allclose(jax_logits(cfg.model, state["params"], tokens()), ref, atol=TOL, rtol=0)
    # config.py loads through the training CLI's --config flag (ml-collections runs it as a module),
    # flags still apply, and it resolves to the stored config.
    loaded = config_file(work / "config.py", "--config.train.lr=0.005")
    assert loaded.train.lr == 0.005
    loaded.train.lr = saved.train.lr
    assert resolve(loaded, num_devices=jax.device_count()).to_dict() == cfg.to_dict()

    r = cli("--to-hf", str(work), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(hf_logits(load_hf(tmp_path / "out"), tokens()), ref, atol=TOL, rtol=0)


LOAD_CONFIG = """
import json, sys
from absl import flags
from jaxllm import cli
cli.define_config_flag()
cli.parse_flags(["train", *sys.argv[1:]])
c = flags.FLAGS.config
print(type(c).__module__ + "." + type(c).__name__)
print(json.dumps(c.to_dict()))
"""


def config_file(path, *flags):
    """The Config that ``--config=path`` (the flag of jaxllm.train and the other CLIs) gives, in a new process."""
    r = subprocess.run([sys.executable, "-c", LOAD_CONFIG, f"--config={path}", *flags], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    kind, values = r.stdout.splitlines()[-2:]
    assert kind == "jaxllm.config.Config"
    return config.from_dict(json.loads(values))


def small_cfg(**changes):
    """A resolved config of a tiny model of 100 tokens (padded to 128 rows)."""
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, dtype="float32", vocab_size=100, **changes)
    c.train.seq_length = SEQ
    return resolve(c, num_devices=1)


LLAMA_CFG = dict(**llama_family.PRESET, num_kv_heads=2, tie_embeddings=False, rotary_base=10000.0, norm_eps=1e-6)
MOE_CFG = dict(LLAMA_CFG, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_jaxllm_model_exports(kind, tmp_path):
    """A jaxllm-initialized model (vocab 100 padded to 128, all parameters perturbed, the padding rows too)
    loads in transformers with its 100 real rows and gives jaxllm's logits over them."""
    m = small_cfg(**(LLAMA_CFG if kind == "llama" else {})).model
    params = gpt.init(m, 0)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape)
                                          for x, k in zip(leaves, keys, strict=True)])
    hf = hf_workdir.save_hf(m, params, str(tmp_path))
    assert (m.padded_vocab_size, hf["vocab_size"]) == (128, 100)
    toks = tokens(vocab=100)
    np.testing.assert_allclose(hf_logits(load_hf(tmp_path), toks), jax_logits(m, params, toks), atol=TOL, rtol=0)


# A few steps of a tiny run on Tiny Shakespeare's 65 characters, whose tables tensor 2 pads to 66 rows
# (make_vocab_size_divisible_by=1 x tensor 2, as Megatron-LM pads): GPT-2 from the Shakespeare recipe
# with biases, Llama from configs/llama.py:tiny.
TENSOR2_RUNS = {
    "gpt2": ["--config=configs/shakespeare_char.py", "--config.model.use_bias=True"],
    "llama": ["--config=configs/llama.py:tiny", "--config.data.input=tests/data/tinyshakespeare.txt",
              "--config.data.tokenizer=char", "--config.data.sampling=uniform", "--config.data.split=9,1"],
}


def umask_mode():
    """The mode a new file gets here: 0666 less the umask (the test's, which the CLI inherits)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


@pytest.mark.parametrize("arch", list(TENSOR2_RUNS))
def test_tensor_parallel_run_exports_its_real_rows(arch, tmp_path):
    """A run trained by the CLI on tensor 2 (2 fake devices), its tables padded for that layout, exports with
    the tokenizer's rows only; transformers gives jaxllm's logits.  The files are readable as the umask
    allows (safetensors writes 0600), and an export that fails is one line on stderr, ending its line."""
    import jaxllm

    work, out = tmp_path / "run", tmp_path / "hf"
    env = {**ENV, "XLA_FLAGS": f"{ENV.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", *TENSOR2_RUNS[arch], f"--workdir={work}",
                        "--config.mesh.tensor=2", "--config.model.num_layers=1", "--config.model.hidden_size=32",
                        "--config.train.micro_batch_size=4", "--config.train.global_batch_size=4",
                        "--config.train.train_iters=3", "--config.train.warmup_iters=1",
                        "--config.train.lr_warmup_fraction=0", "--config.train.lr_decay_iters=3",
                        "--config.train.lr=0.01", "--config.train.min_lr=0.001", "--config.train.eval_interval=0",
                        "--config.log.samples=0", "--config.log.tensorboard=False",
                        "--config.log.progress_bar=False"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("--to-hf", str(work), str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {HF_CLASSES[arch]} (65 vocab) to ")
    for name in ("model.safetensors", "config.json"):
        assert (out / name).stat().st_mode & 0o777 == umask_mode(), name
    assert out.stat().st_mode & 0o777 == umask_mode() | (umask_mode() & 0o444) >> 2  # a folder's: x where r
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".partial-")] == []  # written aside, renamed

    run = jaxllm.load(str(work))
    assert (run.config.mesh_shape["tensor"], run.vocab_size, run.config.model.padded_vocab_size) == (2, 65, 66)
    assert run.params["wte"].shape[0] == 66 and run.config.model.use_bias == (arch == "gpt2")
    hf = load_hf(out)
    assert type(hf).__name__ == HF_CLASSES[arch] and hf.config.vocab_size == 65
    toks = tokens(seq=64, vocab=65)
    np.testing.assert_allclose(hf_logits(hf, toks), run.logits(toks), atol=TOL, rtol=0)

    r = cli("--to-hf", str(work), str(out))  # the directory is not empty now
    assert r.returncode == 2 and r.stderr.endswith("\n") and "Traceback" not in r.stderr, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        f"error: {out} exists and is not empty: export into a new directory"]


def test_moe_run_exports_as_mixtral_with_its_eval_loss(tmp_path):
    """A jaxllm mixture of experts (4 experts, top 2, vocab 100 padded to 128) trained 3 steps with its
    router's losses, saved as training saves it and exported by the --to-hf CLI: transformers'
    MixtralForCausalLM gives the run's eval_loss (Run.evaluate) as its cross entropy on the same batches."""
    c = config.get_config()
    # init_std 0.2: the router and the experts weigh on the loss (0.02 leaves it near ln 100 whatever
    # they are; here swapping the experts' gate and up, or two experts' router rows, moves it by > 0.1)
    c.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, dtype="float32", vocab_size=100,
                   init_std=0.2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, **MOE_CFG)
    c.train.update(seq_length=SEQ, micro_batch_size=4, global_batch_size=4, train_iters=3, warmup_iters=1,
                   lr=1e-2, eval_iters=2)
    cfg = resolve(c, num_devices=1)
    run = Run(cfg, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 100, (4, SEQ + 1)).astype(np.int32) for _ in range(5)]
    state = run.initial_state()
    for b in batches[:3]:
        state, _ = run.train_step(state, *run.global_batch(b[:, :-1], b[:, 1:]))
    validation = batches[3:]

    class Validation:
        def eval_batch(self, i):
            return validation[i][:, :-1], validation[i][:, 1:]

    eval_loss = run.evaluate(state["params"], Validation())
    ckpt = checkpoint.Checkpointer(str(tmp_path / "run"), cfg)
    ckpt.maybe_save(3, state, force=True)
    ckpt.close()
    assert convert.main(["--to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    hf = load_hf(tmp_path / "hf")
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.vocab_size == 100
    assert (hf.config.num_local_experts, hf.config.num_experts_per_tok, hf.config.intermediate_size) == (4, 2, 48)
    assert hf.config.router_aux_loss_coef == 0.01 and hf.config.sliding_window is None
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(torch.tensor(hf_logits(hf, b[:, :-1])).reshape(-1, 100),
                                                    torch.tensor(b[:, 1:], dtype=torch.long).reshape(-1))
                  for b in validation]
    assert abs(float(np.mean(losses)) - eval_loss) < TOL, (np.mean(losses), eval_loss)


def test_bfloat16_safetensors_import(tmp_path):
    torch.manual_seed(2)
    m = randomize(llama(True), seed=3).to(torch.bfloat16)
    m.save_pretrained(tmp_path, safe_serialization=True)
    _, params = hf_workdir.from_hf(str(tmp_path), F32)
    want = m.model.embed_tokens.weight.detach().float().numpy()
    assert params["wte"].dtype == np.float32
    np.testing.assert_array_equal(params["wte"][:VOCAB], want)
    assert not params["wte"][VOCAB:].any()  # the padding rows are zeros


def test_sharded_safetensors_import(tmp_path):
    torch.manual_seed(4)
    m = randomize(llama(False), seed=5)
    m.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    cfg, params = hf_workdir.from_hf(str(tmp_path), F32)
    np.testing.assert_allclose(jax_logits(cfg.model, params, tokens()), hf_logits(m, tokens()), atol=TOL, rtol=0)


def test_gpt2_tokenizer_travels(tmp_path):
    """A run on the gpt2 tokenizer (the files shipped with jaxllm: data.gpt2_dir empty) exports HF tokenizer
    files; importing them sets data.tokenizer=gpt2."""
    from jaxllm.data.tokenizers import GPT2Tokenizer

    torch.manual_seed(3)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16))
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    hf_workdir.import_to_workdir(str(tmp_path / "hf"), str(tmp_path / "w1"),
                              {"data.tokenizer": "gpt2"})
    hf = hf_workdir.export_workdir(str(tmp_path / "w1"), str(tmp_path / "out"))
    assert hf["eos_token_id"] == 50256
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "Hello world!  It's   a test\n\nof tokens, ünïcode and\ttabs"
    assert tok(text)["input_ids"] == GPT2Tokenizer().encode(text).tolist()
    cfg = hf_workdir.import_to_workdir(str(tmp_path / "out"), str(tmp_path / "w2"))
    assert cfg.data.tokenizer == "gpt2" and cfg.data.gpt2_dir == str(tmp_path / "w2" / "tokenizer")
    GPT2Tokenizer(cfg.data.gpt2_dir)


def test_sentencepiece_tokenizer_travels(tmp_path):
    """A Llama directory with a SentencePiece tokenizer.model and no tokenizer.json (a Llama 2 / Mistral v0.1
    release): --from-hf takes the model along as data.tokenizer; --to-hf writes it back for transformers'
    LlamaTokenizer, which encodes ordinary text (known characters, no leading space) as jaxllm does, beginning-of-text
    token first."""
    from conftest import train_sentencepiece

    from jaxllm.data.tokenizers import SentencePieceTokenizer, file_tokenizer

    torch.manual_seed(3)
    llama().save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = train_sentencepiece(tmp_path / "hf" / "tokenizer.model", vocab_size=VOCAB - 1, byte_fallback=False,
                                character_coverage=1.0)
    cfg = hf_workdir.import_to_workdir(str(tmp_path / "hf"), str(tmp_path / "w1"))
    assert cfg.data.tokenizer == str(tmp_path / "w1" / "tokenizer")
    tok = file_tokenizer(cfg.data.tokenizer)
    assert isinstance(tok, SentencePieceTokenizer) and tok.sha256 == SentencePieceTokenizer(str(model)).sha256
    hf = hf_workdir.export_workdir(str(tmp_path / "w1"), str(tmp_path / "out"))
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (tok.bos_id, tok.eot_id) == (1, 2)
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == model.read_bytes()
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in ("First Citizen: Before we proceed any further, hear me speak.", "You are all resolved rather to die"):
        assert ref(text)["input_ids"] == tok.encode(text).tolist()
    assert hf_workdir.import_to_workdir(str(tmp_path / "out"), str(tmp_path / "w2")).data.tokenizer == str(
        tmp_path / "w2" / "tokenizer")


WORDS = "the quick brown fox jumps over a lazy dog .".split()


def word_tokenizer(size):
    """transformers' fast tokenizer of ``size`` tokens, as a model's directory saves it: a word-level vocabulary (the
    end-of-text and unknown tokens, :data:`WORDS`, then filler words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>", "<unk>", *WORDS]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(size - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>")


def test_a_tokenizer_larger_than_the_embedding_is_refused_with_a_fix_that_trains(tmp_path):
    """A model of 64 embedding rows saved with a tokenizer of 96 tokens, which training would refuse (and a
    model.vocab_size set to fit would not be the imported checkpoint's): --from-hf refuses it in one line, exit 2,
    writing nothing; the transformers code the line gives (resize_token_embeddings, save_pretrained) makes a
    directory that imports, whose config.py trains a step as the docs' command runs it, from another directory than
    the import's, whose relative data.input it names absolutely."""
    from conftest import run_python, word_sentences

    d, work = tmp_path / "hf", tmp_path / "work"
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16, tie_word_embeddings=False)).save_pretrained(d)
    word_tokenizer(96).save_pretrained(d)
    r = cli("--from-hf", str(d), str(work))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    line = lines[0]
    assert line.startswith(f"error: {d / 'config.json'}: vocab_size=64 (the embedding's rows) is below the 96 tokens "
                           f"of the tokenizer in {d}, and training refuses a model.vocab_size below its tokenizer's; "
                           f"resize the embedding with transformers ("), line
    assert "or give a tokenizer of at most 64 tokens (--config.data.tokenizer)" in line, line
    assert not work.exists()
    with pytest.raises(ConvertError) as e:  # the options' tokenizer too, and from_hf's
        hf_workdir.from_hf(str(d), {"data.tokenizer": "byte"})
    assert e.value.keys == ("vocab_size",) and "below the 256 tokens of data.tokenizer=byte" in str(e.value)

    fix = line.split("with transformers (", 1)[1].rsplit(") and import again", 1)[0]
    exec(fix, {"AutoModelForCausalLM": transformers.AutoModelForCausalLM})  # the line's advice, as it stands
    assert len(transformers.AutoTokenizer.from_pretrained(d)) == json.loads((d / "config.json").read_text())[
        "vocab_size"] == 96
    (tmp_path / "corpus.txt").write_text(word_sentences(WORDS[:-1], n=100))
    r = cli("--from-hf", "hf", "work", "--config.data.input=corpus.txt", cwd=tmp_path)  # paths as typed there
    assert r.returncode == 0 and f"data.tokenizer={work / 'tokenizer'}" in r.stdout, r.stderr
    assert f"'input': '{tmp_path / 'corpus.txt'}'" in (work / "config.py").read_text()
    r = run_python("-m", "jaxllm.train", f"--config={work / 'config.py'}", f"--workdir={work}",
                   "--config.data.sampling=uniform",
                   "--config.data.split=9,1", "--config.train.train_iters=1", "--config.train.warmup_iters=0",
                   "--config.train.micro_batch_size=2", "--config.train.global_batch_size=2",
                   "--config.train.eval_interval=0", "--config.log.samples=0", env=ENV)
    assert checkpoint.load_config(str(work)).model.vocab_size == 96 and "step     1 |" in r.stdout, r.stdout


def test_pickle_weights_are_refused_unread(tmp_path):
    """A pytorch_model.bin-only directory is an error; the file is never unpickled."""
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Trap()))
    (tmp_path / "config.json").write_text(json.dumps(gpt2().config.to_dict()))
    with pytest.raises(ConvertError, match="pytorch_model.bin.*safetensors"):
        hf_workdir.from_hf(str(tmp_path))
    r = cli("--from-hf", str(tmp_path), str(tmp_path / "work"))
    assert r.returncode == 2 and "pytorch_model.bin" in r.stderr and "safetensors" in r.stderr
    assert not marker.exists() and not (tmp_path / "work" / "checkpoints").exists()


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory):
    """A Llama directory with its SentencePiece tokenizer.model, as a Llama 2 release has them."""
    from conftest import train_sentencepiece

    d = tmp_path_factory.mktemp("llama_sp")
    torch.manual_seed(4)
    llama().save_pretrained(d, safe_serialization=True)
    train_sentencepiece(d / "tokenizer.model", vocab_size=VOCAB - 1, byte_fallback=False, character_coverage=1.0)
    return d


def truncated(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


BROKEN = {  # file of the directory -> (its damage, words of the one line)
    "model.safetensors": (truncated, "model.safetensors cannot be read as safetensors weights (SafetensorError"),
    "config.json": (lambda p: p.write_text('{"model_type": "llama",'), "config.json cannot be read as JSON"),
    "config.json's values": (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "hidden_size": "x"})),
                             "config.json cannot be read as a Hugging Face config.json"),
    "tokenizer.model": (lambda p: p.write_bytes(os.urandom(2000)), "tokenizer.model: not a SentencePiece model"),
    "tokenizer.json": (lambda p: p.write_text('{"model": {"type": "BPE", "vocab"'),
                       "tokenizer.json: not a Hugging Face tokenizer.json"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_damaged_file_of_an_import_is_one_line_and_leaves_nothing(name, llama_with_tokenizer, tmp_path):
    """Each file --from-hf reads, damaged: one line naming it (a damaged tokenizer is never replaced by the byte
    tokenizer), exit 2 for the CLI, no workdir left; the two of the issue through the CLI, the others in-process."""
    d = tmp_path / "hf"
    shutil.copytree(llama_with_tokenizer, d)
    damage, words = BROKEN[name]
    damage(d / name.split("'")[0])
    if name in ("model.safetensors", "tokenizer.model"):
        r = cli("--from-hf", str(d), str(tmp_path / "work"))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert words in lines[0] and str(d / name) in lines[0], lines[0]
    else:
        with pytest.raises((ConvertError, DataError)) as e:
            hf_workdir.import_to_workdir(str(d), str(tmp_path / "work"))
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("changes,keys", [
    (dict(position_embedding="rotary"), ("model.position_embedding",)),
    (dict(norm="rmsnorm", activation="swiglu"), ("model.norm", "model.activation")),
    (dict(num_kv_heads=2), ("model.num_kv_heads",)),
    (dict(position_embedding="rotary", norm="rmsnorm", activation="swiglu"), ("model.use_bias",)),
    (dict(MOE_CFG, moe_capacity_factor=1.25), ("model.moe_capacity_factor",)),  # Mixtral is dropless
    (dict(MOE_CFG, moe_shared_expert_intermediate_size=32), ("model.moe_shared_expert_intermediate_size",)),
    (dict(num_experts=4), ("model.num_experts",)),  # GPT-2's layer with experts: no such HF model
    (dict(kv_channels=32), ("model.kv_channels",)),  # GPT-2's heads are hidden_size / heads wide
    (dict(mtp_num_layers=1), ("model.mtp_num_layers",)),  # its modules would be left out of the export
    # multi-head latent attention: no q/k/v projections for Llama's table to write; DeepSeek-V3's needs experts
    (dict(LLAMA_CFG, num_kv_heads=0, multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
          v_head_dim=8), ("model.multi_latent_attention",)),
    # DeepSeek-V3's shape, but groups scored by their top 1 (transformers' by their top 2)
    (dict(MOE_CFG, num_kv_heads=0, multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
          v_head_dim=8, moe_shared_expert_intermediate_size=48, moe_router_score_function="sigmoid",
          moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=2),
     ("model.moe_router_group_topk",)),
])
def test_unsupported_combination_names_keys(changes, keys):
    m = small_cfg(**changes).model
    with pytest.raises(ConvertError) as e:
        to_hf(m, gpt.init(m, 0))
    assert e.value.keys == keys
    for k in keys:
        assert k in str(e.value)


def test_cli_export_of_unsupported_model_fails_cleanly(tmp_path):
    cfg = small_cfg(position_embedding="rotary")  # rotary + layernorm + gelu: neither GPT-2 nor Llama
    optimizer = optim.make_optimizer(cfg.train, gpt.describe(cfg.model).decay)
    ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
    ckpt.maybe_save(1, step.init_state(gpt.init(cfg.model, 0), optimizer), force=True)
    ckpt.close()
    r = cli("--to-hf", str(tmp_path), str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert "model.position_embedding" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("model_type,change,key", [
    ("gpt2", {"activation_function": "gelu"}, "activation_function"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("gemma", {}, "model_type"),
    ("mixtral", {"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    ("mixtral", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
                                     "original_max_position_embeddings": 4096}},
     "rope_parameters.rope_type"),
    # what jaxllm's sigmoid router, rotary or YaRN does not compute
    ("deepseek_v3", {"rope_parameters": {**YARN, "attention_factor": 1.5}}, "rope_parameters.attention_factor"),
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("deepseek_v3", {"topk_group": 2}, "topk_group"),
    ("deepseek_v3", {"n_shared_experts": 0}, "n_shared_experts"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
])
def test_unsupported_hf_config_names_key(tmp_path, model_type, change, key):
    hf = {"gpt2": gpt2, "mixtral": mixtral, "qwen3_moe": qwen3_moe,
          "deepseek_v3": lambda: deepseek_v3(12)}.get(model_type, llama)().config.to_dict()
    hf.update(change)
    if model_type == "gemma":
        hf["model_type"] = "gemma"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConvertError) as e:
        hf_workdir.from_hf(str(tmp_path))
    assert e.value.keys == (key,) and key in str(e.value)


@pytest.mark.parametrize("hf_dir", ["gpt2-tied", "llama-gqa-untied"], indirect=True)
def test_import_options_are_checked(hf_dir, tmp_path):
    name, d, _ = hf_dir
    with pytest.raises(ConvertError, match="model.hidden_size") as e:
        hf_workdir.from_hf(d, {"model.hidden_size": "128"})
    assert e.value.keys == ("model.hidden_size",)
    with pytest.raises(ConvertError, match="train.seq_length"):
        hf_workdir.from_hf(d, {"train.seq_length": str(2 * SEQ)})
    # A shorter training length keeps HF's whole position table.
    cfg, params = hf_workdir.from_hf(d, {"train.seq_length": str(SEQ // 2)})
    assert (cfg.train.seq_length, cfg.model.max_position_embeddings) == (SEQ // 2, SEQ)
    assert params["wpe"].shape[0] == SEQ if "gpt2" in name else "wpe" not in params
    # multi-token prediction on an imported model: its modules fresh, every other parameter the import's
    cfg, mtp = hf_workdir.from_hf(d, {"train.seq_length": str(SEQ // 2), "model.mtp_num_layers": "1"})
    h = cfg.model.hidden_size
    assert mtp["mtp"]["eh_proj"].shape == (1, 2, h, h) and np.abs(mtp["mtp"]["eh_proj"]).max() > 0
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in mtp.items() if k != "mtp"}, params)
    with pytest.raises(config.ConfigError, match="data.nope.*no such key"):
        hf_workdir.from_hf(d, {"data.nope": "1"})
    with pytest.raises(config.ConfigError, match="train.train_iters.*must be an integer"):
        hf_workdir.from_hf(d, {"train.train_iters": "many"})
    with pytest.raises(config.ConfigError, match="data.input"):
        hf_workdir.from_hf(d, {"data.input": " "})
    hf_workdir.import_to_workdir(d, str(tmp_path / "w"))
    with pytest.raises(ConvertError, match="already holds checkpoints"):
        hf_workdir.import_to_workdir(d, str(tmp_path / "w"))
