"""Hugging Face conversion: jaxllm <-> ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` directories.

CLI::

    python -m jaxllm.convert --to-hf WORKDIR OUT [--step N]
    python -m jaxllm.convert --from-hf DIR WORKDIR [--config.SECTION.KEY=VALUE ...]

``--to-hf`` writes the latest (or ``--step``) checkpoint of a run as ``OUT/config.json`` +
``OUT/model.safetensors`` (float32) for ``AutoModelForCausalLM.from_pretrained(OUT)``: **GPT-2**
for learned positions, LayerNorm, GELU, biases and multi-head attention; **Llama** for rotary,
RMSNorm, SwiGLU, no biases, grouped-query attention; tied or untied embeddings (any other model
is a :class:`ConvertError` naming the keys that do not fit).  The tables keep the
``model.vocab_size`` real rows (config.json's ``vocab_size``): jaxllm masks the logits of its
padding rows, so without them HF's logits and softmax are exactly jaxllm's.  A run on the
``gpt2`` tokenizer gets its files too (``vocab.json``, ``merges.txt``).

``--from-hf`` reads ``DIR/config.json`` and ``DIR/model.safetensors`` (or the shards of
``model.safetensors.index.json``) into a step-0 checkpoint in ``WORKDIR`` (float32 parameters,
a fresh optimizer state; the padding rows jaxllm adds are zeros) and writes ``WORKDIR/config.py``
for ``python -m jaxllm.train --config=WORKDIR/config.py --workdir=WORKDIR`` (and ``jaxllm.generate
--workdir=WORKDIR``).  HF's ``vocab_size`` is ``model.vocab_size``; ``n_positions`` /
``max_position_embeddings`` is ``model.max_position_embeddings`` and ``train.seq_length`` (which
``--config.train.seq_length`` may shorten); GPT-2's ``resid_pdrop`` is ``model.dropout``.  Other
keys are jaxllm's defaults, changed with ``--config.SECTION.KEY=VALUE`` (of the model keys only
:data:`FREE_MODEL_KEYS`).  **The data must be tokenized as the model expects**: GPT-2's tokenizer
in ``DIR`` (``vocab.json`` + ``merges.txt``, or such a ``tokenizer.json``) is copied to
``WORKDIR/tokenizer`` and used; otherwise set ``--config.data.*``.

Each architecture is one :class:`Arch` that both directions read (the model keys it fixes,
config.json keys <-> model keys, the config.json values supported, and the table of its
:class:`Tensor` rows: HF name, our parameters, layout), so import and export are inverses by
construction.  Only JSON and safetensors are read: pickle-based weights are refused unread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pprint
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxllm import cli, config, model
from jaxllm.data.tokenizers import GPT2_EOT_ID, GPT2_FILES, GPT2_VOCAB_SIZE, DataError, GPT2Tokenizer
from jaxllm.resolve import resolve, resolve_model
from jaxllm.runtime import checkpoint, optim, step

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Formats that need pickle (or another framework) to read: never loaded here.
UNSAFE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth",
                  "tf_model.h5", "flax_model.msgpack", "model.ckpt.index")
# Model keys --from-hf lets the user set; the others come from config.json.
FREE_MODEL_KEYS = ("dtype", "remat", "attention_impl", "dropout", "init_std", "make_vocab_size_divisible_by")


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
    ``[layers, ...]`` parameters.  ``params``: our parameter paths, several concatenated along
    HF's output axis (GPT-2's ``c_attn = [wq | wk | wv]``).  ``fan_in``: the leading axes of a
    (per-layer) parameter that form the input axis, the rest the output axis (``wq [h, heads, d]``,
    1: ``[h, heads*d]``; ``wo [heads, d, h]``, 2: ``[heads*d, h]``); 0: a vector, flattened.
    ``linear``: stored ``[out, in]`` (torch ``Linear``), else ``[in, out]`` (``Conv1D``, embeddings).
    """

    name: str
    params: tuple[str, ...]
    fan_in: int = 1
    linear: bool = False


VEC = 0  # fan_in of a vector


@dataclasses.dataclass(frozen=True)
class Arch:
    """A Hugging Face architecture in jaxllm's terms, read by both directions: ``model_type`` and
    ``hf_class`` (config.json's ``architectures[0]``); ``needs``: the jaxllm model keys it fixes;
    ``keys``: config.json key -> (model key, HF's default; None: derived by jaxllm as by HF);
    ``supports``: config.json key -> the values jaxllm supports (export writes the first);
    ``extra``: further config.json entries export writes; ``prefix``: the base model's, absent from
    a bare base model's checkpoint; ``buffers``: regex of non-parameter tensors checkpoints may
    hold; ``tensors``: the table, every parameter in one row (``lm_head`` only when untied)."""

    model_type: str
    hf_class: str
    needs: dict[str, Any]
    keys: dict[str, tuple[str, Any]]
    supports: dict[str, tuple]
    extra: Callable[[config.Model], dict]
    prefix: str
    buffers: str
    tensors: tuple[Tensor, ...]


GPT2 = Arch(
    model_type="gpt2", hf_class="GPT2LMHeadModel",
    needs={"position_embedding": "learned", "norm": "layernorm", "activation": "gelu", "use_bias": True},
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

LLAMA = Arch(
    model_type="llama", hf_class="LlamaForCausalLM",
    needs={"position_embedding": "rotary", "norm": "rmsnorm", "activation": "swiglu", "use_bias": False},
    keys={"num_hidden_layers": ("num_layers", 32), "hidden_size": ("hidden_size", 4096),
          "num_attention_heads": ("num_attention_heads", 32), "num_key_value_heads": ("num_kv_heads", None),
          "intermediate_size": ("ffn_hidden_size", 11008), "vocab_size": ("vocab_size", 32000),
          "max_position_embeddings": ("max_position_embeddings", 2048), "rms_norm_eps": ("norm_eps", 1e-6),
          "rope_theta": ("rotary_base", 10000.0), "initializer_range": ("init_std", 0.02),
          "tie_word_embeddings": ("tie_embeddings", False)},
    supports={"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)},
    # rope_theta for transformers 4.x, rope_parameters for 5.x: the same value.
    extra=lambda m: {"head_dim": m.head_dim, "rope_scaling": None, "attention_dropout": 0.0, "pretraining_tp": 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base}},
    prefix="model.",
    buffers=r".*rotary_emb\.inv_freq",
    tensors=(
        Tensor("model.embed_tokens.weight", ("wte",)),  # [vocab, h]
        Tensor("model.layers.{i}.input_layernorm.weight", ("layers/ln1/scale",), VEC),
        Tensor("model.layers.{i}.self_attn.q_proj.weight", ("layers/attn/wq",), linear=True),  # [heads*d, h]
        Tensor("model.layers.{i}.self_attn.k_proj.weight", ("layers/attn/wk",), linear=True),  # [kv_heads*d, h]
        Tensor("model.layers.{i}.self_attn.v_proj.weight", ("layers/attn/wv",), linear=True),  # [kv_heads*d, h]
        Tensor("model.layers.{i}.self_attn.o_proj.weight", ("layers/attn/wo",), 2, linear=True),  # [h, heads*d]
        Tensor("model.layers.{i}.post_attention_layernorm.weight", ("layers/ln2/scale",), VEC),
        Tensor("model.layers.{i}.mlp.gate_proj.weight", ("layers/mlp/wg",), linear=True),  # [f, h]
        Tensor("model.layers.{i}.mlp.up_proj.weight", ("layers/mlp/w1",), linear=True),  # [f, h]
        Tensor("model.layers.{i}.mlp.down_proj.weight", ("layers/mlp/w2",), linear=True),  # [h, f]
        Tensor("model.norm.weight", ("ln_f/scale",), VEC),
        Tensor("lm_head.weight", ("lm_head",), linear=True),  # [vocab, h]
    ))

ARCHITECTURES = {arch.model_type: arch for arch in (GPT2, LLAMA)}


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


def _by_path(tree) -> dict[str, Any]:
    """A nested parameter dict (leaves: arrays, shapes or logical-axes tuples) as ``{"layers/attn/wq": leaf}``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {"/".join(k.key for k in path): leaf for path, leaf in leaves}


def _unpadded_shapes(m: config.Model, spec: model.Spec) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape with ``vocab_size`` rows on its ``vocab`` axis: what HF holds.  jaxllm
    masks the logits of the padding rows, so without them HF's softmax is exactly jaxllm's."""
    axes = _by_path(spec.axes)
    return {k: tuple(m.vocab_size if a == "vocab" else n for a, n in zip(axes[k], v.shape, strict=True))
            for k, v in _by_path(spec.params).items()}


# --------------------------------------------------------------------------- export


def hf_architecture(m: config.Model) -> Arch:
    """The Hugging Face architecture that holds the (resolved) model section ``m`` exactly.

    Raises:
      ConvertError: the model fits neither; ``keys`` are the keys that do not fit the closer
        architecture (the message lists both).
    """
    misfits = {}
    for arch in (GPT2, LLAMA):
        bad = {f"model.{k}": v for k, v in arch.needs.items() if getattr(m, k) != v}
        if arch is GPT2 and m.num_kv_heads != m.num_attention_heads:
            bad["model.num_kv_heads"] = m.num_attention_heads
        if not bad:
            return arch
        misfits[arch.model_type] = bad
    likely = "llama" if m.position_embedding == "rotary" else "gpt2"
    closest = min(misfits, key=lambda a: (len(misfits[a]), a != likely))
    other = "llama" if closest == "gpt2" else "gpt2"

    def changes(arch):
        return ", ".join(f"{k}={getattr(m, k.split('.')[1])!r} (needs {v!r})" for k, v in misfits[arch].items())

    raise ConvertError(
        f"the model fits no Hugging Face architecture jaxllm converts to: for {ARCHITECTURES[closest].hf_class} "
        f"change {changes(closest)}; for {ARCHITECTURES[other].hf_class} change {changes(other)}",
        keys=tuple(misfits[closest]))


def to_hf(m: config.Model, params: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """A jaxllm model as a Hugging Face GPT-2 or Llama model.

    Args:
      m: the resolved ``model`` section (:func:`jaxllm.resolve.resolve_model`).
      params: the nested parameters of :func:`jaxllm.model.init` (jax or numpy arrays), shaped
        as ``model.describe(m).params``: ``wte [vocab, h]``, ``wpe [positions, h]`` (learned),
        ``layers/attn/wq [L, h, heads, d]``, ``wk``/``wv [L, h, kv_heads, d]``, ``wo [L, heads, d, h]``,
        ``layers/mlp/w1 [L, h, f]``, ``wg [L, h, f]`` (swiglu), ``w2 [L, f, h]``, norms, biases,
        ``lm_head [h, vocab]`` (untied), where ``vocab`` = ``m.padded_vocab_size``.
    Returns:
      ``(hf_config, tensors)``: the ``config.json`` dict, and float32 C-contiguous arrays by HF
      name, laid out by the architecture's table, with ``m.vocab_size`` rows (see the module doc):
      GPT-2's ``Conv1D`` weights are ``[in, out]`` (``c_attn.weight [h, 3h]`` = ``[wq | wk | wv]``
      flattened over ``(heads, d)``), Llama's
      ``Linear`` weights ``[out, in]`` (``q_proj [heads*d, h]``, ``o_proj [h, heads*d]``,
      ``gate_proj``/``up_proj [f, h]`` = ``wg``/``w1``), one tensor per layer.
    Raises:
      ConvertError: the model fits neither architecture, or ``params`` does not match it.
    """
    arch = hf_architecture(m)
    spec = model.describe(m)
    want = {k: v.shape for k, v in _by_path(spec.params).items()}
    flat = {k: np.asarray(jax.device_get(v), np.float32) for k, v in _by_path(params).items()}
    have = {k: v.shape for k, v in flat.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))
        raise ConvertError("the parameters do not match the config (" + "; ".join(
            f"{k}: {'config' if (k, s) in want.items() else 'parameters'} {list(s)}" for k, s in diff[:6]) + ")")
    real = _unpadded_shapes(m, spec)
    flat = {k: x[tuple(map(slice, real[k]))] for k, x in flat.items()}
    tensors = {}
    for t in arch.tensors:
        if t.params[0] not in flat:  # lm_head of a tied model
            continue
        arrays = [flat[p] for p in t.params]
        for i in range(m.num_layers) if "{i}" in t.name else [None]:
            tensors[t.name.format(i=i)] = _to_hf_layout(t, arrays if i is None else [a[i] for a in arrays])
    hf = {"architectures": [arch.hf_class], "model_type": arch.model_type,
          **{key: allowed[0] for key, allowed in arch.supports.items()},
          **{key: getattr(m, ours) for key, (ours, _) in arch.keys.items()}, **arch.extra(m),
          "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
          "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    return hf, {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


def _write_gpt2_tokenizer(data: config.Data, m: config.Model, out: str, hf: dict) -> None:
    """Writes GPT-2's tokenizer files into ``out`` if the run used them and they are still there."""
    if data.tokenizer != "gpt2":
        return
    src = [os.path.join(data.gpt2_dir, n) for n in GPT2_FILES]
    if not all(os.path.isfile(s) for s in src):
        warnings.warn(f"the run's GPT-2 tokenizer files ({data.gpt2_dir}) are gone; no tokenizer written",
                      stacklevel=2)
        return
    shutil.copyfile(src[0], os.path.join(out, "vocab.json"))
    shutil.copyfile(src[1], os.path.join(out, "merges.txt"))
    eot = "<|endoftext|>"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fp:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": eot,
                   "eos_token": eot, "unk_token": eot, "model_max_length": m.max_position_embeddings}, fp, indent=2)
    hf.update(bos_token_id=GPT2_EOT_ID, eos_token_id=GPT2_EOT_ID)


def save_hf(m: config.Model, params: dict, out: str, *, data: config.Data | None = None) -> dict:
    """Writes ``out/config.json`` and ``out/model.safetensors`` (see :func:`to_hf`), and GPT-2's
    tokenizer files when ``data`` (the run's data section) used them; returns the config.json dict."""
    from safetensors.numpy import save_file

    hf, tensors = to_hf(m, params)
    os.makedirs(out, exist_ok=True)
    if data is not None:
        _write_gpt2_tokenizer(data, m, out, hf)
    save_file(tensors, os.path.join(out, SAFETENSORS), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as fp:
        json.dump(hf, fp, indent=2, sort_keys=True)
    return hf


def export_workdir(workdir: str, out: str, step: int | None = None) -> dict:
    """``--to-hf``: the checkpoint of ``workdir`` (latest or ``step``) as the Hugging Face
    directory ``out``; returns the config.json dict.

    Raises:
      FileNotFoundError: no checkpoint. ConvertError: the model fits no architecture, or ``out``
        exists and is not empty (stale files there could be loaded along with the new ones).
    """
    if os.path.isdir(out) and os.listdir(out):
        raise ConvertError(f"{out} exists and is not empty: export into a new directory")
    cfg = checkpoint.load_config(workdir, step)
    m = resolve_model(cfg.model, seq_length=cfg.train.seq_length)  # the run's padding is restored away
    hf_architecture(m)  # fail before reading the parameters
    return save_hf(m, checkpoint.restore_params(m, workdir, step), out, data=cfg.data)


# --------------------------------------------------------------------------- import


def _read_json(path: str) -> dict:
    with open(path) as fp:
        return json.load(fp)


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
        files = [os.path.join(directory, n) for n in sorted(set(_read_json(index)["weight_map"].values()))]
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


def _model_from_hf(hf: dict) -> tuple[Arch, dict]:
    """The architecture and jaxllm's model keys of a config.json dict. Raises ConvertError."""
    arch = ARCHITECTURES.get(hf.get("model_type"))
    if arch is None:
        raise ConvertError(f"config.json: model_type={hf.get('model_type')!r} is not supported: jaxllm converts "
                           f"'gpt2' (GPT2LMHeadModel) and 'llama' (LlamaForCausalLM)", keys=("model_type",))

    def unsupported(key, value, need):
        raise ConvertError(f"config.json: {key}={value!r} is not supported: jaxllm needs {need}", keys=(key,))

    for key, allowed in arch.supports.items():
        if hf.get(key, allowed[0]) not in allowed:
            unsupported(key, hf[key], " or ".join(map(repr, allowed)))
    keys = {}
    for key, (ours, default) in arch.keys.items():
        value = hf.get(key, default)
        keys[ours] = 0 if value is None else config.key_type(f"model.{ours}")(value)  # 0: derived, as HF does
    if arch is LLAMA:
        rope = hf.get("rope_parameters") or {}
        scaling, rope_type = hf.get("rope_scaling"), rope.get("rope_type", rope.get("type", "default"))
        if scaling or rope_type != "default":
            unsupported("rope_scaling" if scaling else "rope_parameters.rope_type", scaling or rope_type,
                        "plain rotary embeddings (rope type 'default', no scaling)")
        head_dim = keys["hidden_size"] // keys["num_attention_heads"]
        if hf.get("head_dim") not in (None, head_dim):
            unsupported("head_dim", hf["head_dim"], f"hidden_size / num_attention_heads = {head_dim}")
        keys["rotary_base"] = float(rope.get("rope_theta", keys["rotary_base"]))
    return arch, {**keys, **arch.needs}


def _params_from_hf(arch: Arch, m: config.Model, tensors: dict[str, np.ndarray]) -> dict:
    """jaxllm's nested float32 parameters (``model.describe(m).params``) from HF's tensors, by
    ``arch``'s table read backwards (the layouts are :func:`to_hf`'s). Raises ConvertError."""
    spec = model.describe(m)
    shapes = _unpadded_shapes(m, spec)
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
        if t.params[0] not in shapes:  # the tied copy of the head some checkpoints store: HF ignores it too
            used.add(t.name)
            continue
        layered = "{i}" in t.name
        per_layer = [shapes[p][1:] if layered else shapes[p] for p in t.params]
        slices = [_from_hf_layout(t, get(t.name.format(i=i), _hf_shape(t, per_layer)), per_layer)
                  for i in (range(m.num_layers) if layered else [None])]
        for j, p in enumerate(t.params):
            out[p] = np.stack([s[j] for s in slices]) if layered else slices[0][j]
    left = sorted(k for k in tensors if k not in used and not re.fullmatch(arch.buffers, k))
    if left:
        raise ConvertError(f"model.safetensors: tensors jaxllm has no place for: {', '.join(left[:6])}"
                           + (f" and {len(left) - 6} more" if len(left) > 6 else ""))
    padded = {k: v.shape for k, v in _by_path(spec.params).items()}  # the padding rows are zeros
    leaves = [np.pad(out[k], [(0, p - n) for n, p in zip(out[k].shape, padded[k], strict=True)]) for k in shapes]
    return jax.tree_util.tree_unflatten(jax.tree.structure(spec.params), leaves)


def _import(directory: str, overrides: dict[str, str]) -> tuple[config.Config, config.Resolved, dict]:
    """``(config as given, resolved config, params)`` of a Hugging Face directory; see :func:`from_hf`."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{directory} has no config.json: not a Hugging Face model directory")
    arch, keys = _model_from_hf(_read_json(path))
    given = config.get_config()
    given.model.update(**keys)
    given.train.seq_length = positions = given.model.max_position_embeddings
    for key, text in overrides.items():
        config.check_key(key, text)
        section, _, name = key.partition(".")
        if section == "model" and name not in FREE_MODEL_KEYS:
            raise ConvertError(f"--config.{key}: the Hugging Face config.json determines it; only "
                               f"{', '.join('model.' + k for k in FREE_MODEL_KEYS)} may be set", keys=(key,))
        config.override(given, key, text)
    if given.train.seq_length > positions:
        raise ConvertError(f"train.seq_length={given.train.seq_length} exceeds the {positions} positions of "
                           f"config.json", keys=("train.seq_length",))
    # The checkpoint fits any mesh: check the config on the devices its mesh names (a -1 axis as 1),
    # whatever this machine has.
    cfg = resolve(given, num_devices=math.prod(max(n, 1) for n in dataclasses.asdict(given.mesh).values()))
    return given, cfg, _params_from_hf(arch, cfg.model, read_safetensors(directory))


def from_hf(directory: str, overrides: dict[str, str] | None = None) -> tuple[config.Resolved, dict]:
    """A Hugging Face GPT-2 or Llama directory as a jaxllm config and parameters.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or its sharded index).
      overrides: ``{"SECTION.KEY": "value"}`` changes to jaxllm's defaults, parsed as the key's
        type; model keys other than :data:`FREE_MODEL_KEYS` come from config.json.
    Returns:
      ``(cfg, params)``: the resolved config (``model.vocab_size`` = HF's ``vocab_size``;
      ``model.max_position_embeddings`` = ``train.seq_length`` = its positions unless
      shortened), and float32 numpy parameters shaped as ``model.describe(cfg.model).params``
      (padding rows zero; see :func:`to_hf` for the layouts).
    Raises:
      ConvertError: missing or pickle-only files, an unsupported config.json (``keys`` names the
        key), tensors missing, of the wrong shape or left over, or a model key that may not be set.
      ConfigError: an unknown key or unparsable value, or an invalid resulting config (e.g. an
        empty ``data.input``; its files are read by training, not here).
    """
    return _import(directory, dict(overrides or {}))[1:]


def _find_gpt2_tokenizer(directory: str, dest: str) -> bool:
    """Copies GPT-2's tokenizer from a Hugging Face directory into ``dest`` as ``encoder.json`` +
    ``vocab.bpe`` (jaxllm's gpt2 tokenizer files); False, with nothing left, if it is not GPT-2's."""
    vocab, merges = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    tok_json = os.path.join(directory, "tokenizer.json")
    os.makedirs(dest, exist_ok=True)
    try:
        if os.path.isfile(vocab) and os.path.isfile(merges):
            shutil.copyfile(vocab, os.path.join(dest, GPT2_FILES[0]))
            shutil.copyfile(merges, os.path.join(dest, GPT2_FILES[1]))
        elif os.path.isfile(tok_json):
            bpe = _read_json(tok_json).get("model") or {}
            if bpe.get("type") != "BPE" or not isinstance(bpe.get("vocab"), dict):
                raise DataError("not a BPE tokenizer")
            with open(os.path.join(dest, GPT2_FILES[0]), "w") as fp:
                json.dump(bpe["vocab"], fp, ensure_ascii=False)
            with open(os.path.join(dest, GPT2_FILES[1]), "w", encoding="utf-8") as fp:
                fp.write("#version: 0.2\n")
                fp.writelines((p if isinstance(p, str) else " ".join(p)) + "\n" for p in bpe.get("merges", []))
        else:
            raise DataError("no tokenizer files")
        GPT2Tokenizer(dest)
        return True
    except (DataError, OSError, ValueError):
        shutil.rmtree(dest, ignore_errors=True)
        return False


def _config_file_text(given: config.Config, directory: str) -> str:
    return (f'"""The jaxllm config of the Hugging Face model imported from {os.path.abspath(directory)}\n'
            f'by jaxllm.convert. Train on with:\n'
            f'    python -m jaxllm.train --config={{this file}} --workdir={{its directory}}\n'
            f'(--config.SECTION.KEY=VALUE flags still apply; leave the model section as it is)."""\n\n'
            f"from jaxllm.config import from_dict\n\n"
            f"CONFIG = {pprint.pformat(given.to_dict(), sort_dicts=False, width=110)}\n\n\n"
            f"def get_config():\n    return from_dict(CONFIG)\n")


def import_to_workdir(directory: str, workdir: str, overrides: dict[str, str] | None = None) -> config.Resolved:
    """``--from-hf``: a step-0 training checkpoint of the Hugging Face model in ``directory``,
    written to ``workdir`` (which must hold no checkpoint), plus ``workdir/config.py``.

    The state is :func:`jaxllm.runtime.step.init_state`'s around HF's parameters (a fresh optimizer
    state), saved by :class:`jaxllm.runtime.checkpoint.Checkpointer` as training saves it.  Unless
    ``overrides`` set ``data.tokenizer`` or ``data.gpt2_dir``, GPT-2's tokenizer found in
    ``directory`` is copied to ``workdir/tokenizer`` and used (``data.tokenizer=gpt2``).
    ``config.py`` holds the config as given (derived sizes left to ``jaxllm.train``).

    Returns the resolved config. Raises what :func:`from_hf` raises, and ConvertError when
    ``workdir`` already has checkpoints.
    """
    overrides = dict(overrides or {})
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise ConvertError(f"{ckpt_dir} already holds checkpoints: import into a new workdir")
    tok_dir = os.path.abspath(os.path.join(workdir, "tokenizer"))
    if "data.tokenizer" not in overrides and "data.gpt2_dir" not in overrides:
        hf_path = os.path.join(directory, "config.json")
        vocab = _read_json(hf_path).get("vocab_size", 0) if os.path.isfile(hf_path) else 0
        if vocab >= GPT2_VOCAB_SIZE and _find_gpt2_tokenizer(directory, tok_dir):
            overrides.update({"data.tokenizer": "gpt2", "data.gpt2_dir": tok_dir})
    try:
        given, cfg, params = _import(directory, overrides)
    except Exception:
        if overrides.get("data.gpt2_dir") == tok_dir:
            shutil.rmtree(tok_dir, ignore_errors=True)
        raise
    optimizer = optim.make_optimizer(cfg.train, model.describe(cfg.model).decay)
    with jax.default_device(jax.devices("cpu")[0]):  # host memory, whatever accelerator is present
        state = step.init_state(jax.device_put(params), optimizer)
    ckpt = checkpoint.Checkpointer(workdir, cfg)
    ckpt.maybe_save(0, state, force=True)
    ckpt.close()
    with open(os.path.join(workdir, "config.py"), "w") as fp:
        fp.write(_config_file_text(given, directory))
    return cfg


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module docstring); errors are one line on stderr and exit status 2."""
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.convert",
        description="Convert between jaxllm checkpoints and Hugging Face GPT-2 / Llama directories "
                    "(safetensors; see the module docstring).",
        epilog="--from-hf also takes --config.SECTION.KEY=VALUE options (e.g. --config.data.input=FILE, "
               "--config.data.tokenizer=char): the data must be tokenized with the model's tokenizer.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-hf", nargs=2, metavar=("WORKDIR", "OUT"),
                      help="export WORKDIR's latest checkpoint to the Hugging Face directory OUT")
    mode.add_argument("--from-hf", nargs=2, metavar=("DIR", "WORKDIR"),
                      help="import the Hugging Face directory DIR as a step-0 checkpoint in WORKDIR")
    p.add_argument("--step", type=int, default=None, help="--to-hf: the checkpoint step (default: latest)")
    args, rest = p.parse_known_args(argv)
    overrides = {}
    for item in rest:
        m = re.fullmatch(r"--config\.([A-Za-z_]\w*\.[A-Za-z_]\w*)=(.*)", item)
        if not m or args.to_hf:
            p.error(f"unrecognized argument {item!r}" + (" (--to-hf takes no --config options)" if args.to_hf else ""))
        overrides[m.group(1)] = m.group(2)
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # Orbax logs every file at INFO
    try:
        if args.to_hf:
            workdir, out = args.to_hf
            hf = export_workdir(workdir, out, args.step)
            print(f"wrote {hf['architectures'][0]} ({hf['vocab_size']} vocab) to {out}")
            return 0
        directory, workdir = args.from_hf
        cfg = import_to_workdir(directory, workdir, overrides)
    except config.ConfigError as e:  # already reads "config error: KEY=VALUE: fix"
        cli.fail(e)
    except (ConvertError, DataError, FileNotFoundError) as e:
        cli.fail(f"error: {e}")
    config_py = os.path.join(workdir, "config.py")
    if not any(k.startswith("data.") for k in overrides) and cfg.data.tokenizer != "gpt2":
        print(f"note: {directory} holds no GPT-2 tokenizer for this model, so the config keeps jaxllm's default "
              f"data section (data.tokenizer={cfg.data.tokenizer}, data.input={cfg.data.input}); the data must be "
              f"tokenized as the model expects: import again with --config.data.* or edit {config_py}",
              file=sys.stderr)
    kind = "GPT-2" if cfg.model.position_embedding == "learned" else "Llama"
    print(f"imported {kind} from {directory} into "
          f"{workdir} (step 0, data.tokenizer={cfg.data.tokenizer})\n"
          f"train on:  python -m jaxllm.train --config={config_py} --workdir={workdir}\n"
          f"sample:    python -m jaxllm.generate --workdir={workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
