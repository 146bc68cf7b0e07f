"""Hugging Face conversion: jaxllm <-> ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` directories.

CLI::

    python -m jaxllm.convert --to-hf WORKDIR OUT [--step N]
    python -m jaxllm.convert --from-hf DIR WORKDIR [--config.SECTION.KEY=VALUE ...]

``--to-hf`` reads the latest (or ``--step``) checkpoint of a training run and writes
``OUT/config.json`` + ``OUT/model.safetensors`` (float32), which transformers loads with
``AutoModelForCausalLM.from_pretrained(OUT)``.  The architecture follows from the model config:

* **GPT-2** for ``position_embedding=learned, norm=layernorm, activation=gelu, use_bias=True``
  and multi-head attention (``num_kv_heads`` = ``num_attention_heads``).  Tied embeddings as
  GPT-2; an untied model is written with ``tie_word_embeddings=false`` and ``lm_head.weight``.
* **Llama** for ``position_embedding=rotary, norm=rmsnorm, activation=swiglu, use_bias=False``;
  grouped-query attention through ``num_key_value_heads``, tied or untied.

Any other combination is a :class:`ConvertError` naming the keys that do not fit.

Vocabulary: the export writes the model's whole, possibly padded, vocabulary
(``model.vocab_size``, e.g. 50304 for GPT-2's 50257 tokens): ``vocab_size`` in config.json,
the embedding and the output layer all have those rows, so logits are exactly the
model's.  The padding rows are never produced by the tokenizer; transformers handles a
model vocabulary larger than its tokenizer's.  When the run's data used the ``gpt2``
tokenizer and its files are still there, they are written too (``vocab.json``,
``merges.txt``, ``tokenizer_config.json``); ``char`` and ``byte`` tokenizers have no
Hugging Face files and are not written.

``--from-hf`` reads ``DIR/config.json`` and ``DIR/model.safetensors`` (or the shards of
``model.safetensors.index.json``) and writes a step-0 checkpoint into ``WORKDIR`` with the full
training state: the Hugging Face parameters (as float32), a fresh optimizer state and the
config; HF's ``vocab_size`` becomes ``model.vocab_size`` unchanged.  ``n_positions`` (GPT-2) or
``max_position_embeddings`` (Llama) becomes ``train.seq_length``; for Llama, which has no
position table, ``--config.train.seq_length=N`` may shorten it.  Every other section is
jaxllm's defaults, changed with ``--config.SECTION.KEY=VALUE`` (the model keys that come from
config.json cannot be changed).  **The data must be tokenized with the model's tokenizer**:
when DIR holds GPT-2's tokenizer (``vocab.json`` + ``merges.txt``, or a ``tokenizer.json``
with the same 50,257-token BPE), it is copied to ``WORKDIR/tokenizer`` and the config uses
``data.tokenizer=gpt2``; otherwise set ``--config.data.*`` yourself (jaxllm has no tokenizer
for e.g. Llama's), or the default byte tokenizer is used, which only makes sense for a model
trained on bytes.  ``WORKDIR/config.py`` holds the imported config, so that::

    python -m jaxllm.train --config=WORKDIR/config.py --workdir=WORKDIR   # continues at step 0
    python -m jaxllm.generate --workdir=WORKDIR                            # samples

(``jaxllm.train`` takes its config from ``--config``, not from the checkpoint: without that
flag it builds the default model, whose shapes do not match the checkpoint.)

Dropout: GPT-2's ``resid_pdrop`` becomes ``model.dropout`` (jaxllm drops the embedding and
each residual branch; ``attn_pdrop`` has no counterpart and is ignored), Llama's is 0; the
export writes ``resid_pdrop = embd_pdrop = model.dropout`` and ``attn_pdrop = 0``.

Safety: only JSON and safetensors are ever read; there is no pickle or ``torch.load`` path.
A directory with only ``pytorch_model.bin`` (or another pickle-based format) is refused.

Library: :func:`to_hf` (config + params -> config.json dict + tensors), :func:`from_hf`
(directory -> config + params), :func:`save_hf`, :func:`export_workdir`,
:func:`import_to_workdir`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import config, model

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Formats that need pickle (or another framework) to read: never loaded here.
UNSAFE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth",
                  "tf_model.h5", "flax_model.msgpack", "model.ckpt.index")

# What each target needs from the jaxllm model config (resolved num_kv_heads is checked apart).
NEEDS = {
    "gpt2": {"model.position_embedding": "learned", "model.norm": "layernorm",
             "model.activation": "gelu", "model.use_bias": True},
    "llama": {"model.position_embedding": "rotary", "model.norm": "rmsnorm",
              "model.activation": "swiglu", "model.use_bias": False},
}
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
# HF GPT-2 activations that are GELU's tanh approximation (jaxllm's gelu).
GPT2_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Model keys --from-hf lets the user set; the rest come from config.json.
FREE_MODEL_KEYS = ("dtype", "remat", "attention_impl", "dropout", "init_std", "make_vocab_size_divisible_by")


class ConvertError(ValueError):
    """A model, directory or option that cannot be converted.

    Attributes:
      keys: the config keys (jaxllm ``model.*`` or Hugging Face config.json keys) at fault,
        possibly empty.
    """

    def __init__(self, message: str, keys=()):
        self.keys = tuple(keys)
        super().__init__(message)


# --------------------------------------------------------------------------- architecture


def hf_architecture(cfg) -> str:
    """``"gpt2"`` or ``"llama"``: the Hugging Face architecture that holds ``cfg.model`` exactly.

    Raises:
      ConvertError: the model fits neither; ``keys`` are the keys that do not fit the closer
        target (the message lists both).
    """
    m = config.resolved(cfg).model
    misfits = {}
    for arch, needs in NEEDS.items():
        bad = {k: v for k, v in needs.items() if m[k.split(".")[1]] != v}
        if arch == "gpt2" and m.num_kv_heads != m.num_attention_heads:
            bad["model.num_kv_heads"] = m.num_attention_heads
        misfits[arch] = bad
    fits = [a for a, bad in misfits.items() if not bad]
    if fits:
        return fits[0]
    closest = min(misfits, key=lambda a: (len(misfits[a]), a != ("llama" if m.position_embedding == "rotary"
                                                                    else "gpt2")))

    def describe(arch):
        return ", ".join(f"{k}={m[k.split('.')[1]]!r} (needs {v!r})" for k, v in misfits[arch].items())

    other = "llama" if closest == "gpt2" else "gpt2"
    raise ConvertError(
        f"the model fits no Hugging Face architecture jaxllm converts to: for {ARCHITECTURES[closest]} change "
        f"{describe(closest)}; for {ARCHITECTURES[other]} change {describe(other)}",
        keys=tuple(misfits[closest]))


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), dtype=np.float32)


def _check_param_shapes(cfg, params, source: str) -> None:
    """Raises ConvertError unless ``params`` has exactly the names and shapes of ``model.abstract(cfg)``."""
    _, want = model.abstract(cfg)
    want_shapes = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(want)}
    have_shapes = {jax.tree_util.keystr(k): tuple(np.shape(v)) for k, v in jax.tree_util.tree_leaves_with_path(params)}
    if want_shapes != have_shapes:
        diff = sorted(set(want_shapes.items()) ^ set(have_shapes.items()))
        detail = "; ".join(f"{name}: {'config' if (name, s) in want_shapes.items() else source} {s}"
                           for name, s in diff[:6])
        keys = ["train.seq_length"] if any("wpe" in name for name, _ in diff) else []
        raise ConvertError(f"parameters from {source} do not match the config ({detail})", keys=keys)


# --------------------------------------------------------------------------- export


def to_hf(cfg, params) -> tuple[dict, dict[str, np.ndarray]]:
    """A jaxllm model as a Hugging Face GPT-2 or Llama model.

    Args:
      cfg: the run's config (resolved, as stored with a checkpoint: ``model.vocab_size`` set).
      params: the nested parameter dict of :func:`jaxllm.model.init` (jax or numpy arrays):
        ``wte [vocab, h]``, ``wpe [max_length, h]`` (learned), ``layers/attn/wq [L, h, heads, d]``,
        ``wk``/``wv [L, h, kv_heads, d]``, ``wo [L, heads, d, h]``, ``layers/mlp/w1 [L, h, f]``,
        ``wg [L, h, f]`` (swiglu), ``w2 [L, f, h]``, norms, biases, ``lm_head [h, vocab]`` (untied).
    Returns:
      ``(hf_config, tensors)``: the ``config.json`` dict, and float32 C-contiguous arrays by
      Hugging Face name.  GPT-2 (``transformer.*``): Conv1D weights are ``[in, out]``, so
      ``attn.c_attn.weight [h, 3h]`` is ``[wq | wk | wv]`` flattened over ``(heads, d)``,
      ``mlp.c_fc.weight [h, f]``, ``mlp.c_proj.weight [f, h]``.  Llama (``model.*``): torch
      Linear weights are ``[out, in]``: ``q_proj [heads*d, h]``, ``k_proj``/``v_proj
      [kv_heads*d, h]``, ``o_proj [h, heads*d]``, ``gate_proj``/``up_proj [f, h]``
      (``wg``/``w1``), ``down_proj [h, f]``.  ``lm_head.weight [vocab, h]`` only when untied.
      The vocabulary is ``model.vocab_size`` rows, padding included (see the module doc).
    Raises:
      ConvertError: the config fits neither architecture, or ``params`` does not match it.
    """
    cfg = config.resolved(cfg)
    p = jax.tree.map(_np, params)
    if not cfg.model.vocab_size:  # an unresolved config: the embedding says it
        cfg.model.vocab_size = p["wte"].shape[0]
    arch = hf_architecture(cfg)
    _check_param_shapes(cfg, p, "the checkpoint")
    m = cfg.model
    L, h, nh, nkv, f, V = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads,
                           m.ffn_hidden_size, m.vocab_size)
    d = h // nh
    lay, attn, mlp = p["layers"], p["layers"]["attn"], p["layers"]["mlp"]
    t = {}
    if arch == "gpt2":
        t["transformer.wte.weight"] = p["wte"]
        t["transformer.wpe.weight"] = p["wpe"]
        for i in range(L):
            n = f"transformer.h.{i}."
            t[n + "ln_1.weight"], t[n + "ln_1.bias"] = lay["ln1"]["scale"][i], lay["ln1"]["bias"][i]
            t[n + "attn.c_attn.weight"] = np.concatenate(
                [attn[w][i].reshape(h, nh * d) for w in ("wq", "wk", "wv")], axis=1)
            t[n + "attn.c_attn.bias"] = np.concatenate([attn[b][i].reshape(nh * d) for b in ("bq", "bk", "bv")])
            t[n + "attn.c_proj.weight"] = attn["wo"][i].reshape(nh * d, h)
            t[n + "attn.c_proj.bias"] = attn["bo"][i]
            t[n + "ln_2.weight"], t[n + "ln_2.bias"] = lay["ln2"]["scale"][i], lay["ln2"]["bias"][i]
            t[n + "mlp.c_fc.weight"], t[n + "mlp.c_fc.bias"] = mlp["w1"][i], mlp["b1"][i]
            t[n + "mlp.c_proj.weight"], t[n + "mlp.c_proj.bias"] = mlp["w2"][i], mlp["b2"][i]
        t["transformer.ln_f.weight"], t["transformer.ln_f.bias"] = p["ln_f"]["scale"], p["ln_f"]["bias"]
        hf = {
            "architectures": [ARCHITECTURES[arch]], "model_type": "gpt2",
            "vocab_size": V, "n_positions": cfg.train.seq_length,
            "n_embd": h, "n_layer": L, "n_head": nh, "n_inner": f,
            "activation_function": "gelu_new", "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": 0.0,
            "initializer_range": m.init_std, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": bool(m.tie_embeddings), "use_cache": True,
        }
    else:
        t["model.embed_tokens.weight"] = p["wte"]
        for i in range(L):
            n = f"model.layers.{i}."
            t[n + "input_layernorm.weight"] = lay["ln1"]["scale"][i]
            t[n + "self_attn.q_proj.weight"] = attn["wq"][i].reshape(h, nh * d).T
            t[n + "self_attn.k_proj.weight"] = attn["wk"][i].reshape(h, nkv * d).T
            t[n + "self_attn.v_proj.weight"] = attn["wv"][i].reshape(h, nkv * d).T
            t[n + "self_attn.o_proj.weight"] = attn["wo"][i].reshape(nh * d, h).T
            t[n + "post_attention_layernorm.weight"] = lay["ln2"]["scale"][i]
            t[n + "mlp.gate_proj.weight"] = mlp["wg"][i].T
            t[n + "mlp.up_proj.weight"] = mlp["w1"][i].T
            t[n + "mlp.down_proj.weight"] = mlp["w2"][i].T
        t["model.norm.weight"] = p["ln_f"]["scale"]
        theta = float(m.rotary_base)
        hf = {
            "architectures": [ARCHITECTURES[arch]], "model_type": "llama",
            "vocab_size": V, "hidden_size": h, "intermediate_size": f, "num_hidden_layers": L,
            "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": d, "hidden_act": "silu",
            "max_position_embeddings": cfg.train.seq_length, "rms_norm_eps": m.norm_eps,
            # rope_theta for transformers 4.x, rope_parameters for 5.x; the same value.
            "rope_theta": theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "initializer_range": m.init_std, "pretraining_tp": 1,
            "tie_word_embeddings": bool(m.tie_embeddings), "use_cache": True,
        }
    if not m.tie_embeddings:
        t["lm_head.weight"] = p["lm_head"].T
    hf.update({"torch_dtype": "float32", "dtype": "float32", "bos_token_id": None, "eos_token_id": None,
               "pad_token_id": None})
    return hf, {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def _write_gpt2_tokenizer(cfg, out: str, hf: dict) -> bool:
    """Writes GPT-2's tokenizer files into ``out`` if the run used them and they are there."""
    from jaxllm.data.tokenizers import GPT2_FILES

    if cfg.data.tokenizer != "gpt2":
        return False
    src = [os.path.join(cfg.data.gpt2_dir, n) for n in GPT2_FILES]
    if not all(os.path.isfile(s) for s in src):
        warnings.warn(f"the run's GPT-2 tokenizer files ({cfg.data.gpt2_dir}) are gone; no tokenizer written")
        return False
    shutil.copyfile(src[0], os.path.join(out, "vocab.json"))
    shutil.copyfile(src[1], os.path.join(out, "merges.txt"))
    eot = "<|endoftext|>"
    tok_cfg = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": eot, "eos_token": eot,
               "unk_token": eot, "model_max_length": cfg.train.seq_length}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fp:
        json.dump(tok_cfg, fp, indent=2)
    hf.update(bos_token_id=50256, eos_token_id=50256)
    return True


def save_hf(cfg, params, out: str, *, tokenizer: bool = True) -> dict:
    """Writes ``out/config.json`` and ``out/model.safetensors`` (and GPT-2's tokenizer files when
    the run used them and ``tokenizer``); returns the config.json dict. See :func:`to_hf`."""
    from safetensors.numpy import save_file

    hf, tensors = to_hf(cfg, params)
    os.makedirs(out, exist_ok=True)
    if tokenizer:
        _write_gpt2_tokenizer(cfg, out, hf)
    save_file(tensors, os.path.join(out, SAFETENSORS), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as fp:
        json.dump(hf, fp, indent=2, sort_keys=True)
    return hf


def export_workdir(workdir: str, out: str, step: int | None = None) -> dict:
    """``--to-hf``: the checkpoint of ``workdir`` (latest or ``step``) as a Hugging Face directory
    ``out``; returns the config.json dict.

    Raises:
      FileNotFoundError: no checkpoint. ConvertError: the model fits no target, or ``out``
        exists and is not empty (stale files there could be loaded along with the new ones).
    """
    from jaxllm import checkpoint

    if os.path.isdir(out) and os.listdir(out):
        raise ConvertError(f"{out} exists and is not empty: export into a new directory")
    cfg = checkpoint.load_config(workdir, step)
    hf_architecture(cfg)  # fail before reading the parameters
    return save_hf(cfg, checkpoint.restore_params(cfg, workdir, step), out)


# --------------------------------------------------------------------------- import


def _read_json(path: str) -> dict:
    with open(path) as fp:
        return json.load(fp)


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of ``directory``'s ``model.safetensors`` (or of the shards its
    ``model.safetensors.index.json`` names), as numpy arrays (bfloat16 ones as float32).

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
    for path in files:
        later = []
        with safe_open(path, framework="numpy") as f:
            for k in f.keys():
                if f.get_slice(k).get_dtype() == "BF16":  # numpy has no bfloat16: read through jax
                    later.append(k)
                else:
                    tensors[k] = f.get_tensor(k)
        if later:
            with safe_open(path, framework="flax") as f, jax.default_device(jax.devices("cpu")[0]):
                for k in later:
                    tensors[k] = np.asarray(f.get_tensor(k).astype(jnp.float32))
    return tensors


def _model_from_hf(hf: dict) -> tuple[str, dict, int]:
    """``(arch, jaxllm model keys, seq_length)`` from a config.json dict. Raises ConvertError."""
    kind = hf.get("model_type")

    def unsupported(key, value, need):
        raise ConvertError(f"config.json: {key}={value!r} is not supported: jaxllm needs {need}", keys=(key,))

    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in GPT2_TANH_GELUS:
            unsupported("activation_function", act, f"GELU's tanh approximation ({', '.join(GPT2_TANH_GELUS)})")
        for key, need in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
            if hf.get(key, need) != need:
                unsupported(key, hf[key], repr(need))
        h = hf.get("n_embd", 768)
        return "gpt2", dict(
            num_layers=hf.get("n_layer", 12), hidden_size=h, num_attention_heads=hf.get("n_head", 12),
            num_kv_heads=hf.get("n_head", 12), ffn_hidden_size=hf.get("n_inner") or 4 * h,
            vocab_size=hf.get("vocab_size", 50257), position_embedding="learned", norm="layernorm",
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), activation="gelu", use_bias=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            dropout=float(hf.get("resid_pdrop", 0.1)), init_std=float(hf.get("initializer_range", 0.02)),
        ), hf.get("n_positions", 1024)
    if kind == "llama":
        if hf.get("hidden_act", "silu") != "silu":
            unsupported("hidden_act", hf["hidden_act"], "'silu' (SwiGLU)")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key, False):
                unsupported(key, hf[key], "False (jaxllm's Llama layout has no biases)")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if scaling or rope_type != "default":
            key = "rope_scaling" if scaling else "rope_parameters.rope_type"
            unsupported(key, scaling or rope_type, "plain rotary embeddings (rope type 'default', no scaling)")
        h, nh = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
        if hf.get("head_dim") not in (None, h // nh):
            unsupported("head_dim", hf["head_dim"], f"hidden_size / num_attention_heads = {h // nh}")
        return "llama", dict(
            num_layers=hf.get("num_hidden_layers", 32), hidden_size=h, num_attention_heads=nh,
            num_kv_heads=hf.get("num_key_value_heads") or nh, ffn_hidden_size=hf.get("intermediate_size", 11008),
            vocab_size=hf.get("vocab_size", 32000), position_embedding="rotary",
            rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu", use_bias=False,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0,
            init_std=float(hf.get("initializer_range", 0.02)),
        ), hf.get("max_position_embeddings", 2048)
    raise ConvertError(f"config.json: model_type={kind!r} is not supported: jaxllm converts 'gpt2' "
                       f"(GPT2LMHeadModel) and 'llama' (LlamaForCausalLM)", keys=("model_type",))


def _params_from_hf(arch: str, m, tensors: dict[str, np.ndarray]) -> dict:
    """jaxllm's nested float32 parameters from Hugging Face tensors (see :func:`to_hf` for the layouts)."""
    L, h, nh, nkv, f, V = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads,
                           m.ffn_hidden_size, m.vocab_size)
    d = h // nh
    root = {"gpt2": ("transformer.", "wte.weight"), "llama": ("model.", "embed_tokens.weight")}[arch]
    prefix = root[0] if root[0] + root[1] in tensors else ""
    used = set()

    def get(name, shape, top=False):
        key = name if top else prefix + name
        if key not in tensors:
            raise ConvertError(f"model.safetensors: tensor {key} is missing (expected shape {list(shape)})")
        x = np.asarray(tensors[key], np.float32)
        if x.shape != tuple(shape):
            raise ConvertError(f"model.safetensors: {key} has shape {list(x.shape)}, config.json implies {list(shape)}")
        used.add(key)
        return x

    def stack(fn):
        return np.stack([fn(i) for i in range(L)])

    p = {"layers": {"attn": {}, "mlp": {}, "ln1": {}, "ln2": {}}}
    attn, mlp, lay = p["layers"]["attn"], p["layers"]["mlp"], p["layers"]
    if arch == "gpt2":
        p["wte"] = get("wte.weight", (V, h))
        p["wpe"] = get("wpe.weight", (m.max_length, h))
        qkv = stack(lambda i: get(f"h.{i}.attn.c_attn.weight", (h, 3 * h)))
        qkv_b = stack(lambda i: get(f"h.{i}.attn.c_attn.bias", (3 * h,)))
        for j, (w, b) in enumerate((("wq", "bq"), ("wk", "bk"), ("wv", "bv"))):
            attn[w] = qkv[:, :, j * h:(j + 1) * h].reshape(L, h, nh, d)
            attn[b] = qkv_b[:, j * h:(j + 1) * h].reshape(L, nh, d)
        attn["wo"] = stack(lambda i: get(f"h.{i}.attn.c_proj.weight", (h, h))).reshape(L, nh, d, h)
        attn["bo"] = stack(lambda i: get(f"h.{i}.attn.c_proj.bias", (h,)))
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            lay[ours]["scale"] = stack(lambda i: get(f"h.{i}.{theirs}.weight", (h,)))
            lay[ours]["bias"] = stack(lambda i: get(f"h.{i}.{theirs}.bias", (h,)))
        mlp["w1"] = stack(lambda i: get(f"h.{i}.mlp.c_fc.weight", (h, f)))
        mlp["b1"] = stack(lambda i: get(f"h.{i}.mlp.c_fc.bias", (f,)))
        mlp["w2"] = stack(lambda i: get(f"h.{i}.mlp.c_proj.weight", (f, h)))
        mlp["b2"] = stack(lambda i: get(f"h.{i}.mlp.c_proj.bias", (h,)))
        p["ln_f"] = {"scale": get("ln_f.weight", (h,)), "bias": get("ln_f.bias", (h,))}
        # GPT-2's causal-mask buffers, saved by old versions: not parameters.
        ignorable = re.compile(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias$")
    else:
        p["wte"] = get("embed_tokens.weight", (V, h))
        sa, ml = "self_attn.", "mlp."
        attn["wq"] = stack(lambda i: get(f"layers.{i}.{sa}q_proj.weight", (nh * d, h)).T).reshape(L, h, nh, d)
        attn["wk"] = stack(lambda i: get(f"layers.{i}.{sa}k_proj.weight", (nkv * d, h)).T).reshape(L, h, nkv, d)
        attn["wv"] = stack(lambda i: get(f"layers.{i}.{sa}v_proj.weight", (nkv * d, h)).T).reshape(L, h, nkv, d)
        attn["wo"] = stack(lambda i: get(f"layers.{i}.{sa}o_proj.weight", (h, nh * d)).T).reshape(L, nh, d, h)
        lay["ln1"]["scale"] = stack(lambda i: get(f"layers.{i}.input_layernorm.weight", (h,)))
        lay["ln2"]["scale"] = stack(lambda i: get(f"layers.{i}.post_attention_layernorm.weight", (h,)))
        mlp["wg"] = stack(lambda i: get(f"layers.{i}.{ml}gate_proj.weight", (f, h)).T)
        mlp["w1"] = stack(lambda i: get(f"layers.{i}.{ml}up_proj.weight", (f, h)).T)
        mlp["w2"] = stack(lambda i: get(f"layers.{i}.{ml}down_proj.weight", (h, f)).T)
        p["ln_f"] = {"scale": get("norm.weight", (h,))}
        ignorable = re.compile(r".*rotary_emb\.inv_freq$")
    if m.tie_embeddings:
        used.add("lm_head.weight")  # some checkpoints store the tied copy too; HF ignores it as well
    else:
        p["lm_head"] = get("lm_head.weight", (V, h), top=True).T
    left = sorted(k for k in tensors if k not in used and not ignorable.match(k))
    if left:
        raise ConvertError(f"model.safetensors: tensors jaxllm has no place for: {', '.join(left[:6])}"
                           + (f" and {len(left) - 6} more" if len(left) > 6 else ""))
    return jax.tree.map(np.ascontiguousarray, p)


def _coerce(old, text: str):
    """``text`` parsed as the type of the default ``old``."""
    if isinstance(old, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(old, int):
        return int(text)
    if isinstance(old, float):
        return float(text)
    return text


def apply_overrides(cfg, overrides: dict) -> None:
    """Sets ``{"SECTION.KEY": value}`` in ``cfg`` (string values are parsed as the key's type).

    Raises:
      ConvertError: an unknown key, or a model key that config.json determines.
    """
    for key, value in overrides.items():
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in cfg or parts[1] not in cfg[parts[0]]:
            raise ConvertError(f"--config.{key}: no such config key (SECTION.KEY, see jaxllm/config.py)", keys=(key,))
        section, name = parts
        if section == "model" and name not in FREE_MODEL_KEYS:
            raise ConvertError(f"--config.{key}: the Hugging Face config.json determines it; only "
                               f"{', '.join('model.' + k for k in FREE_MODEL_KEYS)} may be set", keys=(key,))
        old = cfg[section][name]
        try:
            cfg[section][name] = _coerce(old, value) if isinstance(value, str) else value
        except ValueError as e:
            raise ConvertError(f"--config.{key}={value}: {e}", keys=(key,)) from None


def from_hf(directory: str, overrides: dict | None = None):
    """A Hugging Face GPT-2 or Llama directory as a jaxllm config and parameters.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or its sharded index).
      overrides: ``{"SECTION.KEY": value}`` changes to jaxllm's defaults (values may be strings,
        parsed as the key's type); model keys other than :data:`FREE_MODEL_KEYS` come from
        config.json and cannot be set.
    Returns:
      ``(cfg, params)``: a resolved, validated full config (``model.vocab_size`` = HF's
      ``vocab_size``, ``train.seq_length`` = ``n_positions`` / ``max_position_embeddings``, other
      sections jaxllm's defaults), and float32 numpy parameters shaped as
      :func:`jaxllm.model.abstract` gives them (see :func:`to_hf` for the layouts).
    Raises:
      ConvertError: missing or pickle-only files, an unsupported config.json (the message
        names the key), tensors missing or of the wrong shape, or bad overrides.
      ConfigError: the resulting jaxllm config is invalid (e.g. a bad ``--config.data.input``).
    """
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{directory} has no config.json: not a Hugging Face model directory")
    hf = _read_json(path)
    arch, model_keys, seq_length = _model_from_hf(hf)
    cfg = config.get_config()
    cfg.model.update(model_keys)
    cfg.train.seq_length = int(seq_length)
    apply_overrides(cfg, dict(overrides or {}))
    if arch == "gpt2" and cfg.train.seq_length != seq_length:
        raise ConvertError(f"train.seq_length={cfg.train.seq_length}: GPT-2's learned position table has "
                           f"n_positions={seq_length} rows, so it must be {seq_length}", keys=("train.seq_length",))
    if cfg.train.seq_length > seq_length:
        raise ConvertError(f"train.seq_length={cfg.train.seq_length} exceeds max_position_embeddings={seq_length} "
                           f"of config.json", keys=("train.seq_length",))
    config.validate(cfg)
    cfg = config.resolved(cfg)
    tensors = read_safetensors(directory)
    params = _params_from_hf(arch, model.model_config(cfg), tensors)
    _check_param_shapes(cfg, params, directory)
    return cfg, params


def _find_gpt2_tokenizer(directory: str, dest: str) -> bool:
    """Copies GPT-2's tokenizer from a Hugging Face directory into ``dest`` as ``encoder.json`` +
    ``vocab.bpe`` (jaxllm's gpt2 tokenizer files); False, with nothing left, if it is not GPT-2's."""
    from jaxllm.data.tokenizers import DataError, GPT2Tokenizer

    vocab, merges = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    tok_json = os.path.join(directory, "tokenizer.json")
    os.makedirs(dest, exist_ok=True)
    try:
        if os.path.isfile(vocab) and os.path.isfile(merges):
            shutil.copyfile(vocab, os.path.join(dest, "encoder.json"))
            shutil.copyfile(merges, os.path.join(dest, "vocab.bpe"))
        elif os.path.isfile(tok_json):
            bpe = _read_json(tok_json).get("model") or {}
            if bpe.get("type") != "BPE" or not isinstance(bpe.get("vocab"), dict):
                raise DataError("not a BPE tokenizer")
            with open(os.path.join(dest, "encoder.json"), "w") as fp:
                json.dump(bpe["vocab"], fp, ensure_ascii=False)
            with open(os.path.join(dest, "vocab.bpe"), "w", encoding="utf-8") as fp:
                fp.write("#version: 0.2\n")
                for pair in bpe.get("merges", []):
                    fp.write((pair if isinstance(pair, str) else " ".join(pair)) + "\n")
        else:
            raise DataError("no tokenizer files")
        GPT2Tokenizer(dest)
        return True
    except (DataError, OSError, ValueError):
        shutil.rmtree(dest, ignore_errors=True)
        return False


def _config_file_text(cfg, directory: str) -> str:
    return (f'"""The jaxllm config of the Hugging Face model imported from {os.path.abspath(directory)}\n'
            f'by jaxllm.convert. Train on with:\n'
            f'    python -m jaxllm.train --config={{this file}} --workdir={{its directory}}\n'
            f'(--config.SECTION.KEY=VALUE flags still apply; leave the model section as it is)."""\n\n'
            f"import ml_collections\n\nCONFIG = {cfg.to_dict()!r}\n\n\n"
            f"def get_config():\n    return ml_collections.ConfigDict(CONFIG)\n")


def import_to_workdir(directory: str, workdir: str, overrides: dict | None = None):
    """``--from-hf``: a step-0 training checkpoint of the Hugging Face model in ``directory``,
    written to ``workdir`` (which must hold no checkpoint), plus ``workdir/config.py``.

    The state is :func:`jaxllm.step.init_state`'s (``step`` 0, fresh counters) with the
    parameters from HF and ``opt_state`` freshly initialized for them, saved with :class:`jaxllm.checkpoint.Checkpointer` as training saves it.  Unless
    ``overrides`` set ``data.tokenizer`` or ``data.gpt2_dir``, GPT-2's tokenizer found in
    ``directory`` is copied to ``workdir/tokenizer`` and used (``data.tokenizer=gpt2``).

    Returns the resolved config. Raises what :func:`from_hf` raises, and ConvertError when
    ``workdir`` already has checkpoints.
    """
    from jaxllm import checkpoint, optim, step

    overrides = dict(overrides or {})
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise ConvertError(f"{ckpt_dir} already holds checkpoints: import into a new workdir")
    if "data.tokenizer" not in overrides and "data.gpt2_dir" not in overrides:
        hf_path = os.path.join(directory, "config.json")
        vocab = _read_json(hf_path).get("vocab_size", 0) if os.path.isfile(hf_path) else 0
        tok_dir = os.path.abspath(os.path.join(workdir, "tokenizer"))
        if vocab >= 50257 and _find_gpt2_tokenizer(directory, tok_dir):
            overrides.update({"data.tokenizer": "gpt2", "data.gpt2_dir": tok_dir})
    try:
        cfg, params = from_hf(directory, overrides)
    except Exception:
        if overrides.get("data.gpt2_dir") == os.path.abspath(os.path.join(workdir, "tokenizer")):
            shutil.rmtree(overrides["data.gpt2_dir"], ignore_errors=True)
        raise
    optimizer = optim.make_optimizer(cfg)

    def initial_state(params):
        # A fresh training state (every entry as training starts it) holding HF's parameters;
        # the random parameters it would draw are dead code under jit and never computed.
        state = step.init_state(cfg, optimizer, cfg.train.seed)
        state.update(params=params, opt_state=optimizer.init(params))
        return state

    with jax.default_device(jax.devices("cpu")[0]):  # host memory, whatever accelerator is present
        state = jax.jit(initial_state)(params)
    os.makedirs(workdir, exist_ok=True)
    ckpt = checkpoint.Checkpointer(workdir, cfg)
    ckpt.maybe_save(0, state, force=True)
    ckpt.close()
    with open(os.path.join(workdir, "config.py"), "w") as fp:
        fp.write(_config_file_text(cfg, directory))
    return cfg


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
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
            p.error(f"unrecognized argument {item!r}" + ("" if args.to_hf is None else " (--to-hf takes no "
                                                                                         "--config options)"))
        overrides[m.group(1)] = m.group(2)
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # Orbax logs every file at INFO
    from jaxllm.data.tokenizers import DataError

    try:
        if args.to_hf:
            workdir, out = args.to_hf
            hf = export_workdir(workdir, out, args.step)
            print(f"wrote {hf['architectures'][0]} ({hf['vocab_size']} vocab) to {out}")
        else:
            directory, workdir = args.from_hf
            cfg = import_to_workdir(directory, workdir, overrides)
            if not any(k.startswith("data.") for k in overrides) and cfg.data.tokenizer != "gpt2":
                print(f"note: {directory} holds no GPT-2 tokenizer for this model, so the config keeps jaxllm's "
                      f"default data section (data.tokenizer={cfg.data.tokenizer}, data.input={cfg.data.input}); "
                      f"the data must be tokenized as the model expects: import again with --config.data.* "
                      f"or edit {os.path.join(workdir, 'config.py')}", file=sys.stderr)
            kind = "GPT-2" if cfg.model.position_embedding == "learned" else "Llama"
            print(f"imported {kind} from {directory} into {workdir} (step 0, data.tokenizer={cfg.data.tokenizer})\n"
                  f"train on:  python -m jaxllm.train --config={os.path.join(workdir, 'config.py')} "
                  f"--workdir={workdir}\nsample:    python -m jaxllm.generate --workdir={workdir}")
    except config.ConfigError as e:  # already reads "config error: KEY=VALUE: fix"
        print(e, file=sys.stderr)
        return 2
    except (ConvertError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
