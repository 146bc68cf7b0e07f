"""The token embedding and the output layer's loss, partitioned over the vocabulary on the mesh.

Megatron-LM's vocabulary-parallel layers (Shoeybi et al. 2019, section 3), for the
mesh axes the rules table gives the logical ``vocab`` axis (``tensor``); they are the
``embed`` and ``cross_entropy`` operations of :class:`jaxllm.model.gpt.Ops` (model code
names no mesh axis):

:class:`Embed`
    Each device looks its tokens up in its own rows of the table: ids outside its
    shard give zeros, and the partial embeddings are summed over the vocabulary axes
    (reduce-scattered along the sequence where ``parallel.megatron_sp`` splits the
    residual stream over them, Korthikanti et al. 2022).  The gradient is each
    shard's scatter-add of its own ids, summed over the batch and sequence axes.
    XLA's partitioner cannot split a gather along the gathered (vocabulary)
    dimension: it would replicate the table ("Involuntary full rematerialization").
:class:`CrossEntropy`
    :func:`jaxllm.model.fused_loss.cross_entropy` with the logits of each device's vocabulary
    shard: chunked and fused with its gradient; only per-token maxima, sums and
    target logits cross the vocabulary axes, and the table's gradient is summed
    over the batch and sequence axes once per call.

Both run under ``jax.shard_map`` with specs from the rules table, the table in
``("vocab", None)`` (its ``embed`` shards, ``fsdp``/ZeRO-3, are all-gathered before, as
for every weight).  On a one-device mesh they are the plain single-device operations.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxllm.model import fused_loss
from jaxllm.parallel.sharding import Layout


def _scatter_axes(layout: Layout) -> tuple[str, ...]:
    """The vocabulary axes that also split the residual stream's sequence (``parallel.megatron_sp``),
    where the vocabulary-parallel sums become reduce-scatters along the sequence; else ``()``."""
    length, residual, vocab = (layout.mesh_axes(n) for n in ("length", "residual", "vocab"))
    extra = residual[len(length):]
    return extra if residual[:len(length)] == length and extra and set(extra) <= set(vocab) else ()


def _shard_start(vocab_axes, rows):
    return jax.lax.axis_index(vocab_axes) * rows if vocab_axes else 0


def _table_grad_sum(layout: Layout, embed: int):
    """``(reduce, out_spec)`` for a table gradient ``[rows, embed]`` computed from one device's tokens:
    summed over the batch and sequence axes, reduce-scattered along ``embed`` over those of them
    that also split the weights' ``embed`` (``fsdp``), so that it leaves laid out as the table; summed
    whole where they do not divide ``embed`` (a size the table is stored padded for)."""
    axes = (*layout.mesh_axes("batch"), *layout.mesh_axes("length"))
    split = tuple(a for a in layout.mesh_axes("embed") if a in axes)
    if embed % math.prod(layout.mesh.shape[a] for a in split):
        split = ()
    rest = tuple(a for a in axes if a not in split)

    def reduce(d):
        if split:
            d = jax.lax.psum_scatter(d, split, scatter_dimension=1, tiled=True)
        return jax.lax.psum(d, rest) if rest else d

    return reduce, layout.spec(("vocab", "embed" if split else None))


@dataclasses.dataclass(frozen=True)
class Embed:
    """``embed(table, ids)``: rows of ``table`` ``[padded_vocab, embed]`` (the compute dtype) at int32
    ``ids`` ``[batch, len]`` -> ``[batch, len, embed]``, in the residual stream's layout.  Exact:
    every token's row comes from the one shard that holds it, the others add zeros."""

    layout: Layout

    def __call__(self, table, ids):
        layout = self.layout
        if layout.mesh.size == 1:
            return table[ids]
        vocab = layout.mesh_axes("vocab")
        rows, width = table.shape[0] // layout.size("vocab"), table.shape[1]
        scatter = _scatter_axes(layout)
        rest = tuple(a for a in vocab if a not in scatter)
        table_spec, ids_spec = layout.spec(("vocab", None)), layout.spec(("batch", "length"))
        out_spec = layout.spec(("batch", "residual" if scatter else "length", "act_embed"))
        grad_sum, grad_spec = _table_grad_sum(layout, width)

        def shard(ids):
            local = ids - _shard_start(vocab, rows)
            inside = (local >= 0) & (local < rows)
            return jnp.where(inside, local, rows), inside

        def lookup(table, ids):
            local, inside = shard(ids)
            x = jnp.where(inside[..., None], table[jnp.minimum(local, rows - 1)], 0)
            if scatter:
                x = jax.lax.psum_scatter(x, scatter, scatter_dimension=1, tiled=True)
            return jax.lax.psum(x, rest) if rest else x

        def table_grad(g, ids):
            if scatter:
                g = jax.lax.all_gather(g, scatter, axis=1, tiled=True)
            local, _ = shard(ids)  # ids of other shards land on row `rows`: dropped
            return grad_sum(jnp.zeros((rows, width), jnp.float32).at[local].add(g.astype(jnp.float32), mode="drop"))

        forward = jax.shard_map(lookup, mesh=layout.mesh, in_specs=(table_spec, ids_spec), out_specs=out_spec,
                                check_vma=False)
        backward = jax.shard_map(table_grad, mesh=layout.mesh, in_specs=(out_spec, ids_spec), out_specs=grad_spec,
                                 check_vma=False)

        @jax.custom_vjp
        def embed(table, ids):
            return forward(table, ids)

        def embed_fwd(table, ids):
            return forward(table, ids), ids

        def embed_bwd(ids, g):
            return backward(g, ids).astype(table.dtype), None

        embed.defvjp(embed_fwd, embed_bwd)
        return embed(table, ids)


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """``cross_entropy(h, table, targets, vocab_size, weights=None)``: :func:`jaxllm.model.fused_loss.cross_entropy`
    on the mesh; ``h`` ``[..., batch, len, embed]``, ``targets`` and ``weights`` (float32, or None)
    ``[..., batch, len]`` split as the rules table says (any leading dimensions unsplit), ``table``
    ``[padded_vocab, embed]`` over the vocabulary axes.  Returns the float32 (weighted) sum over all
    tokens."""

    layout: Layout

    def __call__(self, h, table, targets, vocab_size: int, weights=None):
        if self.layout.mesh.size == 1:
            return fused_loss.cross_entropy(h, table, targets, vocab_size, weights)
        sharded = _Sharded(self.layout, vocab_size, table.shape[0], h.ndim - 3)
        return fused_loss.fused(sharded, h, table, targets, weights)


@dataclasses.dataclass(frozen=True)
class _Sharded:
    """The ``value`` and ``value_and_grads`` of :func:`jaxllm.model.fused_loss.fused` under ``shard_map``."""

    layout: Layout
    vocab_size: int
    padded_vocab_size: int
    lead: int  # leading dimensions of h before [batch, len, embed]

    def _specs(self):
        layout, lead = self.layout, (None,) * self.lead
        scatter = _scatter_axes(layout)
        h_spec = layout.spec((*lead, "batch", "residual" if scatter else "length", "act_embed"))
        return h_spec, layout.spec(("vocab", None)), layout.spec((*lead, "batch", "length")), scatter

    def _local(self):
        return fused_loss.Local(self.vocab_size, self.padded_vocab_size, self.layout.mesh_axes("vocab"))

    def _sum_axes(self):
        return tuple((*self.layout.mesh_axes("batch"), *self.layout.mesh_axes("length")))

    def _map(self, body, out_specs, weights):
        h_spec, table_spec, t_spec, _ = self._specs()
        w_spec = None if weights is None else t_spec
        return jax.shard_map(body, mesh=self.layout.mesh, in_specs=(h_spec, table_spec, t_spec, w_spec),
                             out_specs=out_specs, check_vma=False)

    def _gather(self, h):  # megatron_sp: the sequence shards of the vocabulary axes, gathered
        scatter, seq = self._specs()[3], self.lead + 1
        return jax.lax.all_gather(h, scatter, axis=seq, tiled=True) if scatter else h

    def value(self, h, table, targets, weights=None):
        local, axes = self._local(), self._sum_axes()

        def body(h, table, targets, weights):
            h = self._gather(h)
            total = local.value(h.reshape(-1, h.shape[-1]), table, targets.reshape(-1), weights)
            return jax.lax.psum(total, axes) if axes else total

        return self._map(body, PartitionSpec(), weights)(h, table, targets, weights)

    def value_and_grads(self, h, table, targets, weights=None):
        local, axes = self._local(), self._sum_axes()
        h_spec, _, _, scatter = self._specs()
        grad_sum, grad_spec = _table_grad_sum(self.layout, table.shape[1])
        vocab = self.layout.mesh_axes("vocab")
        rest = tuple(a for a in vocab if a not in scatter)

        def body(h, table, targets, weights):
            full = self._gather(h)
            total, dh, dtable = local.value_and_grads(full.reshape(-1, full.shape[-1]), table, targets.reshape(-1),
                                                      weights)
            dh = dh.reshape(full.shape)
            if scatter:
                dh = jax.lax.psum_scatter(dh, scatter, scatter_dimension=self.lead + 1, tiled=True)
            if rest:
                dh = jax.lax.psum(dh, rest)
            return (jax.lax.psum(total, axes) if axes else total), dh, grad_sum(dtable)

        return self._map(body, (PartitionSpec(), h_spec, grad_spec), weights)(h, table, targets, weights)

