"""Sharded, asynchronous checkpoints with Orbax's CheckpointManager, and preemption.

What a checkpoint holds: the training state (``step``, ``params``, ``opt_state`` and
the skipped-step counters ``nonfinite_steps``/``nonfinite_in_a_row``) and the run's
full config as JSON (``train.optimizer`` says whose state ``opt_state`` is: resuming with
another optimizer is a :class:`~jaxllm.errors.ConfigError`, not a damaged checkpoint).
Nothing else is needed to resume exactly: the data position is a function of the step
(batch ``s`` is :meth:`jaxllm.data.Loader.train_batch` ``(s)``), and so are the dropout
keys (``fold_in(key(train.seed), step)``, see :func:`jaxllm.runtime.step.make_train_step`);
a resumed run computes bit for bit what an uninterrupted one computes.

Policy: a save every ``checkpoint.interval`` steps and at the end (or on
preemption); the last ``checkpoint.keep`` are kept, and with
``checkpoint.keep_period`` = k also every step that is a multiple of k.

Crash safety: Orbax writes each step into ``STEP.orbax-checkpoint-tmp-*`` and
renames it to ``STEP`` once every file is written, so a process killed during a
(possibly asynchronous) save leaves the previous checkpoints intact, and the
step listing (hence :meth:`Checkpointer.latest_step`) never includes a
temporary directory.  A finalized step directory damaged afterwards (a deleted or
truncated file) is detected at restore: :meth:`Checkpointer.restore` warns and
falls back to the previous step.

Restoring takes an abstract state (``jax.ShapeDtypeStruct`` leaves with
shardings), which may describe another mesh than the one that saved: each
process then reads only the shards its devices need.
"""

from __future__ import annotations

import logging as python_logging
import os
import signal
import threading

import jax
import orbax.checkpoint as ocp
from absl import logging

from jaxllm import config, model
from jaxllm.errors import ConfigError
from jaxllm.runtime import optim

# Library detail (full Orbax/TensorStore errors): a log file, not the console (see jaxllm.platform.console).
library = python_logging.getLogger("jaxllm.library")

# The model keys that decide the parameters' shapes (the others, e.g. remat or dtype, may change on resume).
_SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
               "max_position_embeddings", "position_embedding", "norm", "activation", "use_bias", "tie_embeddings")


def _manager(workdir: str, options: ocp.CheckpointManagerOptions | None = None) -> ocp.CheckpointManager:
    """Orbax's manager of ``WORKDIR/checkpoints`` (every reader and writer of checkpoints uses this)."""
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


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
    """Checkpoints exist but none can be restored; the message names each step and why."""


def _reason(e: Exception) -> str:
    """One line saying why a restore failed (Orbax and TensorStore errors span many lines)."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"


class Checkpointer:
    """``WORKDIR/checkpoints``: saves every ``checkpoint.interval`` steps (and when forced),
    keeps the last ``checkpoint.keep`` and every ``checkpoint.keep_period``-th step."""

    def __init__(self, workdir: str, cfg: config.Resolved):
        c = cfg.checkpoint
        options = ocp.CheckpointManagerOptions(max_to_keep=c.keep, keep_period=c.keep_period or None,
                                               create=True, enable_async_checkpointing=True)
        self.manager = _manager(workdir, options)
        self.directory = str(self.manager.directory)
        self.interval = c.interval
        self.config = cfg.to_dict()
        self.invalid: set[int] = set()  # steps that failed to restore: overwritten when training reaches them again

    def latest_step(self) -> int | None:
        """The newest finalized step (temporary directories of interrupted saves are not steps)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finalized step, ascending."""
        return sorted(self.manager.all_steps())

    def restore(self, abstract_state, step: int | None = None):
        """The state saved at ``step``, laid out as ``abstract_state`` (a pytree of
        ``jax.ShapeDtypeStruct`` with shardings, on any mesh); None if there is no checkpoint.

        With ``step=None`` it tries the newest step first; when a step cannot be read (a
        file deleted or truncated, a shape that does not match) it tries the one before, and
        once one restores it logs one warning line per damaged step (the full error goes to
        the ``jaxllm.library`` logger, a file in ``WORKDIR/logs``) and moves the damaged steps
        to ``checkpoints/damaged/`` (see :meth:`_quarantine`).  In a multi-process run every
        process must see the same files (a shared filesystem), so that all of them fall back
        alike.

        Raises:
          CheckpointError: ``step`` was given and cannot be restored, or no step can; the
            message lists each step tried and why it failed.
        """
        steps = self.all_steps()[::-1] if step is None else [step]
        if steps:
            self._check_run_matches(steps[0])
        failures = []
        for s in steps:
            try:
                strict = _same_shapes(self.manager, s, abstract_state)
                restored = self.manager.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state, strict=strict)))
            except Exception as e:  # noqa: BLE001  Orbax/TensorStore raise many types for damaged files
                failures.append((s, _reason(e)))
                self.invalid.add(s)
                library.info("checkpoint step %d in %s cannot be restored", s, self.directory, exc_info=True)
                continue
            moved = self._quarantine([f for f, _ in failures]) if step is None else {}
            for f, why in failures:  # one line per damaged step
                logging.warning("checkpoint step %d in %s cannot be restored (%s)%s; restored step %d instead", f,
                                self.directory, why, f", moved to {moved[f]}" if f in moved else "", s)
            return restored["state"]
        if failures:
            raise CheckpointError(f"no checkpoint in {self.directory} can be restored: "
                                  + "; ".join(f"step {f}: {why}" for f, why in failures)
                                  + ". Delete the damaged step directories, or the whole directory to start over.")
        return None

    def _quarantine(self, steps: list[int]) -> dict[int, str]:
        """Moves damaged ``steps`` (newer than the one restored) to ``checkpoints/damaged/STEP``:
        kept for inspection, but out of Orbax's step list, so that ``checkpoint.keep`` counts
        good checkpoints only (Orbax's LatestN keeps the newest ``keep`` steps it lists,
        damaged or not) and a later save of the same step needs no special case.  Process 0
        moves them; every process then waits for it and re-reads the step list.  Returns
        ``{step: new directory}``."""
        if not steps:
            return {}
        moved = {}
        for s in steps:
            target = os.path.join(self.directory, "damaged", str(s))
            while os.path.exists(target):  # damaged before, at the same step
                target += "+"
            moved[s] = target
        if jax.process_index() == 0:
            os.makedirs(os.path.join(self.directory, "damaged"), exist_ok=True)
            for s, target in moved.items():
                os.rename(os.path.join(self.directory, str(s)), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            multihost_utils.sync_global_devices("jaxllm checkpoint quarantine")
        self.manager.reload()
        return moved

    def _check_run_matches(self, step: int) -> None:
        """A checkpoint of another model, or with another optimizer's state, would fail to restore on shapes
        or structure and look damaged: say what differs.

        Raises:
          CheckpointError: another model (the keys that differ).
          ConfigError: another ``train.optimizer``, or a hyperparameter that decides the optimizer's
            arrays (:data:`jaxllm.runtime.optim.STATE_SWITCHES`) on the other side of 0.
        """
        try:
            saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except Exception:  # noqa: BLE001  an unreadable config is a damaged step: restore() reports it
            return
        self._check_model_matches(step, saved)
        self._check_optimizer_matches(step, saved)

    def _check_optimizer_matches(self, step: int, saved: dict) -> None:
        ours, theirs = self.config["train"], saved.get("train", {})
        name = theirs.get("optimizer", "adamw")  # written before train.optimizer existed: AdamW
        name = config.OPTIMIZER_ALIASES.get(name, name)
        where = f"the checkpoint at step {step} in {self.directory}"
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

    def _check_model_matches(self, step: int, saved: dict) -> None:
        ours, theirs = self.config["model"], saved.get("model", {})
        differ = [f"model.{k}={theirs[k]!r} (this run: {ours[k]!r})" for k in _SHAPE_KEYS
                  if k in ours and k in theirs and ours[k] != theirs[k] and ours[k] != 0]  # 0: derived, unknown here
        if differ:
            raise CheckpointError(
                f"the checkpoint at step {step} in {self.directory} is of another model: {', '.join(differ)}. "
                "Run with the config it was written with (--config=... and the same --config.model.* flags), "
                "or use another --workdir")

    def maybe_save(self, step: int, state, *, force: bool = False) -> bool:
        """Starts an asynchronous save of ``state`` if ``step`` is on the interval or ``force``;
        returns whether it did.  A step that exists already is kept, unless it failed to restore."""
        if not force and not (self.interval and step % self.interval == 0):
            return False
        if step in self.manager.all_steps():
            if step not in self.invalid:
                return False
            logging.warning("replacing checkpoint step %d, which could not be restored", step)
            self.manager.delete(step)
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(self.config)), force=True)

    def close(self):
        """Waits for pending saves and releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


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
                            model.describe(model_cfg).params)
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
