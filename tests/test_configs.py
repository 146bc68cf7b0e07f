"""The shipped configs: configs/gpt3.py's keys (ALCF's ALCF/model.sh, GPT-3's 350M, the Frontier study's)
and the recipes, which need no folder outside the repository."""

import importlib.util
import re
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT, run_python

from jaxllm import config
from jaxllm.data.tokenizers import PACKAGED_GPT2_DIR
from jaxllm.model import gpt
from jaxllm.resolve import resolve


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpt3 = load("gpt3")

# argonne-lcf/Megatron-DeepSpeed ALCF/model.sh (the copy in samanta-amit/Megatron-DeepSpeed at 39a484d2):
# every MODEL_SIZE_KEY it defines ...
MODEL_SH_KEYS = ["GPT125M", "BERT1.2B", "GPT1_5B", "GPT2_7B", "GPT6_7B", "GPT13B", "GPT25B", "GPT30B", "GPT33B",
                 *(f"GPT145B_{n}L" for n in (2, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)), "GPT145B",
                 *(f"GPT1T_{n}L" for n in (1, 2, 4, 8, 16, 24, 30, 32, 60, 64, 120, 128, 256, 512, 1024))]
# ... and its A_NLAYERS, A_HIDDEN, A_ATEN_HEADS for some of them, as the file writes them
MODEL_SH = {"GPT125M": (12, 768, 16), "BERT1.2B": (24, 2048, 128), "GPT1_5B": (48, 1536, 24),
            "GPT13B": (40, 5120, 64), "GPT25B": (64, 6144, 64), "GPT33B": (80, 6144, 64),
            "GPT145B": (80, 12288, 96), "GPT145B_5L": (5, 12288, 96), "GPT1T_30L": (30, 25600, 160),
            "GPT1T_1024L": (1024, 25600, 160)}
# the Frontier study's launch scripts (sajal-vt/Megatron-DeepSpeed-ORNL): --num-layers, --hidden-size,
# --num-attention-heads
FRONTIER = {"GPT22B": (48, 6144, 48), "GPT175B": (96, 12288, 96), "GPT1T": (128, 25600, 128)}


def test_the_keys_are_model_sh_and_the_frontier_study():
    assert set(MODEL_SH_KEYS) <= set(gpt3.SIZES) and len(MODEL_SH_KEYS) == 9 + 12 + 1 + 15
    assert set(gpt3.SIZES) == {*MODEL_SH_KEYS, *FRONTIER, "GPT350M"}
    for key, shape in {**MODEL_SH, **FRONTIER, "GPT350M": (24, 1024, 16)}.items():
        assert gpt3.SIZES[key] == shape, key


@pytest.mark.parametrize("key", list(gpt3.SIZES))
def test_every_key_resolves(key):
    cfg = resolve(gpt3.get_config(key), num_devices=1, vocab_size=50257, data_files=False)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == gpt3.SIZES[key]
    assert m.padded_vocab_size == 50304 and m.max_position_embeddings >= 2048 and m.tie_embeddings
    assert cfg.data.tokenizer == "gpt2" and cfg.data.gpt2_dir == ""  # the shipped GPT-2 files


def hand_count(layers, h, vocab=50304, positions=2048):
    """GPT-3's parameters, counted by hand: token and position tables; per layer LayerNorm (2h), the
    query/key/value (3h^2 + 3h) and output (h^2 + h) projections, LayerNorm (2h), the MLP h -> 4h -> h
    (8h^2 + 5h); the final LayerNorm (2h); the output layer is the token table (tied)."""
    per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (8 * h * h + 5 * h)
    return vocab * h + positions * h + layers * per_layer + 2 * h


@pytest.mark.parametrize("key, expected", [("GPT125M", 125_262_336), ("GPT145B_2L", 4_267_524_096),
                                           ("GPT1T_1L", 9_204_915_200)])
def test_parameter_counts_are_the_hand_counts(key, expected):
    cfg = resolve(gpt3.get_config(key), num_devices=1, vocab_size=50257, data_files=False)
    layers, h, _ = gpt3.SIZES[key]
    assert hand_count(layers, h) == expected
    assert gpt.num_params(gpt.describe(cfg.model).params) == expected


def test_a_fresh_clone_runs_the_configs():
    """No file outside the repository: GPT-2's files ship with the package, Tiny Shakespeare with the
    repository, and the end-to-end recipe trains on the running Python's standard library."""
    assert sorted(p.name for p in Path(PACKAGED_GPT2_DIR).iterdir()) == ["LICENSE", "encoder.json", "vocab.bpe"]
    for path in (ROOT / "configs").glob("*.py"):  # no path into a ../shared folder (shared experts are fine)
        assert not re.search(r"/shared\b", path.read_text()), path
    cfg = resolve(gpt3.get_config("GPT125M"), num_devices=1)  # the data files checked: the shipped ones
    assert cfg.data.input == config.default_corpus()
    shakespeare = load("shakespeare_char").get_config()
    assert Path(shakespeare.data.input) == ROOT / "tests" / "data" / "tinyshakespeare.txt"
    resolve(shakespeare, num_devices=1)
    python = resolve(load("python_gpt2").get_config(), num_devices=1)
    assert python.data.input == sysconfig.get_paths()["stdlib"] and python.data.tokenizer == "gpt2"


@pytest.mark.parametrize("key, impl", [("DS4Science", "ulysses"), ("DS4Science-ring", "ring"),
                                       ("DS4Science-usp", "usp")])
def test_long_context_recipes_are_the_deepspeed4science_run(key, impl):
    """GPT25B (64 x 6144, 64 heads), rotary, 430,080 tokens over 32 sequence devices with ZeRO-3, each layer
    recomputed with its input in host memory, the MLP in 8 chunks; USP in groups of a node's 4 devices."""
    cfg = resolve(load("long_context").get_config(key), num_devices=32, vocab_size=50257, data_files=False,
                  backend="cuda")
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.position_embedding, m.remat, m.mlp_chunks) == (
        64, 6144, 64, "rotary", "offload", 8)
    assert (cfg.train.seq_length, cfg.train.global_batch_size, cfg.mesh_shape["sequence"]) == (430_080, 1, 32)
    assert (cfg.parallel.sequence_impl, cfg.parallel.zero_stage, m.dtype) == (impl, 3, "bfloat16")
    assert cfg.parallel.ulysses_degree == (4 if impl == "usp" else 0)


def test_deepspeed4science_plans_fit_a100_40gb():
    """The acceptance of the long-sequence work: the DeepSpeed4Science run's plan (Ulysses over 32 A100-40GB,
    ZeRO-3, 430,080 tokens) fits, and so does USP in groups of 4, as the command line prints it."""
    for key in ("DS4Science", "DS4Science-usp"):
        out = run_python("-m", "jaxllm.plan", f"--config=configs/long_context.py:{key}", "--devices=32",
                         "--device=A100-40GB")
        assert "\nFITS in A100-40GB" in out.stdout, out.stdout + out.stderr
