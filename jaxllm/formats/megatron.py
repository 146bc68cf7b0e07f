"""Megatron-LM's GPT in jaxllm's terms: the saved arguments of a Megatron-LM run as config keys, and
megatron-core ``GPTModel``'s parameters, as its distributed checkpoint (``torch_dist``) holds them, as
jaxllm's parameters and back.  NumPy only: the files are :mod:`jaxllm.formats.torch_dist`'s; what of a
family's features it does not hold, the family says (:mod:`jaxllm.families`).

Names: megatron-core's sharded keys (``GPTModel.sharded_state_dict``), where the layers are one tensor
with a leading ``[layers]`` axis (``decoder.layers.self_attention.linear_qkv.weight [L, (heads + 2 x
groups) x head_dim, hidden]``) and the experts a second one (``decoder.layers.mlp.experts.experts.linear_fc1.weight
[L, E, 2f, hidden]``), whatever tensor, pipeline or expert layout saved them.  Norms are under Transformer
Engine's fused names (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), which the local
spec maps its own to; the unfused names (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``) are read too.
Layouts (megatron-core's ``SelfAttention.get_query_key_value_tensors`` and ``MLP.glu``): the fused QKV
rows are per query group, its query heads then its key then its value; SwiGLU's ``linear_fc1`` rows
are the gate's then the up projection's; linear weights are ``[out, in]`` (ours ``[in, out]``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from jaxllm import config
from jaxllm.data.tokenizers import GPT2_FILES, SENTENCEPIECE_FILE, TOKENIZER_NAMES, gpt2_dir_or_packaged
from jaxllm.errors import MEGATRON_NAMES, ConvertError
from jaxllm.families import registry
from jaxllm.model import gpt
from jaxllm.model.params import by_path, unpadded_shapes

# --------------------------------------------------------------------------- arguments -> config keys

# Megatron-LM's values of its enumerated arguments, as jaxllm's (argument -> {Megatron's: ours}).
VALUES = {
    "position_embedding_type": {"learned_absolute": "learned", "rope": "rotary"},
    "normalization": {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"},
    "lr_decay_style": {s: s for s in config.LR_DECAY_STYLES},
    "lr_wsd_decay_style": {s: s for s in config.LR_WSD_DECAY_STYLES},
}
# Arguments with a key of the same name (those MEGATRON_NAMES does not list).
SAME_NAMES = {"lr": "train", "min_lr": "train", "rotary_base": "model", "eval_iters": "train", "qk_layernorm": "model",
              "add_qkv_bias": "model"}
# Keys an import does not take from the arguments: the layout (the run goes on with any), how the model is
# computed, and what the arguments do not say alone (the tokenizer: :func:`tokenizer_overrides`).
NOT_TAKEN = ("mesh.", "parallel.", "model.remat", "model.attention_impl", "model.dtype", "data.json_key",
             "data.tokenizer", "data.cache_dir", "train.optimizer")
# Arguments jaxllm holds only at these values: argument -> (the values, why); those of a family's features are the
# family's (jaxllm.families: Family.megatron_args)
FIXED = {
    "mtp_num_layers": ((None, 0), "multi-token prediction modules are not read from Megatron checkpoints"),
    "rotary_percent": ((1.0, None), "jaxllm rotates the whole head"),
    "rotary_interleaved": ((False, None), "jaxllm rotates halves, not interleaved pairs"),
    "apply_layernorm_1p": ((False, None), "norms scaled by 1 + weight are not read from Megatron checkpoints"),
    "squared_relu": ((False, None), "jaxllm's activations are GELU and SwiGLU"),
    "rampup_batch_size": ((None,), "jaxllm's global batch is one size from the first step"),
    "train_samples": ((None,), "jaxllm's schedule is in iterations (--train-iters), not samples"),
    "moe_expert_capacity_factor": ((None,), "jaxllm reads dropless mixtures of experts"),
    **registry.MEGATRON_ARGS,
}
# Arguments of training alone (not of the model) that jaxllm does not have: the import goes on without them.
NOT_HELD = {"attention_dropout": "jaxllm has no dropout of the attention probabilities"}
# Megatron-LM's --tokenizer-type values whose file jaxllm reads as data.tokenizer (--tokenizer-model)
TOKENIZER_MODELS = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                    "Llama2Tokenizer", "Llama3Tokenizer")


def _refuse_unrepresentable(args: dict) -> None:
    for name, (allowed, why) in FIXED.items():
        if args.get(name) not in allowed:
            raise ConvertError(f"Megatron argument {name}={args.get(name)!r}: jaxllm cannot represent it ({why})",
                               keys=(name,))
    if not args.get("swiglu") and not args.get("openai_gelu"):
        raise ConvertError("Megatron argument openai_gelu=False: the run's GELU is erf's, jaxllm's the tanh "
                           "approximation (Megatron's --openai-gelu); the logits would differ", keys=("openai_gelu",))
    if args.get("swiglu") and args.get("add_bias_linear"):
        raise ConvertError("Megatron argument add_bias_linear=True with swiglu: jaxllm's SwiGLU has no gate bias",
                           keys=("add_bias_linear",))
    if args.get("qk_layernorm") and args.get("normalization") != "RMSNorm":
        raise ConvertError("Megatron argument qk_layernorm=True with LayerNorm: jaxllm's query/key norms are "
                           "RMSNorm's", keys=("qk_layernorm",))
    if args.get("optimizer", "adam") != "adam" or not args.get("decoupled_weight_decay", True):
        raise ConvertError(f"Megatron argument optimizer={args.get('optimizer')!r} (decoupled_weight_decay="
                           f"{args.get('decoupled_weight_decay', True)}): jaxllm imports AdamW's state only",
                           keys=("optimizer",))


def notes(args: dict) -> list[str]:
    """What of Megatron's saved arguments the import leaves behind (:data:`NOT_HELD`), one line each."""
    return [f"Megatron argument {name}={args[name]} is left behind: {why}" for name, why in NOT_HELD.items()
            if args.get(name)]


def tokenizer_overrides(args: dict) -> dict[str, str]:
    """``data.tokenizer`` of Megatron's ``tokenizer_type``: GPT-2's BPE (``GPT2BPETokenizer``: jaxllm's
    ``gpt2``, whose files are GPT-2's too) or the ``tokenizer_model`` file of a Hugging Face or SentencePiece
    tokenizer; else nothing (``NullTokenizer``: the token ids are the data's; jaxllm's default stays)."""
    kind = args.get("tokenizer_type")
    if kind == "GPT2BPETokenizer":
        return {"data.tokenizer": "gpt2"}
    if kind in TOKENIZER_MODELS and args.get("tokenizer_model"):
        return {"data.tokenizer": str(args["tokenizer_model"])}
    return {}


def tokenizer_args(data: config.Data) -> dict:
    """Megatron-LM's tokenizer arguments for jaxllm's ``data`` section (the inverse of
    :func:`tokenizer_overrides`): ``GPT2BPETokenizer`` with GPT-2's files, ``HuggingFaceTokenizer`` or
    ``SentencePieceTokenizer`` with the file, and ``NullTokenizer`` (ids as they are) for bytes and characters."""
    if data.tokenizer == "gpt2":
        directory = gpt2_dir_or_packaged(data.gpt2_dir)
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.join(directory, GPT2_FILES[0]),
                "merge_file": os.path.join(directory, GPT2_FILES[1])}
    if data.tokenizer in TOKENIZER_NAMES:
        return {"tokenizer_type": "NullTokenizer"}
    kind = "SentencePieceTokenizer" if data.tokenizer.endswith(SENTENCEPIECE_FILE) else "HuggingFaceTokenizer"
    return {"tokenizer_type": kind, "tokenizer_model": data.tokenizer}


def args_overrides(args: dict) -> dict[str, str]:
    """The ``--config.SECTION.KEY=VALUE`` overrides that Megatron-LM's saved arguments (``common.pt``'s
    ``args``, as a dict) stand for: the model exactly, the optimizer and its schedule, the batch sizes, the
    data, split and seed (the sample order is Megatron-LM's, :mod:`jaxllm.data.samples`).

    Megatron's names are :data:`jaxllm.errors.MEGATRON_NAMES`'s and :data:`SAME_NAMES`; ``padded_vocab_size``
    is ``model.vocab_size`` (Megatron's softmax runs over its padding rows, and so does jaxllm's with them as
    vocabulary), the query groups are ``model.num_kv_heads`` only with ``group_query_attention``, and
    ``--optimizer adam`` with decoupled weight decay is ``train.optimizer=adamw``.
    Raises:
      ConvertError: an argument jaxllm cannot represent (``keys`` names it), e.g. GELU without ``--openai-gelu``.
    """
    _refuse_unrepresentable(args)
    names = {**MEGATRON_NAMES, **{n: f"{section}.{n}" for n, section in SAME_NAMES.items()}}
    out = {}
    for name, target in names.items():
        value = args.get(name)
        if value is None or " " in target or "=" in target or target.startswith(NOT_TAKEN):
            continue
        if name in VALUES:
            if value not in VALUES[name]:
                raise ConvertError(f"Megatron argument {name}={value!r}: jaxllm knows {', '.join(VALUES[name])}",
                                   keys=(name,))
            value = VALUES[name][value]
        out[target] = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    out.update({
        "model.vocab_size": str(args["padded_vocab_size"]),
        "model.num_kv_heads": str(args["num_query_groups"] if args.get("group_query_attention")
                                  else args["num_attention_heads"]),
        "model.activation": "swiglu" if args.get("swiglu") else "gelu",
        "model.use_bias": str(bool(args.get("add_bias_linear", True))),
        "model.tie_embeddings": str(not args.get("untie_embeddings_and_output_weights", False)),
        "model.num_experts": str(args.get("num_experts") or 0),
        "train.optimizer": "adamw",
        **tokenizer_overrides(args),
    })
    if args.get("num_experts"):
        out.update({"model.moe_router_topk": str(args["moe_router_topk"]),
                    "model.moe_ffn_hidden_size": str(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"]),
                    "model.moe_router_pre_softmax": str(bool(args.get("moe_router_pre_softmax"))),
                    "model.moe_aux_loss_coeff": str(args.get("moe_aux_loss_coeff") or 0.0)})
    if args.get("lr_warmup_fraction") is not None:
        out["train.warmup_iters"] = "0"
    out.setdefault("train.lr_decay_iters", out["train.train_iters"])  # Megatron's default: the whole run
    return out


# --------------------------------------------------------------------------- parameters


class Row(NamedTuple):
    """One megatron-core tensor and the jaxllm parameters it holds: ``to_megatron(arrays, m)`` joins
    ours (in ``params`` order) into it, ``from_megatron(x, m)`` splits it back (a tuple)."""

    name: str
    params: tuple[str, ...]
    to_megatron: Callable
    from_megatron: Callable


def _t(x):
    return np.swapaxes(x, -1, -2)


def _same(name: str, param: str) -> Row:
    return Row(name, (param,), lambda a, m: a[0], lambda x, m: (x,))


def _linear(name: str, param: str) -> Row:  # ours [..., in, out], Megatron's [..., out, in]
    return Row(name, (param,), lambda a, m: _t(a[0]), lambda x, m: (_t(x),))


def _qkv_to(a, m):  # wq [..., (h,) heads, d], wk/wv [..., (h,) groups, d] -> [..., groups x (r + 2) x d (, h)]
    q, k, v = a
    g, d = k.shape[-2], k.shape[-1]
    q = q.reshape(*q.shape[:-2], g, q.shape[-2] // g, d)
    x = np.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)
    return x.reshape(*x.shape[:-3], -1)


def _qkv_from(x, m):
    """Megatron's fused rows ``[..., groups x (r + 2) x d]`` (the last axis) as ``(q, k, v)``."""
    g, d = m.num_kv_heads, m.head_dim
    r = m.num_attention_heads // g
    x = x.reshape(*x.shape[:-1], g, r + 2, d)
    return x[..., :r, :].reshape(*x.shape[:-3], g * r, d), x[..., r, :], x[..., r + 1, :]


_QKV = "decoder.layers.self_attention.linear_qkv."


def _qkv_weight() -> Row:
    return Row(_QKV + "weight", ("layers/attn/wq", "layers/attn/wk", "layers/attn/wv"),
               lambda a, m: _t(_qkv_to(a, m)), lambda x, m: _qkv_from(_t(x), m))


def _qkv_bias() -> Row:
    return Row(_QKV + "bias", ("layers/attn/bq", "layers/attn/bk", "layers/attn/bv"), _qkv_to, _qkv_from)


def _proj() -> Row:  # wo [L, heads, d, h] <-> [L, h, heads x d]
    return Row("decoder.layers.self_attention.linear_proj.weight", ("layers/attn/wo",),
               lambda a, m: _t(a[0].reshape(a[0].shape[0], -1, a[0].shape[-1])),
               lambda x, m: (_t(x).reshape(x.shape[0], m.num_attention_heads, m.head_dim, x.shape[1]),))


def _glu(name: str, prefix: str) -> Row:  # wg, w1 [..., h, f] <-> [..., 2f, h] (gate rows first)
    return Row(name, (f"{prefix}/wg", f"{prefix}/w1"),
               lambda a, m: np.concatenate([_t(a[0]), _t(a[1])], axis=-2),
               lambda x, m: tuple(_t(p) for p in np.split(x, 2, axis=-2)))


def _zero_bias(name: str, size: int, layers: int | None) -> Row:
    """A LayerNorm bias megatron-core always has and jaxllm's model has none of (``model.use_bias=False``, nanoGPT's
    norms): written as zeros, which hold the same model; read back only if zeros (another model otherwise)."""
    shape = (size,) if layers is None else (layers, size)

    def check(x, m):
        if x.shape != shape:
            raise ConvertError(f"{name} has shape {list(x.shape)}, not {list(shape)}")
        if np.any(x != 0):
            raise ConvertError(f"{name} is not zero (max |x| {float(np.abs(x).max()):.3g}), and with "
                               f"add_bias_linear=False jaxllm's LayerNorm has no bias (model.use_bias=False); a "
                               f"LayerNorm that learned its bias has no jaxllm form without the linear biases",
                               keys=("add_bias_linear",))
        return ()

    return Row(name, (), lambda a, m: np.zeros(shape, np.float32), check)


_NORMS = {"ln1": "decoder.layers.self_attention.linear_qkv.layer_norm_",
          "ln2": "decoder.layers.mlp.linear_fc1.layer_norm_", "ln_f": "decoder.final_layernorm."}
# The unfused names of the same norms (megatron-core's modules before the local spec's key map; Transformer
# Engine's MoE layers keep pre_mlp_layernorm) -> the fused ones
ALIASES = {"decoder.layers.input_layernorm.": _NORMS["ln1"], "decoder.layers.pre_mlp_layernorm.": _NORMS["ln2"]}


def rows(m: config.Model) -> list[Row]:
    """megatron-core's tensors of the model ``m`` (a resolved model section), every parameter in one row."""
    out = [_same("embedding.word_embeddings.weight", "wte")]
    if m.position_embedding == "learned":
        out.append(_same("embedding.position_embeddings.weight", "wpe"))
    for ours, theirs in _NORMS.items():
        path = f"layers/{ours}" if ours != "ln_f" else ours
        out.append(_same(theirs + "weight", f"{path}/scale"))
        if m.norm == "layernorm":  # megatron-core's LayerNorm has a bias; jaxllm's only with model.use_bias
            out.append(_same(theirs + "bias", f"{path}/bias") if m.use_bias else
                       _zero_bias(theirs + "bias", m.hidden_size, None if ours == "ln_f" else m.num_layers))
    out += [_qkv_weight(), _proj()]
    if m.use_bias or m.add_qkv_bias:
        out.append(_qkv_bias())
    if m.use_bias:
        out.append(_same("decoder.layers.self_attention.linear_proj.bias", "layers/attn/bo"))
    if m.qk_layernorm:
        out += [_same("decoder.layers.self_attention.q_layernorm.weight", "layers/attn/q_norm/scale"),
                _same("decoder.layers.self_attention.k_layernorm.weight", "layers/attn/k_norm/scale")]
    mlp = "decoder.layers.mlp."
    if m.num_experts:
        out += [_linear(mlp + "router.weight", "layers/mlp/router"),
                _glu(mlp + "experts.experts.linear_fc1.weight", "layers/mlp"),
                _linear(mlp + "experts.experts.linear_fc2.weight", "layers/mlp/w2")]
    else:
        out += [_glu(mlp + "linear_fc1.weight", "layers/mlp") if m.activation == "swiglu"
                else _linear(mlp + "linear_fc1.weight", "layers/mlp/w1"),
                _linear(mlp + "linear_fc2.weight", "layers/mlp/w2")]
        if m.use_bias:
            out += [_same(mlp + "linear_fc1.bias", "layers/mlp/b1"), _same(mlp + "linear_fc2.bias", "layers/mlp/b2")]
    if not m.tie_embeddings:
        out.append(_linear("output_layer.weight", "lm_head"))
    return out


def extra_state_keys(m: config.Model) -> list[str]:
    """The keys of the linear layers' ``_extra_state`` objects megatron-core's GPTModel saves (and expects on
    load): one per layer (``.../shard_{i}_{L}``) and per layer and expert (``.../shard_{i}.{e}_{L}.{E}``;
    ``ShardedObject.unique_key``).  Their content, Transformer Engine's FP8 metadata, is empty here."""
    layers, experts = m.num_layers, m.num_experts
    attention = ["decoder.layers.self_attention.linear_qkv", "decoder.layers.self_attention.linear_proj"]
    mlp = ["decoder.layers.mlp.linear_fc1", "decoder.layers.mlp.linear_fc2"]
    keys = [f"{k}._extra_state/shard_{i}_{layers}" for k in attention + ([] if experts else mlp) for i in range(layers)]
    if experts:
        keys += [f"decoder.layers.mlp.experts.experts.linear_fc{n}._extra_state/shard_{i}.{e}_{layers}.{experts}"
                 for n in (1, 2) for i in range(layers) for e in range(experts)]
    return keys


def check_representable(m: config.Model) -> None:
    """Raises ConvertError naming the model key that megatron-core's ``GPTModel`` (as :func:`rows` lays it
    out) cannot hold."""
    bad = {**registry.MEGATRON_KEYS, "mtp_num_layers": 0}
    for key, fine in bad.items():
        if getattr(m, key) != fine:
            raise ConvertError(f"model.{key}={getattr(m, key)!r}: not written to Megatron checkpoints "
                               f"(only {fine!r})", keys=(f"model.{key}",))
    if m.num_experts and m.moe_layer_freq != "1":
        raise ConvertError(f"model.moe_layer_freq={m.moe_layer_freq!r}: Megatron checkpoints are written with "
                           f"every layer a mixture of experts", keys=("model.moe_layer_freq",))
    if m.activation not in ("gelu", "swiglu"):
        raise ConvertError(f"model.activation={m.activation!r}: Megatron checkpoints are written with gelu or swiglu",
                           keys=("model.activation",))
    if m.activation == "swiglu" and m.use_bias:
        raise ConvertError("model.use_bias=True with swiglu: megatron-core's SwiGLU also has a gate bias",
                           keys=("model.use_bias",))


def to_megatron(m: config.Model, params: dict) -> dict[str, np.ndarray]:
    """megatron-core's tensors (float32, named as :func:`rows`) of jaxllm's parameters, or of a tree of the
    same structure (Adam's moments), cut to ``gpt.describe(m).params``' shapes (a checkpoint's arrays may be
    padded further for ZeRO/FSDP): with ``m`` resolved for one device, the vocabulary rows are
    ``m.vocab_size`` padded to ``m.make_vocab_size_divisible_by``, Megatron's ``padded_vocab_size`` at tensor
    size 1.  Raises ConvertError: a model megatron-core's GPTModel cannot hold."""
    check_representable(m)
    shapes = {k: v.shape for k, v in by_path(gpt.describe(m).params).items()}
    flat = {k: np.asarray(v, np.float32)[tuple(slice(0, n) for n in shapes[k])] for k, v in by_path(params).items()}
    return {r.name: np.ascontiguousarray(r.to_megatron([flat[p] for p in r.params], m)) for r in rows(m)}


def from_megatron(m: config.Model, tensors: dict[str, np.ndarray], what: str = "parameters") -> dict:
    """jaxllm's nested float32 parameters (``gpt.describe(m).params``' structure and shapes) from
    megatron-core's tensors (``tensors``: name -> array, the unfused norm names allowed).

    Raises ConvertError: a tensor missing or of the wrong shape, or one jaxllm has no place for (``what``
    says whose: parameters, ``exp_avg``...)."""
    check_representable(m)
    for old, new in ALIASES.items():
        tensors = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in tensors.items()}
    spec = gpt.describe(m)
    shapes, padded = unpadded_shapes(m, spec), by_path(spec.params)
    out, used = {}, set()
    for r in rows(m):
        if r.name not in tensors:
            raise ConvertError(f"the checkpoint's {what} lack {r.name}")
        x = np.asarray(tensors[r.name], np.float32)
        try:
            parts = r.from_megatron(x, m)
        except ConvertError as e:  # a zero bias that is not (_zero_bias): whose tensor, then why
            raise ConvertError(f"the checkpoint's {what}: {e}", keys=e.keys) from None
        except ValueError:  # a reshape or split that the shape does not allow
            parts = ()
        if [q.shape for q in parts] != [shapes[p] for p in r.params]:
            raise ConvertError(f"the checkpoint's {what}: {r.name} has shape {list(x.shape)}, not the arguments' "
                               f"model's ({', '.join(f'{p} {list(shapes[p])}' for p in r.params)})")
        out.update(zip(r.params, parts, strict=True))
        used.add(r.name)
    left = sorted(set(tensors) - used)
    if left:
        raise ConvertError(f"the checkpoint's {what} hold tensors jaxllm has no place for: {', '.join(left[:4])}"
                           + (f" and {len(left) - 4} more" if len(left) > 4 else ""))
    # jaxllm's padding rows beyond Megatron's (a tensor size that pads the vocabulary further) are zeros
    leaves = [np.pad(out[k], [(0, p - n) for n, p in zip(out[k].shape, padded[k].shape, strict=True)]) for k in padded]
    return jax.tree_util.tree_unflatten(jax.tree.structure(spec.params), leaves)


# --------------------------------------------------------------------------- Megatron-DeepSpeed

# Megatron-DeepSpeed's (legacy Megatron-LM's) modules of a layer -> megatron-core's
_DEEPSPEED_LAYER = {"input_layernorm.": "input_layernorm.",
                    "self_attention.query_key_value.": "self_attention.linear_qkv.",
                    "self_attention.dense.": "self_attention.linear_proj.",
                    "post_attention_layernorm.": "pre_mlp_layernorm.", "mlp.dense_h_to_4h.": "mlp.linear_fc1.",
                    "mlp.dense_4h_to_h.": "mlp.linear_fc2."}


# Megatron-DeepSpeed's --optimizer values that are AdamW (decoupled weight decay): torch's AdamW, apex's FusedAdam
# (adam_w_mode by default), DeepSpeed's; "adam" is DeepSpeed's FusedAdam in argonne's fork with --ds-fused-adam
# (else torch's Adam: L2 decay) and apex's FusedAdam in microsoft's (which has no --ds-fused-adam)
_DEEPSPEED_ADAMW = ("adamw", "apex.adam", "ds.adamw")


def deepspeed_args(args: dict) -> dict:
    """Megatron-DeepSpeed's saved arguments (``megatron/arguments.py`` of argonne-lcf's and microsoft's forks)
    in Megatron-LM's names, as :func:`args_overrides` reads them: ``normalization`` layernorm/rmsnorm,
    ``use_rotary_position_embeddings`` / ``add_position_embedding``, ``rope_theta``, ``num_key_value_heads``,
    ``layernorm_epsilon``, the optimizer (:data:`_DEEPSPEED_ADAMW`), and GELU: the fused bias GELU (the default
    with biases, ``bias_gelu_fusion``: ``megatron/model/fused_bias_gelu.py``) is the tanh approximation.
    Raises ConvertError: DeepSpeed's mixture of experts, no position embedding, torch's Adam (L2 decay), the
    query/key/value thirds of microsoft's fork since its FPDT change (676a482, ``ds_sequence_parallel_fpdt``)."""
    if "ds_sequence_parallel_fpdt" in args:
        raise ConvertError("Megatron-DeepSpeed argument ds_sequence_parallel_fpdt: this fork (microsoft's since "
                           "676a482, December 2024) splits the fused QKV rows into query, key and value thirds, "
                           "which jaxllm does not read", keys=("ds_sequence_parallel_fpdt",))
    optimizer = str(args.get("optimizer", "adam")).lower()
    if optimizer not in _DEEPSPEED_ADAMW and not (optimizer == "adam" and args.get("ds_fused_adam", True)):
        raise ConvertError(f"Megatron-DeepSpeed argument optimizer={args.get('optimizer')!r}"
                           + (" without ds_fused_adam (torch's Adam, L2 weight decay)" if optimizer == "adam" else "")
                           + ": jaxllm imports AdamW's state only", keys=("optimizer",))
    out = dict(args, optimizer="adam", decoupled_weight_decay=True)
    fused_gelu = args.get("bias_gelu_fusion", True) and args.get("add_bias_linear", True)
    if not any(args.get(k) for k in ("swiglu", "squared_relu", "onnx_safe")) and fused_gelu:
        out["openai_gelu"] = True
    out["normalization"] = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(args.get("normalization"),
                                                                                args.get("normalization"))
    rotary = bool(args.get("use_rotary_position_embeddings"))
    if not rotary and not args.get("add_position_embedding", True):
        raise ConvertError("Megatron-DeepSpeed argument add_position_embedding=False without rotary embeddings: "
                           "jaxllm's positions are learned or rotary", keys=("add_position_embedding",))
    out["position_embedding_type"] = "rope" if rotary else "learned_absolute"
    if args.get("rope_theta") is not None:
        out["rotary_base"] = args["rope_theta"]
    groups = args.get("num_key_value_heads") or args["num_attention_heads"]
    out.update(num_query_groups=groups, group_query_attention=groups != args["num_attention_heads"])
    experts = args.get("num_experts") or [1]
    if max(experts if isinstance(experts, (list, tuple)) else [experts]) > 1:
        raise ConvertError(f"Megatron-DeepSpeed argument num_experts={experts}: DeepSpeed's mixture of experts is "
                           "not read", keys=("num_experts",))
    out["num_experts"] = None
    out.setdefault("norm_epsilon", args.get("layernorm_epsilon"))
    return out


def _deepspeed_key(name: str, num_layers: int) -> tuple[str, int | None] | None:
    """``(megatron-core name, layer or None)`` of a Megatron-DeepSpeed parameter, named as its ``GPTModel``
    (``language_model.encoder.layers.3.mlp.dense_h_to_4h.weight``) or its ``GPTModelPipe`` (``5.mlp...``: spec 0
    casts, 1 embeds (``tied_modules.embed.`` when tied), 2 to L + 1 are the layers, L + 2 the final norm, L + 3
    the untied output) names it; None for any other."""
    pipe = re.fullmatch(r"(\d+)\.(.+)", name)
    if pipe:
        index, rest = int(pipe.group(1)), pipe.group(2)
        if index == 1:
            name = "language_model.embedding." + rest
        elif 2 <= index <= num_layers + 1:
            name = f"language_model.encoder.layers.{index - 2}.{rest}"
        elif index == num_layers + 2:
            name = "language_model.encoder.final_layernorm." + rest
        elif index == num_layers + 3 and rest == "lm_head.weight":
            name = "language_model.output_layer.weight"
    name = re.sub(r"^tied_modules\.embed\.", "language_model.embedding.", name)
    layer = re.fullmatch(r"language_model\.encoder\.layers\.(\d+)\.(.+)", name)
    if layer:
        part = next((p for p in _DEEPSPEED_LAYER if layer.group(2).startswith(p)), None)
        i = int(layer.group(1))
        return (f"decoder.layers.{_DEEPSPEED_LAYER[part]}{layer.group(2)[len(part):]}", i) \
            if part and i < num_layers else None
    fixed = {"language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
             "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
             "language_model.output_layer.weight": "output_layer.weight"}
    if name in fixed:
        return fixed[name], None
    final = re.fullmatch(r"language_model\.encoder\.final_layernorm\.(weight|bias)", name)
    return (f"decoder.final_layernorm.{final.group(1)}", None) if final else None


def from_deepspeed(tensors: dict[str, np.ndarray], num_layers: int, what: str) -> dict[str, np.ndarray]:
    """Megatron-DeepSpeed's tensors (:func:`_deepspeed_key`'s names) under megatron-core's names, the layers
    stacked on a leading ``[layers]`` axis, for :func:`from_megatron`.  The fused QKV rows are per key/value
    group, its queries then its key then its value (``ParallelAttention`` of argonne-lcf's fork, and of
    microsoft's before its December 2024 FPDT change), which is megatron-core's layout; SwiGLU's
    ``dense_h_to_4h`` rows are the gate's then the up projection's (``torch.chunk``), as megatron-core's.
    Raises ConvertError: a tensor jaxllm has no place for, or a layer missing one."""
    out, layers = {}, {}
    for name, x in tensors.items():
        key = _deepspeed_key(name, num_layers)
        if key is None:
            raise ConvertError(f"the checkpoint's {what}: {name} is a tensor jaxllm has no place for")
        if key[1] is None:
            out[key[0]] = x
        else:
            layers.setdefault(key[0], {})[key[1]] = x
    for name, by_layer in layers.items():
        if sorted(by_layer) != list(range(num_layers)):
            raise ConvertError(f"the checkpoint's {what}: {name} of layers {sorted(by_layer)}, not 0 to "
                               f"{num_layers - 1}")
        out[name] = np.stack([by_layer[i] for i in range(num_layers)])
    return out
