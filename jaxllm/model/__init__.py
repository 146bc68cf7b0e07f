"""The model: the GPT's assembly (:mod:`~jaxllm.model.gpt`: the GPT, its layer stack, :class:`~jaxllm.model.gpt.Ops`
and the functions on its parameters), its layers (:mod:`~jaxllm.model.layers`), the remat policies
(:mod:`~jaxllm.model.remat`), the attention dispatch (:mod:`~jaxllm.model.attention`), the fused chunked loss
(:mod:`~jaxllm.model.fused_loss`), mixture-of-experts routing (:mod:`~jaxllm.model.moe`), the FP8 matmul
(:mod:`~jaxllm.model.fp8`) and the parameters by path (:mod:`~jaxllm.model.params`).  It names no mesh axis:
:class:`~jaxllm.model.gpt.Ops` is all it knows of a layout.

The package imports none of its modules (so none of them imports it back half-initialised): import the
module, ``from jaxllm.model import gpt`` (``gpt.describe``, ``gpt.forward``, ...).
"""

__all__ = ["attention", "fp8", "fused_loss", "gpt", "layers", "moe", "params", "remat"]
