"""FP8 layer matmuls: e4m3 inputs and weights forward, e5m2 output gradients backward, current scaling.

:func:`dense` is the model's ``dense`` operation (:class:`jaxllm.model.gpt.Ops`) with ``model.fp8=True``
(the runtime puts it there).  Each operand of a matmul is quantized with a per-tensor scale taken
from its current absolute maximum ("current scaling": ``scale = amax / max(float8)``) and cast to
float8 (:func:`quantize`); the matmul takes the float8 arrays themselves and the product of the two
scales multiplies its output::

    y = einsum(float8(x / s_x), float8(w / s_w)) * (s_x s_w)

The backward pass quantizes the incoming gradient ``dy`` to e5m2 the same way and runs both gradient
matmuls on float8 operands too: the forward pass keeps the float8 arrays and their scales (not
dequantized copies) for them.  So every one of the three matmuls is a float8 x float8 dot in the
program, which XLA:GPU compiles to an FP8 GEMM whichever GEMM emitter it picks: a Triton GEMM with
float8 operands, or with ``--xla_gpu_enable_triton_gemm=false`` a cuBLASLt ``__cublas$lt$matmul$f8``
with the scales as its alpha (checked on the compiled program: ``tests/test_gpu_program.py``).  This
is the form of Flax's ``fp8_ops.fp8_scaled_dot_general``; the older dequantize-then-dot form
(``float8(x / s).astype(bf16) * s`` into a bfloat16 ``einsum``) reaches FP8 only through XLA's
cuBLASLt pattern match, and with Triton GEMMs on (XLA's default) runs as a bfloat16 GEMM on
dequantized copies.  Formats: Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (e4m3 for
activations and weights, e5m2, with its wider range, for gradients).  Parameters, optimizer state,
norms, softmax and the loss stay in their own dtypes: only the layer matmuls change.

On a backend without FP8 matmuls the same arithmetic runs emulated (slow, exact to the formats),
which is how the CPU tests check it; ``jaxllm.resolve`` refuses ``model.fp8`` for training there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["E4M3", "E5M2", "dense", "quantize"]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x, fp8_dtype):
    """``x`` (any float dtype and shape) as ``(float8(x / s), s)``: the array in ``fp8_dtype`` and the
    float32 scalar scale ``s = amax(|x|) / max(fp8_dtype)`` (1 where ``x`` is all zeros), so that
    ``q.astype(float32) * s`` is ``x`` rounded to ``fp8_dtype``.  The scale carries no gradient."""
    x32 = x.astype(jnp.float32)
    amax = jax.lax.stop_gradient(jnp.max(jnp.abs(x32)))
    fmax = float(jnp.finfo(fp8_dtype).max)
    scale = jnp.where(amax > 0, amax / fmax, 1.0)
    return jnp.clip(x32 / scale, -fmax, fmax).astype(fp8_dtype), scale


def _scaled(spec, a, b, scale, dtype):
    """``einsum(spec, a, b) * scale`` in ``dtype``, ``a`` and ``b`` float8: the scale applied to the
    output, where XLA folds it into the GEMM (cuBLASLt's alpha, a Triton GEMM's epilogue)."""
    return jnp.einsum(spec, a, b, preferred_element_type=dtype) * scale.astype(dtype)


def _gradient_specs(spec):
    """``"X,W->Y"`` -> ``("Y,W->X", "X,Y->W")``: the einsums of the gradients of ``x`` and ``w``.  Every
    index of a layer matmul is in exactly two of the three terms (rows in X and Y, contracted in X and W,
    outputs in W and Y), so each gradient is one einsum."""
    ins, ys = spec.split("->")
    xs, ws = ins.split(",")
    return f"{ys},{ws}->{xs}", f"{xs},{ys}->{ws}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _einsum(spec, x, w, dtype):
    return _einsum_fwd(spec, x, w, dtype)[0]


def _einsum_fwd(spec, x, w, dtype):
    (xq, sx), (wq, sw) = quantize(x, E4M3), quantize(w, E4M3)
    # the float8 operands and scales are the residuals; the zeros carry x's and w's dtypes for the gradients
    return _scaled(spec, xq, wq, sx * sw, dtype), (xq, sx, wq, sw, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _einsum_bwd(spec, dtype, residuals, dy):
    xq, sx, wq, sw, x_like, w_like = residuals
    dyq, sdy = quantize(dy, E5M2)
    dx_spec, dw_spec = _gradient_specs(spec)
    return _scaled(dx_spec, dyq, wq, sdy * sw, x_like.dtype), _scaled(dw_spec, xq, dyq, sx * sdy, w_like.dtype)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def dense(x, w, b, spec, dtype):
    """:func:`jaxllm.model.layers.dense` with the matmul in FP8: ``einsum(spec, x, w) + b``, x and w quantized
    to e4m3 (the gradient of the output to e5m2 in the backward pass), accumulated in float32 and
    returned in ``dtype``; ``b`` (an array or None) is added in ``dtype``.  The gradients of ``x`` and
    ``w`` come back in their own dtypes (a float32 weight's straight from its FP8 GEMM).

    ``spec`` is a layer matmul's einsum, each index in exactly two of its three terms (``"bse,ef->bsf"``)."""
    y = _einsum(spec, x, w, jnp.dtype(dtype))
    return y if b is None else y + b.astype(dtype)
