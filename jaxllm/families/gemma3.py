"""Gemma 3 (Gemma Team 2025, arXiv:2503.19786; transformers' ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``:
the text model): RMSNorm scaled by ``1 + w`` (``model.apply_layernorm_1p``), GeGLU (``model.activation="geglu"``,
GELU's tanh approximation gating), a norm before and after attention and the MLP (``model.norm_placement=
"sandwich"``), the token embeddings times ``sqrt(hidden)`` (``model.scale_embeddings``), an RMSNorm of each head's
queries and keys (``model.qk_layernorm``), scores scaled by ``query_pre_attn_scalar ** -0.5``
(``model.softmax_scale``), and five local layers (a window of ``sliding_window``, their own rotary base
``model.local_rotary_base``, unscaled) per global one (``model.window_attn_skip_freq``; the global layers' rotary
``rotary_base``, linearly scaled in 4B and up: ``model.rotary_seq_len_interpolation_factor``).  Tied embeddings.

The padding row: transformers' ``Gemma3TextScaledWordEmbedding`` is an ``nn.Embedding`` with ``padding_idx=
config.pad_token_id`` (0, ``<pad>``, in Google's checkpoints), so that row is zero (as initialized, and as the
checkpoints hold it) and the lookup gives it no gradient; the tied output layer's gradient still reaches it.
``model.pad_token_id`` is that id (``Arch.padding_idx``: import reads config.json's, export writes it, as for every
family but GPT-2), and jaxllm's lookup of it passes no gradient to the row either: without that, the gradient of
the zero row through the scaled embedding and the first (1 + w) RMSNorm (of a zero vector: ``1 / sqrt(eps)``) is
enormous wherever a batch holds the pad id, and gradient clipping then leaves every other parameter nearly
unchanged.

Sizes: Google's 1B, 4B, 12B and 27B (the text models); ``configs/gemma3.py`` trains them.
"""

from typing import Any

from jaxllm import config
from jaxllm.families import llama, olmo2
from jaxllm.families.tables import VEC, Arch, Family, RopeType, Tensor, refuse

PRESET = {"position_embedding": "rotary", "norm": "rmsnorm", "activation": "geglu", "use_bias": False,
          "apply_layernorm_1p": True, "norm_placement": "sandwich", "scale_embeddings": True, "qk_layernorm": True,
          "qk_layernorm_per_head": True, "tie_embeddings": True}

# transformers 4's rope type linear (positions divided by the factor): Gemma 3's global layers in 4B and up
LINEAR_ROPE = RopeType(
    what="linear scaling",
    read=lambda rope, refuse: {"rotary_seq_len_interpolation_factor": float(rope.get("factor") or refuse(
        "rope_parameters", rope, "the linear rope type's factor"))},
    applies=lambda m: m.rotary_seq_len_interpolation_factor != 1,
    write=lambda m: {"rope_type": "linear", "factor": m.rotary_seq_len_interpolation_factor})


def layer_pattern(hf: dict, layers: int, refuse) -> str:
    """``model.window_attn_skip_freq`` of config.json's ``layer_types`` (else its ``sliding_window_pattern``, 6: every
    6th layer global, as transformers' Gemma 3): ``N`` where every ``N``-th layer is global, "" where none is, else one
    1/0 per layer.  ``refuse(key, value, need)`` raises for a list of other lengths or types."""
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        refuse("layer_types", types, f"{layers} of sliding_attention and full_attention")
    local = [t == "sliding_attention" for t in types]
    for every in range(2, layers + 1):
        if local == [(i + 1) % every != 0 for i in range(layers)]:
            return str(every)
    return "" if all(local) else "[" + ",".join(str(int(x)) for x in local) + "]"


def _gemma3_keys(hf: dict, keys: dict) -> dict:
    """Gemma 3's layer kinds and rotary as model keys (transformers' ``Gemma3TextConfig``): the local layers
    (``layer_types``) as ``model.window_attn_skip_freq``; the rotary of the global layers (``rope_parameters``'
    ``full_attention``: ``default`` or ``linear``) and of the local ones (``sliding_attention``: ``default``, its
    theta ``model.local_rotary_base``), or transformers 4's ``rope_theta``, ``rope_scaling`` and
    ``rope_local_base_freq``; ``query_pre_attn_scalar`` as ``model.softmax_scale`` (0 where it is the head size).
    Raises ConvertError for other rope types or a layer type of neither kind."""

    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: one per layer type
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    else:
        full, local = {**rope, **(hf.get("rope_scaling") or {})}, {"rope_theta": hf.get("rope_local_base_freq")}
    scaling = {"default": 1.0, "linear": full.get("factor")}.get(full.get("rope_type", full.get("type", "default")))
    if not scaling:
        refuse("rope_parameters.full_attention", full, "rope type default or linear (with its factor)")
    if local.get("rope_type", "default") != "default":
        refuse("rope_parameters.sliding_attention", local, "rope type default")
    head = keys["kv_channels"] or keys["hidden_size"] // keys["num_attention_heads"]
    scalar = hf.get("query_pre_attn_scalar", 256)
    window = keys["sliding_window"]
    return {"rotary_base": float(full.get("rope_theta") or hf.get("rope_theta") or 1e6),
            "rotary_seq_len_interpolation_factor": float(scaling),
            "local_rotary_base": float(local.get("rope_theta") or 10000.0) if window else 0.0,
            "window_attn_skip_freq": layer_pattern(hf, keys["num_layers"], refuse) if window else "",
            "softmax_scale": 0.0 if scalar == head else float(scalar) ** -0.5}


def layer_types(m: config.Model) -> list[str]:
    """config.json's ``layer_types`` of ``m``'s layers (the inverse of :func:`layer_pattern`)."""
    return ["sliding_attention" if w else "full_attention" for w in m.window_layers]


def _rope(m: config.Model) -> dict:
    """config.json's rotary of both layer types, transformers 5's and 4's names."""
    rope = llama.rope_parameters(m, LINEAR_ROPE)  # the global layers'
    full = rope["rope_parameters"]
    local = {"rope_type": "default", "rope_theta": m.local_rotary_base} if m.local_rotary_base else full
    return {"rope_parameters": {"full_attention": full, "sliding_attention": local},
            "rope_local_base_freq": local["rope_theta"], "rope_scaling": rope["rope_scaling"]}


def _gemma3_extra(m: config.Model) -> dict[str, Any]:
    """config.json beyond the keys: the head size, the scores' scale, the layer types and the rotary."""
    scalar = m.softmax_scale ** -2 if m.softmax_scale else m.head_dim
    return {"head_dim": m.head_dim, "attention_dropout": 0.0, "sliding_window": m.sliding_window or None,
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
            "layer_types": layer_types(m), **_rope(m)}


GEMMA3 = Arch(
    model_type="gemma3_text", hf_class="Gemma3ForCausalLM",
    needs={**{k: v for k, v in llama.NEEDS.items() if k != "sliding_window"}, **PRESET},
    # transformers' Gemma3TextConfig defaults (its rotary: _gemma3_keys)
    keys={"num_hidden_layers": ("num_layers", 26), "hidden_size": ("hidden_size", 2304),
          "num_attention_heads": ("num_attention_heads", 8), "num_key_value_heads": ("num_kv_heads", 4),
          "intermediate_size": ("ffn_hidden_size", 9216), "vocab_size": ("vocab_size", 262208),
          "max_position_embeddings": ("max_position_embeddings", 131072), "rms_norm_eps": ("norm_eps", 1e-6),
          "initializer_range": ("init_std", 0.02), "sliding_window": ("sliding_window", 4096),
          "rope_theta": ("rotary_base", 1e6)},
    supports={"hidden_activation": ("gelu_pytorch_tanh",), "attention_bias": (False,),
              "final_logit_softcapping": (None,), "attn_logit_softcapping": (None,),
              "use_bidirectional_attention": (False,), "tie_word_embeddings": (True,)},
    extra=_gemma3_extra,
    **llama.FILES,
    tensors=(
        llama.ATTENTION[0], llama.ATTENTION[1],  # the embedding, input_layernorm
        *llama.PROJECTIONS, *llama.QK_NORMS,
        olmo2.POST_NORMS[0],
        Tensor("model.layers.{i}.pre_feedforward_layernorm.weight", ("layers/ln2/scale",), VEC),
        olmo2.POST_NORMS[1],
        *llama.MLP, *llama.OUTPUT),
    derive=_gemma3_keys,
    free=("softmax_scale", "window_attn_skip_freq", "local_rotary_base", "rotary_seq_len_interpolation_factor"),
    likely=lambda m: m.apply_layernorm_1p or m.norm_placement == "sandwich")


def _size(layers, hidden, heads, kv_heads, ffn, head_dim, **more) -> dict:
    """A Gemma 3 size: the vocabulary (262208 rows, its tokenizer's 262144 and more), 32768 positions (131072 for
    4B and up), a window of 512 (1B) or 1024, every 6th layer global (rotary base 1e6; 4B and up linearly scaled by 8),
    the local ones at base 10000, rms_norm_eps 1e-6, the padding token ``<pad>`` id 0."""
    return {**PRESET, "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_kv_heads": kv_heads, "ffn_hidden_size": ffn, "kv_channels": head_dim, "vocab_size": 262144,
            "max_position_embeddings": 131072, "norm_eps": 1e-6, "sliding_window": 1024, "window_attn_skip_freq": "6",
            "rotary_base": 1e6, "local_rotary_base": 10000.0, "rotary_seq_len_interpolation_factor": 8.0,
            "pad_token_id": 0, **more}


FAMILY = Family(
    name="gemma3", preset=PRESET, architectures=(GEMMA3,), rope_types={"linear": LINEAR_ROPE},
    # megatron-core's GPTModel: pre-norms of w, the embeddings unscaled
    megatron_keys={"apply_layernorm_1p": False, "scale_embeddings": False, "softmax_scale": 0.0,
                   "local_rotary_base": 0.0, "rotary_seq_len_interpolation_factor": 1.0},
    # google/gemma-3-{1b,4b,12b,27b}-pt config.json (text_config for 4B and up), as recalled (no network here)
    sizes={"Gemma-3-1B": _size(26, 1152, 4, 1, 6912, 256, vocab_size=262144, max_position_embeddings=32768,
                               sliding_window=512, rotary_seq_len_interpolation_factor=1.0),
           "Gemma-3-4B": _size(34, 2560, 8, 4, 10240, 256, vocab_size=262208),
           "Gemma-3-12B": _size(48, 3840, 16, 8, 15360, 256, vocab_size=262208),
           "Gemma-3-27B": _size(62, 5376, 32, 16, 21504, 128, vocab_size=262208, softmax_scale=168 ** -0.5)})
