"""Expert parallelism: a mixture of experts' tokens brought to their experts' devices and back.

The ``experts`` operation of :class:`jaxllm.model.gpt.Ops` on a mesh.  It runs under ``jax.shard_map``, manual
over every mesh axis, with specs from the rules table: each device dispatches its own tokens (batch over the
data axes, ``expert_length`` over the sequence axes) and holds the experts of its ``expert`` shard, split over
``tensor`` along their hidden dimension (column- then row-parallel, as the dense MLP; the partial outputs are
summed over ``tensor``).  With ``mesh.expert_tensor=1`` (Megatron-LM's expert tensor-parallel size 1, its "MoE
parallel folding") the tensor devices, which hold the same tokens, each dispatch their share of them
(``expert_length`` also over ``tensor``) and hold whole experts (``experts`` over ``expert`` x ``tensor``, the
group the dispatchers below run over), so no expert's work is repeated on them.  Megatron-LM's token dispatchers
(``model.moe_token_dispatcher_type``, ``megatron/core/transformer/moe/token_dispatcher.py``) and a ragged one:

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

``ragged``
  as ``alltoall``, but each rank is sent only the copies routed to it (``jax.lax.ragged_all_to_all``, with the
  send sizes of :func:`send_sizes` and their offsets), into a receive buffer sized for the worst case; the outputs
  return the same way (MaxText's dropless ragged dispatch).  XLA:CPU has no ragged-all-to-all: on CPUs
  :func:`ragged_all_to_all` emulates the primitive exactly (the same offsets and sizes) through ``all_to_all`` of
  padded buffers, so every layout test runs it.

All are dropless with static shapes and equal to one device's computation: a capacity factor's drops are
the router's (:func:`jaxllm.model.moe.route`, over the micro batch's tokens, before dispatch), so a dropped copy
is simply not sent.  The all-to-all's buffers are sized for the worst case (:func:`send_rows`): with no
capacity factor every local copy may go to one rank, so it moves ``min(topk, local experts)`` times the bytes of
the allgather dispatcher (which moves each token once); it moves less only when the capacity bounds a rank's
copies below its tokens.  The ragged exchange sends the routed copies only, ``topk x`` a device's tokens at
most, ``(expert - 1) / expert`` of them with a balanced router: fewer rows than allgather's where the expert axis is
larger than top k.  :func:`choose` picks the one that sends the fewest rows (``auto``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.model import attention, moe
from jaxllm.parallel.sharding import Layout


def _axis(axes):
    return axes[0] if len(axes) == 1 else axes


def send_rows(tokens: int, topk: int, local_experts: int, capacity: int) -> int:
    """Rows of the all-to-all's buffer from one device to one expert-parallel rank: ``tokens`` (this device's)
    send each rank at most one copy per token and expert of that rank's ``local_experts``, and at most
    ``capacity`` (:func:`jaxllm.model.moe.capacity` of the micro batch) copies per expert."""
    return min(tokens * min(topk, local_experts), local_experts * min(capacity, tokens))


DISPATCHERS = ("allgather", "alltoall", "ragged")  # auto's order of preference where they send as many rows


def dispatch_rows(dispatcher: str, *, tokens: int, micro_tokens: int, experts: int, expert_size: int, topk: int,
                  capacity_factor: float) -> int:
    """Token rows each device sends per dispatch (its incoming traffic is the same, and so is the return's):
    ``allgather`` its ``tokens`` to each of the other ``expert_size - 1`` devices of its group, ``alltoall`` one
    :func:`send_rows` buffer to each (``micro_tokens``: the micro batch's, which a capacity is taken over),
    ``ragged`` the copies routed to each: with a balanced router ``tokens x topk / expert_size``, at most
    :func:`send_rows` (the count is the routing's; this is the estimate ``auto`` compares)."""
    if dispatcher == "allgather":
        return (expert_size - 1) * tokens
    c = moe.capacity(micro_tokens, experts, topk, capacity_factor)
    rows = send_rows(tokens, topk, experts // expert_size, c)
    if dispatcher == "ragged":
        rows = min(rows, math.ceil(tokens * topk / expert_size))
    return (expert_size - 1) * rows


def choose(dispatcher: str, **sizes) -> str:
    """``model.moe_token_dispatcher_type`` as it runs: ``auto`` is the dispatcher of :data:`DISPATCHERS` that sends
    the fewest rows (:func:`dispatch_rows`; ``sizes`` its keywords), the first of them on a tie."""
    if dispatcher != "auto":
        return dispatcher
    return min(DISPATCHERS, key=lambda d: dispatch_rows(d, **sizes))


@dataclasses.dataclass(frozen=True, eq=False)
class Experts:
    """The experts of a mixture of experts on ``layout``'s mesh (see the module docstring).

    Called as :func:`jaxllm.model.moe.local_experts`: ``x`` ``[batch, len, embed]``, ``ids`` int32 and
    ``weights`` float32 ``[batch, len, topk]``, the expert weights ``[experts, ...]`` (global shapes) ->
    ``[batch, len, embed]`` in ``dtype``, laid out as ``x``'s ``(batch, length)``.  ``dispatcher``:
    ``"allgather"``, ``"alltoall"`` or ``"ragged"``; ``capacity_factor``: the router's
    (``model.moe_capacity_factor``), which bounds the all-to-all's buffers.
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
            elif self.dispatcher == "ragged":
                y = _ragged(run, *flat, ep, n_ep, w1.shape[0], capacity)
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


def send_sizes(ids, n_ep: int, local: int):
    """This device's token copies (``ids`` int32 ``[tokens, topk]``, ``n_ep x local`` for a dropped one) by the
    expert-parallel rank holding their expert: ``(order, sizes)``, int32 ``[tokens x topk]`` the copies sorted
    by rank (stable: then by token), dropped ones last; int32 ``[n_ep]`` the copies for each rank, the ``ragged``
    dispatcher's send sizes."""
    rank = jnp.minimum(ids.reshape(-1) // local, n_ep)
    return jnp.argsort(rank, stable=True).astype(jnp.int32), jnp.bincount(rank, length=n_ep + 1)[:n_ep].astype(
        jnp.int32)


def _emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, rows: int):
    """``jax.lax.ragged_all_to_all``'s result through ``jax.lax.all_to_all`` of padded buffers (XLA:CPU has no
    ragged-all-to-all): slice ``i`` (``send_sizes[i] <= rows`` rows from ``input_offsets[i]``) padded to ``rows``,
    exchanged, and written into ``output`` at ``all_to_all(output_offsets)[i]`` for ``recv_sizes[i]`` rows."""
    j = jnp.arange(rows, dtype=input_offsets.dtype)
    take = jnp.where(j < send_sizes[:, None], input_offsets[:, None] + j, operand.shape[0])  # [slices, rows]
    sent = operand.at[take].get(mode="fill", fill_value=0)
    got = jax.lax.all_to_all(sent, axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)[:, None] + j
    at = jnp.where(j < recv_sizes[:, None], at, output.shape[0])  # past the end: not written
    return output.at[at.reshape(-1)].set(got.reshape(-1, *got.shape[2:]), mode="drop")


def _planned(operand, output, *offsets_and_sizes, axis_name, n_ep: int):
    """A GPU's ragged exchange in its plan compiled by XLA:CPU (:func:`jaxllm.model.attention.planned_gpu`): the
    GPU's buffers (``operand``, ``output``) and, on the wire, an all-to-all of as many rows as the smaller of them
    holds (the routed copies, which a balanced router sends ``(n_ep - 1) / n_ep`` of); not its values."""
    del offsets_and_sizes
    rows = min(operand.shape[0], output.shape[0]) // n_ep * n_ep
    got = jax.lax.all_to_all(operand[:rows], axis_name, 0, 0, tiled=True)
    return output.at[:rows].set(got)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                      rows: int, n_ep: int):
    """``jax.lax.ragged_all_to_all`` (one slice per rank of ``axis_name``, ``n_ep`` of them) as the platform runs
    it, chosen here: on GPUs the primitive; on CPUs its exact emulation (:func:`_emulated`: the same offsets and
    sizes, ``rows`` the bound on a slice); in a GPU's plan compiled here a stand-in of its buffers
    (:func:`_planned`)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    if attention.planned_gpu():
        return _planned(*args, axis_name=axis_name, n_ep=n_ep)
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(_emulated, axis_name=axis_name, rows=rows),
        default=functools.partial(jax.lax.ragged_all_to_all, axis_name=axis_name))


def _ragged(run, x, ids, weights, ep, n_ep: int, local: int, capacity: int):
    """The ``ragged`` dispatcher on one device (module docstring): as :func:`_all_to_all`, but each rank is sent
    only the copies routed to it (:func:`ragged_all_to_all`), into a receive buffer of the worst case,
    ``n_ep x`` :func:`send_rows` rows; ``run`` this device's ``local`` experts; returns ``[tokens, embed]``."""
    t, k = ids.shape
    rows = send_rows(t, k, local, capacity)
    order, sizes = send_sizes(ids, n_ep, local)
    dest = jnp.minimum(ids.reshape(-1)[order] // local, n_ep)
    offsets = jnp.cumsum(sizes) - sizes  # where each rank's copies start here
    recv = jax.lax.all_to_all(sizes, ep, 0, 0, tiled=True)  # the copies each rank sends here
    recv_offsets = jnp.cumsum(recv) - recv  # where they land here
    there = jax.lax.all_to_all(recv_offsets, ep, 0, 0, tiled=True)  # where this device's land on each rank
    size = n_ep * rows

    def exchange(a, fill):
        out = jnp.full((size, *a.shape[1:]), fill, a.dtype)
        return ragged_all_to_all(a, out, offsets, sizes, there, recv, axis_name=ep, rows=rows, n_ep=n_ep)

    got_x = exchange(x[order // k], 0)
    got_ids = exchange(ids.reshape(-1)[order] - dest * local, local)  # past the received rows: no expert
    got_w = exchange(weights.reshape(-1)[order], 0)
    y = run(got_x, got_ids[:, None], got_w[:, None])  # each copy's weighted output, back to its source:
    back = ragged_all_to_all(y, jnp.zeros((t * k, y.shape[1]), y.dtype), recv_offsets, recv,
                             jax.lax.all_to_all(offsets, ep, 0, 0, tiled=True), sizes, axis_name=ep, rows=rows,
                             n_ep=n_ep)
    y = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
    return y.reshape(t, k, -1).sum(1, dtype=jnp.float32).astype(y.dtype)
