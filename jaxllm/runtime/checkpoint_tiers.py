"""The two tiers of checkpoints: Orbax managers of the shared and the node-local directories, and what
the processes agree on about them (see :mod:`jaxllm.runtime.checkpoint` for when each saves and restores).

Why two standard ``ocp.CheckpointManager`` instances and not Orbax's
``experimental.emergency.CheckpointManager`` (0.12.8): with one replica along the mesh's
first axis it ignores the local directory (shared saves only); with several it writes the
local tier only on the non-primary replicas and the shared tier only from the primary one,
so every array must be whole in each replica (no ZeRO/FSDP sharding over ``data``); it saves a
single ``state`` item (no config), cannot delete a step, and restores without ``strict=False``
(no restore onto another padding).  Its ``multi_tier_checkpointing`` /
``replicator_checkpoint_manager`` need GKE's replicator service.  The local manager here is
configured as emergency's ``_LocalCheckpointManager`` is: no primary host, every process
writing all of its shards, barriers only within the process.

Crash safety: Orbax writes each step into ``STEP.orbax-checkpoint-tmp-*`` and renames it to
``STEP`` once every file is written, so a process killed during a (possibly asynchronous)
save leaves the previous checkpoints intact, and the step listing never includes a
temporary directory.  A save that fails (disk full, directory gone or read-only) leaves the
previous steps intact (Orbax deletes old steps only after a save completes); its temporary
directory is removed (:meth:`Tier.remove_partial`: on a full disk it holds the space the next save
needs), and the run stops in one line naming the newest complete step, or with
``checkpoint.fail_on_save_error=False`` goes on.  Before a save, a filesystem that says (``statvfs``) it
has less free space than the checkpoint's arrays take fails it at once (:meth:`Tier.check_space`).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import logging as python_logging
import os
import shutil
import tempfile
import time
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from jaxllm import config
from jaxllm.errors import ConfigError

# Saved beside the state in every step: JSON items.
JSON_ITEMS = ("config", "run", "checksums")


def shared_manager(workdir: str, options: ocp.CheckpointManagerOptions | None = None) -> ocp.CheckpointManager:
    """Orbax's manager of ``WORKDIR/checkpoints`` (every reader and writer of the shared tier uses this)."""
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


class _NoPrimaryHostNotice(python_logging.Filter):
    """Drops Orbax's warning, at every save of the local tier, that it logs no global object sizes
    without a primary host: true of every per-process checkpoint, and nothing to act on."""

    def filter(self, record: python_logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Global object size logging disabled")


_NO_PRIMARY_HOST_NOTICE = _NoPrimaryHostNotice()


def local_manager(directory: str, keep: int) -> ocp.CheckpointManager:
    """Orbax's manager of this process's node-local ``directory``: the process writes every shard its devices
    hold (no primary host, no replica selection) and reads them back, without a barrier with the other
    processes (as ``orbax.checkpoint.experimental.emergency``'s local manager)."""
    python_logging.getLogger("absl").addFilter(_NO_PRIMARY_HOST_NOTICE)  # Orbax logs through absl
    mp = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={jax.process_index()},
                                            barrier_sync_key_prefix=f"jaxllm_local_{jax.process_index()}")
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, multiprocessing_options=mp,
                                                     type_handler_registry=registry),
                **{k: ocp.JsonCheckpointHandler(multiprocessing_options=mp) for k in JSON_ITEMS}}
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=False, enable_async_checkpointing=True,
                                           multiprocessing_options=mp, save_root_metadata=False,
                                           enable_per_process_directory_creation=True)
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def same_shapes(manager, step: int, target) -> bool:
    """Whether the checkpoint at ``step`` holds arrays of the shapes of ``target`` (a dict of some of the
    saved state's entries, ``jax.ShapeDtypeStruct`` leaves).

    The model is the same (:meth:`jaxllm.runtime.checkpoint.Checkpointer._check_model_matches`), so only
    padding can differ: the embedding and output tables' rows (``model.padded_vocab_size``, which depends on
    the tensor-parallel size) and the ZeRO/FSDP storage padding (:func:`jaxllm.parallel.sharding.stored`,
    which depends on the data-parallel size).  Padding is zeros at the end of a dimension, so where the shapes
    differ the arrays are read cut or zero-padded to ``target``'s (Orbax's ``strict=False``).
    """
    saved = ocp.PyTreeCheckpointHandler().metadata(manager.directory / str(step) / "state").tree
    shapes = lambda tree: sorted(tuple(a.shape) for a in jax.tree.leaves(tree))  # noqa: E731
    return shapes({k: saved[k] for k in target}) == shapes(target)


def everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds in every process (collective)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return bool(np.min(multihost_utils.process_allgather(np.int32(flag))))


def held_everywhere(steps: list[int]) -> list[int]:
    """The steps of ``steps`` that every process lists too, ascending (collective)."""
    if jax.process_count() == 1:
        return sorted(steps)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    width = int(np.max(multihost_utils.process_allgather(np.int32(len(steps))))) or 1
    padded = np.full(width, -1, np.int32)
    padded[:len(steps)] = steps
    rows = multihost_utils.process_allgather(padded)  # [processes, width]
    return sorted(set.intersection(*(set(r.tolist()) for r in rows)) - {-1})


class Tier:
    """One directory of checkpoints and its Orbax manager: ``shared`` (``WORKDIR/checkpoints``: the processes
    write one checkpoint together) or ``local`` (one checkpoint per process, of its shards only).

    Attributes:
      name, manager, directory, interval (steps between saves; 0: only forced ones, shared tier),
      invalid (steps that failed to restore: replaced when training reaches them again),
      pending (the step of the save in flight, or None), stale (a save failed since the step list was read).
    """

    def __init__(self, name: str, manager: ocp.CheckpointManager, interval: int):
        self.name, self.manager, self.interval = name, manager, interval
        self.directory = str(manager.directory)
        self.invalid: set[int] = set()
        self.pending: int | None = None
        self.stale = False

    @property
    def local(self) -> bool:
        return self.name == "local"

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def steps(self) -> list[int]:
        """Every finalized step, ascending (temporary directories of interrupted saves are not steps)."""
        return sorted(self.manager.all_steps())

    def newest(self) -> int | None:
        """The newest complete step on disk (read again: after a failed save Orbax's own list may hold the step)."""
        self.manager.reload()
        steps = self.steps()
        return steps[-1] if steps else None

    def check_space(self, state) -> None:
        """Raises OSError (ENOSPC) when the tier's filesystem has less free space than ``state``'s arrays take in this
        tier (all of them in the shared tier, whose processes agree; this process's shards in the local tier);
        nothing where ``statvfs`` tells nothing (free space 0 of 0 blocks)."""
        leaves = [a for a in jax.tree.leaves(state) if hasattr(a, "nbytes")]
        if self.local:
            need = sum(s.data.nbytes for a in leaves for s in getattr(a, "addressable_shards", ()))
        else:
            need = sum(a.nbytes for a in leaves)
        fs = os.statvfs(self.directory)
        free = fs.f_bavail * fs.f_frsize
        enough = fs.f_blocks == 0 or free >= need
        everyone = enough if self.local else everywhere(enough)  # collective in the shared tier
        if not enough:
            raise OSError(errno.ENOSPC, f"No space left on device: {free / 2**20:.1f} MiB free, the checkpoint's "
                                        f"arrays take {need / 2**20:.1f} MiB")
        if not everyone:
            raise OSError(errno.ENOSPC, "No space left on device, says another process")

    def remove_partial(self, settle_s: float = 0.0) -> None:
        """Removes the temporary directories of failed saves (``STEP.orbax-checkpoint-tmp-*``; no save is in flight):
        in the shared tier process 0's job, in the local tier each process's.  ``settle_s``: again until none has
        come back for that long (at most 30 s): the TensorStore writes a save that failed as it started left in flight
        go on creating their directories for a while after Orbax has given up on them."""
        if not (self.local or jax.process_index() == 0):
            return
        quiet_since, deadline = time.monotonic(), time.monotonic() + 30
        while True:
            found = glob.glob(os.path.join(self.directory, "*.orbax-checkpoint-tmp*"))
            for path in found:
                shutil.rmtree(path, ignore_errors=True)
            now = time.monotonic()
            if found:
                quiet_since = now
            if now - quiet_since >= settle_s or now > deadline:
                return
            time.sleep(min(0.25, settle_s))

    def restore(self, step: int, abstract_state):
        """``(state, {path: checksum} or None)`` of ``step`` (None: saved before checksums were)."""
        if self.local:  # the same processes and mesh (the directory's name): the shapes are the saved ones
            state = ocp.args.PyTreeRestore(item=abstract_state,
                                           restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
        else:
            state = ocp.args.StandardRestore(abstract_state, strict=same_shapes(self.manager, step, abstract_state))
        items = {"state": state}
        if os.path.isdir(os.path.join(self.directory, str(step), "checksums")):
            items["checksums"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"], restored["checksums"]["arrays"] if "checksums" in items else None

    def read_json(self, step: int, item: str) -> dict | None:
        """The JSON item ``item`` of ``step``, or None if the step has none."""
        if not os.path.isdir(os.path.join(self.directory, str(step), item)):
            return None
        return self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]

    def save(self, step: int, state, items: dict) -> bool:
        """Starts an asynchronous save of ``state`` and the JSON ``items``; False if ``step`` is saved already
        (a step that failed to restore is replaced)."""
        if step in self.manager.all_steps():
            if step not in self.invalid:
                return False
            logging.warning("replacing checkpoint step %d in %s, which could not be restored", step, self.directory)
            self.manager.delete(step)
        # A directory gone or unwritable fails here, at once: Orbax creates the step's directory in a background
        # thread, whose failure leaves its other threads waiting minutes for that thread's signal.
        with tempfile.TemporaryFile(dir=self.directory):
            pass
        if self.stale:  # after a failed save: Orbax's step list as on disk (it dropped the steps it meant to delete)
            self.manager.reload()
            self.stale = False
        state_args = ocp.args.PyTreeSave(state) if self.local else ocp.args.StandardSave(state)
        # the JSON items first: they are written as save() runs, so one that fails does before the arrays' writes start
        saved = self.manager.save(step, args=ocp.args.Composite(
            **{k: ocp.args.JsonSave(v) for k, v in items.items()}, state=state_args), force=True)
        self.pending = step if saved else None
        return saved

    def quarantine(self, steps: list[int]) -> dict[int, str]:
        """Moves damaged ``steps`` (newer than the one restored) to ``damaged/STEP`` in the tier's directory:
        kept for inspection, but out of Orbax's step list, so that ``checkpoint.keep`` counts good
        checkpoints only (Orbax's LatestN keeps the newest ``keep`` steps it lists, damaged or not) and a
        later save of the same step needs no special case.  Shared tier: process 0 moves them and every
        process waits for it (collective); local tier: each process moves its own.  Returns
        ``{step: new directory}``."""
        if not steps:
            return {}
        moved = {}
        for s in steps:
            target = os.path.join(self.directory, "damaged", str(s))
            while os.path.exists(target):  # damaged before, at the same step
                target += "+"
            moved[s] = target
        if self.local or jax.process_index() == 0:
            os.makedirs(os.path.join(self.directory, "damaged"), exist_ok=True)
            for s, target in moved.items():
                if os.path.isdir(os.path.join(self.directory, str(s))):
                    os.rename(os.path.join(self.directory, str(s)), target)
        if not self.local and jax.process_count() > 1:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            multihost_utils.sync_global_devices("jaxllm checkpoint quarantine")
        self.manager.reload()
        return moved


def local_directory(workdir: str, cfg: config.Resolved) -> str:
    """This process's node-local directory, ``LOCAL_DIR/RUN_ID/pPofN-MESH``, created: ``RUN_ID`` is the
    run's (``WORKDIR/checkpoints/local_run_id``, written by process 0 when missing), so that a stale
    local tier of another run in the same place is never restored; ``pPofN-MESH`` names the process and the
    mesh, whose shards it holds (collective: every process calls it).

    Raises:
      ConfigError: ``checkpoint.local_dir`` cannot be created or written.
    """
    root = os.path.abspath(cfg.checkpoint.local_dir)
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        raise ConfigError("checkpoint.local_dir", cfg.checkpoint.local_dir,
                          f"cannot write {root} ({e.strerror or e}); give a node-local directory this process "
                          "can write") from None
    path = os.path.join(os.path.abspath(workdir), "checkpoints", "local_run_id")
    if jax.process_index() == 0 and not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(uuid.uuid4().hex[:16])
        os.replace(path + ".tmp", path)  # atomic: every process reads a whole id
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices("jaxllm local run id")
    with open(path) as f:
        run_id = f.read().strip()
    mesh = hashlib.sha256(json.dumps(cfg.mesh_shape, sort_keys=True).encode()).hexdigest()[:8]
    directory = os.path.join(root, run_id, f"p{jax.process_index()}of{jax.process_count()}-{mesh}")
    os.makedirs(directory, exist_ok=True)
    return directory


def name_local_tier(workdir: str, directory: str | None) -> None:
    """Process 0 names its node-local tier in ``WORKDIR/checkpoints/local_tier`` (removed without one): the
    launch scripts, on process 0's node, read the newest step there for their restart line (launch/common.sh)."""
    if jax.process_index() != 0:
        return
    path = os.path.join(os.path.abspath(workdir), "checkpoints", "local_tier")
    if directory is None:
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path + ".tmp", "w") as f:
        f.write(directory + "\n")
    os.replace(path + ".tmp", path)
