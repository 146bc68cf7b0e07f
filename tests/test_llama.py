"""configs/llama.py (train_llama_alcf.sh's recipe) and the launch scripts' ALCF knobs (launch/common.sh)."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.model import gpt
from jaxllm.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]


def llama():
    spec = importlib.util.spec_from_file_location("llama", ROOT / "configs" / "llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# published parameter counts: those of Meta's released checkpoints (Llama-2-7B 6.74B, Llama-3-8B 8.03B, as
# given in the brief of issue 31) and AuroraGPT-2B's model card (~1.986B); within 0.5%
@pytest.mark.parametrize("key, published", [("Llama-2-7B", 6.74e9), ("Llama-3-8B", 8.03e9),
                                            ("Llama-3.1-8B", 8.03e9), ("AuroraGPT-2B", 1.986e9)])
def test_keys_resolve_with_the_published_sizes(key, published):
    cfg = resolve(llama().get_config(key), num_devices=1, data_files=False)
    n = gpt.num_params(gpt.describe(cfg.model).params)  # jax.eval_shape: nothing allocated
    assert abs(n - published) / published < 0.005, (key, n)


# the published config.json values (Hugging Face Hub: meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-7B, Qwen/Qwen3-8B,
# mistralai/Mistral-7B-v0.1, Qwen/Qwen3-30B-A3B)
HF_CONFIGS = {
    "Llama-3.1-8B": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "Qwen2.5-7B": ("Qwen2Config", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=1000000.0)),
    "Qwen3-8B": ("Qwen3Config", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=1000000.0)),
    "Mistral-7B": ("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=10000.0, sliding_window=4096)),
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0)),
    # from memory, not read from the Hub (no network here): see configs/llama.py
    "Moonlight-16B-A3B": ("DeepseekV3Config", dict(
        hidden_size=2048, intermediate_size=11264, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
        vocab_size=163840, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        num_nextn_predict_layers=0,  # its checkpoint holds no multi-token prediction module
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    # from memory, not read from the Hub (no network here): see jaxllm/families/deepseek_v3.py
    "DeepSeek-V3": ("DeepseekV3Config", dict(
        hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_nextn_predict_layers=1, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # from memory, not read from the Hub (no network here): see jaxllm/families/olmo2.py
    "OLMo-2-7B": ("Olmo2Config", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=100352, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=500000.0, pad_token_id=100277)),
    "OLMo-2-32B": ("Olmo2Config", dict(
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
        vocab_size=100352, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=500000.0, pad_token_id=100277)),
}


@pytest.mark.parametrize("key", HF_CONFIGS)
def test_open_model_keys_are_the_published_models(key):
    """The key's parameter count is transformers' for the published config (built on the meta device; transformers
    builds no multi-token prediction module, so DeepSeek-V3's is left out of the count), and importing that
    config.json gives the key's model settings."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from jaxllm.formats import hf  # noqa: PLC0415

    cls, values = HF_CONFIGS[key]
    hf_config = getattr(transformers, cls)(**values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    # DeepSeek-V3's expert bias is a buffer there, a parameter (not trained by gradients) here
    reference = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    m = resolve(llama().get_config(key), num_devices=1, data_files=False).model
    assert m.padded_vocab_size == m.vocab_size  # no padding rows: the count is comparable
    params = gpt.describe(m).params
    assert gpt.num_params(params) - gpt.num_params(params.get("mtp", {})) == reference
    _, imported = hf.model_from_hf(hf_config.to_dict())
    assert {k: getattr(m, k) for k in imported} == imported


def test_recipe_is_train_llama_alcf():
    cfg = resolve(llama().get_config("ALCF-7B"), num_devices=1, data_files=False)
    m, t = cfg.model, cfg.train
    assert (m.norm, m.activation, m.position_embedding, m.tie_embeddings, m.use_bias) == (
        "rmsnorm", "swiglu", "rotary", False, False)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.ffn_hidden_size) == (
        32, 4096, 32, 8, 11008)
    assert (t.optimizer, t.lr, t.min_lr, t.lr_decay_style, t.warmup_iters, t.lr_warmup_fraction) == (
        "adamw", 2e-4, 0.0, "cosine", 0, 0.05)
    assert (t.beta1, t.beta2, t.adam_eps, t.weight_decay, t.grad_clip) == (0.9, 0.95, 1e-5, 0.1, 1.0)
    assert (cfg.data.split, t.eval_interval, t.eval_iters, cfg.checkpoint.interval) == ("990,10,0", 100, 20, 50)
    l3 = resolve(llama().get_config("Llama-3-8B"), num_devices=1, data_files=False).model
    assert (l3.rotary_base, l3.vocab_size, l3.max_position_embeddings) == (500000.0, 128256, 8192)
    l31 = resolve(llama().get_config("Llama-3.1-8B"), num_devices=1, data_files=False).model
    assert (l31.max_position_embeddings, l31.use_rope_scaling, l31.rope_scaling_factor, l31.rope_low_freq_factor,
            l31.rope_high_freq_factor, l31.rope_original_max_position_embeddings) == (131072, True, 8.0, 1.0, 4.0, 8192)
    assert not l3.use_rope_scaling
    with pytest.raises(ValueError, match="unknown key"):
        llama().get_config("Llama-9B")


def test_tiny_key_trains_through_the_cli(tmp_path):
    words = "the quick brown fox jumps over a lazy dog while llamas graze".split()
    docs = ["=== doc\n" + " ".join(words[(i * 7 + j) % len(words)] for j in range(120)) + "\n" for i in range(200)]
    (tmp_path / "t.txt").write_text("".join(docs))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXLLM_", "XLA_"))}
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", "--config=configs/llama.py:tiny",
                        f"--workdir={tmp_path / 'w'}", f"--config.data.input={tmp_path / 't.txt'}",
                        "--config.data.document_marker====", "--config.train.train_iters=4",
                        "--config.train.eval_interval=4", "--config.log.tensorboard=False",
                        "--config.log.progress_bar=False", "--config.log.samples=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(ln) for ln in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert any(m["kind"] == "eval" and m["step"] == 4 for m in lines)


# ---------------------------------------------------------------- launch scripts' knobs (dry runs)

def dry_run(script, *args, **env):
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "USER": "alice",
            "PYTHON": sys.executable, "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(ROOT)}
    r = subprocess.run(["bash", str(ROOT / "launch" / script), "--dry-run", *args], capture_output=True, text=True,
                       timeout=120, env={**base, **env}, cwd="/")
    commands = [shlex.split(ln) for ln in r.stdout.splitlines() if ln and not ln.startswith(("export ", "#"))]
    flags = commands[0][commands[0].index("jaxllm.train") + 1:] if commands else []
    return r, flags


KNOBS = {"NUM_KV_HEAD": "4", "FFN_HIDDEN_SIZE": "14336", "OPT": "lamb", "LR": "3e-4", "LR_DECAY_STYLE": "linear",
         "LR_WARMUP_FRAC": "0.01", "TOKENIZER_TYPE": "HFTokenizer", "TOKENIZER_MODEL": "/lus/x/tokenizer.json",
         "DATA_FILE_LIST": "/lus/x/dolma.txt", "TRAIN_SPLIT": "98", "VAL_SPLIT": "2", "EVAL_INTERVAL": "50",
         "EVAL_ITERS": "5", "SAVE_INTERVAL": "200", "ADAM_BETA1": "0.85", "ADAM_BETA2": "0.98", "ADAM_EPS": "1e-8",
         "WEIGHT_DECAY": "0.05", "CLIP_GRAD": "0.5", "TRAIN_ITERS": "5000"}


def test_alcf_knobs_become_config_flags():
    r, flags = dry_run("frontier.sbatch", "--config.train.lr=1e-4", LLAMA="1", MODEL_SIZE_KEY="Llama-3-8B", TP="2",
                       **KNOBS)
    assert r.returncode == 0, r.stderr
    assert flags == [f"--config={ROOT}/configs/llama.py:Llama-3-8B",  # run from /: the repository's, absolute
                     "--config.mesh.tensor=2", "--config.mesh.pipeline=1", "--config.mesh.sequence=1",
                     "--config.mesh.data=8", "--config.model.num_kv_heads=4",
                     "--config.model.ffn_hidden_size=14336", "--config.train.optimizer=lamb",
                     "--config.train.lr=3e-4", "--config.train.lr_decay_style=linear",
                     "--config.train.train_iters=5000", "--config.train.eval_interval=50",
                     "--config.train.eval_iters=5", "--config.checkpoint.interval=200", "--config.train.beta1=0.85",
                     "--config.train.beta2=0.98", "--config.train.adam_eps=1e-8", "--config.train.weight_decay=0.05",
                     "--config.train.grad_clip=0.5", "--config.data.file_list=/lus/x/dolma.txt",
                     "--config.train.lr_warmup_fraction=0.01", "--config.train.warmup_iters=0",
                     "--config.data.split=98,2,0", "--config.data.tokenizer=/lus/x/tokenizer.json",
                     "--config.train.lr=1e-4"]  # the script's own arguments last: they win
    # the cluster's files are not looked for here, and the output says so in one line
    assert "# jaxllm check: config ok for 16 rocm devices: data 8 x tensor 2" in r.stdout
    assert sum("not check" in ln for ln in r.stdout.splitlines()) == 1


def test_gpt3_stays_the_default_and_llama_is_chosen_by_llama_1(tmp_path):
    # documented commands (MODEL_SIZE_KEY=GPT1_5B ...) keep their meaning; NO_LLAMA (ALCF's) says the same
    for env in ({}, {"NO_LLAMA": "1"}):
        r, flags = dry_run("polaris.pbs", MODEL_SIZE_KEY="GPT1_5B", PBS_NODEFILE=nodefile(tmp_path),
                           PBS_O_WORKDIR=str(ROOT), TOKENIZER_TYPE="GPT2BPETokenizer",
                           JAXLLM_ARGS="--config.mesh.data=-1", **env)
        assert r.returncode == 0, r.stderr
        assert flags == [f"--config={ROOT}/configs/gpt3.py:GPT1_5B", "--config.data.tokenizer=gpt2",
                         "--config.mesh.data=-1"]  # run from /: the repository's config, made absolute
    r, flags = dry_run("polaris.pbs", LLAMA="1", PBS_NODEFILE=nodefile(tmp_path), PBS_O_WORKDIR=str(ROOT),
                       JAXLLM_ARGS="--config.mesh.data=-1")
    assert r.returncode == 0, r.stderr
    assert flags == [f"--config={ROOT}/configs/llama.py:ALCF-7B", "--config.mesh.data=-1"]


@pytest.mark.parametrize("env", [{"TOKENIZER_TYPE": "Llama2Tokenizer", "TOKENIZER_MODEL": "/lus/x/tokenizer.model"},
                                 {"TOKENIZER_TYPE": "/lus/x/tokenizer.model"}])
def test_a_sentencepiece_model_is_the_tokenizer(env):
    """ALCF's Llama 2 settings: Megatron's Llama2Tokenizer reads TOKENIZER_MODEL, jaxllm's data.tokenizer that file."""
    r, flags = dry_run("frontier.sbatch", LLAMA="1", MODEL_SIZE_KEY="Llama-3-8B", TP="2", **env)
    assert r.returncode == 0, r.stderr
    assert [f for f in flags if f.startswith("--config.data.")] == ["--config.data.tokenizer=/lus/x/tokenizer.model"]


def nodefile(tmp_path):
    path = tmp_path / "nodefile"
    path.write_text("x3005c0s13b0n0\n")
    return str(path)


@pytest.mark.parametrize("env, message", [
    ({"LLAMA": "1", "NO_LLAMA": "1"}, "LLAMA=1 and NO_LLAMA=1: give one of them"),
    ({"LLAMA": "yes"}, "LLAMA=yes: 1"),
    ({"TOKENIZER_TYPE": "Llama2Tokenizer"}, "TOKENIZER_TYPE=Llama2Tokenizer: jaxllm reads a Hugging Face"),
    ({"TRAIN_ITERS": "0"}, "TRAIN_ITERS=0: must be a positive integer"),
    ({"EVAL_INTERVAL": "often"}, "EVAL_INTERVAL=often: must be an integer >= 0"),
])
def test_bad_knobs_are_one_line_exit_2(env, message):
    r, _ = dry_run("frontier.sbatch", **env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("launch: ") and message in r.stderr


def test_an_optimizer_jaxllm_lacks_is_the_checks_error():
    r, _ = dry_run("frontier.sbatch", LLAMA="1", OPT="sophiag")
    assert r.returncode == 2 and "train.optimizer='sophiag'" in r.stderr, r.stderr
