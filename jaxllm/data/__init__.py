"""Data: tokenizers, preparing text into token files, and stateless batch loading.

    from jaxllm.data import TokenData, Loader, ensure_prepared
    from jaxllm.data.prepare import prepare      # the function; ``jaxllm.data.prepare`` is the module

``ensure_prepared`` is imported lazily so that ``python -m jaxllm.data.prepare`` does not find
its own module already imported (runpy warns about that).
"""

from jaxllm.data.loader import Loader, TokenData
from jaxllm.data.tokenizers import ByteTokenizer, CharTokenizer, DataError, GPT2Tokenizer, tokenizer_from_meta

__all__ = ["ByteTokenizer", "CharTokenizer", "DataError", "GPT2Tokenizer", "Loader", "TokenData",
           "ensure_prepared", "tokenizer_from_meta"]


def __getattr__(name):
    if name == "ensure_prepared":
        from jaxllm.data.prepare import ensure_prepared

        return ensure_prepared
    raise AttributeError(f"module 'jaxllm.data' has no attribute {name!r}")
