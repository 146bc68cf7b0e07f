"""What every import into a jaxllm workdir shares, whatever the format: the workdir locked and holding no
checkpoint, nothing left behind by a failed import (:func:`importing`), the ``--config.SECTION.KEY=VALUE`` options
on top of the imported config (of the model keys only :data:`FREE_MODEL_KEYS`), the config checked for its own
mesh, and the imported state saved as a training checkpoint beside a ``config.py`` to train on with."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pprint
from collections.abc import Iterator

from jaxllm import config
from jaxllm.errors import ConvertError, reading
from jaxllm.resolve import resolve
from jaxllm.runtime import checkpoint, workdir_lock

# Model keys --from-hf lets the user set; the others come from config.json.
# (mtp_num_layers: modules that start fresh, jaxllm.formats.hf.params_from_hf)
FREE_MODEL_KEYS = ("dtype", "remat", "attention_impl", "dropout", "init_std", "make_vocab_size_divisible_by",
                   "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type", "mtp_num_layers",
                   "mtp_loss_scaling_factor")


def read_json(path: str) -> dict:
    """The JSON object in the file ``path``.  Raises ConvertError: it cannot be read, or holds no JSON object."""
    with reading(path, "JSON", ConvertError), open(path, encoding="utf-8") as fp:
        value = json.load(fp)
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def refuse_used(workdir: str) -> None:
    """Raises ConvertError if ``workdir`` holds checkpoints already: an import starts a run."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise ConvertError(f"{ckpt_dir} already holds checkpoints: import into a new workdir")


@contextlib.contextmanager
def importing(workdir: str, what: str) -> Iterator[None]:
    """An import (``what``: its command) writing into ``workdir``, inside: the workdir's lock held
    (:mod:`jaxllm.runtime.workdir_lock`) and no checkpoint there; if the import fails (any exception, Ctrl-C too),
    what it wrote is removed, and the workdir if it made it.

    Raises:
      WorkdirBusy: a run or another import holds ``workdir``.  ConvertError: it holds checkpoints.
    """
    before = workdir_lock.snapshot(workdir)
    with workdir_lock.held(workdir, what, collective=False, flag="WORKDIR"):
        try:
            refuse_used(workdir)
            yield
        except BaseException:
            workdir_lock.remove_new(workdir, before)
            raise


def apply_overrides(given: config.Config, overrides: dict[str, str], source: str) -> None:
    """``--config.SECTION.KEY=VALUE`` on top of an imported config: of the model keys only :data:`FREE_MODEL_KEYS`
    (``source`` determines the others)."""
    for key, text in overrides.items():
        config.check_key(key, text)
        section, _, name = key.partition(".")
        if section == "model" and name not in FREE_MODEL_KEYS:
            raise ConvertError(f"--config.{key}: the {source} determines it; only "
                               f"{', '.join('model.' + k for k in FREE_MODEL_KEYS)} may be set", keys=(key,))
        config.override(given, key, text)


def resolve_for_its_mesh(given: config.Config) -> config.Resolved:
    """An imported checkpoint fits any mesh: the config checked on the devices its mesh names (a -1 axis as 1),
    whatever this machine has."""
    return resolve(given, num_devices=math.prod(max(n, 1) for n in given.mesh.devices().values()))


def config_file_text(given: config.Config, directory: str, what: str = "Hugging Face model") -> str:
    """The ``config.py`` of a run imported from ``directory`` (a ``what``): ``given`` as a dict."""
    return (f'"""The jaxllm config of the {what} imported from {os.path.abspath(directory)}\n'
            f'by jaxllm.convert. Train on with:\n'
            f'    python -m jaxllm.train --config={{this file}} --workdir={{its directory}}\n'
            f'(--config.SECTION.KEY=VALUE flags still apply; leave the model section as it is)."""\n\n'
            f"from jaxllm.config import from_dict\n\n"
            f"CONFIG = {pprint.pformat(given.to_dict(), sort_dicts=False, width=110)}\n\n\n"
            f"def get_config():\n    return from_dict(CONFIG)\n")


def save_imported(workdir: str, cfg: config.Resolved, state: dict, step: int, given: config.Config, source: str,
                  what: str) -> None:
    """Writes an imported run into ``workdir``: ``state`` (:func:`jaxllm.runtime.step.init_state`'s structure) as
    the checkpoint of ``step``, saved as training saves it, and ``config.py`` holding ``given`` (the config as
    imported from ``source``, a ``what``; derived sizes left to ``jaxllm.train``)."""
    ckpt = checkpoint.Checkpointer(workdir, cfg)
    ckpt.maybe_save(step, state, force=True)
    ckpt.close()
    with open(os.path.join(workdir, "config.py"), "w") as fp:
        fp.write(config_file_text(anchored(given), source, what))


# The data keys that name files, as typed: relative to the directory the import ran in (data.cache_dir's relative
# path is under WORKDIR, as the run's own).
PATH_KEYS = ("input", "file_list", "tokenizer", "gpt2_dir")


def anchored(given: config.Config) -> config.Config:
    """``given`` with each relative path of :data:`PATH_KEYS` that names a file or folder here made absolute (a
    blend's prefixes word by word, its weights kept), so that the run's ``config.py`` trains from any directory."""
    out = config.from_dict(given.to_dict())
    for key in PATH_KEYS:
        value = getattr(out.data, key)
        if os.path.exists(value):
            setattr(out.data, key, os.path.abspath(value))
        elif key == "input":  # "W1 PREFIX1 W2 PREFIX2": each prefix whose .bin (or the file) exists
            out.data.input = " ".join(os.path.abspath(w) if os.path.exists(w) or os.path.exists(w + ".bin") else w
                                      for w in value.split())
    return out
