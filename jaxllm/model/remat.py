"""The remat policies of ``model.remat``: which of a layer's named activations (:mod:`jaxllm.model.layers`'
``checkpoint_name`` calls, MaxText's names) its backward pass keeps, the rest recomputed.
"""

import jax

# The layer's named activations (``checkpoint_name``, MaxText's names): its input (``decoder_layer_input``),
# each matmul's output and the attention output (``context``).  A remat policy saves some for the backward
# pass and recomputes the rest.
QKV = ("query_proj", "key_proj", "value_proj")
MATMULS = (*QKV, "out_proj", "mlpwi", "mlpwi_gate", "mlpwo")
_names = jax.checkpoint_policies.save_only_these_names


def _offloaded(*names):
    """Save ``names`` in host memory (pinned) instead of device memory; recompute the rest."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host")


# ``model.remat``: what each layer keeps for its backward pass (MaxText's policy names; "none": everything).
# ``full`` keeps only the layer's input (the checkpointed function's argument); ``offload`` keeps that in
# host memory (MaxText's ``decoder_layer_input: offload``): nothing of the layer stays on the device, so
# device memory no longer grows with layers x tokens.  The saved sets, by size: offload < full < save_qkv_proj
# < save_dots_except_mlp < minimal ~ save_dots (the same matmuls, whose outputs have no dot batch dimension;
# minimal keeps them after the bias) < minimal_with_context.
POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": _names(*MATMULS),
    "minimal_with_context": _names(*MATMULS, "context"),
    "save_qkv_proj": _names(*QKV),
    "save_dots_except_mlp": _names(*QKV, "out_proj"),
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal_offloaded": _offloaded(*MATMULS),
    "qkv_proj_offloaded": _offloaded(*QKV),
    "offload": _offloaded("decoder_layer_input"),
}

