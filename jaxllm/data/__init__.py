"""Data: tokenizers, text -> Megatron indexed datasets, blends, samples in Megatron-LM's order.

    from jaxllm.data.loader import Data, Batches
    from jaxllm.errors import DataError

Modules: ``tokenizers`` (char, byte, gpt2, Hugging Face), ``indexed`` (the .bin/.idx format),
``text`` (text -> that format; its command line is :mod:`jaxllm.prepare`), ``blend`` (data.input /
data.file_list), ``samples`` (Megatron's index building), ``cache`` (built once across processes),
``loader`` (Data, Batches).  :mod:`jaxllm.inspect_data` shows a run's batches.  See docs/data.md.

The package imports none of its modules (each imports the package first: no import cycle).
"""

__all__ = ["blend", "cache", "indexed", "loader", "samples", "text", "tokenizers"]
