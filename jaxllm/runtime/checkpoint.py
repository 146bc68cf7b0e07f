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

The tiers' Orbax managers (and why not Orbax's emergency manager) are in
:mod:`jaxllm.runtime.checkpoint_tiers`, the checksums in :mod:`jaxllm.runtime.checksums`, the
signals in :mod:`jaxllm.runtime.preemption`.

Verification: Orbax and TensorStore (0.12.8) do not detect a changed byte in an array's
chunk (the array restores with other values), so every save records a checksum of each
array (:func:`checksums`, computed on the devices) and a restore compares them.  A step that
cannot be read or does not match is reported in one warning line, moved to ``damaged/``
(:meth:`jaxllm.runtime.checkpoint_tiers.Tier.quarantine`) and the step before is restored.

Restoring takes an abstract state (``jax.ShapeDtypeStruct`` leaves with shardings), which may
describe another mesh than the one that saved (shared tier): each process then reads only the
shards its devices need.
"""

from __future__ import annotations

import logging as python_logging
import os
import re

import jax
import orbax.checkpoint as ocp
from absl import logging

from jaxllm import config
from jaxllm.errors import ConfigError
from jaxllm.model import gpt
from jaxllm.model.params import unpadded_shapes
from jaxllm.resolve import resolve_model
from jaxllm.runtime import checkpoint_tiers as tiers
from jaxllm.runtime import optim
from jaxllm.runtime.checksums import checksums, tokenizer_fingerprint

# Library detail (full Orbax/TensorStore errors): a log file, not the console (see jaxllm.platform.console).
library = python_logging.getLogger("jaxllm.library")

class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be restored (the message names each step and why), or a save failed
    (:class:`SaveError`)."""


# Exit status of jaxllm.train and jaxllm.convert stopped by a SaveError: BSD's EX_IOERR.  The launch scripts do not
# restart it (it would fail again); free space and rerun, which resumes from the newest saved step.
EXIT_SAVE_FAILED = 74


class SaveError(CheckpointError):
    """A checkpoint was not saved (a full disk or quota, a directory gone): its partial directory is removed and the
    message names the newest complete step, which a rerun resumes from; the run stops (``jaxllm.train`` exits 74)
    unless ``checkpoint.fail_on_save_error=False``, and always when the last save of a run failed."""


class ModelMismatch(ConfigError, CheckpointError):
    """The checkpoint is of another model: a model key that changes the parameters differs (a config error, exit 2,
    not a damaged checkpoint); the message names each such key with both values."""


def _parameter_shapes(model: dict, seq_length: int) -> dict[str, tuple[int, ...]] | None:
    """The parameters (path -> shape, the vocabulary unpadded) of a saved config's ``model`` section; None if
    it no longer resolves (then the restore itself says what is wrong)."""
    try:
        m = resolve_model(config.from_dict({"model": model}).model, seq_length=seq_length)
        return unpadded_shapes(m, gpt.describe(m))
    except (ConfigError, ValueError):
        return None


def _reason(e: Exception) -> str:
    """One line saying why a restore or save failed (Orbax and TensorStore errors span many lines, the system's
    reason at their end: ``[os_error_code='28']``), e.g. ``No space left on device (ValueError: RESOURCE_EXHAUSTED:
    Error writing local file ...)``."""
    text = str(e)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    why = f"{type(e).__name__}: {first[:300]}"
    code = re.search(r"os_error_code='?(\d+)|\[Errno (\d+)\]", text)
    if code:
        system = os.strerror(int(code.group(1) or code.group(2)))
        if system not in why:
            return f"{system} ({type(e).__name__}: {first[:160]}...)"
    return why


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
        local = tiers.local_directory(workdir, cfg) if c.local_dir else None  # its errors before anything is written
        tiers.name_local_tier(workdir, local)
        self.shared = tiers.Tier("shared", tiers.shared_manager(workdir, options), c.interval)
        self.tiers = [self.shared]
        if local:
            self.tiers.append(tiers.Tier("local", tiers.local_manager(local, c.keep), c.local_interval))
        self.manager, self.directory, self.interval = self.shared.manager, self.shared.directory, c.interval
        self.fail_on_save_error = c.fail_on_save_error
        self.config = cfg.to_dict()
        self.run = {"tokenizer": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None}

    @property
    def local(self) -> tiers.Tier | None:
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

    def _candidates(self, step: int | None) -> list[tuple[tiers.Tier, int]]:
        """``(tier, step)`` pairs to restore from, in order: newest first, a step that every process holds
        in its local tier before the same step in the shared one (collective)."""
        shared = self.shared.steps()
        if step is not None:
            return [(self.shared, step)]
        local = tiers.held_everywhere(self.local.steps()) if self.local else []
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
        steps to ``damaged/`` (see :meth:`jaxllm.runtime.checkpoint_tiers.Tier.quarantine`).  ``step``: that
        step of the shared tier only.

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

    def _read(self, tier: tiers.Tier, step: int, abstract_state) -> tuple[object, str | None]:
        """``(state, None)``, or ``(None, why)`` where some process cannot read ``step`` of ``tier`` or its
        arrays do not match their checksums (collective: every process gets the same answer)."""
        try:
            state, saved = tier.restore(step, abstract_state)
            why = None
        except Exception as e:  # noqa: BLE001  Orbax/TensorStore raise many types for damaged files
            state, saved, why = None, None, _reason(e)
            library.info("checkpoint step %d in %s cannot be restored", step, tier.directory, exc_info=True)
        if not tiers.everywhere(why is None):
            return None, why or "another process cannot read its part"
        if saved is not None:
            sums = checksums(state)
            bad = sorted(k for k in set(sums) | set(saved) if sums.get(k) != saved.get(k))
            if not tiers.everywhere(not bad):
                return None, (f"{len(bad)} array(s) do not match the checksums saved with them ({', '.join(bad[:3])})"
                              if bad else "another process's arrays do not match their checksums")
        return state, None

    def _report(self, failures: list, tier: tiers.Tier, step: int, *, quarantine: bool) -> None:
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

    def _check_run_matches(self, tier: tiers.Tier, step: int) -> None:
        """A checkpoint of another model, or with another optimizer's state, would fail to restore on shapes
        or structure and look damaged, and one of another tokenizer or sequence length would train on other
        data: say what differs.

        Raises:
          ConfigError: another tokenizer (``data.tokenizer``), ``train.seq_length`` or ``train.optimizer``,
            or a hyperparameter that decides the optimizer's arrays (:data:`jaxllm.runtime.optim.STATE_SWITCHES`)
            on the other side of 0.
          ModelMismatch: another model (the keys that differ and change the parameters).
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
        _check_tokenizer_matches(where, self.config["data"]["tokenizer"], self.run.get("tokenizer"),
                                 run.get("tokenizer"))
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
        """Raises :class:`ModelMismatch` when the saved model's parameters (:func:`jaxllm.model.gpt.describe`)
        are not this run's, naming each model key that differs and changes them on its own (or, if none does
        alone, every model key that differs)."""
        ours, theirs = self.config["model"], saved.get("model", {})
        if not ours.get("padded_vocab_size"):  # an unresolved config (a tool's): its sizes of 0 are unknown here
            ours = {k: theirs.get(k, v) if type(v) is int and v == 0 else v for k, v in ours.items()}
        seq = self.config["train"]["seq_length"]
        saved_seq = saved.get("train", {}).get("seq_length", seq)
        shapes = _parameter_shapes(theirs, saved_seq)
        if shapes is None or shapes == _parameter_shapes(ours, seq):
            return
        derived = {k for k, f in config.Model.__dataclass_fields__.items() if f.metadata.get("derived")}
        differ = [k for k in ours if k in theirs and ours[k] != theirs[k] and k not in derived]
        keys = [k for k in differ if _parameter_shapes({**theirs, k: ours[k]}, saved_seq) != shapes] or differ
        if not keys:  # nothing of the model section: the restore says what does not fit
            return
        raise ModelMismatch(
            f"model.{keys[0]}", ours[keys[0]],
            f"the checkpoint at step {step} in {directory or self.directory} is of another model: "
            + ", ".join(f"model.{k}={theirs[k]!r} (this run: {ours[k]!r})" for k in keys)
            + ". Run with the config it was written with (--config=... and the same --config.model.* flags), or use "
            "another --workdir")

    def due(self, step: int) -> bool:
        """Whether a tier saves after ``step`` completed steps (besides the forced saves)."""
        return any(t.due(step) for t in self.tiers)

    def maybe_save(self, step: int, state, *, force: bool = False) -> bool:
        """Starts an asynchronous save of ``state`` into each tier whose interval ``step`` is on (the shared
        tier also when ``force``), with the checksums of its arrays; returns whether one started.  A step a
        tier holds already is kept, unless it failed to restore.  A tier's filesystem with less free space than
        the checkpoint's arrays take fails the save at once (where ``statvfs`` tells it).  A failed save (now, or
        in the background: found by :meth:`poll`, the tier's next save or :meth:`close`) is :meth:`_save_failed`'s.

        Raises:
          SaveError: a save failed and ``checkpoint.fail_on_save_error`` is set (the default), or a forced save (the
            run's last, a preemption's) failed.
        """
        due = [t for t in self.tiers if t.due(step) or (force and t is self.shared)]
        items, started = None, False
        for tier in due:
            self._finish(tier)
            if step in tier.manager.all_steps() and step not in tier.invalid:
                continue
            items = items or {"config": self.config, "run": self.run, "checksums": {"arrays": checksums(state)}}
            try:
                tier.check_space(state)
                started |= tier.save(step, state, items)
            except Exception as e:  # noqa: BLE001  full disk, lost permission, a directory gone: OSError and others
                self._save_failed(tier, step, e, last=force and tier is self.shared)  # the end's, a preemption's
        return started

    def poll(self) -> None:
        """Reports a background save that has failed since (:meth:`_save_failed`), without waiting for one in
        flight: a run stops at the failed save, not at the next.  Only where the answer is this process's alone
        (one process, or its node-local tier); the shared tier of a multi-process run is checked at its saves."""
        for tier in self.tiers:
            if tier.pending is not None and (tier.local or jax.process_count() == 1) \
                    and not tier.manager.is_saving_in_progress():
                self._finish(tier)

    def _finish(self, tier: tiers.Tier, *, last: bool = False) -> None:
        """Waits for ``tier``'s save in flight, reporting its failure (:meth:`_save_failed`)."""
        try:
            tier.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001  the background save's error, whatever its type
            self._save_failed(tier, tier.pending, e, last=last)
        tier.pending = None

    def _save_failed(self, tier: tiers.Tier, step: int | None, e: Exception, *, last: bool = False) -> None:
        """A failed save: its partial directory removed (it would keep a full disk full), then a :class:`SaveError`
        naming the newest complete step, or with ``checkpoint.fail_on_save_error=False`` (not for the ``last`` save
        of a run) one warning line.  Orbax deletes older steps only once a save completes, so those are intact."""
        library.info("checkpoint step %s in %s was not saved", step, tier.directory, exc_info=e)
        tier.pending, tier.stale = None, True
        try:  # a save that failed as it started may have threads still writing (what is left: close() removes it)
            tier.manager.wait_until_finished()
        except Exception:  # noqa: BLE001, S110  the same failure, said below
            pass
        tier.remove_partial()
        newest = tier.newest()
        line = (f"checkpoint step {step} was not saved to {tier.directory} ({_reason(e)}); "
                + (f"the newest complete checkpoint there is step {newest}" if newest is not None else
                   "it holds no complete checkpoint"))
        if self.fail_on_save_error or last:
            resume = f"resumes from step {newest}" if newest is not None else "starts over"
            raise SaveError(f"{line}; stopping: free space (or fix the directory) and rerun, which {resume}"
                            + ("" if last else " (checkpoint.fail_on_save_error=False trains on instead)")) from None
        logging.warning("%s; training goes on and the next save tries again (checkpoint.fail_on_save_error=False)",
                        line)

    def close(self):
        """Waits for pending saves (a failure is a :class:`SaveError` whatever ``checkpoint.fail_on_save_error``
        says: it was the run's last) and releases the managers."""
        try:
            for tier in self.tiers:
                self._finish(tier, last=True)
        finally:
            for tier in self.tiers:
                tier.manager.close()
                if tier.stale:  # a save failed: what its writes left since it was said
                    tier.remove_partial(settle_s=1.0)


def _check_tokenizer_matches(where: str, value: str, ours: dict | None, theirs: dict | None) -> None:
    """Raises ConfigError (``data.tokenizer``, ``value``) when two tokenizer fingerprints (``tokenizer_fingerprint``,
    None: unknown) differ: ``where``'s (a checkpoint) and this run's."""
    if ours and theirs and ours["sha256"] != theirs["sha256"]:
        what = lambda t: f"{t['name']}, {t['vocab_size']} tokens, sha256 {t['sha256'][:12]}"  # noqa: E731
        raise ConfigError("data.tokenizer", value,
                          f"{where} was trained with another tokenizer ({what(theirs)}; this run's: {what(ours)}): "
                          "its token ids stand for other text; resume with the tokenizer (and, for char, the "
                          "data.input) it was trained with, or train in another --workdir")


def check_resume_tokenizer(workdir: str, value: str, tokenizer) -> None:
    """Before a run tokenizes its text with ``tokenizer`` (``data.tokenizer=value``): the refusal that resuming
    would give (:meth:`Checkpointer.restore`) when the newest checkpoint in ``WORKDIR/checkpoints`` was trained with
    another tokenizer, so that nothing is written first.  Reads, writes nothing.

    Raises:
      ConfigError: ``data.tokenizer``, as the resume's.
    """
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    if not os.path.isdir(directory):
        return
    manager = tiers.shared_manager(workdir)
    try:
        step = manager.latest_step()
        if step is None or not os.path.isdir(os.path.join(directory, str(step), "run")):
            return
        run = manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"] or {}
    finally:
        manager.close()
    _check_tokenizer_matches(f"the checkpoint at step {step} in {directory}", value, tokenizer_fingerprint(tokenizer),
                             run.get("tokenizer"))


def load_config(workdir: str, step: int | None = None) -> config.Config:
    """The config stored with the checkpoint at ``step`` (default: the latest) in ``workdir``.

    Raises:
      FileNotFoundError: ``workdir`` has no checkpoint.
    """
    manager = tiers.shared_manager(workdir)
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
    return restore_on_host(workdir, {"params": gpt.describe(model_cfg).params}, step)[1]["params"]


def restore_on_host(workdir: str, item: dict, step: int | None = None) -> tuple[int, dict]:
    """``(step, state)``: the parts of the training state that ``item`` names (a subtree of it, leaves with
    ``shape`` and ``dtype``: e.g. ``{"params": ..., "opt_state": ...}``) from ``workdir``'s checkpoint at
    ``step`` (default: the latest), on the host CPU in ``item``'s shapes whatever mesh (and ZeRO padding) the
    run used.  Raises FileNotFoundError: no checkpoint."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    item = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu), item)
    manager = tiers.shared_manager(workdir)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints")
        strict = tiers.same_shapes(manager, step, item)
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, strict=strict), item)
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True)))
    finally:
        manager.close()
    return step, restored["state"]
