"""Expert parallelism: a mixture of experts' tokens brought to their experts' devices and back.

The ``experts`` operation of :class:`jaxllm.model.gpt.Ops` on a mesh.  It runs under ``jax.shard_map``, manual
over every mesh axis, with specs from the rules table: each device routes its own tokens (batch over the
data axes, length over the sequence axes) and holds the experts of its ``expert`` shard, split over
``tensor`` along their hidden dimension (column- then row-parallel, as the dense MLP).  Dispatch is
Megatron-LM's ``allgather`` token dispatcher (``megatron/core/transformer/moe/token_dispatcher.py``):

1. the tokens and their routing are all-gathered over the ``expert`` axes (each device of an expert group
   then sees the group's tokens);
2. each device runs its experts on the copies routed to them, sorted into grouped matmuls
   (:func:`jaxllm.model.moe.experts`), and weights them by the router;
3. the partial outputs are summed over ``tensor`` and reduce-scattered over ``expert``, which returns each
   device its own tokens with every expert's contribution.

Dropless with static shapes: no capacity buffer, no token is lost, whatever the routing.  It moves
``expert`` x the tokens where an all-to-all moves ``topk`` x; the all-to-all dispatcher is the next step for
large expert groups.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.model import moe
from jaxllm.parallel.sharding import Layout


def _axis(axes):
    return axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True, eq=False)
class Experts:
    """The experts of a mixture of experts on ``layout``'s mesh (see the module docstring).

    Called as :func:`jaxllm.model.moe.local_experts`: ``x`` ``[batch, len, embed]``, ``ids`` int32 and
    ``weights`` float32 ``[batch, len, topk]``, the expert weights ``[experts, ...]`` (global shapes) ->
    ``[batch, len, embed]`` in ``dtype``, laid out as ``x``'s ``(batch, length)``.
    """

    layout: Layout

    def __call__(self, x, ids, weights, w1, wg, w2, b1, b2, *, activation, dtype):
        layout = self.layout
        if layout.mesh.size == 1:
            return moe.local_experts(x, ids, weights, w1, wg, w2, b1, b2, activation=activation, dtype=dtype)
        ep, tp = layout.mesh_axes("experts"), layout.mesh_axes("expert_mlp")
        n_ep, n_tp = layout.size("experts"), layout.size("expert_mlp")
        tokens = layout.spec(("batch", "length", None))
        w_in, w_out = layout.spec(("experts", None, "expert_mlp")), layout.spec(("experts", "expert_mlp", None))
        b_in, b_out = layout.spec(("experts", "expert_mlp")), layout.spec(("experts", None))

        def body(x, ids, weights, w1, wg, w2, b1, b2):
            b, s, e = x.shape
            flat = [a.reshape(b * s, a.shape[-1]) for a in (x, ids, weights)]
            first = 0
            if n_ep > 1:  # 1. the expert group's tokens
                flat = [jax.lax.all_gather(a, _axis(ep), axis=0, tiled=True) for a in flat]
                first = jax.lax.axis_index(_axis(ep)) * w1.shape[0]
            if b2 is not None and n_tp > 1:  # added once: the tensor shards' outputs are summed
                b2 = jnp.where(jax.lax.axis_index(_axis(tp)) == 0, b2, 0)
            y = moe.experts(*flat, w1, wg, w2, b1, b2, activation=activation, dtype=dtype, first=first)  # 2.
            if n_tp > 1:  # 3. (in the compute dtype, as the dense MLP's row-parallel sum)
                y = jax.lax.psum(y, _axis(tp))
            if n_ep > 1:
                y = jax.lax.psum_scatter(y, _axis(ep), scatter_dimension=0, tiled=True)
            return y.reshape(b, s, e)

        optional = lambda a, spec: (a, spec) if a is not None else (None, None)  # noqa: E731
        (wg, wg_spec), (b1, b1_spec), (b2, b2_spec) = optional(wg, w_in), optional(b1, b_in), optional(b2, b_out)
        return jax.shard_map(body, mesh=layout.mesh,
                             in_specs=(tokens, tokens, tokens, w_in, wg_spec, w_out, b1_spec, b2_spec),
                             out_specs=tokens, check_vma=False)(x, ids, weights, w1, wg, w2, b1, b2)
