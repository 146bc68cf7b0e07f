"""Checkpoint formats of other frameworks <-> jaxllm workdirs (``python -m jaxllm.convert``): Hugging Face
(:mod:`~jaxllm.formats.hf`, the engine over the families' tables; :mod:`~jaxllm.formats.hf_workdir`), Megatron-LM
(:mod:`~jaxllm.formats.megatron`, megatron-core's ``GPTModel`` in jaxllm's terms; :mod:`~jaxllm.formats.torch_dist`,
its files; :mod:`~jaxllm.formats.megatron_workdir`) and Megatron-DeepSpeed (:mod:`~jaxllm.formats.deepspeed`), and
what every import into a workdir shares (:mod:`~jaxllm.formats.workdir`).  Their errors are
:class:`jaxllm.errors.ConvertError` (one line, exit 2).

The package imports none of its modules: ``from jaxllm.formats import hf``.
"""
