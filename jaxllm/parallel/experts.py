"""Expert parallelism: a mixture of experts' tokens brought to their experts' devices and back.

The ``experts`` operation of :class:`jaxllm.model.gpt.Ops` on a mesh.  It runs under ``jax.shard_map``, manual
over every mesh axis, with specs from the rules table: each device dispatches its own tokens (batch over the
data axes, ``expert_length`` over the sequence axes) and holds the experts of its ``expert`` shard, split over
``tensor`` along their hidden dimension (column- then row-parallel, as the dense MLP; the partial outputs are
summed over ``tensor``).  With ``mesh.expert_tensor=1`` (Megatron-LM's expert tensor-parallel size 1, its "MoE
parallel folding") the tensor devices, which hold the same tokens, each dispatch their share of them
(``expert_length`` also over ``tensor``) and hold whole experts (``experts`` over ``expert`` x ``tensor``, the
group the dispatchers below run over), so no expert's work is repeated on them.  Two of Megatron-LM's token
dispatchers (``model.moe_token_dispatcher_type``, ``megatron/core/transformer/moe/token_dispatcher.py``):

``allgather``
  1. the tokens and their routing are all-gathered over the ``expert`` axes (each device of an expert group
     then sees the group's tokens);
  2. each device runs its experts on the copies routed to them, sorted into grouped matmuls
     (:func:`jaxllm.model.moe.experts`), and weights them by the router;
  3. the outputs are reduce-scattered over ``expert``, which returns each device its own tokens with every
     expert's contribution.

``alltoall``
  1. each device sorts its token copies by the expert-parallel rank holding their expert and sends each rank
     only those (``jax.lax.all_to_all`` of one buffer of :func:`send_rows` rows per rank, with each copy's
     local expert and routing weight);
  2. each device runs its experts on the copies it received (grouped matmuls, weighted by the router);
  3. the reverse all-to-all returns each copy's output to its token's device, which sums a token's k copies.

Both are dropless with static shapes and equal to one device's computation: a capacity factor's drops are
the router's (:func:`jaxllm.model.moe.route`, over the micro batch's tokens, before dispatch), so a dropped copy
is simply not sent.  The all-to-all's buffers are sized for the worst case (:func:`send_rows`): with no
capacity factor every local copy may go to one rank, so it moves ``min(topk, local experts)`` times the bytes of
the allgather dispatcher (which moves each token once); it moves less only when the capacity bounds a rank's
copies below its tokens.  :func:`choose` picks the one that moves fewer bytes (``auto``).  XLA:CPU has no
``ragged_all_to_all``, the exchange of only the copies routed (MaxText's dropless dispatch), so it is not used.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.model import moe
from jaxllm.parallel.sharding import Layout


def _axis(axes):
    return axes[0] if len(axes) == 1 else axes


def send_rows(tokens: int, topk: int, local_experts: int, capacity: int) -> int:
    """Rows of the all-to-all's buffer from one device to one expert-parallel rank: ``tokens`` (this device's)
    send each rank at most one copy per token and expert of that rank's ``local_experts``, and at most
    ``capacity`` (:func:`jaxllm.model.moe.capacity` of the micro batch) copies per expert."""
    return min(tokens * min(topk, local_experts), local_experts * min(capacity, tokens))


def dispatch_rows(dispatcher: str, *, tokens: int, micro_tokens: int, experts: int, expert_size: int, topk: int,
                  capacity_factor: float) -> int:
    """Token rows each device sends per dispatch (its incoming traffic is the same, and so is the return's):
    ``allgather`` its ``tokens`` to each of the other ``expert_size - 1`` devices of its group, ``alltoall`` one
    :func:`send_rows` buffer to each (``micro_tokens``: the micro batch's, which a capacity is taken over)."""
    if dispatcher == "allgather":
        return (expert_size - 1) * tokens
    c = moe.capacity(micro_tokens, experts, topk, capacity_factor)
    return (expert_size - 1) * send_rows(tokens, topk, experts // expert_size, c)


def choose(dispatcher: str, **sizes) -> str:
    """``model.moe_token_dispatcher_type`` as it runs: ``auto`` is ``alltoall`` where it sends fewer rows than
    ``allgather`` (:func:`dispatch_rows`; ``sizes`` its keywords), else ``allgather``."""
    if dispatcher != "auto":
        return dispatcher
    rows = {d: dispatch_rows(d, **sizes) for d in ("allgather", "alltoall")}
    return "alltoall" if rows["alltoall"] < rows["allgather"] else "allgather"


@dataclasses.dataclass(frozen=True, eq=False)
class Experts:
    """The experts of a mixture of experts on ``layout``'s mesh (see the module docstring).

    Called as :func:`jaxllm.model.moe.local_experts`: ``x`` ``[batch, len, embed]``, ``ids`` int32 and
    ``weights`` float32 ``[batch, len, topk]``, the expert weights ``[experts, ...]`` (global shapes) ->
    ``[batch, len, embed]`` in ``dtype``, laid out as ``x``'s ``(batch, length)``.  ``dispatcher``:
    ``"allgather"`` or ``"alltoall"``; ``capacity_factor``: the router's (``model.moe_capacity_factor``), which
    bounds the all-to-all's buffers.
    """

    layout: Layout
    dispatcher: str = "allgather"
    capacity_factor: float = 0.0

    def __call__(self, x, ids, weights, w1, wg, w2, b1, b2, *, activation, dtype):
        layout = self.layout
        if layout.mesh.size == 1:
            return moe.local_experts(x, ids, weights, w1, wg, w2, b1, b2, activation=activation, dtype=dtype)
        ep, tp = _axis(layout.mesh_axes("experts")), _axis(layout.mesh_axes("expert_mlp"))
        n_ep, n_tp = layout.size("experts"), layout.size("expert_mlp")
        tokens = layout.spec(("batch", "expert_length", None))  # with expert_tensor=1 a share of the tensor
        # group's tokens, whose replicas on the other tensor devices are the others' shares (sharding.rules)
        w_in, w_out = layout.spec(("experts", None, "expert_mlp")), layout.spec(("experts", "expert_mlp", None))
        b_in, b_out = layout.spec(("experts", "expert_mlp")), layout.spec(("experts", None))
        capacity = moe.capacity(x.shape[0] * x.shape[1], w1.shape[0], ids.shape[-1], self.capacity_factor)

        def body(x, ids, weights, w1, wg, w2, b1, b2):
            b, s, e = x.shape
            flat = [a.reshape(b * s, a.shape[-1]) for a in (x, ids, weights)]
            if b2 is not None and n_tp > 1:  # added once: the tensor shards' outputs are summed
                b2 = jnp.where(jax.lax.axis_index(tp) == 0, b2, 0)

            def run(x, ids, weights, first=0):  # this device's experts, summed over tensor (in the compute
                y = moe.experts(x, ids, weights, w1, wg, w2, b1, b2, activation=activation, dtype=dtype,
                                first=first)  # dtype, as the dense MLP's row-parallel sum)
                return jax.lax.psum(y, tp) if n_tp > 1 else y

            if n_ep == 1:
                y = run(*flat)
            elif self.dispatcher == "alltoall":
                y = _all_to_all(run, *flat, ep, n_ep, w1.shape[0], capacity)
            else:
                flat = [jax.lax.all_gather(a, ep, axis=0, tiled=True) for a in flat]
                y = run(*flat, first=jax.lax.axis_index(ep) * w1.shape[0])
                y = jax.lax.psum_scatter(y, ep, scatter_dimension=0, tiled=True)
            return y.reshape(b, s, e)

        optional = lambda a, spec: (a, spec) if a is not None else (None, None)  # noqa: E731
        (wg, wg_spec), (b1, b1_spec), (b2, b2_spec) = optional(wg, w_in), optional(b1, b_in), optional(b2, b_out)
        return jax.shard_map(body, mesh=layout.mesh,
                             in_specs=(tokens, tokens, tokens, w_in, wg_spec, w_out, b1_spec, b2_spec),
                             out_specs=tokens, check_vma=False)(x, ids, weights, w1, wg, w2, b1, b2)


def _all_to_all(run, x, ids, weights, ep, n_ep: int, local: int, capacity: int):
    """The ``alltoall`` dispatcher on one device (module docstring): ``x`` ``[tokens, embed]``, ``ids`` and
    ``weights`` ``[tokens, topk]`` of this device's tokens; ``run(x, ids, weights)`` this device's ``local``
    experts (ids ``0 ... local - 1``, ``local`` for none) -> ``[tokens, embed]``, a token's copies summed in
    float32 as :func:`jaxllm.model.moe.experts` sums them."""
    t, k = ids.shape
    rows = send_rows(t, k, local, capacity)
    rank = jnp.minimum(ids.reshape(-1) // local, n_ep)  # a dropped copy (id: all experts) goes nowhere: n_ep
    order = jnp.argsort(rank, stable=True)  # the copies by destination, then token
    dest = rank[order]
    counts = jnp.bincount(rank, length=n_ep + 1)
    start = jnp.cumsum(counts) - counts
    slot = jnp.where(dest < n_ep, dest * rows + jnp.arange(t * k) - start[dest], n_ep * rows)  # past the end: none
    send = lambda a, fill: jnp.full((n_ep * rows, *a.shape[1:]), fill, a.dtype).at[slot].set(a, mode="drop")  # noqa: E731
    exchange = lambda a: jax.lax.all_to_all(a.reshape(n_ep, rows, *a.shape[1:]), ep, 0, 0,  # noqa: E731
                                            tiled=True).reshape(a.shape)
    got_x = exchange(send(x[order // k], 0))
    got_ids = exchange(send(ids.reshape(-1)[order] - dest * local, local))
    got_w = exchange(send(weights.reshape(-1)[order], 0))
    y = exchange(run(got_x, got_ids[:, None], got_w[:, None]))  # each copy's weighted output, back at its source
    y = jnp.zeros((t * k, x.shape[1]), y.dtype).at[order].set(y.at[slot].get(mode="fill", fill_value=0),
                                                                unique_indices=True)
    return y.reshape(t, k, -1).sum(1, dtype=jnp.float32).astype(y.dtype)
