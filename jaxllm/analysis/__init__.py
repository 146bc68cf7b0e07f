"""The analysis layer: what a step costs, read from its compiled program and its traces, for the planning and
measuring tools (``plan``, ``tune``, ``bench``), never for the step itself: the collectives of a compiled step
per mesh axis (:mod:`~jaxllm.analysis.collectives`), the step-time model on a cluster
(:mod:`~jaxllm.analysis.step_time`), the step time of a GPU program predicted kernel by kernel
(:mod:`~jaxllm.analysis.gpu_time`) and its constants fitted to profiled steps (:mod:`~jaxllm.analysis.gpu_fit`), a
profiled step's kernels by category (:mod:`~jaxllm.analysis.profile`), and the layouts N devices allow, the
tuner's search space (:mod:`~jaxllm.analysis.layouts`)."""

__all__ = ["collectives", "gpu_fit", "gpu_time", "layouts", "profile", "step_time"]
