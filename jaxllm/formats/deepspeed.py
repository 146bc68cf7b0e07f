"""Megatron-DeepSpeed's checkpoints (DeepSpeed's ``engine.save_checkpoint``) read whole on one host, with torch
alone: DeepSpeed need not be installed.

Native layout (DeepSpeed 0.19, as Megatron-DeepSpeed's ``megatron/checkpointing.py`` saves through it):
``DIR/latest`` names the tag, ``DIR/global_stepN/`` holds ``mp_rank_XX_model_states.pt`` (one per model-parallel
rank; under ZeRO-3 ``zero_pp_rank_R_mp_rank_XX_model_states.pt``, one per data-parallel rank): the module, the
optimizer's ``param_shapes`` (per parameter group, in the order of its flat buffer), ``lr_scheduler`` (Megatron's
``OptimizerParamScheduler`` state), and Megatron's ``args``, ``iteration``; and ``[bf16_]zero_pp_rank_R_mp_rank_XX
_optim_states.pt``, each data-parallel rank's partition of the float32 master weights and Adam's moments.
The partitions are joined as DeepSpeed's ``deepspeed/utils/zero_to_fp32.py`` does (``_zero2_merge_trainable_params``,
``_zero3_merge_trainable_params``): ZeRO-1/2 (and ``BF16_Optimizer``) split each group's flat buffer into equal
parts, the parameters in ``param_shapes`` order with ``param_alignment_paddings`` between them; ZeRO-3 splits each
parameter on its own, ``ceil(numel / ranks)`` per rank.

Universal layout (``python -m deepspeed.checkpoint.ds_to_universal``): ``DIR/latest_universal`` names the tag,
whose ``zero/<parameter>/{fp32,exp_avg,exp_avg_sq[,step]}.pt`` hold each parameter whole (``{"param": tensor}``
from ZeRO-1/2, a flat tensor from ZeRO-3); vocabulary tensors without their padding rows, which are put back as
zeros, as DeepSpeed's ``universal_checkpoint.load_hp_checkpoint_state`` does.

Safe loading: every file through torch's weights-only unpickler, with Megatron's ``argparse.Namespace``, NumPy's
array reconstruction (the saved random state) and inert stand-ins for the DeepSpeed and Megatron classes these files
name (:data:`_STAND_INS`: enums, a fragment address, loss scalers); anything else is refused in one line naming the
file.
"""

from __future__ import annotations

import argparse
import enum
import math
import os
import re

import numpy as np

from jaxllm.errors import ConvertError
from jaxllm.formats import torch_dist

LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"
TAG = re.compile(r"global_step\d+(_universal)?")  # DeepSpeed's default tags, and ds_to_universal's convention
KINDS = ("fp32", "exp_avg", "exp_avg_sq")  # what is read of each parameter: its float32 master, Adam's moments


class _ZeroStage(enum.IntEnum):
    """Stands for ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _ModelType(enum.Enum):
    """Stands for ``megatron.core.enums.ModelType`` (Megatron's ``args.model_type``)."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


class _Attributes:
    """Stands for a class whose instances are saved as their attributes and are not used here: DeepSpeed's
    fragment address (``numel``, ``start``), loss scalers, curriculum scheduler (Megatron's
    ``args.curriculum_scheduler``)."""


_STAND_INS = [(_Attributes, "deepspeed.utils.tensor_fragment.fragment_address"),
              (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
              (_ModelType, "megatron.core.enums.ModelType"),
              (_Attributes, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
              (_Attributes, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
              (_Attributes, "deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler")]


def _allowed() -> list:
    """What the weights-only unpickler lets through: Megatron's arguments, NumPy's random state, the stand-ins."""
    multiarray = getattr(np, "_core", np.core).multiarray
    numpy_path = multiarray.__name__
    return [argparse.Namespace, (multiarray._reconstruct, f"{numpy_path}._reconstruct"), np.ndarray, np.dtype,
            *{type(np.dtype(t)) for t in ("uint32", "int64", "float64", "uint8")}, *_STAND_INS]


def _load(file: str):
    if not os.path.isfile(file):
        raise ConvertError(f"{file} is missing: the checkpoint is incomplete")
    return torch_dist.load_safely(file, _allowed())


def is_deepspeed(directory: str) -> bool:
    """Whether ``directory`` is a DeepSpeed checkpoint directory or one of its tags."""
    names = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    return bool(names & {LATEST, LATEST_UNIVERSAL, "zero", "mp_rank_00_model_states.pt",
                         "zero_pp_rank_0_mp_rank_00_model_states.pt"}
                or any(TAG.fullmatch(n) for n in names))


def tag_dir(directory: str, iteration: int | None) -> str:
    """The tag directory to read: ``directory`` itself when it is one; else ``global_step{iteration}`` (or its
    ``_universal`` conversion), or the tag ``latest`` (else ``latest_universal``) names.  Raises ConvertError."""
    names = os.listdir(directory)
    if "zero" in names or any(n.endswith("model_states.pt") for n in names):
        return directory
    tags = sorted(n for n in names if TAG.fullmatch(n))
    if iteration is not None:
        found = [t for t in (f"global_step{iteration}", f"global_step{iteration}_universal") if t in names]
        if not found:
            raise ConvertError(f"{directory} holds no global_step{iteration}; it holds {tags or 'none'}")
        return os.path.join(directory, found[0])
    tracker = next((os.path.join(directory, n) for n in (LATEST, LATEST_UNIVERSAL) if n in names), None)
    if tracker is None:
        raise ConvertError(f"{directory} has no {LATEST} or {LATEST_UNIVERSAL} file"
                           + (f" (it holds {tags}: pass --iteration)" if tags else ": not a DeepSpeed checkpoint"))
    tag = open(tracker).read().strip()
    if not os.path.isdir(os.path.join(directory, tag)):
        raise ConvertError(f"{tracker} names {tag!r}, which {directory} does not hold")
    return os.path.join(directory, tag)


def _rank(file: str) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(file)).group(1))


def model_states(path: str) -> list[dict]:
    """The model-state files of a tag, one per model-parallel rank (its first data-parallel rank's under
    ZeRO-3).  Raises ConvertError."""
    names = os.listdir(path)
    ranks = sorted({int(m.group(1)) for n in names if (m := re.fullmatch(r"(?:zero_pp_rank_0_)?mp_rank_(\d+)"
                                                                      r"_model_states\.pt", n))})
    if ranks != list(range(len(ranks))) or not ranks:
        raise ConvertError(f"{path}: model-state files of model-parallel ranks {ranks or 'none'}; expected 0 to N-1")
    files = [next(n for n in (f"mp_rank_{r:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{r:02d}_model_states.pt")
                  if n in names) for r in ranks]
    return [_load(os.path.join(path, n)) for n in files]


def _flat(x) -> np.ndarray:
    return x.detach().float().numpy().reshape(-1)


def _join_zero12(osd: list[dict], shapes: list[dict], where: str) -> dict[str, dict[str, np.ndarray]]:
    """ZeRO-1/2 and ``BF16_Optimizer``: per group, the ranks' partitions joined, the parameters cut from it."""
    out = {k: {} for k in KINDS}
    for g, group in enumerate(shapes):
        full = {"fp32": np.concatenate([_flat(o["single_partition_of_fp32_groups"][g]) for o in osd])}
        for k in ("exp_avg", "exp_avg_sq"):
            full[k] = np.concatenate([_flat(o["base_optimizer_state"]["state"][g][k]) for o in osd])
        pads = (osd[0].get("param_alignment_paddings") or [[0] * len(group)] * len(shapes))[g]
        off = 0
        for (name, shape), pad in zip(group.items(), pads, strict=True):
            n = math.prod(shape)
            for k in out:
                out[k][name] = full[k][off:off + n].reshape(tuple(shape))
            off += n + pad
        # the group's padding is at the end, a few values (the last rank's float32 copy may drop it)
        if min(len(v) for v in full.values()) < off - pads[-1] or len(full["exp_avg"]) - off > 16 * len(osd):
            raise ConvertError(f"{where}: parameter group {g}'s partitions hold {len(full['fp32'])} values, its "
                               f"parameters {off}: the shards do not add up")
    return out


def _join_zero3(osd: list[dict], shapes: list[dict], where: str) -> dict[str, dict[str, np.ndarray]]:
    """ZeRO-3: each parameter split on its own, ``ceil(numel / ranks)`` of it on each rank, in order."""
    flat = {"fp32": [np.concatenate([_flat(t) for t in o["fp32_flat_groups"]]) for o in osd]}
    for k in ("exp_avg", "exp_avg_sq"):
        flat[k] = [np.concatenate([_flat(s[g][k]) for g in sorted(s)])
                   for s in (o["optimizer_state_dict"]["state"] for o in osd)]
    out, off = {k: {} for k in flat}, 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        n = math.prod(shape)
        part = -(-n // len(osd))
        for k in out:
            out[k][name] = np.concatenate([f[off:off + part] for f in flat[k]])[:n].reshape(tuple(shape))
        off += part
    if any(len(f) != off for f in flat["fp32"]):
        raise ConvertError(f"{where}: each rank's partition holds {len(flat['fp32'][0])} values, its parameters' "
                           f"parts {off}: the shards do not add up")
    return out


def _adam_steps(osd: list[dict]) -> set[int]:
    states = [o["base_optimizer_state"]["state"] if "base_optimizer_state" in o else o["optimizer_state_dict"]["state"]
              for o in osd]
    return {int(s["step"]) for st in states for s in st.values() if "step" in s}


def read_native(path: str, states: list[dict]) -> tuple[dict[str, dict[str, np.ndarray]], set[int]]:
    """The ZeRO shards of a native tag: ``({kind: {name: array}} for :data:`KINDS`, Adam's step counts)``, for
    each model-parallel rank (pipeline stages; tensor parallelism is refused) its own files.
    Raises ConvertError."""
    out, steps = {k: {} for k in KINDS}, set()
    for mp, state in enumerate(states):
        files = sorted((os.path.join(path, n) for n in os.listdir(path)
                        if re.fullmatch(rf"(bf16_)?zero_pp_rank_\d+_mp_rank_{mp:02d}_optim_states\.pt", n)), key=_rank)
        if not files:
            raise ConvertError(f"{path} holds no optimizer states of model-parallel rank {mp} "
                               f"(*zero_pp_rank_R_mp_rank_{mp:02d}_optim_states.pt): saved without them")
        osd = [_load(f)["optimizer_state_dict"] for f in files]
        if isinstance(osd[0].get("base_optimizer_state"), list):
            raise ConvertError(f"{files[0]}: an elastic checkpoint (zero_optimization.elastic_checkpoint): its "
                               f"optimizer state per parameter group is not read")
        count = osd[0].get("partition_count")
        count = count[0] if isinstance(count, list) else count
        if [_rank(f) for f in files] != list(range(len(files))) or count not in (None, len(files)):
            raise ConvertError(f"{path}: optimizer states of data-parallel ranks {[_rank(f) for f in files]}, "
                               f"partitioned {count} ways: a shard is missing")
        if not state.get("param_shapes"):
            raise ConvertError(f"{path}: the model states list no param_shapes (ZeRO stage 0, whose optimizer "
                               f"state is not partitioned): not read (nor by DeepSpeed's ds_to_universal)")
        join = _join_zero3 if "fp32_flat_groups" in osd[0] else _join_zero12
        for k, v in join(osd, state["param_shapes"], f"{path} (model-parallel rank {mp})").items():
            for name, x in v.items():
                out[k].setdefault(name, x)  # a tied embedding on two stages: the first's
        steps |= _adam_steps(osd)
    return out, steps


def read_universal(path: str, states: list[dict], padded_vocab: int) -> tuple[dict[str, dict[str, np.ndarray]],
                                                                            set[int]]:
    """A universal tag's ``zero/<name>/*.pt``: as :func:`read_native`; flat ZeRO-3 tensors shaped by the model
    states' ``param_shapes``, vocabulary tensors padded back to ``padded_vocab`` rows with zeros."""
    zero = os.path.join(path, "zero")
    shapes = {n: tuple(s) for state in states for group in state.get("param_shapes") or [] for n, s in group.items()}
    names = sorted(shapes or (n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n))))
    missing = [n for n in names if not os.path.isdir(os.path.join(zero, n))]
    if missing:
        raise ConvertError(f"{zero}/{missing[0]} is missing ({len(missing)} of the parameters the model states "
                           f"list): the universal checkpoint is incomplete")
    out, steps = {k: {} for k in KINDS}, set()
    for name in names:
        for k in out:
            saved = _load(os.path.join(zero, name, f"{k}.pt"))
            x = saved["param"] if isinstance(saved, dict) else saved
            x = x.detach().float().numpy()
            if x.ndim == 1 and name in shapes and len(shapes[name]) > 1:
                if x.size != math.prod(shapes[name]):
                    raise ConvertError(f"{zero}/{name}/{k}.pt holds {x.size} values, the model states' shape "
                                       f"{list(shapes[name])} {math.prod(shapes[name])}")
                x = x.reshape(shapes[name])
            if isinstance(saved, dict) and saved.get("vocab_tensor") and x.shape[0] < padded_vocab:
                x = np.pad(x, [(0, padded_vocab - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
            out[k][name] = x
        if os.path.isfile(os.path.join(zero, name, "step.pt")):
            steps.add(int(_load(os.path.join(zero, name, "step.pt"))))
    return out, steps
