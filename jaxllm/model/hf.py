"""The Hugging Face architectures jaxllm converts to and from, as tables: ``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``MixtralForCausalLM``,
``Qwen3MoeForCausalLM`` and ``DeepseekV3ForCausalLM`` in jaxllm's terms, and the pure mapping of parameters both ways.

Each architecture is one :class:`Arch` that both directions read (the model keys it fixes,
config.json keys <-> model keys, the config.json values supported, and the table of its
:class:`Tensor` rows: HF name, our parameters, layout), so import and export are inverses by
construction.  **GPT-2** holds learned positions, LayerNorm, GELU, biases and multi-head
attention; **Llama** rotary (Llama 3.1's scaled frequencies too: rope type ``llama3``), RMSNorm, SwiGLU, no
biases, grouped-query attention; **Qwen2** Llama's layer with query/key/value biases (``model.add_qkv_bias``);
**Qwen3** Llama's with an RMSNorm of each head's queries and keys (``model.qk_layernorm``); **Mistral** Llama's
attending to a sliding window (``model.sliding_window``); **Mixtral** Llama's
layer with a dropless top-k mixture of SwiGLU experts in place of the MLP (``model.num_experts`` > 0, no
shared expert); **Qwen3-MoE** Qwen3's attention with such experts (their top k renormalized or not:
``model.moe_router_pre_softmax``), some layers dense if ``model.moe_layer_freq`` says so; **DeepSeek-V3**
multi-head latent attention (``model.multi_latent_attention``; DeepSeek's interleaved rotary rows) with dense layers
first, then experts routed by sigmoid score with an expert bias, groups, a scaled top k and shared experts; each
with tied or untied embeddings and any head size (``model.kv_channels``, HF's ``head_dim``; GPT-2's is
``hidden_size / heads``).  Any other model is a :class:`ConvertError` naming the keys that do not fit.
The tables keep the ``model.vocab_size`` real rows (config.json's ``vocab_size``): jaxllm masks the
logits of its padding rows, so without them HF's logits and softmax are exactly jaxllm's.

Export: :func:`hf_architecture`, :func:`to_hf` (config.json dict + tensors).  Import:
:func:`model_from_hf` (config.json -> model keys), :func:`read_safetensors`, :func:`params_from_hf`.
Only JSON and safetensors are read: pickle-based weights are refused unread.  Files, workdirs,
tokenizers and the CLI are :mod:`jaxllm.convert`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxllm import config
from jaxllm.data.tokenizers import GPT2_VOCAB_SIZE
from jaxllm.model import gpt

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Formats that need pickle (or another framework) to read: never loaded here.
UNSAFE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth",
                  "tf_model.h5", "flax_model.msgpack", "model.ckpt.index")


class ConvertError(ValueError):
    """A model, directory or option that cannot be converted.

    Attributes:
      keys: the config keys (jaxllm ``SECTION.KEY`` or config.json keys) at fault, possibly empty.
    """

    def __init__(self, message: str, keys=()):
        self.keys = tuple(keys)
        super().__init__(message)


# --------------------------------------------------------------------------- the tables


class Tensor(NamedTuple):
    """A row of an architecture's table: one Hugging Face tensor and the jaxllm parameters it holds.

    ``name``: HF's; with ``{i}``, one tensor per layer ``i``, holding that layer's slice of our
    ``[layers, ...]`` parameters; with ``{e}`` too, one per layer and expert ``e``, holding the slice
    ``[i, e]`` of our ``[layers, experts, ...]`` parameters (Mixtral's ``w1 [L, E, h, f]`` -> ``experts.{e}.w3
    [f, h]``).  ``params``: our parameter paths, several concatenated along
    HF's output axis (GPT-2's ``c_attn = [wq | wk | wv]``).  ``fan_in``: the leading axes of a
    (per-layer) parameter that form the input axis, the rest the output axis (``wq [h, heads, d]``,
    1: ``[h, heads*d]``; ``wo [heads, d, h]``, 2: ``[heads*d, h]``); 0: a vector, flattened.
    ``linear``: stored ``[out, in]`` (torch ``Linear``), else ``[in, out]`` (``Conv1D``, embeddings).
    ``moe``: for a per-layer row, the layers it is in: True, the mixtures of experts; False, the dense
    layers; None, every layer.  A model whose layers are of both kinds (``model.moe_layer_freq``) holds
    them in layer groups (:func:`jaxllm.model.gpt.layer_groups`): ``layers/...`` is then each group's
    ``layers_0/...``, ``layers_1/...``, layer ``i`` that group's slice ``i - group.first``.
    """

    name: str
    params: tuple[str, ...]
    fan_in: int = 1
    linear: bool = False
    moe: bool | None = None


VEC = 0  # fan_in of a vector


@dataclasses.dataclass(frozen=True)
class Arch:
    """A Hugging Face architecture in jaxllm's terms, read by both directions: ``model_type`` and
    ``hf_class`` (config.json's ``architectures[0]``); ``needs``: the jaxllm model keys it fixes;
    ``keys``: config.json key -> (model key, HF's default; None: derived by jaxllm as by HF);
    ``supports``: config.json key -> the values jaxllm supports (export writes the first);
    ``extra``: further config.json entries export writes; ``prefix``: the base model's, absent from
    a bare base model's checkpoint; ``buffers``: regex of non-parameter tensors checkpoints may
    hold; ``tensors``: the table, every parameter in one row (``lm_head`` only when untied);
    ``layouts``: ``(tensors, model section) -> tensors``, a checkpoint's other layouts of the same
    parameters renamed and split into the table's (None: the table's is the only one); ``saves``:
    ``(tensors, model section) -> tensors``, the table's tensors as the checkpoint holds them, the inverse of the
    reordering ``layouts`` undoes (None: as the table lays them out); ``aliases``:
    config.json key -> the key of ``keys`` it also goes by; ``derive``: ``(config.json, model keys read
    by keys) -> more model keys``, those that are no one config.json value (None: no more)."""

    model_type: str
    hf_class: str
    needs: dict[str, Any]
    keys: dict[str, tuple[str, Any]]
    supports: dict[str, tuple]
    extra: Callable[[config.Model], dict]
    prefix: str
    buffers: str
    tensors: tuple[Tensor, ...]
    layouts: Callable[[dict, config.Model], dict] | None = None
    saves: Callable[[dict, config.Model], dict] | None = None
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    derive: Callable[[dict, dict], dict] | None = None


GPT2 = Arch(
    model_type="gpt2", hf_class="GPT2LMHeadModel",
    needs={"position_embedding": "learned", "norm": "layernorm", "activation": "gelu", "use_bias": True,
           "num_experts": 0, "qk_layernorm": False, "sliding_window": 0, "kv_channels": 0,
           "multi_latent_attention": False},
    keys={"n_layer": ("num_layers", 12), "n_embd": ("hidden_size", 768), "n_head": ("num_attention_heads", 12),
          "n_inner": ("ffn_hidden_size", None), "vocab_size": ("vocab_size", GPT2_VOCAB_SIZE),
          "n_positions": ("max_position_embeddings", 1024), "layer_norm_epsilon": ("norm_eps", 1e-5),
          "resid_pdrop": ("dropout", 0.1), "initializer_range": ("init_std", 0.02),
          "tie_word_embeddings": ("tie_embeddings", True)},
    supports={"activation_function": ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"),  # GELU's tanh approximation
              "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
              "add_cross_attention": (False,)},
    extra=lambda m: {"embd_pdrop": m.dropout, "attn_pdrop": 0.0, "reorder_and_upcast_attn": False},
    prefix="transformer.",
    buffers=r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",  # causal-mask buffers of old versions
    tensors=(
        Tensor("transformer.wte.weight", ("wte",)),  # [vocab, h]
        Tensor("transformer.wpe.weight", ("wpe",)),  # [positions, h]
        Tensor("transformer.h.{i}.ln_1.weight", ("layers/ln1/scale",), VEC),
        Tensor("transformer.h.{i}.ln_1.bias", ("layers/ln1/bias",), VEC),
        Tensor("transformer.h.{i}.attn.c_attn.weight", ("layers/attn/wq", "layers/attn/wk", "layers/attn/wv")),
        Tensor("transformer.h.{i}.attn.c_attn.bias", ("layers/attn/bq", "layers/attn/bk", "layers/attn/bv"), VEC),
        Tensor("transformer.h.{i}.attn.c_proj.weight", ("layers/attn/wo",), 2),  # [h, h]
        Tensor("transformer.h.{i}.attn.c_proj.bias", ("layers/attn/bo",), VEC),
        Tensor("transformer.h.{i}.ln_2.weight", ("layers/ln2/scale",), VEC),
        Tensor("transformer.h.{i}.ln_2.bias", ("layers/ln2/bias",), VEC),
        Tensor("transformer.h.{i}.mlp.c_fc.weight", ("layers/mlp/w1",)),  # [h, f]
        Tensor("transformer.h.{i}.mlp.c_fc.bias", ("layers/mlp/b1",), VEC),
        Tensor("transformer.h.{i}.mlp.c_proj.weight", ("layers/mlp/w2",)),  # [f, h]
        Tensor("transformer.h.{i}.mlp.c_proj.bias", ("layers/mlp/b2",), VEC),
        Tensor("transformer.ln_f.weight", ("ln_f/scale",), VEC),
        Tensor("transformer.ln_f.bias", ("ln_f/bias",), VEC),
        Tensor("lm_head.weight", ("lm_head",), linear=True),  # [vocab, h]
    ))

# Llama's rows around the MLP, which Mixtral shares: the embedding and each layer's attention and norms ...
_LLAMA_ATTENTION = (
    Tensor("model.embed_tokens.weight", ("wte",)),  # [vocab, h]
    Tensor("model.layers.{i}.input_layernorm.weight", ("layers/ln1/scale",), VEC),
    Tensor("model.layers.{i}.self_attn.q_proj.weight", ("layers/attn/wq",), linear=True),  # [heads*d, h]
    Tensor("model.layers.{i}.self_attn.k_proj.weight", ("layers/attn/wk",), linear=True),  # [kv_heads*d, h]
    Tensor("model.layers.{i}.self_attn.v_proj.weight", ("layers/attn/wv",), linear=True),  # [kv_heads*d, h]
    Tensor("model.layers.{i}.self_attn.o_proj.weight", ("layers/attn/wo",), 2, linear=True),  # [h, heads*d]
    Tensor("model.layers.{i}.post_attention_layernorm.weight", ("layers/ln2/scale",), VEC),
)
# ... and the final norm and output layer
_LLAMA_OUTPUT = (
    Tensor("model.norm.weight", ("ln_f/scale",), VEC),
    Tensor("lm_head.weight", ("lm_head",), linear=True),  # [vocab, h]
)

_LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_position_embeddings"}


def _rope_parameters(m: config.Model) -> dict:
    """config.json's rotary settings: ``rope_parameters`` (transformers 5) with the theta, ``rope_scaling``
    (transformers 4) the scaling alone; rope type ``llama3`` with ``model.use_rope_scaling``."""
    scaling = {"rope_type": "llama3", **{hf: getattr(m, ours) for hf, ours in _LLAMA3_ROPE.items()}}
    if not m.use_rope_scaling:
        return {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base}}
    return {"rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": m.rotary_base}}


_LLAMA_FILES = {"prefix": "model.", "buffers": r".*rotary_emb\.inv_freq"}  # the family's base model and buffers
_LLAMA_NEEDS = {"position_embedding": "rotary", "norm": "rmsnorm", "activation": "swiglu", "use_bias": False,
                "num_experts": 0, "add_qkv_bias": False, "qk_layernorm": False, "sliding_window": 0,
                "multi_latent_attention": False}
_LLAMA_KEYS = {"num_hidden_layers": ("num_layers", 32), "hidden_size": ("hidden_size", 4096),
               "num_attention_heads": ("num_attention_heads", 32), "num_key_value_heads": ("num_kv_heads", None),
               "intermediate_size": ("ffn_hidden_size", 11008), "vocab_size": ("vocab_size", 32000),
               "max_position_embeddings": ("max_position_embeddings", 2048), "rms_norm_eps": ("norm_eps", 1e-6),
               "rope_theta": ("rotary_base", 10000.0), "initializer_range": ("init_std", 0.02),
               "tie_word_embeddings": ("tie_embeddings", False)}
_LLAMA_MLP = (  # a dense layer's
    Tensor("model.layers.{i}.mlp.gate_proj.weight", ("layers/mlp/wg",), linear=True, moe=False),  # [f, h]
    Tensor("model.layers.{i}.mlp.up_proj.weight", ("layers/mlp/w1",), linear=True, moe=False),  # [f, h]
    Tensor("model.layers.{i}.mlp.down_proj.weight", ("layers/mlp/w2",), linear=True, moe=False),  # [h, f]
)

LLAMA = Arch(
    model_type="llama", hf_class="LlamaForCausalLM", needs=_LLAMA_NEEDS, keys=_LLAMA_KEYS,
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)},
    # rope_theta for transformers 4.x, rope_parameters for 5.x: the same value.
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, "pretraining_tp": 1, **_rope_parameters(m)},
    **_LLAMA_FILES,
    tensors=(*_LLAMA_ATTENTION, *_LLAMA_MLP, *_LLAMA_OUTPUT))

# Mistral: Llama's layer attending to the last sliding_window positions (null or absent: every one, as Mistral
# v0.2 and later; then it is exported as Llama, the same model); the defaults are transformers' MistralConfig's
MISTRAL = Arch(
    model_type="mistral", hf_class="MistralForCausalLM",
    needs={k: v for k, v in _LLAMA_NEEDS.items() if k != "sliding_window"},  # and a window (hf_architecture)
    keys={**_LLAMA_KEYS, "num_key_value_heads": ("num_kv_heads", 8), "intermediate_size": ("ffn_hidden_size", 14336),
          "max_position_embeddings": ("max_position_embeddings", 131072), "sliding_window": ("sliding_window", 4096)},
    supports={"hidden_act": ("silu",)},
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, "sliding_window": m.sliding_window or None,
                     **_rope_parameters(m)},
    **_LLAMA_FILES,
    tensors=(*_LLAMA_ATTENTION, *_LLAMA_MLP, *_LLAMA_OUTPUT))

# Qwen2/2.5 and Qwen3: Llama's layer with biases on the query/key/value projections (Qwen2), or an RMSNorm of each
# head's queries and keys before rotary (Qwen3); their defaults are Qwen's (transformers' Qwen2Config, Qwen3Config)
_QWEN_KEYS = {**_LLAMA_KEYS, "intermediate_size": ("ffn_hidden_size", 22016), "vocab_size": ("vocab_size", 151936),
              "max_position_embeddings": ("max_position_embeddings", 32768)}
_QWEN_EXTRA = {"attention_dropout": 0.0, "sliding_window": None, "max_window_layers": 0}
QWEN2 = Arch(
    model_type="qwen2", hf_class="Qwen2ForCausalLM", needs={**_LLAMA_NEEDS, "add_qkv_bias": True}, keys=_QWEN_KEYS,
    supports={"hidden_act": ("silu",), "use_sliding_window": (False,)},
    extra=lambda m: {**_QWEN_EXTRA, "head_dim": m.head_dim, **_rope_parameters(m)},
    **_LLAMA_FILES,
    tensors=(*_LLAMA_ATTENTION,
             *(Tensor(f"model.layers.{{i}}.self_attn.{x}_proj.bias", (f"layers/attn/b{x}",), VEC) for x in "qkv"),
             *_LLAMA_MLP, *_LLAMA_OUTPUT))
_QWEN3_ATTENTION = (*_LLAMA_ATTENTION, *(Tensor(f"model.layers.{{i}}.self_attn.{x}_norm.weight",
                                               (f"layers/attn/{x}_norm/scale",), VEC) for x in "qk"))
QWEN3 = Arch(
    model_type="qwen3", hf_class="Qwen3ForCausalLM", needs={**_LLAMA_NEEDS, "qk_layernorm": True}, keys=_QWEN_KEYS,
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "use_sliding_window": (False,)},
    extra=lambda m: {**_QWEN_EXTRA, "head_dim": m.head_dim, **_rope_parameters(m)},
    **_LLAMA_FILES,
    tensors=(*_QWEN3_ATTENTION, *_LLAMA_MLP, *_LLAMA_OUTPUT))


def _fused_experts(moe: str, gate: str, up: str, down: str) -> Callable[[dict, config.Model], dict]:
    """The ``layouts`` of a mixture of experts whose table holds each expert's SwiGLU as
    ``{moe}.experts.{e}.{gate|up|down}.weight`` (``[f, h]``, ``[f, h]``, ``[h, f]``): the per-expert layout
    of the Hub's checkpoints, which transformers 5 still saves.  Its fused layout in memory
    (``save_pretrained(..., save_original_format=False)``; transformers' ``conversion_mapping.py``) is split
    per expert: ``mlp.experts.gate_up_proj [E, 2f, h]`` (each expert's gate rows, then its up rows) into
    ``gate`` and ``up``, ``mlp.experts.down_proj [E, h, f]`` into ``down``; ``mlp.`` reads as ``{moe}.``
    (Mixtral's ``mlp.gate.weight [E, h]``, the router).  The layouts raise ConvertError."""

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


def _expert_rows(moe: str, gate: str, up: str, down: str) -> tuple[Tensor, ...]:
    """A mixture of experts' rows: its router ``{moe}.gate.weight [E, h]`` and each expert's SwiGLU
    (``gate``/``up [f, h]`` = ``wg``/``w1``, ``down [h, f]`` = ``w2``)."""
    return (Tensor(f"model.layers.{{i}}.{moe}.gate.weight", ("layers/mlp/router",), linear=True, moe=True),
            *(Tensor(f"model.layers.{{i}}.{moe}.experts.{{e}}.{w}.weight", (f"layers/mlp/{ours}",), linear=True,
                     moe=True) for w, ours in ((gate, "wg"), (down, "w2"), (up, "w1"))))


# What both mixtures of experts need: Llama's layer without biases; dropless experts, no shared expert, softmax
# scores, no expert groups or bias
_MOE_NEEDS = {"position_embedding": "rotary", "norm": "rmsnorm", "activation": "swiglu", "use_bias": False,
              "add_qkv_bias": False, "moe_capacity_factor": 0.0, "moe_shared_expert_intermediate_size": 0,
              "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": 0.0,
              "moe_router_num_groups": 0, "moe_router_enable_expert_bias": False, "multi_latent_attention": False}
MIXTRAL = Arch(
    model_type="mixtral", hf_class="MixtralForCausalLM",
    # and num_experts > 0 (hf_architecture); every layer a mixture of experts, the top k renormalized
    needs={**_MOE_NEEDS, "qk_layernorm": False, "moe_layer_freq": "1", "moe_router_pre_softmax": False},
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
                     "output_router_logits": False, **_rope_parameters(m)},
    **_LLAMA_FILES,
    tensors=(*_LLAMA_ATTENTION, *_expert_rows("block_sparse_moe", "w1", "w3", "w2"), *_LLAMA_OUTPUT),
    layouts=_fused_experts("block_sparse_moe", "w1", "w3", "w2"),
    derive=lambda hf, keys: {"ffn_hidden_size": keys["moe_ffn_hidden_size"]})


def _qwen3_moe_keys(hf: dict, keys: dict) -> dict:
    """Qwen3-MoE's routing and layer kinds as model keys: ``norm_topk_prob`` false (transformers'
    default: the softmax over all experts, its top k not renormalized) is ``model.moe_router_pre_softmax``;
    layer ``i`` is a mixture of experts unless in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
    (transformers' ``Qwen3MoeDecoderLayer``), one 0/1 per layer in ``model.moe_layer_freq`` (``1``: every
    layer).  Raises ConvertError for a ``decoder_sparse_step`` or ``mlp_only_layers`` transformers cannot
    have built."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ConvertError(f"config.json: decoder_sparse_step={step!r} is not supported: jaxllm needs an "
                           f"integer >= 1", keys=("decoder_sparse_step",))
    if not all(isinstance(i, int) for i in dense):
        raise ConvertError(f"config.json: mlp_only_layers={dense!r} is not supported: jaxllm needs a list of "
                           f"layer indices", keys=("mlp_only_layers",))
    moe = [i not in dense and (i + 1) % step == 0 for i in range(keys["num_layers"])]
    return {"moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
            "moe_layer_freq": "1" if all(moe) else "[" + ",".join(str(int(x)) for x in moe) + "]"}


# Qwen3-MoE: Qwen3's attention with a mixture of experts in every layer but those of mlp_only_layers (which
# keep a dense MLP of intermediate_size); the defaults are transformers' Qwen3MoeConfig's
QWEN3_MOE = Arch(
    model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM",
    needs={**_MOE_NEEDS, "qk_layernorm": True, "sliding_window": 0},  # and num_experts > 0 (hf_architecture)
    keys={**_QWEN_KEYS, "num_hidden_layers": ("num_layers", 24), "hidden_size": ("hidden_size", 2048),
          "num_key_value_heads": ("num_kv_heads", 4), "intermediate_size": ("ffn_hidden_size", 6144),
          "moe_intermediate_size": ("moe_ffn_hidden_size", 768), "num_experts": ("num_experts", 128),
          "num_experts_per_tok": ("moe_router_topk", 8), "router_aux_loss_coef": ("moe_aux_loss_coeff", 0.001)},
    aliases={"num_local_experts": "num_experts"},  # what transformers' to_dict writes (its attribute_map)
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "use_sliding_window": (False,)},
    extra=lambda m: {"head_dim": m.head_dim, "attention_dropout": 0.0, "sliding_window": None,
                     "norm_topk_prob": not m.moe_router_pre_softmax, "decoder_sparse_step": 1,
                     "mlp_only_layers": [i for i, moe in enumerate(m.moe_layers) if not moe],
                     "output_router_logits": False, **_rope_parameters(m)},
    **_LLAMA_FILES,
    tensors=(*_QWEN3_ATTENTION, *_LLAMA_MLP, *_expert_rows("mlp", "gate_proj", "up_proj", "down_proj"),
             *_LLAMA_OUTPUT),
    layouts=_fused_experts("mlp", "gate_proj", "up_proj", "down_proj"),
    derive=_qwen3_moe_keys)

def _rotary_rows(m: config.Model) -> dict[str, tuple[int, int]]:
    """The HF tensors whose rows hold rotary dimensions, as ``name: (rows per block, rotary rows at its end)``:
    each head's query rows (``q_proj`` or ``q_b_proj``, ``dn + dr`` per head) and ``kv_a_proj_with_mqa``'s
    shared rotary key (its last ``dr`` of ``kv_lora + dr``)."""
    dr, dq = m.qk_pos_emb_head_dim, m.qk_head_dim + m.qk_pos_emb_head_dim
    return {"q_b_proj" if m.q_lora_rank else "q_proj": (dq, dr), "kv_a_proj_with_mqa": (m.kv_lora_rank + dr, dr)}


def _interleave(tensors: dict[str, np.ndarray], m: config.Model, *, to_hf: bool) -> dict[str, np.ndarray]:
    """DeepSeek's rotary layout (``rope_interleave``, transformers' default) from jaxllm's or back: its checkpoints
    rotate neighbouring pairs ``(2j, 2j + 1)``, jaxllm (and HF Llama) the halves ``(j, j + dr/2)``, so jaxllm's
    rotary row ``j`` is HF's ``2j`` for ``j < dr/2``, else ``2(j - dr/2) + 1`` (transformers'
    ``apply_rotary_pos_emb_interleave``, which de-interleaves the same way).  Other rows and tensors unchanged."""
    rows = _rotary_rows(m)
    out = dict(tensors)
    for k, x in tensors.items():
        proj = re.fullmatch(r".*layers\.\d+\.self_attn\.(\w+)\.weight", k)
        if not proj or proj.group(1) not in rows:
            continue
        block, dr = rows[proj.group(1)]
        at = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])  # HF's row of our rotary row j
        order = np.concatenate([np.arange(block - dr), block - dr + (np.argsort(at) if to_hf else at)])
        out[k] = x.reshape(-1, block, x.shape[-1])[:, order].reshape(x.shape)
    return out


def _deepseek_v3_layouts(tensors: dict[str, np.ndarray], m: config.Model) -> dict[str, np.ndarray]:
    """A DeepSeek-V3 checkpoint as its table: the multi-token-prediction layers some hold (``model.layers.{L}``
    and on, ``num_nextn_predict_layers``) dropped, as transformers drops them; the experts per expert
    (:func:`_fused_experts`), the rotary rows half-split (:func:`_interleave`)."""
    kept = {k: x for k, x in tensors.items()
            if not (i := re.match(r"(?:model\.)?layers\.(\d+)\.", k)) or int(i.group(1)) < m.num_layers}
    return _interleave(_fused_experts("mlp", "gate_proj", "up_proj", "down_proj")(kept, m), m, to_hf=False)


def _deepseek_v3_keys(hf: dict, keys: dict) -> dict:
    """DeepSeek-V3's routing and layer kinds as model keys (transformers' ``DeepseekV3TopkRouter``,
    ``DeepseekV3DecoderLayer``): the first ``first_k_dense_replace`` layers dense, the rest mixtures of experts
    (``model.moe_layer_freq``); ``n_shared_experts`` shared experts of ``moe_intermediate_size`` as one shared MLP
    (``model.moe_shared_expert_intermediate_size``); ``n_group`` > 1 groups as ``model.moe_router_num_groups``,
    ``moe_router_group_topk`` (1: no groups).  Raises ConvertError for what jaxllm's router
    (:func:`jaxllm.model.moe.route`) computes otherwise, or MLA with ``num_key_value_heads`` other than the heads:
    ``norm_topk_prob`` other than ``num_experts_per_tok > 1``
    (jaxllm renormalizes exactly the top k of more than one), no shared expert, or groups scored other than
    by their top 2 (transformers sums each group's 2 best scores, jaxllm its ``topk / group_topk``)."""
    layers, topk, heads = keys["num_layers"], keys["moe_router_topk"], keys["num_attention_heads"]
    dense, shared = hf.get("first_k_dense_replace", 3), hf.get("n_shared_experts", 1)
    groups, group_topk = hf.get("n_group", 8) or 1, hf.get("topk_group", 4) or 1

    def refuse(key, value, need):
        raise ConvertError(f"config.json: {key}={value!r} is not supported: jaxllm needs {need}", keys=(key,))

    if hf.get("num_key_value_heads") not in (None, heads):  # transformers would repeat MLA's per-head keys
        refuse("num_key_value_heads", hf["num_key_value_heads"], f"num_attention_heads={heads} (or null)")
    if hf.get("norm_topk_prob", True) != (topk > 1):
        refuse("norm_topk_prob", hf.get("norm_topk_prob", True), f"{topk > 1} with num_experts_per_tok={topk} "
               "(jaxllm's sigmoid router renormalizes the top k when k > 1, and only then)")
    if not isinstance(shared, int) or shared < 1:
        refuse("n_shared_experts", shared, "an integer >= 1")
    if not isinstance(dense, int) or not 0 <= dense < layers:
        refuse("first_k_dense_replace", dense, f"an integer from 0 to num_hidden_layers - 1 = {layers - 1}")
    if groups > 1 and topk != 2 * group_topk:
        refuse("topk_group", group_topk, f"num_experts_per_tok / 2 = {topk / 2} with n_group={groups} (transformers "
               "scores a group by its 2 best experts, jaxllm by its num_experts_per_tok / topk_group best)")
    kinds = "1" if not dense else "[" + ",".join("0" if i < dense else "1" for i in range(layers)) + "]"
    return {"kv_channels": 0, "num_kv_heads": heads, "moe_layer_freq": kinds,
            "moe_shared_expert_intermediate_size": shared * keys["moe_ffn_hidden_size"],
            "moe_router_num_groups": groups if groups > 1 else 0,
            "moe_router_group_topk": group_topk if groups > 1 else 0}


def _deepseek_v3_misfits(m: config.Model) -> dict[str, Any]:
    """What keeps the model ``m`` from DeepSeek-V3's table beyond its ``needs`` (the refusals of
    :func:`_deepseek_v3_keys`, the other way): model key -> what it needs."""
    bad = {}
    if not m.num_experts:
        bad["model.num_experts"] = _Condition("> 0")
    shared, f = m.moe_shared_expert_intermediate_size, m.moe_ffn_hidden_size
    if not shared or not f or shared % f:
        bad["model.moe_shared_expert_intermediate_size"] = _Condition(f"a multiple > 0 of moe_ffn_hidden_size={f}")
    kinds = m.moe_layers
    if not kinds[-1] or sorted(kinds) != list(kinds):
        bad["model.moe_layer_freq"] = _Condition("dense layers first, then mixtures of experts")
    if m.moe_router_num_groups and m.moe_router_topk != 2 * m.moe_router_group_topk:
        bad["model.moe_router_group_topk"] = _Condition(f"model.moe_router_topk / 2 = {m.moe_router_topk / 2}")
    return bad


# DeepSeek-V3 (and Moonlight, DeepSeek-V3-architecture): multi-head latent attention; the first
# first_k_dense_replace layers a dense MLP, the rest a mixture of experts with sigmoid routing (its expert bias,
# e_score_correction_bias, choosing the top k; groups; the top k renormalized and scaled) and shared experts; the
# defaults are transformers' DeepseekV3Config's.  Not taken: YaRN rotary scaling (DeepSeek-V3's own checkpoint's),
# refused by model_from_hf's rope check
DEEPSEEK_V3 = Arch(
    model_type="deepseek_v3", hf_class="DeepseekV3ForCausalLM",
    # and num_experts > 0, shared experts, dense layers first (hf_architecture: _deepseek_v3_misfits)
    needs={"position_embedding": "rotary", "norm": "rmsnorm", "activation": "swiglu", "use_bias": False,
           "add_qkv_bias": False, "qk_layernorm": False, "sliding_window": 0, "multi_latent_attention": True,
           "moe_capacity_factor": 0.0, "moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
           "moe_router_enable_expert_bias": True},
    keys={"num_hidden_layers": ("num_layers", 61), "hidden_size": ("hidden_size", 7168),
          "num_attention_heads": ("num_attention_heads", 128), "intermediate_size": ("ffn_hidden_size", 18432),
          "moe_intermediate_size": ("moe_ffn_hidden_size", 2048),
          "n_routed_experts": ("num_experts", 256), "num_experts_per_tok": ("moe_router_topk", 8),
          "routed_scaling_factor": ("moe_router_topk_scaling_factor", 2.5), "q_lora_rank": ("q_lora_rank", 1536),
          "kv_lora_rank": ("kv_lora_rank", 512), "qk_nope_head_dim": ("qk_head_dim", 128),
          "qk_rope_head_dim": ("qk_pos_emb_head_dim", 64), "v_head_dim": ("v_head_dim", 128),
          "vocab_size": ("vocab_size", 129280), "max_position_embeddings": ("max_position_embeddings", 4096),
          "rms_norm_eps": ("norm_eps", 1e-6), "rope_theta": ("rotary_base", 10000.0),
          "initializer_range": ("init_std", 0.02), "tie_word_embeddings": ("tie_embeddings", False)},
    aliases={"num_local_experts": "n_routed_experts"},  # transformers' attribute_map
    # scoring_func, topk_method: DeepSeek's own config.json's names of the router transformers implements
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "rope_interleave": (True,),
              "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    extra=lambda m: {"num_key_value_heads": m.num_attention_heads, "attention_dropout": 0.0,
                     "n_shared_experts": m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size,
                     "first_k_dense_replace": m.moe_layers.index(True),
                     "n_group": m.moe_router_num_groups or 1, "topk_group": m.moe_router_group_topk or 1,
                     "norm_topk_prob": m.moe_router_topk > 1, "routed_scaling_factor": m.moe_router_topk_scaling_factor
                     or 1.0, "q_lora_rank": m.q_lora_rank or None, "num_nextn_predict_layers": 0,
                     "output_router_logits": False, **_rope_parameters(m)},
    **_LLAMA_FILES,
    tensors=(
        _LLAMA_ATTENTION[0], _LLAMA_ATTENTION[1],  # embeddings, input_layernorm
        *(Tensor(f"model.layers.{{i}}.self_attn.{hf}.weight", (f"layers/attn/{ours}",), linear=True)
          for hf, ours in (("q_proj", "wq"), ("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"),  # [n*(dn+dr), h or rq]
                           ("kv_a_proj_with_mqa", "wkv_a"), ("kv_b_proj", "wkv_b"))),  # [rkv+dr, h], [n*(dn+dv), rkv]
        Tensor("model.layers.{i}.self_attn.q_a_layernorm.weight", ("layers/attn/q_a_norm/scale",), VEC),
        Tensor("model.layers.{i}.self_attn.kv_a_layernorm.weight", ("layers/attn/kv_a_norm/scale",), VEC),
        Tensor("model.layers.{i}.self_attn.o_proj.weight", ("layers/attn/wo",), 2, linear=True),  # [h, n*dv]
        _LLAMA_ATTENTION[-1],  # post_attention_layernorm
        *_LLAMA_MLP, *_expert_rows("mlp", "gate_proj", "up_proj", "down_proj"),
        Tensor("model.layers.{i}.mlp.gate.e_score_correction_bias", ("layers/mlp/expert_bias",), VEC, moe=True),
        *(Tensor(f"model.layers.{{i}}.mlp.shared_experts.{hf}.weight", (f"layers/mlp/shared/{ours}",), linear=True,
                 moe=True) for hf, ours in (("gate_proj", "wg"), ("up_proj", "w1"), ("down_proj", "w2"))),
        *_LLAMA_OUTPUT),
    layouts=_deepseek_v3_layouts,
    saves=lambda tensors, m: _interleave(tensors, m, to_hf=True),
    derive=_deepseek_v3_keys)

ARCHITECTURES = {arch.model_type: arch for arch in (GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL, QWEN3_MOE,
                                                    DEEPSEEK_V3)}


class _Condition(str):
    """A requirement other than a value (``> 0``), printed as it is."""

    def __repr__(self):
        return str(self)


def _placements(t: Tensor, m: config.Model) -> list[tuple[tuple[str, ...], list[tuple]]]:
    """Where the HF tensors of row ``t`` come from: for each layer group the row is in (one entry for a
    row of no layer), the paths of its parameters there and, layer-major, each tensor's ``(layer, index
    along the group's stacked layers, expert)`` (None: no such axis)."""
    experts = range(m.num_experts) if "{e}" in t.name else [None]
    if "{i}" not in t.name:
        return [(t.params, [(None, None, e) for e in experts])]
    return [(tuple(g.name + p.removeprefix("layers") for p in t.params),
             [(g.first + j, j, e) for j in range(g.num_layers) for e in experts])
            for g in gpt.layer_groups(m) if t.moe is None or t.moe == g.moe]


def _slice(a: np.ndarray, i: int | None, e: int | None) -> np.ndarray:
    """Layer ``i``'s, then expert ``e``'s slice of ``a`` (None: the whole axis is the tensor's)."""
    a = a if i is None else a[i]
    return a if e is None else a[e]


def _to_hf_layout(t: Tensor, arrays: list[np.ndarray]) -> np.ndarray:
    """HF's tensor of row ``t`` from one layer's slices of its parameters."""
    flat = [a.reshape((math.prod(a.shape[:t.fan_in]), -1) if t.fan_in else -1) for a in arrays]
    x = np.concatenate(flat, axis=-1)
    return x.T if t.linear else x


def _from_hf_layout(t: Tensor, x: np.ndarray, shapes: list[tuple]) -> list[np.ndarray]:
    """The inverse of :func:`_to_hf_layout`: one layer's slices, shaped ``shapes``, from HF's tensor."""
    x = x.T if t.linear else x
    sizes = [math.prod(s[t.fan_in:]) for s in shapes]
    return [part.reshape(s) for part, s in zip(np.split(x, np.cumsum(sizes)[:-1], axis=-1), shapes, strict=True)]


def _hf_shape(t: Tensor, shapes: list[tuple]) -> tuple[int, ...]:
    """The shape :func:`_to_hf_layout` gives for parameters of (per-layer) ``shapes``."""
    out = sum(math.prod(s[t.fan_in:]) for s in shapes)
    if not t.fan_in:
        return (out,)
    inp = math.prod(shapes[0][:t.fan_in])
    return (out, inp) if t.linear else (inp, out)


def by_path(tree) -> dict[str, Any]:
    """A nested parameter dict (leaves: arrays, shapes or logical-axes tuples) as ``{"layers/attn/wq": leaf}``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {"/".join(k.key for k in path): leaf for path, leaf in leaves}


def unpadded_shapes(m: config.Model, spec: gpt.Spec) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape with ``vocab_size`` rows on its ``vocab`` axis: what HF holds.  jaxllm
    masks the logits of the padding rows, so without them HF's softmax is exactly jaxllm's."""
    axes = by_path(spec.axes)
    return {k: tuple(m.vocab_size if a == "vocab" else n for a, n in zip(axes[k], v.shape, strict=True))
            for k, v in by_path(spec.params).items()}


# --------------------------------------------------------------------------- jaxllm -> HF


def hf_architecture(m: config.Model) -> Arch:
    """The Hugging Face architecture that holds the (resolved) model section ``m`` exactly: GPT-2, Llama,
    Qwen2, Qwen3 or Mistral for a dense model, Mixtral or Qwen3-MoE for a mixture of experts, DeepSeek-V3 for one
    with multi-head latent attention.

    Raises:
      ConvertError: the model fits none; ``keys`` are the keys that do not fit the closest
        architecture (the message lists the two closest).
    """
    misfits = {}
    for arch in ARCHITECTURES.values():
        bad = {f"model.{k}": v for k, v in arch.needs.items() if getattr(m, k) != v}
        if arch is GPT2 and m.num_kv_heads != m.num_attention_heads:
            bad["model.num_kv_heads"] = m.num_attention_heads
        if arch in (MIXTRAL, QWEN3_MOE) and not m.num_experts:
            bad["model.num_experts"] = _Condition("> 0")
        if arch is MISTRAL and not m.sliding_window:
            bad["model.sliding_window"] = _Condition("> 0")
        if arch is DEEPSEEK_V3:
            bad.update(_deepseek_v3_misfits(m))
        if m.mtp_num_layers:  # no table writes multi-token prediction modules (transformers skips them) yet
            bad["model.mtp_num_layers"] = 0
        if not bad:
            return arch
        misfits[arch.model_type] = bad
    likely = ("deepseek_v3" if m.multi_latent_attention
              else "qwen3_moe" if m.num_experts and m.qk_layernorm else "mixtral" if m.num_experts
              else "qwen3" if m.qk_layernorm else "qwen2" if m.add_qkv_bias else "mistral" if m.sliding_window
              else "llama" if m.position_embedding == "rotary" else "gpt2")
    dense = {a for a in misfits if "num_experts" in ARCHITECTURES[a].needs} if m.num_experts else set()
    # the fewest changes first, then the likely one, then (for a mixture of experts) those with experts
    closest, other = sorted(misfits, key=lambda a: (len(misfits[a]), a != likely, a in dense))[:2]

    def changes(arch):
        return ", ".join(f"{k}={getattr(m, k.split('.')[1])!r} (needs {v!r})" for k, v in misfits[arch].items())

    raise ConvertError(
        f"the model fits no Hugging Face architecture jaxllm converts to: for {ARCHITECTURES[closest].hf_class} "
        f"change {changes(closest)}; for {ARCHITECTURES[other].hf_class} change {changes(other)}",
        keys=tuple(misfits[closest]))


def to_hf(m: config.Model, params: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """A jaxllm model as a Hugging Face model of :func:`hf_architecture`.

    Args:
      m: the resolved ``model`` section (:func:`jaxllm.resolve.resolve_model`).
      params: the nested parameters of :func:`jaxllm.model.gpt.init` (jax or numpy arrays), shaped
        as ``gpt.describe(m).params``: ``wte [vocab, h]``, ``wpe [positions, h]`` (learned),
        ``layers/attn/wq [L, h, heads, d]``, ``wk``/``wv [L, h, kv_heads, d]``, ``wo [L, heads, d, h]``,
        ``layers/mlp/w1 [L, h, f]``, ``wg [L, h, f]`` (swiglu), ``w2 [L, f, h]``, norms, biases,
        ``lm_head [h, vocab]`` (untied), where ``vocab`` = ``m.padded_vocab_size``; with experts
        (``E`` = ``m.num_experts``, ``f`` = ``m.moe_ffn_hidden_size``) ``layers/mlp/router [L, h, E]``,
        ``w1``/``wg [L, E, h, f]``, ``w2 [L, E, f, h]``.
    Returns:
      ``(hf_config, tensors)``: the ``config.json`` dict, and float32 C-contiguous arrays by HF
      name, laid out by the architecture's table, with ``m.vocab_size`` rows (see the module doc):
      GPT-2's ``Conv1D`` weights are ``[in, out]`` (``c_attn.weight [h, 3h]`` = ``[wq | wk | wv]``
      flattened over ``(heads, d)``), Llama's
      ``Linear`` weights ``[out, in]`` (``q_proj [heads*d, h]``, ``o_proj [h, heads*d]``,
      ``gate_proj``/``up_proj [f, h]`` = ``wg``/``w1``), one tensor per layer; Mixtral's as Llama's, with
      ``block_sparse_moe.gate.weight [E, h]`` (the router) and, per layer and expert ``e``,
      ``block_sparse_moe.experts.{e}.w1``/``w3 [f, h]`` = ``wg``/``w1`` and ``w2 [h, f]`` (the layout of
      the Hub's checkpoints, which transformers 4 and 5 both read and 5 saves); Qwen3-MoE's as Mixtral's under
      ``mlp.gate.weight`` and ``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``, and in its dense layers
      Llama's MLP (a model of dense and MoE layers holds each kind's parameters in its layer groups,
      ``layers_0``, ``layers_1``, ...: :func:`jaxllm.model.gpt.layer_groups`); DeepSeek-V3's as Qwen3-MoE's experts
      with ``self_attn.q_proj [n*(dn+dr), h]`` (or ``q_a_proj [rq, h]``, ``q_a_layernorm``, ``q_b_proj
      [n*(dn+dr), rq]``), ``kv_a_proj_with_mqa [rkv+dr, h]``, ``kv_a_layernorm``, ``kv_b_proj [n*(dn+dv), rkv]``,
      ``o_proj [h, n*dv]`` (rotary rows interleaved: :func:`_interleave`), ``mlp.gate.e_score_correction_bias
      [E]`` and ``mlp.shared_experts.gate_proj``/``up_proj``/``down_proj``.
    Raises:
      ConvertError: the model fits no architecture, or ``params`` does not match it.
    """
    arch = hf_architecture(m)
    spec = gpt.describe(m)
    want = {k: v.shape for k, v in by_path(spec.params).items()}
    flat = {k: np.asarray(jax.device_get(v), np.float32) for k, v in by_path(params).items()}
    have = {k: v.shape for k, v in flat.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))
        raise ConvertError("the parameters do not match the config (" + "; ".join(
            f"{k}: {'config' if (k, s) in want.items() else 'parameters'} {list(s)}" for k, s in diff[:6]) + ")")
    real = unpadded_shapes(m, spec)
    flat = {k: x[tuple(map(slice, real[k]))] for k, x in flat.items()}
    tensors = {}
    for t in arch.tensors:
        for paths, where in _placements(t, m):
            if paths[0] not in flat:  # lm_head of a tied model
                continue
            arrays = [flat[p] for p in paths]
            for i, j, e in where:
                tensors[t.name.format(i=i, e=e)] = _to_hf_layout(t, [_slice(a, j, e) for a in arrays])
    if arch.saves is not None:
        tensors = arch.saves(tensors, m)
    hf = {"architectures": [arch.hf_class], "model_type": arch.model_type,
          **{key: allowed[0] for key, allowed in arch.supports.items()},
          **{key: getattr(m, ours) for key, (ours, _) in arch.keys.items()}, **arch.extra(m),
          "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
          "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    return hf, {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


# --------------------------------------------------------------------------- HF -> jaxllm


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of ``directory``'s ``model.safetensors`` (or of the shards its
    ``model.safetensors.index.json`` names), as float32 numpy arrays.

    Raises:
      ConvertError: no safetensors weights (pickle-based ones are refused, never read).
    """
    from safetensors import safe_open

    single, index = os.path.join(directory, SAFETENSORS), os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as fp:
            files = [os.path.join(directory, n) for n in sorted(set(json.load(fp)["weight_map"].values()))]
    else:
        unsafe = [n for n in UNSAFE_WEIGHTS if os.path.exists(os.path.join(directory, n))]
        unsafe += sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth")) and n not in unsafe)
        if unsafe:
            raise ConvertError(
                f"{directory} holds {', '.join(unsafe)} but no {SAFETENSORS}: jaxllm reads only safetensors, "
                f"never pickle-based weights. Convert them to safetensors first (in an environment where you "
                f"trust the file), e.g. AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR, "
                f"safe_serialization=True)")
        raise ConvertError(f"{directory} has no {SAFETENSORS} or {SAFETENSORS_INDEX}")
    tensors = {}
    with jax.default_device(jax.devices("cpu")[0]):
        for path in files:
            with safe_open(path, framework="flax") as f:  # through jax: numpy has no bfloat16
                for k in f.keys():  # noqa: SIM118  (a safe_open is not a dict)
                    tensors[k] = np.asarray(f.get_tensor(k), np.float32)
    return tensors


def model_from_hf(hf: dict) -> tuple[Arch, dict]:
    """The architecture and jaxllm's model keys of a config.json dict. Raises ConvertError."""
    arch = ARCHITECTURES.get(hf.get("model_type"))
    if arch is None:
        known = ", ".join(f"{a.model_type!r} ({a.hf_class})" for a in ARCHITECTURES.values())
        raise ConvertError(f"config.json: model_type={hf.get('model_type')!r} is not supported: jaxllm converts "
                           f"{known}", keys=("model_type",))

    hf = {**{ours: hf[theirs] for theirs, ours in arch.aliases.items() if theirs in hf}, **hf}

    def unsupported(key, value, need):
        raise ConvertError(f"config.json: {key}={value!r} is not supported: jaxllm needs {need}", keys=(key,))

    for key, allowed in arch.supports.items():
        if hf.get(key, allowed[0]) not in allowed:
            unsupported(key, hf[key], " or ".join(map(repr, allowed)))
    keys = {}
    for key, (ours, default) in arch.keys.items():
        value = hf.get(key, default)
        keys[ours] = 0 if value is None else config.key_type(f"model.{ours}")(value)  # 0: derived, as HF does
    if arch.needs["position_embedding"] == "rotary":
        rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}  # transformers 5, 4
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            unsupported("rope_scaling" if hf.get("rope_scaling") else "rope_parameters.rope_type",
                        hf.get("rope_scaling") or rope_type, "rope type 'default' or 'llama3' (Llama 3.1's scaling)")
        if rope_type == "llama3":
            missing = [k for k in _LLAMA3_ROPE if k not in rope]
            if missing:
                unsupported("rope_parameters", rope, f"the llama3 rope type's {', '.join(missing)} too")
            keys.update(use_rope_scaling=True, **{ours: config.key_type(f"model.{ours}")(rope[k])
                                                  for k, ours in _LLAMA3_ROPE.items()})
        derived = keys["hidden_size"] // keys["num_attention_heads"]  # as transformers derives it (0: so does jaxllm)
        keys["kv_channels"] = 0 if hf.get("head_dim") in (None, derived) else config.key_type("model.kv_channels")(
            hf["head_dim"])
        keys["rotary_base"] = float(rope.get("rope_theta", keys["rotary_base"]))
    if arch.derive is not None:
        keys.update(arch.derive(hf, keys))
    return arch, {**keys, **arch.needs}


def params_from_hf(arch: Arch, m: config.Model, tensors: dict[str, np.ndarray]) -> dict:
    """jaxllm's nested float32 parameters (``gpt.describe(m).params``) from HF's tensors, by
    ``arch``'s table read backwards (the layouts are :func:`to_hf`'s; Mixtral's and Qwen3-MoE's experts also
    fused, as transformers 5 holds them in memory: ``mlp.experts.gate_up_proj [E, 2f, h]``,
    ``down_proj [E, h, f]``); with ``m.mtp_num_layers`` the multi-token prediction modules initialized as
    :func:`jaxllm.model.gpt.init` (seed 0) initializes them. Raises ConvertError."""
    if arch.layouts is not None:
        tensors = arch.layouts(tensors, m)
    spec = gpt.describe(m)
    shapes = unpadded_shapes(m, spec)
    embed = arch.tensors[0].name
    bare = embed not in tensors and embed.removeprefix(arch.prefix) in tensors  # a bare base model's names
    used, out = set(), {}

    def get(name: str, shape: tuple) -> np.ndarray:
        key = name.removeprefix(arch.prefix) if bare else name
        if key not in tensors:
            raise ConvertError(f"model.safetensors: tensor {key} is missing (expected shape {list(shape)})")
        x = tensors[key]
        if x.shape != tuple(shape):
            raise ConvertError(f"model.safetensors: {key} has shape {list(x.shape)}, config.json implies {list(shape)}")
        used.add(key)
        return x

    for t in arch.tensors:
        lead = ("{i}" in t.name) + ("{e}" in t.name)  # the leading [layers[, experts]] axes HF splits into tensors
        for paths, where in _placements(t, m):
            if paths[0] not in shapes:  # the tied copy of the head some checkpoints store: HF ignores it too
                used.add(t.name)
                continue
            each = [shapes[p][lead:] for p in paths]
            slices = [_from_hf_layout(t, get(t.name.format(i=i, e=e), _hf_shape(t, each)), each)
                      for i, _, e in where]
            for k, p in enumerate(paths):
                out[p] = np.stack([s[k] for s in slices]).reshape(shapes[p]) if lead else slices[0][k]
    if m.mtp_num_layers:  # no table holds multi-token prediction modules (transformers skips them): fresh ones
        out.update(by_path({"mtp": jax.tree.map(np.asarray, jax.jit(lambda: gpt.init(m, 0)["mtp"])())}))
    left = sorted(k for k in tensors if k not in used and not re.fullmatch(arch.buffers, k))
    if left:
        raise ConvertError(f"model.safetensors: tensors jaxllm has no place for: {', '.join(left[:6])}"
                           + (f" and {len(left) - 6} more" if len(left) > 6 else ""))
    padded = {k: v.shape for k, v in by_path(spec.params).items()}  # the padding rows are zeros
    leaves = [np.pad(out[k], [(0, p - n) for n, p in zip(out[k].shape, padded[k], strict=True)]) for k in shapes]
    return jax.tree_util.tree_unflatten(jax.tree.structure(spec.params), leaves)
