"""The model: the GPT (:mod:`~jaxllm.model.gpt`), its attention dispatch (:mod:`~jaxllm.model.attention`),
the fused chunked loss (:mod:`~jaxllm.model.fused_loss`), mixture-of-experts routing
(:mod:`~jaxllm.model.moe`), the FP8 matmul (:mod:`~jaxllm.model.fp8`) and
the Hugging Face architecture tables (:mod:`~jaxllm.model.hf`).  It names no mesh axis: :class:`Ops` is all
it knows of a layout.

``from jaxllm import model`` gives the GPT's functions (``model.describe``, ``model.forward``, ...).
"""

from jaxllm.model.gpt import (
    GPT,
    LOCAL,
    MOE_STATS,
    REMAT_POLICIES,
    RESIDUAL,
    Ops,
    Spec,
    active_params,
    cast_layers,
    dense,
    describe,
    forward,
    gelu,
    init,
    init_cache,
    logical_sizes,
    loss,
    num_params,
    rotary,
    row_keys,
)

__all__ = ["GPT", "LOCAL", "MOE_STATS", "REMAT_POLICIES", "RESIDUAL", "Ops", "Spec", "active_params", "cast_layers",
           "dense", "describe", "forward", "gelu", "init", "init_cache", "logical_sizes", "loss", "num_params",
           "rotary", "row_keys"]
