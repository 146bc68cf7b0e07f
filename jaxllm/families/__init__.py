"""The model families: each in one module (:mod:`~jaxllm.families.gpt2`, :mod:`~jaxllm.families.llama`,
:mod:`~jaxllm.families.mixtral`, :mod:`~jaxllm.families.qwen3_moe`, :mod:`~jaxllm.families.deepseek_v3`,
:mod:`~jaxllm.families.olmo2`, :mod:`~jaxllm.families.gemma3`, :mod:`~jaxllm.families.gpt_oss`), declaring
its ``FAMILY`` (:class:`~jaxllm.families.tables.Family`: preset, Hugging Face tables, rope types, Megatron refusals,
sizes); :mod:`~jaxllm.families.registry` lists them for the checkpoint formats (:mod:`jaxllm.formats`) and the
configs.  The model itself (:mod:`jaxllm.model`) and the rules table are shared by every family: a family is a
configuration of them, never a copy.

The package imports none of its modules: ``from jaxllm.families import registry``.
"""
