"""jaxllm's attention kernels, installed as the package ``jaxllm_kernels``.

``reference.attention`` is the plain XLA implementation that every kernel is
tested against.
"""
