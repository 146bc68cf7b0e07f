"""jaxllm's attention kernels, installed as the package ``jaxllm_kernels``.

- ``reference``: plain XLA attention, the ``xla`` path and the reference every kernel is tested against;
- ``pallas_attention``: FlashAttention-2 in Pallas (Triton lowering: NVIDIA and AMD GPUs; interpreted on CPU),
  its kernels in ``pallas_flash``;
- ``triton_attention``: the same algorithm in the Triton language through ``jax_triton`` (GPUs only).

``jaxllm.model.attention`` dispatches between them by ``model.attention_impl``.
"""
