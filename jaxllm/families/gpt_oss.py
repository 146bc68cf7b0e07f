"""gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925; transformers'
``GptOssForCausalLM``): pre-norm RMSNorm layers whose attention (biases on every projection) has a learned sink
logit per head in its softmax (``model.softmax_type="learnable"``), alternating a window of 128 with every earlier
position (``model.sliding_window``, ``model.window_attn_skip_freq`` 2), YaRN-scaled rotary (rope type ``yarn``), and
a mixture of experts in every layer: a router with a bias (``model.moe_router_bias``), its top 4 softmaxed, each
expert a clamped SwiGLU with biases (Megatron-LM's quick GeGLU: ``model.activation="quick_geglu"``, 1.702,
``model.glu_linear_offset`` 1, ``model.activation_func_clamp_value`` 7; its gate and linear columns interleaved,
as gpt-oss's ``gate_up_proj``).  The published expert weights are MXFP4 (``*_blocks``, ``*_scales``), dequantized on
import as transformers dequantizes them (:func:`dequantize_mxfp4`); the export writes them unquantized.

Sizes: gpt-oss-20b and gpt-oss-120b; ``configs/llama.py`` trains them.
"""

import re

import numpy as np

from jaxllm import config
from jaxllm.errors import ConvertError
from jaxllm.families import deepseek_v3, gemma3, llama, mixtral
from jaxllm.families.tables import VEC, WHOLE, Arch, Family, Tensor, refuse

PRESET = {"position_embedding": "rotary", "norm": "rmsnorm", "activation": "quick_geglu", "use_bias": True,
          "glu_linear_offset": 1.0, "softmax_type": "learnable", "moe_router_bias": True, "tie_embeddings": False}

# transformers' FP4_VALUES (integrations/mxfp4.py): the e2m1 value of each 4-bit code
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 expert weights as transformers' ``convert_moe_packed_tensors`` dequantizes them (OCP Microscaling
    Formats v1.0: blocks of 32 e2m1 values sharing one e8m0 scale).

    Args:
      blocks: ``[experts, out, groups, 16]`` bytes (uint8 values), two 4-bit codes each, the low nibble first.
      scales: ``[experts, out, groups]`` bytes: each group's exponent plus 127.
    Returns:
      float32 ``[experts, groups x 32, out]`` (``[experts, in, out]``): ``FP4_VALUES[code] x 2^(scale - 127)``,
      exact (every such value is a float32, and a bfloat16).
    Raises:
      ConvertError: the shapes do not fit.
    """
    blocks = np.asarray(blocks).astype(np.uint8)
    if blocks.shape[:-1] != np.shape(scales):
        raise ConvertError(f"model.safetensors: MXFP4 blocks {list(blocks.shape)} and scales {list(np.shape(scales))} "
                           "do not fit (blocks [experts, out, groups, 16], scales [experts, out, groups])")
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2], values[..., 1::2] = FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, np.asarray(scales).astype(np.int32)[..., None] - 127)
    experts, out, groups, width = values.shape
    return values.reshape(experts, out, groups * width).transpose(0, 2, 1)


def _gpt_oss_layouts(tensors: dict[str, np.ndarray], m: config.Model) -> dict[str, np.ndarray]:
    """A gpt-oss checkpoint as its table: MXFP4 experts (``mlp.experts.gate_up_proj_blocks`` and ``_scales``, and
    ``down_proj``'s) dequantized (:func:`dequantize_mxfp4`) into ``gate_up_proj``, ``down_proj``."""
    out = dict(tensors)
    for k in [k for k in tensors if re.fullmatch(r".*\.mlp\.experts\.(gate_up_proj|down_proj)_blocks", k)]:
        name = k.removesuffix("_blocks")
        if name + "_scales" not in tensors:
            raise ConvertError(f"model.safetensors: {k} has no {name}_scales")
        out[name] = dequantize_mxfp4(out.pop(k), out.pop(name + "_scales"))
    return out


def _gpt_oss_keys(hf: dict, keys: dict) -> dict:
    """gpt-oss's layer kinds as model keys: ``layer_types`` (else transformers' alternation, from a window's
    layer) as ``model.window_attn_skip_freq``; the dense FFN size the experts' (no dense layer).  Raises
    ConvertError for a quantization other than MXFP4."""
    quantization = hf.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        refuse("quantization_config", quantization, "none or quant_method mxfp4")

    pattern = {**hf, "sliding_window_pattern": 2}  # transformers' default: every other layer global
    return {"ffn_hidden_size": keys["moe_ffn_hidden_size"],
            "window_attn_skip_freq": gemma3.layer_pattern(pattern, keys["num_layers"], refuse)
            if keys["sliding_window"] else ""}


def _experts(name: str, ours: str) -> Tensor:
    """A row of one layer's experts held whole, ``[experts, ...]`` as our parameter's slice."""
    return Tensor(f"model.layers.{{i}}.mlp.experts.{name}", (f"layers/mlp/{ours}",), WHOLE, moe=True)


GPT_OSS = Arch(
    model_type="gpt_oss", hf_class="GptOssForCausalLM",
    # and num_experts > 0 (misfits); YaRN's score scale is DeepSeek's only (transformers' gpt-oss has none)
    needs={**mixtral.MOE_NEEDS, **PRESET, "qk_layernorm": False, "moe_layer_freq": "1",
           "moe_router_pre_softmax": False, "yarn_mscale_all_dim": 0.0},
    # transformers' GptOssConfig defaults
    keys={"num_hidden_layers": ("num_layers", 36), "hidden_size": ("hidden_size", 2880),
          "num_attention_heads": ("num_attention_heads", 64), "num_key_value_heads": ("num_kv_heads", 8),
          "intermediate_size": ("moe_ffn_hidden_size", 2880), "num_local_experts": ("num_experts", 128),
          "num_experts_per_tok": ("moe_router_topk", 4), "router_aux_loss_coef": ("moe_aux_loss_coeff", 0.001),
          "vocab_size": ("vocab_size", 201088), "max_position_embeddings": ("max_position_embeddings", 131072),
          "rms_norm_eps": ("norm_eps", 1e-5), "rope_theta": ("rotary_base", 150000.0),
          "initializer_range": ("init_std", 0.02), "sliding_window": ("sliding_window", 128),
          "swiglu_limit": ("activation_func_clamp_value", 7.0)},
    supports={"hidden_act": ("silu",), "swiglu_alpha": (1.702,), "attention_bias": (True,),
              "tie_word_embeddings": (False,)},
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, "sliding_window": m.sliding_window or None,
                     "layer_types": gemma3.layer_types(m),
                     "output_router_logits": False, **llama.rope_parameters(m, deepseek_v3.YARN_ROPE)},
    **llama.FILES,
    tensors=(
        *llama.ATTENTION[:-1],  # the embedding, input_layernorm, q/k/v/o projections
        *(Tensor(f"model.layers.{{i}}.self_attn.{x}_proj.bias", (f"layers/attn/b{x}",), VEC) for x in "qkvo"),
        Tensor("model.layers.{i}.self_attn.sinks", ("layers/attn/sinks",), VEC),  # [heads]
        llama.ATTENTION[-1],  # post_attention_layernorm
        Tensor("model.layers.{i}.mlp.router.weight", ("layers/mlp/router",), linear=True, moe=True),  # [E, h]
        Tensor("model.layers.{i}.mlp.router.bias", ("layers/mlp/router_bias",), VEC, moe=True),
        _experts("gate_up_proj", "w1"), _experts("gate_up_proj_bias", "b1"),  # [E, h, 2f], [E, 2f]: interleaved
        _experts("down_proj", "w2"), _experts("down_proj_bias", "b2"),  # [E, f, h], [E, h]
        *llama.OUTPUT),
    layouts=_gpt_oss_layouts,
    derive=_gpt_oss_keys,
    free=("rope_type", "window_attn_skip_freq", "activation_func_clamp_value"),
    misfits=mixtral.needs_experts,
    likely=lambda m: m.softmax_type == "learnable")


def _size(layers: int, experts: int) -> dict:
    """A gpt-oss size (``openai/gpt-oss-20b``, ``-120b`` config.json, as recalled: no network here): hidden 2880, 64
    heads of 64, 8 key/value heads, experts of 2880, top 4, vocabulary 201088, 131072 positions, rotary base 150000
    YaRN-scaled by 32 over 4096 positions (beta 32 and 1, not truncated), windows of 128 on every other layer from the
    first, rms_norm_eps 1e-5, swiglu_limit 7."""
    return {**PRESET, "num_layers": layers, "hidden_size": 2880, "num_attention_heads": 64, "num_kv_heads": 8,
            "kv_channels": 64, "ffn_hidden_size": 2880, "moe_ffn_hidden_size": 2880, "num_experts": experts,
            "moe_router_topk": 4, "vocab_size": 201088, "max_position_embeddings": 131072, "norm_eps": 1e-5,
            "rotary_base": 150000.0, "rope_type": "yarn", "yarn_rotary_scaling_factor": 32.0,
            "yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
            "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": False,
            "sliding_window": 128, "window_attn_skip_freq": "2", "activation_func_clamp_value": 7.0}


FAMILY = Family(
    name="gpt_oss", preset=PRESET, architectures=(GPT_OSS,),
    # megatron-core's softmax offsets, router bias and quick GeGLU are not read or written by jaxllm's Megatron format
    megatron_args={"softmax_type": (("vanilla", None), "attention sinks are not read from Megatron checkpoints"),
                   "quick_geglu": ((False, None), "quick GeGLU experts are not read from Megatron checkpoints")},
    megatron_keys={"softmax_type": "vanilla", "moe_router_bias": False},
    sizes={"gpt-oss-20b": _size(24, 32), "gpt-oss-120b": _size(36, 128)})
