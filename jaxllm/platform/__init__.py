"""The platform: joining a multi-process job (:mod:`~jaxllm.platform.distributed`), GPU settings applied
before JAX starts (:mod:`~jaxllm.platform.gpu_env`), device tables (:mod:`~jaxllm.platform.hardware`),
what a run prints (:mod:`~jaxllm.platform.console`), the host allocator on CPUs
(:mod:`~jaxllm.platform.host_memory`) and XLA:GPU's compile for a GPU that is not here
(:mod:`~jaxllm.platform.xla_gpu`).  Nothing here imports the model."""

__all__ = ["console", "distributed", "gpu_env", "hardware", "host_memory", "xla_gpu"]
