"""Sharded, asynchronous checkpoints in two tiers with Orbax's CheckpointManager, verified restores, and preemption.

What a checkpoint holds: the training state (``step``, ``params``, ``opt_state`` and
the skipped-step counters ``nonfinite_steps``/``nonfinite_in_a_row``), the run's
full config as JSON (``train.optimizer`` says whose state ``opt_state`` is: resuming with
another optimizer is a :class:`~jaxllm.errors.ConfigError`, not a damaged checkpoint), the
tokenizer's fingerprint (``run``) and a checksum of every array (``checksums``).
Nothing else is needed to resume exactly: the data position is a function of the step
(batch ``s`` is :meth:`jaxllm.data.Loader.train_batch` ``(s)``), and so are the dropout
keys (``fold_in(key(train.seed), step)``, see :func:`jaxllm.runtime.step.make_train_step`);
a resumed run computes bit for bit what an uninterrupted one computes.

Tiers: the shared one, ``WORKDIR/checkpoints``, is saved every ``checkpoint.interval``
steps and at the end (or on preemption); the last ``checkpoint.keep`` are kept, and with
``checkpoint.keep_period`` = k also every step that is a multiple of k.  With
``checkpoint.local_dir`` (node-local NVMe or /tmp) each process also saves its own shards
every ``checkpoint.local_interval`` steps into ``LOCAL_DIR/RUN_ID/pPofN-MESH`` (the last
``checkpoint.keep``): fast to write and read, lost with the node.  A restore takes the
newest step that every process can read complete: a step every process holds locally
(the processes agree on it through an allgather), else the shared step.  The local tier
applies only to the same processes and mesh (its directory is named after them) and to the
same run (``RUN_ID``, written in ``WORKDIR/checkpoints/local_run_id``).

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

Verification: Orbax and TensorStore (0.12.8) do not detect a changed byte in an array's
chunk (the array restores with other values), so every save records a checksum of each
array (:func:`checksums`, computed on the devices) and a restore compares them.  A step that
cannot be read or does not match is reported in one warning line, moved to ``damaged/``
(:meth:`_Tier.quarantine`) and the step before is restored.

Crash safety: Orbax writes each step into ``STEP.orbax-checkpoint-tmp-*`` and renames it to
``STEP`` once every file is written, so a process killed during a (possibly asynchronous)
save leaves the previous checkpoints intact, and the step listing never includes a
temporary directory.  A save that fails (disk full, directory gone or read-only) leaves the
previous steps intact (Orbax deletes old steps only after a save completes); it is reported
in one line and training goes on, or stops with ``checkpoint.fail_on_save_error``.

Restoring takes an abstract state (``jax.ShapeDtypeStruct`` leaves with shardings), which may
describe another mesh than the one that saved (shared tier): each process then reads only the
shards its devices need.
"""

from __future__ import annotations

import hashlib
import json
import logging as python_logging
import os
import signal
import tempfile
import threading
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from jaxllm import config
from jaxllm.errors import ConfigError
from jaxllm.model import gpt
from jaxllm.runtime import optim

# Library detail (full Orbax/TensorStore errors): a log file, not the console (see jaxllm.platform.console).
library = python_logging.getLogger("jaxllm.library")

# The model keys that decide the parameters' shapes (the others, e.g. remat or dtype, may change on resume).
_SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
               "max_position_embeddings", "position_embedding", "norm", "activation", "use_bias", "tie_embeddings")
# Saved beside the state in every step: JSON items.
_JSON_ITEMS = ("config", "run", "checksums")
# Odd multipliers of the index along each dimension in an array's checksum (dimensions beyond cycle).
_PRIMES = (2654435761, 2246822519, 3266489917, 668265263, 374761393, 1181783497)


def _manager(workdir: str, options: ocp.CheckpointManagerOptions | None = None) -> ocp.CheckpointManager:
    """Orbax's manager of ``WORKDIR/checkpoints`` (every reader and writer of the shared tier uses this)."""
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


class _NoPrimaryHostNotice(python_logging.Filter):
    """Drops Orbax's warning, at every save of the local tier, that it logs no global object sizes
    without a primary host: true of every per-process checkpoint, and nothing to act on."""

    def filter(self, record: python_logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Global object size logging disabled")


_NO_PRIMARY_HOST_NOTICE = _NoPrimaryHostNotice()


def _local_manager(directory: str, keep: int) -> ocp.CheckpointManager:
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
                **{k: ocp.JsonCheckpointHandler(multiprocessing_options=mp) for k in _JSON_ITEMS}}
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=False, enable_async_checkpointing=True,
                                           multiprocessing_options=mp, save_root_metadata=False,
                                           enable_per_process_directory_creation=True)
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _same_shapes(manager, step: int, target) -> bool:
    """Whether the checkpoint at ``step`` holds arrays of the shapes of ``target`` (a dict of some of the
    saved state's entries, ``jax.ShapeDtypeStruct`` leaves).

    The model is the same (:meth:`Checkpointer._check_model_matches`), so only padding can differ: the
    embedding and output tables' rows (``model.padded_vocab_size``, which depends on the tensor-parallel
    size) and the ZeRO/FSDP storage padding (:func:`jaxllm.parallel.sharding.stored`, which depends on the
    data-parallel size).  Padding is zeros at the end of a dimension, so where the shapes differ the arrays
    are read cut or zero-padded to ``target``'s (Orbax's ``strict=False``).
    """
    saved = ocp.PyTreeCheckpointHandler().metadata(manager.directory / str(step) / "state").tree
    shapes = lambda tree: sorted(tuple(a.shape) for a in jax.tree.leaves(tree))  # noqa: E731
    return shapes({k: saved[k] for k in target}) == shapes(target)


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be restored (the message names each step and why), or a save failed
    with ``checkpoint.fail_on_save_error``."""


def _reason(e: Exception) -> str:
    """One line saying why a restore or save failed (Orbax and TensorStore errors span many lines)."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"


def _checksum(x: jax.Array) -> jax.Array:
    """uint32: the sum, modulo 2**32, of each element's bits times an odd weight made of its index along
    each dimension.  A change of any one element changes it; zero elements add nothing, so the zero
    padding a restore cuts or adds (another tensor or data-parallel size) leaves it as it is, and integer
    sums do not depend on the order in which the devices add them."""
    bits = x.astype(jnp.uint32) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(
        x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    weight = jnp.zeros(x.shape, jnp.uint32)
    for d in range(x.ndim):
        weight = weight + (jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) + 1) * jnp.uint32(_PRIMES[d % 6])
    return jnp.sum(bits * (weight * 2 + 1), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def checksums(state) -> dict[str, int]:
    """``{path: checksum}`` of every array of ``state`` (:func:`_checksum`), computed where the arrays are
    (one pass over them, a few scalars to the host; collective: every process calls it)."""
    sums = _checksums(state)
    return {jax.tree_util.keystr(path, simple=True, separator="/"): int(np.asarray(s.addressable_data(0)))
            for path, s in jax.tree_util.tree_flatten_with_path(sums)[0]}


def tokenizer_fingerprint(tokenizer) -> dict:
    """``{"name", "vocab_size", "sha256"}`` of a tokenizer (:mod:`jaxllm.data.tokenizers`): the hash of what
    decides its ids (a char tokenizer's characters, the tokenizer files' contents), not of where its files are."""
    fields = {k: v for k, v in tokenizer.meta_fields().items() if not k.endswith(("_path", "_dir"))}
    text = json.dumps({"name": tokenizer.name, **fields}, sort_keys=True)
    return {"name": tokenizer.name, "vocab_size": int(tokenizer.vocab_size),
            "sha256": hashlib.sha256(text.encode()).hexdigest()}


def _everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds in every process (collective)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return bool(np.min(multihost_utils.process_allgather(np.int32(flag))))


def _held_everywhere(steps: list[int]) -> list[int]:
    """The steps of ``steps`` that every process lists too, ascending (collective)."""
    if jax.process_count() == 1:
        return sorted(steps)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    width = int(np.max(multihost_utils.process_allgather(np.int32(len(steps))))) or 1
    padded = np.full(width, -1, np.int32)
    padded[:len(steps)] = steps
    rows = multihost_utils.process_allgather(padded)  # [processes, width]
    return sorted(set.intersection(*(set(r.tolist()) for r in rows)) - {-1})


class _Tier:
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

    def restore(self, step: int, abstract_state):
        """``(state, {path: checksum} or None)`` of ``step`` (None: saved before checksums were)."""
        if self.local:  # the same processes and mesh (the directory's name): the shapes are the saved ones
            state = ocp.args.PyTreeRestore(item=abstract_state,
                                           restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
        else:
            state = ocp.args.StandardRestore(abstract_state, strict=_same_shapes(self.manager, step, abstract_state))
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
        saved = self.manager.save(step, args=ocp.args.Composite(
            state=state_args, **{k: ocp.args.JsonSave(v) for k, v in items.items()}), force=True)
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


class Checkpointer:
    """A run's checkpoints: the shared tier ``WORKDIR/checkpoints`` (every ``checkpoint.interval`` steps and
    when forced; the last ``checkpoint.keep`` and every ``checkpoint.keep_period``-th step kept) and, with
    ``checkpoint.local_dir``, the node-local tier (every ``checkpoint.local_interval`` steps).

    Args:
      workdir: the run directory.
      cfg: the resolved config (saved with every step).
      tokenizer: the run's tokenizer (:mod:`jaxllm.data.tokenizers`), whose fingerprint is saved and
        checked on resume; None: neither.
    Raises:
      ConfigError: ``checkpoint.local_dir`` without ``checkpoint.local_interval`` or the reverse, or a
        ``local_dir`` that cannot be created or written.
    """

    def __init__(self, workdir: str, cfg: config.Resolved, tokenizer=None):
        c = cfg.checkpoint
        if bool(c.local_dir) != bool(c.local_interval):
            key = "checkpoint.local_interval" if c.local_dir else "checkpoint.local_dir"
            raise ConfigError(key, c.local_interval if c.local_dir else "",
                              "the node-local tier needs both checkpoint.local_dir (a directory on each node: NVMe, "
                              "/tmp) and checkpoint.local_interval (steps between its saves); set both, or neither")
        options = ocp.CheckpointManagerOptions(max_to_keep=c.keep, keep_period=c.keep_period or None,
                                               create=True, enable_async_checkpointing=True)
        local = _local_directory(workdir, cfg) if c.local_dir else None  # its errors before anything is written
        _name_local_tier(workdir, local)
        self.shared = _Tier("shared", _manager(workdir, options), c.interval)
        self.tiers = [self.shared]
        if local:
            self.tiers.append(_Tier("local", _local_manager(local, c.keep), c.local_interval))
        self.manager, self.directory, self.interval = self.shared.manager, self.shared.directory, c.interval
        self.fail_on_save_error = c.fail_on_save_error
        self.config = cfg.to_dict()
        self.run = {"tokenizer": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None}

    @property
    def local(self) -> _Tier | None:
        return self.tiers[1] if len(self.tiers) > 1 else None

    @property
    def invalid(self) -> set[int]:
        """The shared tier's steps that failed to restore (overwritten when training reaches them again)."""
        return self.shared.invalid

    def latest_step(self) -> int | None:
        """The newest finalized step of the shared tier."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finalized step of the shared tier, ascending."""
        return self.shared.steps()

    def _candidates(self, step: int | None) -> list[tuple[_Tier, int]]:
        """``(tier, step)`` pairs to restore from, in order: newest first, a step that every process holds
        in its local tier before the same step in the shared one (collective)."""
        shared = self.shared.steps()
        if step is not None:
            return [(self.shared, step)]
        local = _held_everywhere(self.local.steps()) if self.local else []
        pairs = []
        for s in sorted(set(shared) | set(local), reverse=True):
            pairs += [(t, s) for t, held in ((self.local, local), (self.shared, shared)) if s in held]
        return pairs

    def restore(self, abstract_state, step: int | None = None):
        """The state saved at ``step``, laid out as ``abstract_state`` (a pytree of
        ``jax.ShapeDtypeStruct`` with shardings, on any mesh); None if there is no checkpoint.
        Collective: every process calls it.

        With ``step=None`` it tries the newest step first (from the local tier where every process
        has it, else the shared one); when a step cannot be read (a file deleted or truncated, a shape
        that does not match) by some process, or its arrays do not match the checksums saved with it, it
        tries the one before, and once one restores it logs one warning line per damaged step (the full
        error goes to the ``jaxllm.library`` logger, a file in ``WORKDIR/logs``) and moves the damaged
        steps to ``damaged/`` (see :meth:`_Tier.quarantine`).  ``step``: that step of the shared tier only.

        Raises:
          CheckpointError: ``step`` was given and cannot be restored, or no step can; the
            message lists each step tried and why it failed.
          ConfigError: the newest checkpoint is of another tokenizer, ``train.seq_length`` or optimizer
            (:meth:`_check_run_matches`).
        """
        candidates = self._candidates(step)
        for tier in self.tiers:
            newest = next((s for t, s in candidates if t is tier), None)
            if newest is not None:
                self._check_run_matches(tier, newest)
        failures = []
        for tier, s in candidates:
            state, why = self._read(tier, s, abstract_state)
            if why is not None:
                failures.append((tier, s, why))
                tier.invalid.add(s)
                continue
            self._report(failures, tier, s, quarantine=step is None)
            if self.local:  # newer local steps are of an abandoned trajectory: a process may save that step again
                for newer in (x for x in self.local.steps() if x > s):
                    self.local.manager.delete(newer)
            return state
        if failures:
            where = self.directory + (f" or {self.local.directory}" if self.local else "")
            raise CheckpointError(f"no checkpoint in {where} can be restored: "
                                  + "; ".join(f"step {f}{' (local)' if t.local else ''}: {why}"
                                              for t, f, why in failures)
                                  + ". Delete the damaged step directories, or the whole directory to start over.")
        return None

    def _read(self, tier: _Tier, step: int, abstract_state) -> tuple[object, str | None]:
        """``(state, None)``, or ``(None, why)`` where some process cannot read ``step`` of ``tier`` or its
        arrays do not match their checksums (collective: every process gets the same answer)."""
        try:
            state, saved = tier.restore(step, abstract_state)
            why = None
        except Exception as e:  # noqa: BLE001  Orbax/TensorStore raise many types for damaged files
            state, saved, why = None, None, _reason(e)
            library.info("checkpoint step %d in %s cannot be restored", step, tier.directory, exc_info=True)
        if not _everywhere(why is None):
            return None, why or "another process cannot read its part"
        if saved is not None:
            sums = checksums(state)
            bad = sorted(k for k in set(sums) | set(saved) if sums.get(k) != saved.get(k))
            if not _everywhere(not bad):
                return None, (f"{len(bad)} array(s) do not match the checksums saved with them ({', '.join(bad[:3])})"
                              if bad else "another process's arrays do not match their checksums")
        return state, None

    def _report(self, failures: list, tier: _Tier, step: int, *, quarantine: bool) -> None:
        """One warning line per step in ``failures`` (``(tier, step, why)``, all newer than ``step``, which
        restored from ``tier``), after moving them to ``damaged/`` if ``quarantine``."""
        moved = {}
        for t in self.tiers:
            if quarantine:
                moved.update({(t, s): d for s, d in t.quarantine([s for f, s, _ in failures if f is t]).items()})
        for t, f, why in failures:
            logging.warning("checkpoint step %d in %s cannot be restored (%s)%s; restored step %d instead", f,
                            t.directory, why, f", moved to {moved[t, f]}" if (t, f) in moved else "", step)
        if tier.local and jax.process_index() == 0:
            print(f"jaxllm: restored step {step} from the node-local checkpoints ({tier.directory} and the other "
                  "processes')", flush=True)

    def _check_run_matches(self, tier: _Tier, step: int) -> None:
        """A checkpoint of another model, or with another optimizer's state, would fail to restore on shapes
        or structure and look damaged, and one of another tokenizer or sequence length would train on other
        data: say what differs.

        Raises:
          ConfigError: another tokenizer (``data.tokenizer``), ``train.seq_length`` or ``train.optimizer``,
            or a hyperparameter that decides the optimizer's arrays (:data:`jaxllm.runtime.optim.STATE_SWITCHES`)
            on the other side of 0.
          CheckpointError: another model (the keys that differ).
        """
        try:
            saved, run = tier.read_json(step, "config"), tier.read_json(step, "run")
        except Exception:  # noqa: BLE001  an unreadable config is a damaged step: restore() reports it
            return
        where = f"the checkpoint at step {step} in {tier.directory}"
        self._check_data_matches(where, step, saved or {}, run or {})
        self._check_model_matches(step, saved or {}, tier.directory)
        self._check_optimizer_matches(step, saved or {}, tier.directory)

    def _check_data_matches(self, where: str, step: int, saved: dict, run: dict) -> None:
        ours, theirs = self.run.get("tokenizer"), run.get("tokenizer")
        if ours and theirs and ours["sha256"] != theirs["sha256"]:
            what = lambda t: f"{t['name']}, {t['vocab_size']} tokens, sha256 {t['sha256'][:12]}"  # noqa: E731
            raise ConfigError("data.tokenizer", self.config["data"]["tokenizer"],
                              f"{where} was trained with another tokenizer ({what(theirs)}; this run's: {what(ours)}): "
                              "its token ids stand for other text; resume with the tokenizer (and, for char, the "
                              "data.input) it was trained with, or train in another --workdir")
        length = saved.get("train", {}).get("seq_length")  # step 0 (an import) has read no data yet
        if step and length is not None and length != self.config["train"]["seq_length"]:
            raise ConfigError("train.seq_length", self.config["train"]["seq_length"],
                              f"{where} was trained with train.seq_length={length} (the position table and the "
                              f"data order depend on it); resume with --config.train.seq_length={length}, or train "
                              "in another --workdir")

    def _check_optimizer_matches(self, step: int, saved: dict, directory: str | None = None) -> None:
        ours, theirs = self.config["train"], saved.get("train", {})
        name = theirs.get("optimizer", "adamw")  # written before train.optimizer existed: AdamW
        name = config.OPTIMIZER_ALIASES.get(name, name)
        where = f"the checkpoint at step {step} in {directory or self.directory}"
        if name != ours["optimizer"]:
            raise ConfigError("train.optimizer", ours["optimizer"],
                              f"{where} holds the state of train.optimizer={name}; resume with "
                              f"--config.train.optimizer={name}, or train in another --workdir")
        for key in optim.STATE_SWITCHES.get(name, ()):
            if key in theirs and bool(theirs[key]) != bool(ours[key]):
                raise ConfigError(f"train.{key}", ours[key],
                                  f"{where} was written with train.{key}={theirs[key]!r}, and {name} keeps other "
                                  f"arrays when it is 0; resume with a value that is {'not ' if theirs[key] else ''}0, "
                                  "or train in another --workdir")

    def _check_model_matches(self, step: int, saved: dict, directory: str | None = None) -> None:
        ours, theirs = self.config["model"], saved.get("model", {})
        differ = [f"model.{k}={theirs[k]!r} (this run: {ours[k]!r})" for k in _SHAPE_KEYS
                  if k in ours and k in theirs and ours[k] != theirs[k] and ours[k] != 0]  # 0: derived, unknown here
        if differ:
            raise CheckpointError(
                f"the checkpoint at step {step} in {directory or self.directory} is of another model: "
                f"{', '.join(differ)}. Run with the config it was written with (--config=... and the same "
                "--config.model.* flags), or use another --workdir")

    def due(self, step: int) -> bool:
        """Whether a tier saves after ``step`` completed steps (besides the forced saves)."""
        return any(t.due(step) for t in self.tiers)

    def maybe_save(self, step: int, state, *, force: bool = False) -> bool:
        """Starts an asynchronous save of ``state`` into each tier whose interval ``step`` is on (the shared
        tier also when ``force``), with the checksums of its arrays; returns whether one started.  A step a
        tier holds already is kept, unless it failed to restore.  A save that fails (now, or in the
        background: reported at the tier's next save or at :meth:`close`) is one warning line.

        Raises:
          CheckpointError: a save failed and ``checkpoint.fail_on_save_error`` is set.
        """
        tiers = [t for t in self.tiers if t.due(step) or (force and t is self.shared)]
        items, started = None, False
        for tier in tiers:
            self._finish(tier)
            if step in tier.manager.all_steps() and step not in tier.invalid:
                continue
            items = items or {"config": self.config, "run": self.run, "checksums": {"arrays": checksums(state)}}
            try:
                started |= tier.save(step, state, items)
            except Exception as e:  # noqa: BLE001  full disk, lost permission, a directory gone: OSError and others
                self._save_failed(tier, step, e)
        return started

    def _finish(self, tier: _Tier) -> None:
        """Waits for ``tier``'s save in flight, reporting its failure (:meth:`_save_failed`)."""
        try:
            tier.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001  the background save's error, whatever its type
            self._save_failed(tier, tier.pending, e)
        tier.pending = None

    def _save_failed(self, tier: _Tier, step: int | None, e: Exception) -> None:
        """One warning line (or a :class:`CheckpointError` with ``checkpoint.fail_on_save_error``) for a
        failed save; Orbax deletes older steps only once a save completes, so those are intact."""
        library.info("checkpoint step %s in %s was not saved", step, tier.directory, exc_info=e)
        tier.pending, tier.stale = None, True
        line = (f"checkpoint step {step} was not saved to {tier.directory} ({_reason(e)}); the steps saved "
                "before it are intact")
        if self.fail_on_save_error:
            raise CheckpointError(f"{line}; stopping (checkpoint.fail_on_save_error=True)") from None
        logging.warning("%s; training goes on and the next save tries again (checkpoint.fail_on_save_error=True "
                        "stops instead)", line)

    def close(self):
        """Waits for pending saves (a failure is reported as in :meth:`maybe_save`) and releases the managers."""
        try:
            for tier in self.tiers:
                self._finish(tier)
        finally:
            for tier in self.tiers:
                tier.manager.close()


def _local_directory(workdir: str, cfg: config.Resolved) -> str:
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


def _name_local_tier(workdir: str, directory: str | None) -> None:
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


class Preemption:
    """SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) -> save at the next step boundary and exit (a context manager).

    Call :meth:`reached` with the number of completed steps at every step boundary; once
    it returns True, save and stop.  Single process: a Python handler for the three signals
    sets a flag.  Several processes must all stop after the same step, or the collective
    save hangs: JAX's preemption sync manager (started by ``jax.distributed.initialize``)
    catches SIGTERM in every process and agrees on a step through the coordination service,
    and :meth:`reached` is ``multihost_utils.reached_preemption_sync_point``; so SIGTERM is
    left to it (a Python handler would replace it) and SIGUSR1 and SIGINT are forwarded to
    it as SIGTERM.  Handlers are installed only from the main thread (Python's rule);
    :meth:`uninstall` (or leaving the ``with`` block) puts the previous ones back.

    Ctrl-C: the first SIGINT prints one line and stops like SIGTERM; its handler then gives
    SIGINT back to the operating system's default, so a second Ctrl-C ends the process at
    once (status 130 in a shell), even inside a long XLA call or while an asynchronous save
    completes: Orbax writes into a temporary directory renamed only when complete, so the
    previous checkpoints stay intact.  An inherited ignored SIGINT (a background job of a
    launcher script, ``nohup``) stays ignored.
    """

    def install(self) -> Preemption:
        """Installs the signal handlers; returns self."""
        self.multi = jax.process_count() > 1
        self.signum = None
        signals = (signal.SIGUSR1,) if self.multi else (signal.SIGTERM, signal.SIGUSR1)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signals += (signal.SIGINT,)
        in_main = threading.current_thread() is threading.main_thread()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals} if in_main else {}
        return self

    def uninstall(self) -> None:
        """Puts the previous signal handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    __enter__ = install

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the second Ctrl-C ends the process at once
            os.write(2, b"\njaxllm: Ctrl-C: saving a checkpoint at the end of this step, then stopping "
                        b"(Ctrl-C again: stop now, unsaved)\n")
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.signum = signum

    def reached(self, step: int) -> bool:
        """Whether to save after ``step`` completed steps and stop (collective when multi-process:
        every process must call it at every step)."""
        if self.multi:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return multihost_utils.reached_preemption_sync_point(step)
        return self.signum is not None

    def __exit__(self, *exc):
        self.uninstall()
        return False


def load_config(workdir: str, step: int | None = None) -> config.Config:
    """The config stored with the checkpoint at ``step`` (default: the latest) in ``workdir``.

    Raises:
      FileNotFoundError: ``workdir`` has no checkpoint.
    """
    manager = _manager(workdir)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints: train first "
                                    f"(python -m jaxllm.train --workdir={workdir})")
        saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    finally:
        manager.close()
    return config.from_dict(saved)


def restore_params(model_cfg: config.Model, workdir: str, step: int | None = None):
    """The parameters alone of ``workdir``'s checkpoint at ``step`` (default: the latest), on the
    host CPU whatever mesh the run used (the optimizer state is not read); ``model_cfg`` is the
    run's resolved ``model`` section (:func:`jaxllm.resolve.resolve_model`)."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu),
                            gpt.describe(model_cfg).params)
    manager = _manager(workdir)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints")
        item = {"params": abstract}
        strict = _same_shapes(manager, step, item)
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, strict=strict), item)
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True)))
    finally:
        manager.close()
    return restored["state"]["params"]
