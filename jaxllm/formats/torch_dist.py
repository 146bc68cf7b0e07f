"""Megatron-LM's distributed checkpoints (``--ckpt-format torch_dist``: megatron-core's ``dist_checkpointing``
on PyTorch Distributed Checkpoint) read and written whole on one host, with torch and without a process group.

A Megatron-LM checkpoint directory holds ``latest_checkpointed_iteration.txt`` and one ``iter_NNNNNNN/`` per
save (Megatron-LM's ``training/checkpointing.py``); each holds ``metadata.json`` (the backend:
``torch_dist``), ``common.pt`` (``torch.save`` of what is not sharded: ``args``, ``iteration``, the
optimizer's step and hyperparameters, ``opt_param_scheduler``), ``.metadata`` (the Distributed Checkpoint
index: every tensor's global shape and where its chunks are) and the chunks, ``__R_K.distcp``.

Safe loading: ``common.pt`` goes through torch's weights-only unpickler allowing only the classes Megatron
saves there (:data:`SAFE_GLOBALS`, with megatron-core's own list when it is installed); ``.metadata``, a
plain pickle torch's reader would load unrestricted, through :class:`_MetadataUnpickler`, which allows
only the classes of torch's checkpoint metadata.  Anything else is refused in one line naming the file.
The chunks are read by torch's own reader (weights-only).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pathlib
import pickle
import shutil
import tempfile
import types
import warnings

import numpy as np

from jaxllm.errors import ConvertError, reading

TRACKER = "latest_checkpointed_iteration.txt"
INSTALL = 'pip install -e ".[megatron]"'
# The classes common.pt may hold beyond torch's own: Megatron's saved arguments and what they carry.
SAFE_GLOBALS = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath]
# Modules whose classes a Distributed Checkpoint's .metadata is made of.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner", "megatron.core.dist_checkpointing.strategies.torch")


def require_torch():
    """torch (with its Distributed Checkpoint), or ConvertError naming the extra that installs it."""
    try:
        import torch  # noqa: PLC0415
        import torch.distributed.checkpoint  # noqa: F401, PLC0415
    except ImportError as e:
        raise ConvertError(f"Megatron checkpoints need torch ({e}): {INSTALL}") from None
    return torch


def _safe_globals() -> list:
    try:  # the enums and configs a Megatron-LM run's arguments hold (megatron-core's own list)
        with warnings.catch_warnings():  # megatron-core's notes that Apex and Transformer Engine are absent
            warnings.simplefilter("ignore")
            from megatron.core.safe_globals import SAFE_GLOBALS as MEGATRON  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - megatron-core absent or unimportable: torch's and ours alone
        MEGATRON = []
    return SAFE_GLOBALS + list(MEGATRON)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a Distributed Checkpoint's ``.metadata``: only torch's checkpoint metadata classes, torch's
    ``Size``, dtypes and memory-format helper, paths, and builtin containers."""

    def find_class(self, module, name):
        torch = require_torch()
        if module in _METADATA_MODULES:  # the classes defined there, not whatever those modules import
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif ((module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
              or (module == "torch.serialization" and name == "_get_layout")  # a layout by its name
              or (module == "collections" and name == "OrderedDict")
              or (module == "pathlib" and name in ("PosixPath", "PurePosixPath"))):  # the checkpoint's path
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class of a checkpoint's metadata")


def iteration_dir(directory: str, iteration: int | None = None) -> tuple[str, int]:
    """``(DIR/iter_NNNNNNN, N)``: the iteration ``Megatron's latest_checkpointed_iteration.txt`` names, or
    ``iteration``.  ``directory`` may also be an ``iter_*`` directory itself.  Raises ConvertError."""
    if os.path.isfile(os.path.join(directory, "metadata.json")):
        name = os.path.basename(os.path.normpath(directory))
        found = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
        if found is None or (iteration is not None and iteration != found):
            raise ConvertError(f"{directory} is a checkpoint of iteration {found}, not --iteration {iteration}; "
                               f"pass the directory above it")
        return directory, found
    saved = sorted(int(n[5:]) for n in os.listdir(directory) if n.startswith("iter_") and n[5:].isdigit()) \
        if os.path.isdir(directory) else []
    if iteration is None:
        tracker = os.path.join(directory, TRACKER)
        if not os.path.isfile(tracker):
            raise ConvertError(f"{directory} has no {TRACKER}: not a Megatron-LM checkpoint directory"
                               + (f" (it holds iterations {saved}: pass --iteration)" if saved else ""))
        text = open(tracker).read().strip()
        if not text.isdigit():
            raise ConvertError(f"{tracker} says {text!r}, not an iteration number (a 'release' checkpoint "
                               f"holds no optimizer state to continue from)")
        iteration = int(text)
    path = os.path.join(directory, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise ConvertError(f"{directory} holds no iteration {iteration} (iter_{iteration:07d}); it holds "
                           f"{saved or 'none'}")
    return path, iteration


def _check_backend(path: str) -> None:
    meta = os.path.join(path, "metadata.json")
    if not os.path.isfile(meta):
        raise ConvertError(f"{path} has no metadata.json: not a distributed (torch_dist) checkpoint "
                           f"(Megatron's legacy --ckpt-format torch is not read)")
    with reading(meta, "JSON", ConvertError), open(meta, encoding="utf-8") as fp:
        backend = json.load(fp).get("sharded_backend")
    if backend != "torch_dist":
        raise ConvertError(f"{meta}: sharded_backend {backend!r}; jaxllm reads torch_dist checkpoints "
                           f"(convert with Megatron-LM's --ckpt-convert-format torch_dist)")


def read_common(path: str) -> dict:
    """``path/common.pt`` (an ``iter_*`` directory's) through the weights-only unpickler. Raises ConvertError."""
    require_torch()
    _check_backend(path)
    file = os.path.join(path, "common.pt")
    if not os.path.isfile(file):
        raise ConvertError(f"{file} is missing: the checkpoint is incomplete")
    return load_safely(file, _safe_globals())


def load_safely(file: str, allowed: list):
    """``torch.load`` of ``file`` through torch's weights-only unpickler, ``allowed`` (classes, or ``(stand-in,
    "module.name")`` pairs: ``torch.serialization.safe_globals``) beside torch's own.  Raises ConvertError
    naming the file and the first global refused."""
    torch = require_torch()
    with reading(file, "a torch.save file", ConvertError):  # what the handler below leaves: a damaged file
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            why = next((ln for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln),
                       str(e).splitlines()[0])
            raise ConvertError(f"{file} holds what the weights-only loader refuses ({why.strip()}); it is not read "
                               f"with an unrestricted unpickler") from None


def read_metadata(path: str):
    """The Distributed Checkpoint index ``path/.metadata`` (:class:`_MetadataUnpickler`), its chunk files checked
    present and every tensor's chunks checked to fill it.  Raises ConvertError."""
    file = os.path.join(path, ".metadata")
    if not os.path.isfile(file):
        raise ConvertError(f"{file} is missing: the checkpoint is incomplete")
    with reading(file, "a Distributed Checkpoint index", ConvertError):  # what the handler below leaves
        try:
            with open(file, "rb") as fp:
                metadata = _MetadataUnpickler(fp).load()
        except (pickle.UnpicklingError, AttributeError, ImportError) as e:
            raise ConvertError(f"{file}: {e}; it is not read with an unrestricted unpickler") from None
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    outside = [f for f in files if os.path.basename(f) != f]
    if outside:
        raise ConvertError(f"{file} points at {outside[0]}, outside the checkpoint's directory: not read")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ConvertError(f"{path}: shard {missing[0]} is missing ({len(missing)} of {len(files)} files)")
    for key, item in metadata.state_dict_metadata.items():
        if not hasattr(item, "chunks"):
            continue
        held = sum(math.prod(c.sizes) for c in item.chunks)
        if held != math.prod(item.size):
            raise ConvertError(f"{path}: the shards of {key} hold {held} of its {math.prod(item.size)} values "
                               f"(shape {list(item.size)}): the layout's shards do not add up")
    return metadata


def read_tensors(path: str, metadata, keys: list[str]) -> dict[str, np.ndarray]:
    """The tensors ``keys`` of the checkpoint in ``path`` (their global shapes), as float32 NumPy arrays."""
    torch = require_torch()
    from torch.distributed import checkpoint as dcp  # noqa: PLC0415

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return metadata

    items = metadata.state_dict_metadata
    state = {k: torch.empty(tuple(items[k].size), dtype=items[k].properties.dtype) for k in keys}
    with warnings.catch_warnings(), reading(path, "torch_dist shards", ConvertError):
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # "assuming ... a single process": it is
        dcp.load(state, storage_reader=Reader(path), no_dist=True)
    return {k: v.float().numpy() for k, v in state.items()}


def advance_tracker(directory: str, iteration: int) -> None:
    """Points ``directory``'s ``latest_checkpointed_iteration.txt`` at ``iteration`` unless it names a later one
    (an export into a run's save directory never sends it back); replaced whole (a rename)."""
    tracker = os.path.join(directory, TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if text.isdigit() and int(text) > iteration:
            return
    tmp = f"{tracker}.partial-{os.getpid()}"
    with open(tmp, "w") as fp:
        fp.write(str(iteration))
    os.replace(tmp, tracker)


def write(path: str, common: dict, tensors: dict[str, np.ndarray], objects: dict[str, object]) -> None:
    """Writes the ``iter_*`` directory ``path`` (which must not exist): ``tensors`` (whole, one chunk each) and
    ``objects`` (each ``torch.save``'d in a list, as megatron-core saves a ``ShardedObject``) by PyTorch Distributed
    Checkpoint, ``common.pt`` and ``metadata.json`` as megatron-core writes them; into a temporary directory
    renamed at the end, so that nothing is left half-written."""
    torch = require_torch()
    from torch.distributed import checkpoint as dcp  # noqa: PLC0415

    class _PackedObjects(dcp.DefaultSavePlanner):
        """Writes the objects' bytes as they are (megatron-core's ``MCoreSavePlanner``): torch's planner would
        ``torch.save`` the ``BytesIO`` once more, which megatron-core's reader does not unwrap."""

        def transform_object(self, write_item, object):  # noqa: A002 - torch's name
            return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)

    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    try:
        state = {k: torch.tensor(v) for k, v in tensors.items()}  # a copy: the arrays may be read-only
        for k, obj in objects.items():
            state[k] = io.BytesIO()
            torch.save([obj], state[k])  # one shard's data in a list (megatron-core's _mcore_to_torch_sharded_object)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=_PackedObjects(), no_dist=True)
        torch.save(common, os.path.join(tmp, "common.pt"))
        with open(os.path.join(tmp, "metadata.json"), "w") as fp:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, fp)
        umask = os.umask(0o022)  # mkdtemp's 0700 -> a directory's usual mode (0755 under umask 022)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
