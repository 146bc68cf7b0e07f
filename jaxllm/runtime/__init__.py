"""The training runtime: a run's compiled pieces on a mesh (:mod:`~jaxllm.runtime.run`), the step
functions (:mod:`~jaxllm.runtime.step`), the optimizer (:mod:`~jaxllm.runtime.optim`), evaluation,
checkpoints, metrics and FLOPs accounting, the stall watchdog, KV-cache sampling, the operations
chosen for CPUs (:mod:`~jaxllm.runtime.cpu`), and one writer per workdir (:mod:`~jaxllm.runtime.workdir_lock`)."""

__all__ = ["checkpoint", "cpu", "evaluation", "flops", "metrics", "optim", "run", "sampling", "step", "watchdog"]
