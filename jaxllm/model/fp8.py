"""FP8 layer matmuls: e4m3 inputs and weights forward, e5m2 output gradients backward, current scaling.

:func:`dense` is the model's ``dense`` operation (:class:`jaxllm.model.Ops`) with ``model.fp8=True``
(the runtime puts it there).  Each operand of a matmul is quantized with a per-tensor scale taken
from its current absolute maximum ("current scaling": ``scale = amax / max(float8)``), cast to
float8 and dequantized back to the compute dtype right before the ``einsum``::

    x_dq = (x / s_x).astype(float8_e4m3fn).astype(bf16) * s_x

That dequantize-then-dot pattern is what XLA's GPU compiler rewrites into one cuBLASLt FP8 GEMM
with the scales as its alpha (NVIDIA JAX-Toolbox, "Native FP8 support in XLA"; Micikevicius et al.
2022, "FP8 Formats for Deep Learning": e4m3 for activations and weights, e5m2, with its wider range,
for gradients).  The backward pass quantizes the incoming gradient ``dy`` to e5m2 the same way and
runs the two gradient matmuls against the quantized forward operands.  Parameters, optimizer
state, norms, softmax and the loss stay in their own dtypes: only the layer matmuls change.

On a backend without FP8 matmuls the same arithmetic runs emulated (slow, exact to the formats),
which is how the CPU tests check it; ``jaxllm.resolve`` refuses ``model.fp8`` for training there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["E4M3", "E5M2", "dense", "quantize_dequantize"]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize_dequantize(x, fp8_dtype, dtype):
    """``x`` rounded to ``fp8_dtype`` with the per-tensor scale ``amax(|x|) / max(fp8_dtype)`` (1 where
    ``x`` is all zeros), returned in ``dtype``: ``float8(x / s).astype(dtype) * s``.  The scale is
    float32 and carries no gradient."""
    x32 = x.astype(jnp.float32)
    amax = jax.lax.stop_gradient(jnp.max(jnp.abs(x32)))
    fmax = float(jnp.finfo(fp8_dtype).max)
    scale = jnp.where(amax > 0, amax / fmax, 1.0)
    q = jnp.clip(x32 / scale, -fmax, fmax).astype(fp8_dtype)
    return q.astype(dtype) * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _einsum(spec, x, w, dtype):
    return jnp.einsum(spec, quantize_dequantize(x, E4M3, dtype), quantize_dequantize(w, E4M3, dtype))


def _einsum_fwd(spec, x, w, dtype):
    xq, wq = quantize_dequantize(x, E4M3, dtype), quantize_dequantize(w, E4M3, dtype)
    return jnp.einsum(spec, xq, wq), (xq, wq)


def _einsum_bwd(spec, dtype, residuals, dy):
    xq, wq = residuals
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), xq, wq)
    return vjp(quantize_dequantize(dy, E5M2, dtype))


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def dense(x, w, b, spec, dtype):
    """:func:`jaxllm.model.dense` with the matmul in FP8: ``einsum(spec, x, w) + b``, x and w quantized
    to e4m3 (the gradient of the output to e5m2 in the backward pass), accumulated and returned in
    ``dtype``; ``b`` (an array or None) is added in ``dtype``."""
    y = _einsum(spec, x, w, jnp.dtype(dtype))
    return y if b is None else y + b.astype(dtype)
