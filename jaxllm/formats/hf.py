"""The Hugging Face format's engine: a model family's architecture tables (:class:`~jaxllm.families.tables.Arch`,
registered in :mod:`jaxllm.families.registry`) read both ways, so import and export are inverses by construction.

Each architecture is one table: the model keys it fixes, config.json keys <-> model keys, the config.json values
supported, and its :class:`~jaxllm.families.tables.Tensor` rows (HF name, our parameters, layout).  Export:
:func:`hf_architecture` (the table that holds a model section exactly; any other model is a ConvertError naming
the keys that do not fit), :func:`to_hf` (config.json dict + tensors).  Import: :func:`model_from_hf`
(config.json -> model keys, with the families' rope types), :func:`read_safetensors`, :func:`params_from_hf`.
The tables keep the ``model.vocab_size`` real rows (config.json's ``vocab_size``): jaxllm masks the logits of its
padding rows, so without them HF's logits and softmax are exactly jaxllm's.  config.json's ``pad_token_id`` is
``model.pad_token_id`` for the tables whose embedding transformers builds with it as ``padding_idx``
(``Arch.padding_idx``: that row gets no gradient from the lookup, in both).  Only JSON and safetensors are read:
pickle-based weights are refused unread.  Files, workdirs and tokenizers are :mod:`jaxllm.formats.hf_workdir`'s.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import numpy as np

from jaxllm import config
from jaxllm.errors import ConvertError, reading
from jaxllm.families.registry import ARCHITECTURES, ROPE_TYPES
from jaxllm.families.tables import WHOLE, Arch, Tensor, refuse
from jaxllm.model import gpt
from jaxllm.model.params import by_path, unpadded_shapes

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Formats that need pickle (or another framework) to read: never loaded here.
UNSAFE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth",
                  "tf_model.h5", "flax_model.msgpack", "model.ckpt.index")


def _rows(arch: Arch, m: config.Model) -> tuple[Tensor, ...]:
    """The rows of ``arch`` for the model ``m``: its table, and with ``m.mtp_num_layers`` its multi-token prediction
    modules' (``arch.mtp``: ``{m}``, a module's layer number in the checkpoint, ``num_layers + depth``), their
    layer's the table's rows of the last layer's kind (``layers/`` read as ``mtp/block/``)."""
    if not m.mtp_num_layers:
        return arch.tensors
    moe = gpt.layer_kinds(m)[-1].moe
    block = tuple(Tensor(t.name.replace("{i}", "{m}"), tuple("mtp/block/" + p.removeprefix("layers/")
                                                             for p in t.params), t.fan_in, t.linear, t.moe)
                  for t in arch.tensors if "{i}" in t.name and t.moe in (None, moe))
    return (*arch.tensors, *arch.mtp, *block)


def _placements(t: Tensor, m: config.Model) -> list[tuple[tuple[str, ...], list[tuple]]]:
    """Where the HF tensors of row ``t`` come from: for each layer group the row is in (one entry for a
    row of no layer), the paths of its parameters there and, layer-major, each tensor's ``(layer, index
    along the group's stacked layers, expert)`` (None: no such axis); for a multi-token prediction module's row
    (``{m}``) each module's ``(its layer number, its index along mtp_layers, expert)``, the index None for a copy
    of a parameter of no module (the shared embedding and output layer some checkpoints hold in each)."""
    experts = range(m.num_experts) if "{e}" in t.name else [None]
    if "{m}" in t.name:
        stacked = t.params[0].startswith("mtp/")
        return [(t.params, [(m.num_layers + k, k if stacked else None, e) for k in range(m.mtp_num_layers)
                            for e in experts])]
    if "{i}" not in t.name:
        return [(t.params, [(None, None, e) for e in experts])]
    return [(tuple(g.name + p.removeprefix("layers") for p in t.params),
             [(g.first + j, j, e) for j in range(g.num_layers) for e in experts])
            for g in gpt.layer_groups(m) if t.moe is None or t.moe == g.kind.moe]


def _slice(a: np.ndarray, i: int | None, e: int | None) -> np.ndarray:
    """Layer ``i``'s, then expert ``e``'s slice of ``a`` (None: the whole axis is the tensor's)."""
    a = a if i is None else a[i]
    return a if e is None else a[e]


def _to_hf_layout(t: Tensor, arrays: list[np.ndarray]) -> np.ndarray:
    """HF's tensor of row ``t`` from one layer's slices of its parameters."""
    if t.fan_in == WHOLE:
        return arrays[0]
    flat = [a.reshape((math.prod(a.shape[:t.fan_in]), -1) if t.fan_in else -1) for a in arrays]
    x = np.concatenate(flat, axis=-1)
    return x.T if t.linear else x


def _from_hf_layout(t: Tensor, x: np.ndarray, shapes: list[tuple]) -> list[np.ndarray]:
    """The inverse of :func:`_to_hf_layout`: one layer's slices, shaped ``shapes``, from HF's tensor."""
    if t.fan_in == WHOLE:
        return [x]
    x = x.T if t.linear else x
    sizes = [math.prod(s[t.fan_in:]) for s in shapes]
    return [part.reshape(s) for part, s in zip(np.split(x, np.cumsum(sizes)[:-1], axis=-1), shapes, strict=True)]


def _hf_shape(t: Tensor, shapes: list[tuple]) -> tuple[int, ...]:
    """The shape :func:`_to_hf_layout` gives for parameters of (per-layer) ``shapes``."""
    if t.fan_in == WHOLE:
        return tuple(shapes[0])
    out = sum(math.prod(s[t.fan_in:]) for s in shapes)
    if not t.fan_in:
        return (out,)
    inp = math.prod(shapes[0][:t.fan_in])
    return (out, inp) if t.linear else (inp, out)


# --------------------------------------------------------------------------- jaxllm -> HF


def hf_architecture(m: config.Model) -> Arch:
    """The Hugging Face architecture of :data:`~jaxllm.families.registry.ARCHITECTURES` that holds the (resolved)
    model section ``m`` exactly.

    Raises:
      ConvertError: the model fits none; ``keys`` are the keys that do not fit the closest
        architecture (the message lists the two closest).
    """
    misfits = {}
    for arch in ARCHITECTURES.values():
        bad = {f"model.{k}": v for k, v in arch.needs.items() if getattr(m, k) != v}
        bad.update(arch.misfits(m))
        if m.mtp_num_layers and not arch.mtp:  # a table without multi-token prediction modules would leave them out
            bad["model.mtp_num_layers"] = 0
        if not bad:
            return arch
        misfits[arch.model_type] = bad
    likely = next(a for a in reversed(ARCHITECTURES) if ARCHITECTURES[a].likely(m))
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
      name, laid out by the architecture's table (its rows' ``fan_in`` and ``linear``: a ``Conv1D``'s ``[in, out]``,
      a ``Linear``'s ``[out, in]``; several parameters concatenated along the output axis; one tensor per layer,
      and per layer and expert for ``{e}`` rows; each layer group's rows for its kind of layer:
      :func:`jaxllm.model.gpt.layer_groups`), then as the checkpoint holds them (the table's ``saves``), with
      ``m.vocab_size`` rows (see the module doc).  The families' modules (:mod:`jaxllm.families`) document each
      table's names and layouts.
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
    for t in _rows(arch, m):
        for paths, where in _placements(t, m):
            if paths[0] not in flat:  # lm_head of a tied model
                continue
            arrays = [flat[p] for p in paths]
            for i, j, e in where:
                tensors[t.name.format(i=i, m=i, e=e)] = _to_hf_layout(t, [_slice(a, j, e) for a in arrays])
    if arch.saves is not None:
        tensors = arch.saves(tensors, m)
    hf = {"architectures": [arch.hf_class], "model_type": arch.model_type,
          **{key: allowed[0] for key, allowed in arch.supports.items()},
          **{key: getattr(m, ours) for key, (ours, _) in arch.keys.items()}, **arch.extra(m),
          "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
          "bos_token_id": None, "eos_token_id": None,
          "pad_token_id": m.pad_token_id if m.pad_token_id >= 0 else None}
    return hf, {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


# --------------------------------------------------------------------------- HF -> jaxllm


def tensor_names(directory: str) -> list[str]:
    """The names of the tensors :func:`read_safetensors` reads (from the files' headers only). Raises as it."""
    from safetensors import safe_open

    names = []
    for path in _safetensors_files(directory):
        with reading(path, "safetensors weights", ConvertError), safe_open(path, framework="numpy") as f:
            names += list(f.keys())
    return names


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of ``directory``'s ``model.safetensors`` (or of the shards its
    ``model.safetensors.index.json`` names), as float32 numpy arrays.

    Raises:
      ConvertError: no safetensors weights (pickle-based ones are refused, never read).
    """
    from safetensors import safe_open

    tensors = {}
    with jax.default_device(jax.devices("cpu")[0]):
        for path in _safetensors_files(directory):
            with reading(path, "safetensors weights", ConvertError), safe_open(path, framework="flax") as f:
                for k in f.keys():  # noqa: SIM118  (a safe_open is not a dict); through jax: numpy has no bfloat16
                    tensors[k] = np.asarray(f.get_tensor(k), np.float32)
    return tensors


def _safetensors_files(directory: str) -> list[str]:
    """The safetensors files of ``directory``: ``model.safetensors`` or the shards of its index. Raises ConvertError
    (pickle-based weights are named and refused, never read)."""
    single, index = os.path.join(directory, SAFETENSORS), os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with reading(index, "a safetensors index (JSON with a weight_map of file names)", ConvertError), \
                open(index, encoding="utf-8") as fp:
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
    return files


def model_from_hf(hf: dict, names=None) -> tuple[Arch, dict]:
    """The architecture and jaxllm's model keys of a config.json dict. ``names``: None, or a function giving the
    checkpoint's tensor names, asked only of a table with multi-token prediction modules (``Arch.mtp``) when
    config.json names some: the modules the checkpoint holds (transformers saves none). Raises ConvertError."""
    arch = ARCHITECTURES.get(hf.get("model_type"))
    if arch is None:
        known = ", ".join(f"{a.model_type!r} ({a.hf_class})" for a in ARCHITECTURES.values())
        raise ConvertError(f"config.json: model_type={hf.get('model_type')!r} is not supported: jaxllm converts "
                           f"{known}", keys=("model_type",))

    hf = {**{ours: hf[theirs] for theirs, ours in arch.aliases.items() if theirs in hf}, **hf}

    for key, allowed in arch.supports.items():
        if hf.get(key, allowed[0]) not in allowed:
            refuse(key, hf[key], " or ".join(map(repr, allowed)))
    keys = {}
    for key, (ours, default) in arch.keys.items():
        value = hf.get(key, default)
        keys[ours] = 0 if value is None else config.key_type(f"model.{ours}")(value)  # 0: derived, as HF does
    if arch.needs["position_embedding"] == "rotary":
        rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}  # transformers 5, 4
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" and rope_type not in ROPE_TYPES:
            known = " or ".join(["'default'", *(f"{k!r} ({t.what})" for k, t in ROPE_TYPES.items())])
            refuse("rope_scaling" if hf.get("rope_scaling") else "rope_parameters.rope_type",
                        hf.get("rope_scaling") or rope_type, f"rope type {known}")
        if rope_type != "default":
            scaling = ROPE_TYPES[rope_type].read(rope, refuse)
            clash = {k: v for k, v in scaling.items() if arch.needs.get(k, v) != v}
            if clash:  # a rope type (or its values) the table does not hold
                refuse("rope_scaling" if hf.get("rope_scaling") else "rope_parameters.rope_type",
                            hf.get("rope_scaling") or rope_type, f"another rope type with {arch.hf_class} (jaxllm "
                            "holds it with " + ", ".join(f"model.{k}={arch.needs[k]!r}" for k in clash) + ")")
            keys.update(scaling)
        derived = keys["hidden_size"] // keys["num_attention_heads"]  # as transformers derives it (0: so does jaxllm)
        keys["kv_channels"] = 0 if hf.get("head_dim") in (None, derived) else config.key_type("model.kv_channels")(
            hf["head_dim"])
        keys["rotary_base"] = float(rope.get("rope_theta", keys["rotary_base"]))
    if arch.padding_idx:
        keys["pad_token_id"] = _padding_row(hf.get("pad_token_id"), keys["vocab_size"])
    if arch.derive is not None:
        keys.update(arch.derive(hf, keys))
    if keys.get("mtp_num_layers") and names is not None:
        keys["mtp_num_layers"] = _mtp_held(arch, keys, set(names()), keys["mtp_num_layers"])
    return arch, {**keys, **arch.needs}


def _padding_row(pad, vocab: int) -> int:
    """``model.pad_token_id`` of config.json's ``pad_token_id`` (the embedding's ``padding_idx``): -1 for none, a
    negative one counted from the end as torch's ``nn.Embedding`` counts it. Raises ConvertError: no row of the
    ``vocab``, which transformers cannot build either."""
    if pad is None:
        return -1
    if isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab:
        refuse("pad_token_id", pad, f"a token id of the vocab_size={vocab} rows (or null: none)")
    return pad % vocab


def _mtp_held(arch: Arch, keys: dict, names: set[str], most: int) -> int:
    """How many multi-token prediction modules (at most ``most``) the checkpoint of tensor ``names`` holds: those
    whose first row of ``arch.mtp`` is there (under the prefix or bare)."""
    first = arch.mtp[0].name
    for k in range(most):
        name = first.format(m=keys["num_layers"] + k)
        if name not in names and name.removeprefix(arch.prefix) not in names:
            return k
    return most


def params_from_hf(arch: Arch, m: config.Model, tensors: dict[str, np.ndarray]) -> dict:
    """jaxllm's nested float32 parameters (``gpt.describe(m).params``) from HF's tensors, by
    ``arch``'s table read backwards (the layouts are :func:`to_hf`'s, after the table's ``layouts`` turned the
    checkpoint's other layouts of the same parameters into the table's, e.g. fused experts); with
    ``m.mtp_num_layers`` the multi-token prediction modules initialized as :func:`jaxllm.model.gpt.init` (seed 0)
    initializes them. Raises ConvertError."""
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

    held = bool(arch.mtp) and _mtp_held(arch, {"num_layers": m.num_layers}, set(tensors), 1) == 1
    for t in _rows(arch, m) if held else arch.tensors:
        for paths, where in _placements(t, m):
            if paths[0] not in shapes:  # the tied copy of the head some checkpoints store: HF ignores it too
                used.update(t.name.format(i=i, m=i, e=e) for i, _, e in where)
                continue
            _read_row(t, paths, where, shapes, get, out)
    if m.mtp_num_layers and not held:  # the checkpoint holds no multi-token prediction modules: fresh ones
        out.update(by_path({"mtp": jax.tree.map(np.asarray, jax.jit(lambda: gpt.init(m, 0)["mtp"])())}))
    left = sorted(k for k in tensors if k not in used and not re.fullmatch(arch.buffers, k))
    if left:
        raise ConvertError(f"model.safetensors: tensors jaxllm has no place for: {', '.join(left[:6])}"
                           + (f" and {len(left) - 6} more" if len(left) > 6 else ""))
    padded = {k: v.shape for k, v in by_path(spec.params).items()}  # the padding rows are zeros
    leaves = [np.pad(out[k], [(0, p - n) for n, p in zip(out[k].shape, padded[k], strict=True)]) for k in shapes]
    return jax.tree_util.tree_unflatten(jax.tree.structure(spec.params), leaves)


def _read_row(t: Tensor, paths: tuple[str, ...], where: list[tuple], shapes: dict, get, out: dict) -> None:
    """The parameters ``paths`` of row ``t`` (:func:`_placements`' ``where``) into ``out``, HF's tensors by ``get(name,
    shape)``; a parameter another row or tensor already gave (a checkpoint's copies of the embedding) must be equal."""
    # the leading [layers or modules[, experts]] axes HF splits into tensors
    lead = ("{i}" in t.name) + ("{m}" in t.name and t.params[0].startswith("mtp/")) + ("{e}" in t.name)
    each = [shapes[p][lead:] for p in paths]
    slices = [_from_hf_layout(t, get(t.name.format(i=i, m=i, e=e), _hf_shape(t, each)), each) for i, _, e in where]
    for k, p in enumerate(paths):
        values = [np.stack([s[k] for s in slices]).reshape(shapes[p])] if lead else [s[k] for s in slices]
        for x in values:
            if p in out and not np.array_equal(out[p], x):
                raise ConvertError(f"model.safetensors: {t.name.format(i='N', m='N', e='E')} holds other values "
                                   f"than the parameter {p} it copies")
            out[p] = x
