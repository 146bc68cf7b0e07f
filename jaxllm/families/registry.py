"""The model families jaxllm holds, in one list (:data:`FAMILIES`), and what the checkpoint formats and configs read
of them: the Hugging Face tables by ``model_type``, the rope types, the Megatron refusals, the sizes.  A new family
is a module of :mod:`jaxllm.families` declaring a ``FAMILY`` (:class:`~jaxllm.families.tables.Family`), listed here
(``tests/test_families.py`` fails on a family module not listed)."""

from __future__ import annotations

from typing import Any

from jaxllm.families import deepseek_v3, gemma3, gpt2, gpt_oss, llama, mixtral, olmo2, qwen3_moe
from jaxllm.families.tables import Arch, Family, RopeType

# in the order the export tries their tables (a model fits one); the later ones' hallmarks are asked first
FAMILIES: tuple[Family, ...] = (gpt2.FAMILY, llama.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY, deepseek_v3.FAMILY,
                                olmo2.FAMILY, gemma3.FAMILY, gpt_oss.FAMILY)


def _merged(field: str) -> dict:
    """The families' dicts ``field`` merged, each key held by one family only."""
    out = {}
    for f in FAMILIES:
        for key, value in getattr(f, field).items():
            assert key not in out, f"{field}: {key!r} declared by two families"
            out[key] = value
    return out


ARCHITECTURES: dict[str, Arch] = _merged("hf_tables")
ROPE_TYPES: dict[str, RopeType] = _merged("rope_types")
MEGATRON_ARGS: dict[str, tuple[tuple, str]] = _merged("megatron_args")
MEGATRON_KEYS: dict[str, Any] = _merged("megatron_keys")
SIZES: dict[str, dict[str, Any]] = _merged("sizes")


def family(name: str) -> Family:
    """The family ``name`` (``llama``). Raises KeyError naming the families."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no model family {name!r}: jaxllm holds {', '.join(f.name for f in FAMILIES)}")
