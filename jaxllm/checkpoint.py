"""Sharded, asynchronous checkpoints with Orbax's CheckpointManager.

A checkpoint holds the training state (step, parameters, optimizer state) and
the run's full config as JSON.  Nothing else is needed to resume exactly: the
data position and the dropout keys are functions of the step.  Orbax writes
each step into a temporary directory and renames it when complete, so an
interrupted save never replaces the last good checkpoint.
"""

from __future__ import annotations

import os

import ml_collections
import orbax.checkpoint as ocp


class Checkpointer:
    """``WORKDIR/checkpoints``: saves every ``checkpoint.interval`` steps (and when forced),
    keeps the last ``checkpoint.keep``."""

    def __init__(self, workdir: str, cfg):
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                                             options=options)
        self.interval = cfg.checkpoint.interval
        self.config = cfg.to_dict()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state, step: int | None = None):
        """The state saved at ``step`` (default: the latest), laid out as ``abstract_state``
        (a pytree of ``jax.ShapeDtypeStruct`` with shardings); None if there is no checkpoint."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            return None
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        return restored["state"]

    def maybe_save(self, step: int, state, *, force: bool = False) -> bool:
        """Starts an asynchronous save of ``state`` if ``step`` is on the interval or ``force``."""
        if not force and not (self.interval and step % self.interval == 0):
            return False
        if step in self.manager.all_steps():
            return False
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(self.config)), force=True)

    def close(self):
        """Waits for pending saves and releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def load_config(workdir: str, step: int | None = None) -> ml_collections.ConfigDict:
    """The config stored with the checkpoint at ``step`` (default: the latest) in ``workdir``.

    Raises:
      FileNotFoundError: ``workdir`` has no checkpoint.
    """
    manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints: train first (python -m jaxllm.train --workdir={workdir})")
    cfg = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    manager.close()
    return ml_collections.ConfigDict(cfg)
