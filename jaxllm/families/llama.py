"""Llama (2, 3, 3.1: transformers' ``LlamaForCausalLM``) and the dense models built on its layer: rotary positions
(Llama 3.1's scaled frequencies too: rope type ``llama3``), RMSNorm, SwiGLU, no biases, grouped-query attention;
**Mistral** attending to a sliding window (``model.sliding_window``); **Qwen2/2.5** with biases on the query/key/value
projections (``model.add_qkv_bias``); **Qwen3** with an RMSNorm of each head's queries and keys before rotary
(``model.qk_layernorm``).  Each with tied or untied embeddings and any head size (``model.kv_channels``, HF's
``head_dim``).  Its rows (attention, MLP, output) are shared by the mixtures of experts built on the same layer
(:mod:`~jaxllm.families.mixtral`, :mod:`~jaxllm.families.qwen3_moe`, :mod:`~jaxllm.families.deepseek_v3`).

Sizes: Llama's, ALCF's (``train_llama_alcf.sh``'s), Qwen's dense and Mistral's, each from the file named beside it;
``configs/llama.py`` trains them on ALCF's recipe.
"""

from jaxllm import config
from jaxllm.families.tables import VEC, Arch, Condition, Family, RopeType, Tensor

PRESET = {"position_embedding": "rotary", "norm": "rmsnorm", "activation": "swiglu", "use_bias": False}

# the embedding and each layer's attention and norms ...
ATTENTION = (
    Tensor("model.embed_tokens.weight", ("wte",)),  # [vocab, h]
    Tensor("model.layers.{i}.input_layernorm.weight", ("layers/ln1/scale",), VEC),
    Tensor("model.layers.{i}.self_attn.q_proj.weight", ("layers/attn/wq",), linear=True),  # [heads*d, h]
    Tensor("model.layers.{i}.self_attn.k_proj.weight", ("layers/attn/wk",), linear=True),  # [kv_heads*d, h]
    Tensor("model.layers.{i}.self_attn.v_proj.weight", ("layers/attn/wv",), linear=True),  # [kv_heads*d, h]
    Tensor("model.layers.{i}.self_attn.o_proj.weight", ("layers/attn/wo",), 2, linear=True),  # [h, heads*d]
    Tensor("model.layers.{i}.post_attention_layernorm.weight", ("layers/ln2/scale",), VEC),
)
# ... and the final norm and output layer
OUTPUT = (
    Tensor("model.norm.weight", ("ln_f/scale",), VEC),
    Tensor("lm_head.weight", ("lm_head",), linear=True),  # [vocab, h]
)
MLP = (  # a dense layer's
    Tensor("model.layers.{i}.mlp.gate_proj.weight", ("layers/mlp/wg",), linear=True, moe=False),  # [f, h]
    Tensor("model.layers.{i}.mlp.up_proj.weight", ("layers/mlp/w1",), linear=True, moe=False),  # [f, h]
    Tensor("model.layers.{i}.mlp.down_proj.weight", ("layers/mlp/w2",), linear=True, moe=False),  # [h, f]
)
# the family's base model (whose nn.Embedding has padding_idx=config.pad_token_id: Arch.padding_idx) and buffers
FILES = {"prefix": "model.", "buffers": r".*rotary_emb\.inv_freq", "padding_idx": True}
NEEDS = {**PRESET, "num_experts": 0, "add_qkv_bias": False, "qk_layernorm": False, "sliding_window": 0,
         "multi_latent_attention": False}
KEYS = {"num_hidden_layers": ("num_layers", 32), "hidden_size": ("hidden_size", 4096),
        "num_attention_heads": ("num_attention_heads", 32), "num_key_value_heads": ("num_kv_heads", None),
        "intermediate_size": ("ffn_hidden_size", 11008), "vocab_size": ("vocab_size", 32000),
        "max_position_embeddings": ("max_position_embeddings", 2048), "rms_norm_eps": ("norm_eps", 1e-6),
        "rope_theta": ("rotary_base", 10000.0), "initializer_range": ("init_std", 0.02),
        "tie_word_embeddings": ("tie_embeddings", False)}

# Llama 3.1's scaled frequencies: rope_parameters' keys -> model keys
_LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_position_embeddings"}


def _read_llama3(rope: dict, refuse) -> dict:
    """Model keys of rope type ``llama3``'s parameters (all four needed)."""
    missing = [k for k in _LLAMA3_ROPE if k not in rope]
    if missing:
        refuse("rope_parameters", rope, f"the llama3 rope type's {', '.join(missing)} too")
    return {"use_rope_scaling": True,
            **{ours: config.key_type(f"model.{ours}")(rope[k]) for k, ours in _LLAMA3_ROPE.items()}}


LLAMA3_ROPE = RopeType(
    what="Llama 3.1's scaling", read=_read_llama3, applies=lambda m: m.use_rope_scaling,
    write=lambda m: {"rope_type": "llama3", **{hf: getattr(m, ours) for hf, ours in _LLAMA3_ROPE.items()}})


def rope_parameters(m: config.Model, *types: RopeType) -> dict:
    """config.json's rotary settings: ``rope_parameters`` (transformers 5) with the theta, ``rope_scaling``
    (transformers 4) the scaling alone; the first of the rope types ``types`` (default: ``llama3``, with
    ``model.use_rope_scaling``) that applies to ``m``, else ``default``."""
    scaling = next((t.write(m) for t in types or (LLAMA3_ROPE,) if t.applies(m)), None)
    if scaling is None:
        return {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base}}
    return {"rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": m.rotary_base}}


LLAMA = Arch(
    model_type="llama", hf_class="LlamaForCausalLM", needs=NEEDS, keys=KEYS,
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)},
    # rope_theta for transformers 4.x, rope_parameters for 5.x: the same value.
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, "pretraining_tp": 1, **rope_parameters(m)},
    **FILES,
    tensors=(*ATTENTION, *MLP, *OUTPUT),
    likely=lambda m: m.position_embedding == "rotary")

# Mistral: Llama's layer attending to the last sliding_window positions (null or absent: every one, as Mistral
# v0.2 and later; then it is exported as Llama, the same model); the defaults are transformers' MistralConfig's
MISTRAL = Arch(
    model_type="mistral", hf_class="MistralForCausalLM",
    needs={k: v for k, v in NEEDS.items() if k != "sliding_window"},  # and a window (misfits)
    keys={**KEYS, "num_key_value_heads": ("num_kv_heads", 8), "intermediate_size": ("ffn_hidden_size", 14336),
          "max_position_embeddings": ("max_position_embeddings", 131072), "sliding_window": ("sliding_window", 4096)},
    supports={"hidden_act": ("silu",)},
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, "sliding_window": m.sliding_window or None,
                     **rope_parameters(m)},
    **FILES,
    tensors=(*ATTENTION, *MLP, *OUTPUT),
    misfits=lambda m: {} if m.sliding_window else {"model.sliding_window": Condition("> 0")},
    likely=lambda m: bool(m.sliding_window))

# Qwen2/2.5 and Qwen3: Llama's layer with biases on the query/key/value projections (Qwen2), or an RMSNorm of each
# head's queries and keys before rotary (Qwen3); their defaults are Qwen's (transformers' Qwen2Config, Qwen3Config)
QWEN_KEYS = {**KEYS, "intermediate_size": ("ffn_hidden_size", 22016), "vocab_size": ("vocab_size", 151936),
             "max_position_embeddings": ("max_position_embeddings", 32768)}
_QWEN_EXTRA = {"attention_dropout": 0.0, "sliding_window": None, "max_window_layers": 0}
QWEN2 = Arch(
    model_type="qwen2", hf_class="Qwen2ForCausalLM", needs={**NEEDS, "add_qkv_bias": True}, keys=QWEN_KEYS,
    supports={"hidden_act": ("silu",), "use_sliding_window": (False,)},
    extra=lambda m: {**_QWEN_EXTRA, "head_dim": m.head_dim, **rope_parameters(m)},
    **FILES,
    tensors=(*ATTENTION,
             *(Tensor(f"model.layers.{{i}}.self_attn.{x}_proj.bias", (f"layers/attn/b{x}",), VEC) for x in "qkv"),
             *MLP, *OUTPUT),
    likely=lambda m: m.add_qkv_bias)
PROJECTIONS = tuple(t for t in ATTENTION if ".self_attn." in t.name)  # the query, key, value and output ones
QK_NORMS = tuple(Tensor(f"model.layers.{{i}}.self_attn.{x}_norm.weight", (f"layers/attn/{x}_norm/scale",), VEC)
                 for x in "qk")  # model.qk_layernorm's (per head, or of all heads with qk_layernorm_per_head=False)
QWEN3_ATTENTION = (*ATTENTION, *QK_NORMS)
QWEN3 = Arch(
    model_type="qwen3", hf_class="Qwen3ForCausalLM", needs={**NEEDS, "qk_layernorm": True}, keys=QWEN_KEYS,
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "use_sliding_window": (False,)},
    extra=lambda m: {**_QWEN_EXTRA, "head_dim": m.head_dim, **rope_parameters(m)},
    **FILES,
    tensors=(*QWEN3_ATTENTION, *MLP, *OUTPUT),
    likely=lambda m: m.qk_layernorm)

# The sizes: (num_layers, hidden_size, num_attention_heads, num_kv_heads, ffn_hidden_size, vocab_size,
# max_position_embeddings, rotary_base) and their other model keys, each from the source named.
_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
          "max_position_embeddings", "rotary_base")


def shape(*values, **more) -> dict:
    """A size's model keys: the eight of ``_SHAPE`` in order, then ``more``."""
    return {**dict(zip(_SHAPE, values, strict=True)), **more}


SIZES = {
    # ALCF/helpers.sh's setParams defaults ("Llama2 7B Config" but with NUM_KV_HEAD=8); its vocabulary: ALCF's
    # default TOKENIZER_TYPE is Llama2Tokenizer (ALCF/tokenizer.model, taken to be Llama 2's, 32000 tokens)
    "ALCF-7B": shape(32, 4096, 32, 8, 11008, 32000, 2048, 10000.0),
    # argonne-lcf/Megatron-DeepSpeed ALCF/AuroraGPT/2B/MODEL_CARD.md (google/gemma-7b's tokenizer; the card gives
    # no rotary base: jaxllm's default kept)
    "AuroraGPT-2B": shape(12, 2048, 16, 4, 11008, 256000, 8192, 10000.0),
    # ALCF/helpers.sh's "Llama2 7B Config"; no GQA and context 4k: meta-llama/llama MODEL_CARD.md; FFN, norm_eps,
    # theta: meta-llama/llama llama/model.py; vocabulary: the Llama 2 paper (section 2.2)
    "Llama-2-7B": shape(32, 4096, 32, 32, 11008, 32000, 4096, 10000.0),
    # meta-llama/llama3 Meta-Llama-3-8B-Instruct/params.json and MODEL_CARD.md (context 8k)
    "Llama-3-8B": shape(32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
    # meta-llama/Llama-3.1-8B config.json: Llama-3-8B's shape, 131072 positions, rope type llama3
    "Llama-3.1-8B": shape(32, 4096, 32, 8, 14336, 128256, 131072, 500000.0, use_rope_scaling=True,
                          rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                          rope_original_max_position_embeddings=8192),
    # Qwen/Qwen2.5-7B config.json (Qwen2ForCausalLM)
    "Qwen2.5-7B": shape(28, 3584, 28, 4, 18944, 152064, 131072, 1e6, add_qkv_bias=True, norm_eps=1e-6),
    # Qwen/Qwen3-8B config.json (Qwen3ForCausalLM; head_dim 128 = hidden / heads)
    "Qwen3-8B": shape(36, 4096, 32, 8, 12288, 151936, 40960, 1e6, qk_layernorm=True, norm_eps=1e-6),
    # mistralai/Mistral-7B-v0.1 config.json (MistralForCausalLM)
    "Mistral-7B": shape(32, 4096, 32, 8, 14336, 32000, 32768, 10000.0, sliding_window=4096),
}

FAMILY = Family(
    name="llama", preset=PRESET, architectures=(LLAMA, MISTRAL, QWEN2, QWEN3), rope_types={"llama3": LLAMA3_ROPE},
    megatron_args={
        "use_rope_scaling": ((False, None), "Llama 3's rope scaling is not read from Megatron checkpoints"),
        "window_size": ((None,), "sliding windows are not read from Megatron checkpoints")},
    megatron_keys={"sliding_window": 0},
    sizes=SIZES)
