"""Data: tokenizers, text -> Megatron indexed datasets, blends, samples in Megatron-LM's order.

    from jaxllm.data import Data, Batches, DataError
    from jaxllm.data.prepare import prepare      # the function; ``jaxllm.data.prepare`` is the module

Modules: ``tokenizers`` (char, byte, gpt2, Hugging Face), ``indexed`` (the .bin/.idx format),
``prepare`` (the CLI that writes it), ``blend`` (data.input / data.file_list), ``samples``
(Megatron's index building), ``cache`` (built once across processes), ``loader`` (Data,
Batches), ``inspect`` (the CLI that shows a run's batches). See docs/data.md.
"""

from jaxllm.data.loader import Batches, Data, document_masks, unigram_entropy
from jaxllm.data.tokenizers import (
                                    ByteTokenizer,
                                    CharTokenizer,
                                    DataError,
                                    GPT2Tokenizer,
                                    HFTokenizer,
                                    tokenizer_from_meta,
)

__all__ = ["Batches", "ByteTokenizer", "CharTokenizer", "Data", "DataError", "GPT2Tokenizer", "HFTokenizer",
           "document_masks", "tokenizer_from_meta", "unigram_entropy"]
