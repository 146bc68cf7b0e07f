"""Mixtral (Jiang et al. 2024; transformers' ``MixtralForCausalLM``): Llama's layer with a dropless top-k mixture of
SwiGLU experts in place of the MLP in every layer (``model.num_experts`` > 0, the top k renormalized, no shared
expert), and the expert rows and layouts every mixture of experts on Llama's layer shares
(:func:`expert_rows`, :func:`fused_experts`)."""

import re
from collections.abc import Callable

import numpy as np

from jaxllm import config
from jaxllm.errors import ConvertError
from jaxllm.families import llama
from jaxllm.families.tables import Arch, Condition, Family, Tensor

PRESET = llama.PRESET  # Llama's layer; experts come with a size (model.num_experts)


def fused_experts(moe: str, gate: str, up: str, down: str) -> Callable[[dict, config.Model], dict]:
    """The ``layouts`` of a mixture of experts whose table holds each expert's SwiGLU as
    ``{moe}.experts.{e}.{gate|up|down}.weight`` (``[f, h]``, ``[f, h]``, ``[h, f]``): the per-expert layout
    of the Hub's checkpoints, which transformers 5 still saves.  Its fused layout in memory
    (``save_pretrained(..., save_original_format=False)``; transformers' ``conversion_mapping.py``) is split
    per expert: ``mlp.experts.gate_up_proj [E, 2f, h]`` (each expert's gate rows, then its up rows) into
    ``gate`` and ``up``, ``mlp.experts.down_proj [E, h, f]`` into ``down``; ``mlp.`` reads as ``{moe}.``
    (``mlp.gate.weight [E, h]``, the router).  The layouts raise ConvertError."""

    def layouts(tensors: dict[str, np.ndarray], m: config.Model) -> dict[str, np.ndarray]:
        n, f, h = m.num_experts, m.moe_ffn_hidden_size, m.hidden_size
        out = {}

        def put(name, x):
            if name in out:
                raise ConvertError(f"model.safetensors: holds {name} twice (in the fused and the per-expert layout)")
            out[name] = x

        for k, x in tensors.items():
            fused = re.fullmatch(rf"(.*layers\.\d+\.)(?:mlp|{moe})\.experts\.(gate_up_proj|down_proj)", k)
            if not fused:
                put(re.sub(r"^(.*layers\.\d+\.)mlp\.", rf"\1{moe}.", k), x)
                continue
            layer, kind = fused.groups()
            want = (n, 2 * f, h) if kind == "gate_up_proj" else (n, h, f)
            if x.shape != want:
                raise ConvertError(f"model.safetensors: {k} has shape {list(x.shape)}, config.json implies "
                                   f"{list(want)}")
            for e in range(n):
                parts = {gate: x[e, :f], up: x[e, f:]} if kind == "gate_up_proj" else {down: x[e]}
                for w, part in parts.items():
                    put(f"{layer}{moe}.experts.{e}.{w}.weight", part)
        return out

    return layouts


def expert_rows(moe: str, gate: str, up: str, down: str) -> tuple[Tensor, ...]:
    """A mixture of experts' rows: its router ``{moe}.gate.weight [E, h]`` and each expert's SwiGLU
    (``gate``/``up [f, h]`` = ``wg``/``w1``, ``down [h, f]`` = ``w2``)."""
    return (Tensor(f"model.layers.{{i}}.{moe}.gate.weight", ("layers/mlp/router",), linear=True, moe=True),
            *(Tensor(f"model.layers.{{i}}.{moe}.experts.{{e}}.{w}.weight", (f"layers/mlp/{ours}",), linear=True,
                     moe=True) for w, ours in ((gate, "wg"), (down, "w2"), (up, "w1"))))


# What the mixtures of experts on Llama's layer need: no biases; dropless experts, no shared expert, softmax
# scores, no expert groups or bias
MOE_NEEDS = {**llama.PRESET, "add_qkv_bias": False, "moe_capacity_factor": 0.0,
             "moe_shared_expert_intermediate_size": 0, "moe_router_score_function": "softmax",
             "moe_router_topk_scaling_factor": 0.0, "moe_router_num_groups": 0,
             "moe_router_enable_expert_bias": False, "multi_latent_attention": False}


def needs_experts(m: config.Model) -> dict:
    """A mixture-of-experts table's misfit of a dense model."""
    return {} if m.num_experts else {"model.num_experts": Condition("> 0")}


MIXTRAL = Arch(
    model_type="mixtral", hf_class="MixtralForCausalLM",
    # and num_experts > 0 (misfits); every layer a mixture of experts, the top k renormalized
    needs={**MOE_NEEDS, "qk_layernorm": False, "moe_layer_freq": "1", "moe_router_pre_softmax": False},
    keys={"num_hidden_layers": ("num_layers", 32), "hidden_size": ("hidden_size", 4096),
          "num_attention_heads": ("num_attention_heads", 32), "num_key_value_heads": ("num_kv_heads", 8),
          "intermediate_size": ("moe_ffn_hidden_size", 14336),  # and ffn_hidden_size (derive)
          "num_local_experts": ("num_experts", 8), "num_experts_per_tok": ("moe_router_topk", 2),
          # a training weight only, copied as is: HF's loss is k x Megatron's (jaxllm's), of the layers' pooled
          # statistics, where jaxllm adds each layer's
          "router_aux_loss_coef": ("moe_aux_loss_coeff", 0.001), "vocab_size": ("vocab_size", 32000),
          "max_position_embeddings": ("max_position_embeddings", 131072), "rms_norm_eps": ("norm_eps", 1e-5),
          "rope_theta": ("rotary_base", 1e6), "initializer_range": ("init_std", 0.02),
          "tie_word_embeddings": ("tie_embeddings", False), "sliding_window": ("sliding_window", None)},
    supports={"hidden_act": ("silu",), "router_jitter_noise": (0.0,)},
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, "sliding_window": m.sliding_window or None,
                     "output_router_logits": False, **llama.rope_parameters(m)},
    **llama.FILES,
    tensors=(*llama.ATTENTION, *expert_rows("block_sparse_moe", "w1", "w3", "w2"), *llama.OUTPUT),
    layouts=fused_experts("block_sparse_moe", "w1", "w3", "w2"),
    derive=lambda hf, keys: {"ffn_hidden_size": keys["moe_ffn_hidden_size"]},
    misfits=needs_experts,
    likely=lambda m: bool(m.num_experts))

FAMILY = Family(
    name="mixtral", preset=PRESET, architectures=(MIXTRAL,),
    # transformers' MixtralConfig defaults (its docstring names mistralai/Mixtral-8x7B-v0.1); 46.7B parameters,
    # 12.9B active per token
    sizes={"Mixtral-8x7B": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                                ffn_hidden_size=14336, vocab_size=32000, norm_eps=1e-5, rotary_base=1e6, num_experts=8,
                                moe_router_topk=2, moe_ffn_hidden_size=14336)})
