"""What CPUs run differently, chosen by the runtime: the model and the parallel layer know none of it.

CPUs are where jaxllm is developed and tested, not where it is used for speed; these choices make
the CPU step as fast as an eager PyTorch one (docs/performance.md, "vs PyTorch" and the sections
named below) while the model's own operations stay the plain ones every backend runs:

* :func:`row_major_dense` for the layer matmuls (:class:`jaxllm.model.gpt.Ops`'s ``dense``): their
  gradient matmuls take ``[M, K] @ [K, N]`` operands, which XLA:CPU sends to its fast YNNPACK path
  (docs/performance.md, "Row-major gradient matmuls and written-out layers on CPUs").
* :class:`BatchSlices` around attention on a one-device mesh: XLA:CPU runs a batched matmul on one
  thread, independent ones side by side (docs/performance.md, "Attention in slices of the batch").
* ``model.layer_loop="auto"`` writes the layers out on CPUs without remat (XLA:CPU zero-fills a
  scan's stacked activations and copies them every step), a scan elsewhere: decided with the
  config's other ``auto`` values, by :func:`jaxllm.resolve.layer_loop`.
* The host allocator (:mod:`jaxllm.platform.host_memory`, set at process start-up by the tools,
  before JAX allocates): glibc keeps freed memory, so XLA:CPU's buffers stop page-faulting.

:func:`ops` applies the first two to a run's operations (:class:`jaxllm.runtime.run.Run`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.model import gpt
from jaxllm.platform import hardware

__all__ = ["BatchSlices", "ops", "row_major_dense"]


def ops(base: gpt.Ops, mesh_size: int) -> gpt.Ops:
    """``base`` (a mesh's operations, its attention a :class:`jaxllm.parallel.context_parallel.Attention`) with
    the CPU's: :func:`row_major_dense` for the layer matmuls, and on a one-device mesh the ``xla`` reference
    attention in :class:`BatchSlices`, one per core of this process (:func:`jaxllm.platform.hardware.host_threads`;
    a flash kernel is called whole)."""
    attention = base.attention
    if mesh_size == 1 and not attention.kernel.flash:
        attention = BatchSlices(attention, hardware.host_threads())
    return dataclasses.replace(base, dense=row_major_dense, attention=attention)


@dataclasses.dataclass(frozen=True)
class BatchSlices:
    """An ``attention`` operation (:class:`jaxllm.model.gpt.Ops`) run as up to ``slices`` independent
    slices of the batch (the largest count that divides it).  Same arguments and result as ``attention``:
    q ``[batch, len, heads, head_dim]``, k, v ``[batch, len, kv_heads, head_dim]``, order and
    segment_ids int ``[batch, len]`` or None, the layer's own keywords (``window``) passed on."""

    attention: object
    slices: int

    def __call__(self, q, k, v, order=None, segment_ids=None, **layer):
        n = max(c for c in range(1, self.slices + 1) if q.shape[0] % c == 0)
        if n == 1:
            return self.attention(q, k, v, order, segment_ids, **layer)
        parts = [jnp.split(a, n) if a is not None else [None] * n for a in (q, k, v, order, segment_ids)]
        return jnp.concatenate([self.attention(*args, **layer) for args in zip(*parts)])


def row_major_dense(x, w, b, spec, dtype):
    """:func:`jaxllm.model.layers.dense`, the same function and forward matmul, whose gradient matmuls each take
    their operands as ``[M, K] @ [K, N]`` in memory: the smaller operand of each is transposed
    explicitly, behind an optimization barrier that keeps XLA from folding the transpose back into
    the matmul.  On CPUs XLA otherwise runs the weight gradient ``x^T dy`` (the contraction over
    ``[batch, len]``, the leading dimension of both operands) through Eigen at about half the
    speed of its XNNPACK (YNN) matmuls, after a transposing copy of the larger operand, and the
    input gradient ``dy w^T`` through YNN's slower transposed-weight path.

    ``spec`` is ``"<rows><in>,<in><out>-><rows><out>"`` (each part one or more letters, the rows
    ``batch, len``), as every layer matmul of :class:`jaxllm.model.gpt.GPT`; x ``[rows..., in...]``, w
    ``[in..., out...]``, b ``[out...]`` or None.
    """
    return _row_major(spec, x.astype(dtype), w.astype(dtype), None if b is None else b.astype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _row_major(spec, x, w, b):
    y = jnp.einsum(spec, x, w)
    return y if b is None else y + b


def _row_major_fwd(spec, x, w, b):
    return _row_major(spec, x, w, b), (x, w, b)


def _row_major_bwd(spec, residuals, dy):
    x, w, b = residuals
    xs, rest = spec.split(",")
    ws, ys = rest.split("->")
    rows = "".join(a for a in xs if a not in ws)  # batch, len
    c, o = "".join(a for a in xs if a in ws), "".join(a for a in ws if a in ys)  # contracted, output

    def transposed(a, letters, to):  # a copy of `a` with its dimensions in the order `to`
        return jax.lax.optimization_barrier(jnp.transpose(a, [letters.index(t) for t in to]))

    dx = jnp.einsum(f"{ys},{o}{c}->{xs}", dy, transposed(w, ws, o + c))
    if math.prod(w.shape[ws.index(a)] for a in c) <= math.prod(w.shape[ws.index(a)] for a in o):
        dw = jnp.einsum(f"{c}{rows},{ys}->{ws}", transposed(x, xs, c + rows), dy)
    else:  # (dy^T x)^T: transposing dy and the small product moves fewer bytes than transposing x
        dw_t = jnp.einsum(f"{o}{rows},{xs}->{o}{c}", transposed(dy, ys, o + rows), x)
        dw_t = jax.lax.optimization_barrier(dw_t)  # or XLA folds the transpose below into the matmul
        dw = jnp.transpose(dw_t, [(o + c).index(a) for a in ws])
    db = None if b is None else dy.sum(tuple(range(len(rows))))
    return dx, dw, db


_row_major.defvjp(_row_major_fwd, _row_major_bwd)
