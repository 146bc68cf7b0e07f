"""The types a model family is written in: :class:`Family` (what one family module declares), :class:`Arch` (one
Hugging Face architecture as a table that :mod:`jaxllm.formats.hf` reads both ways) and its :class:`Tensor` rows,
and :class:`RopeType` (a rotary scaling of Hugging Face's ``rope_parameters`` as model keys)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxllm import config
from jaxllm.errors import ConvertError


class Tensor(NamedTuple):
    """A row of an architecture's table: one Hugging Face tensor and the jaxllm parameters it holds.

    ``name``: HF's; with ``{i}``, one tensor per layer ``i``, holding that layer's slice of our
    ``[layers, ...]`` parameters; with ``{e}`` too, one per layer and expert ``e``, holding the slice
    ``[i, e]`` of our ``[layers, experts, ...]`` parameters (``w1 [L, E, h, f]`` -> ``experts.{e}.w3
    [f, h]``).  ``params``: our parameter paths, several concatenated along
    HF's output axis (``c_attn = [wq | wk | wv]``).  ``fan_in``: the leading axes of a
    (per-layer) parameter that form the input axis, the rest the output axis (``wq [h, heads, d]``,
    1: ``[h, heads*d]``; ``wo [heads, d, h]``, 2: ``[heads*d, h]``); 0: a vector, flattened.
    ``linear``: stored ``[out, in]`` (torch ``Linear``), else ``[in, out]`` (``Conv1D``, embeddings);
    :data:`WHOLE` (``fan_in``): one parameter's slice as it is, every axis (gpt-oss's ``[experts, in, out]`` experts).
    ``moe``: for a per-layer row, the layers it is in by their kind (:class:`jaxllm.model.groups.LayerKind`): True,
    the mixtures of experts; False, the dense layers; None, every layer.  A model whose layers are of several
    kinds holds them in layer groups (:func:`jaxllm.model.gpt.layer_groups`): ``layers/...`` is then each group's
    ``layers_0/...``, ``layers_1/...``, layer ``i`` that group's slice ``i - group.first``.
    """

    name: str
    params: tuple[str, ...]
    fan_in: int = 1
    linear: bool = False
    moe: bool | None = None


VEC = 0  # fan_in of a vector
WHOLE = -1  # fan_in of a tensor held as our (per-layer) parameter is, axes and all


# The model keys of features that a table holds only at these values unless its ``needs`` name them (or its
# ``free`` lists them): a model using one of them fits no table that does not say so
PLAIN = {"norm_placement": "pre", "rope_type": "rope", "apply_layernorm_1p": False, "scale_embeddings": False,
         "softmax_scale": 0.0, "window_attn_skip_freq": "", "local_rotary_base": 0.0,
         "rotary_seq_len_interpolation_factor": 1.0, "softmax_type": "vanilla", "glu_linear_offset": 0.0,
         "activation_func_clamp_value": 0.0, "moe_router_bias": False}


class Condition(str):
    """A requirement other than a value (``> 0``), printed as it is."""

    def __repr__(self):
        return str(self)


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
    by keys) -> more model keys``, those that are no one config.json value (None: no more); ``misfits``: what
    keeps a model section from the table beyond ``needs``, as ``{"model.KEY": what it needs}`` (a value or a
    :class:`Condition`); ``likely``: whether a model that fits no table is most probably meant as this one
    (its hallmark: the error names the likely table first among equally close ones; the registry's later
    tables are asked first); ``free``: keys of :data:`PLAIN` the table holds at any value (every other key of
    :data:`PLAIN` joins ``needs`` at its plain value); ``mtp``: the rows of a multi-token prediction module's own
    tensors (``model.mtp_num_layers``: ``{m}`` the module's layer number in the checkpoint, ``num_layers + depth``;
    parameters ``mtp/...``, or a copy of one of no module such as ``wte``), whose layer the engine reads by the
    table's rows of the last layer's kind (empty: the table holds none, so a model with them fits it not);
    ``padding_idx``: transformers builds the embedding with ``padding_idx=config.pad_token_id`` (torch's
    ``nn.Embedding``: that row zero at initialization, and no gradient to it from the lookup), which jaxllm holds as
    ``model.pad_token_id``: import reads config.json's ``pad_token_id`` (a negative one counted from the end, as
    torch counts it), export writes it; False: the table holds only ``model.pad_token_id=-1`` (GPT-2's)."""

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
    misfits: Callable[[config.Model], dict[str, Any]] = lambda m: {}
    likely: Callable[[config.Model], bool] = lambda m: False
    free: tuple[str, ...] = ()
    mtp: tuple[Tensor, ...] = ()
    padding_idx: bool = False

    def __post_init__(self):  # the plain features' values join the needs the table states (see PLAIN)
        plain = {k: v for k, v in PLAIN.items() if k not in self.free and k not in self.needs}
        if not self.padding_idx:
            plain["pad_token_id"] = -1
        object.__setattr__(self, "needs", {**self.needs, **plain})
        read = {ours for ours, _ in self.keys.values()} & set(self.needs)
        assert not read, f"{self.model_type}: model keys both read from config.json and fixed: {sorted(read)}"


class RopeType(NamedTuple):
    """A rope type of Hugging Face's ``rope_parameters`` (``rope_scaling`` in transformers 4) other than
    ``default``: ``what`` names it in messages; ``read(rope, refuse)`` gives its model keys from the dict
    (``refuse(key, value, need)`` raises for what jaxllm cannot hold); ``applies(m)`` says whether a model
    section uses it, and ``write(m)`` gives its entries for an export's config.json."""

    what: str
    read: Callable[[dict, Callable], dict]
    applies: Callable[[config.Model], bool]
    write: Callable[[config.Model], dict]


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: what the shared model (:mod:`jaxllm.model`) and rules table need to hold it, in one place.

    Attributes:
      name: the module's name (``llama``).
      preset: the model keys of its layer's features (``position_embedding``, ``norm``, ``activation``...), what
        configs and tests start from instead of typing the flags.
      architectures: its Hugging Face tables, in the order the export tries them.
      rope_types: the rope types (``rope_parameters.rope_type``) its checkpoints introduce, by name.
      megatron_args: Megatron-LM arguments of its features that jaxllm holds only at some values on import
        (argument -> (the values, why)); the Megatron format reads them (:mod:`jaxllm.formats.megatron`).
      megatron_keys: model keys of its features a Megatron checkpoint is written only at one value (key ->
        the value); exporting another is refused.
      sizes: its published (and ALCF's) shapes: config key (``configs/llama.py:Llama-3-8B``) -> model keys.
    """

    name: str
    preset: dict[str, Any]
    architectures: tuple[Arch, ...] = ()
    rope_types: dict[str, RopeType] = dataclasses.field(default_factory=dict)
    megatron_args: dict[str, tuple[tuple, str]] = dataclasses.field(default_factory=dict)
    megatron_keys: dict[str, Any] = dataclasses.field(default_factory=dict)
    sizes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def hf_tables(self) -> dict[str, Arch]:
        """Its Hugging Face tables by ``model_type``."""
        return {a.model_type: a for a in self.architectures}


def refuse(key: str, value, need: str):
    """Raises ConvertError: config.json's ``key`` holds ``value``, which jaxllm cannot hold; it needs ``need``."""
    raise ConvertError(f"config.json: {key}={value!r} is not supported: jaxllm needs {need}", keys=(key,))
