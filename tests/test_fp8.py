"""model.fp8: the FP8 layer matmul against a numpy reference of the same quantization (ml_dtypes'
float8 types), its gradients, and the config's refusals.  That the train step lowers for cuda with
float8 operands is checked in tests/test_gpu_lowering.py."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm import config
from jaxllm.errors import ConfigError
from jaxllm.model import fp8
from jaxllm.resolve import resolve


def qdq(x, fp8_type):
    """Numpy: ``x`` through ``fp8_type`` with the per-tensor scale amax / max (float32)."""
    x = np.asarray(x, np.float32)
    fmax = np.float32(ml_dtypes.finfo(fp8_type).max)
    amax = np.abs(x).max()
    scale = np.float32(amax / fmax) if amax > 0 else np.float32(1)
    return np.clip(x / scale, -fmax, fmax).astype(fp8_type).astype(np.float32) * scale


@pytest.mark.parametrize("spec, x_shape, w_shape", [("bse,ehd->bshd", (2, 5, 16), (16, 2, 8)),
                                                   ("bshd,hde->bse", (2, 5, 2, 8), (2, 8, 16)),
                                                   ("bsf,fe->bse", (2, 5, 32), (32, 16))])
def test_fp8_dense_is_the_quantized_matmul_with_e5m2_gradients(spec, x_shape, w_shape):
    keys = jax.random.split(jax.random.key(0), 4)
    x, w = jax.random.normal(keys[0], x_shape), 0.1 * jax.random.normal(keys[1], w_shape)
    b = jax.random.normal(keys[2], w_shape[-1:])
    y, vjp = jax.vjp(lambda x, w, b: fp8.dense(x, w, b, spec, jnp.float32), x, w, b)
    dy = jax.random.normal(keys[3], y.shape)
    dx, dw, db = vjp(dy)
    xq, wq, dyq = qdq(x, ml_dtypes.float8_e4m3fn), qdq(w, ml_dtypes.float8_e4m3fn), qdq(dy, ml_dtypes.float8_e5m2)
    np.testing.assert_allclose(y, np.einsum(spec, xq, wq) + np.asarray(b), rtol=1e-5, atol=1e-5)
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    np.testing.assert_allclose(dx, np.einsum(f"{out},{ws}->{xs}", dyq, wq), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, np.einsum(f"{xs},{out}->{ws}", xq, dyq), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, np.asarray(dy).sum(axis=tuple(range(dy.ndim - 1))), rtol=1e-5)
    # and the quantization is real: float32's matmul differs (e4m3 keeps 3 mantissa bits)
    exact = np.einsum(spec, np.asarray(x), np.asarray(w))
    assert np.abs(np.asarray(y) - np.asarray(b) - exact).max() > 1e-3 * np.abs(exact).max()


def test_gradients_come_back_in_the_operands_dtypes():
    """A bfloat16 activation's gradient is bfloat16, a float32 weight's float32 (straight from its FP8 GEMM)."""
    x, w = jnp.ones((2, 3, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: fp8.dense(x, w, None, "bse,ef->bsf", jnp.bfloat16), x, w)
    dx, dw = vjp(jnp.ones_like(y))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    np.testing.assert_allclose(np.asarray(dw, np.float32), 6.0)  # ones quantize exactly: 2 x 3 rows of 1 x 1


def test_zeros_quantize_to_zeros():
    q, scale = fp8.quantize(jnp.zeros((3, 4)), fp8.E4M3)
    assert q.dtype == fp8.E4M3 and float(scale) == 1.0
    np.testing.assert_array_equal(q.astype(jnp.float32), 0)


def _fp8_config(**parallel):
    c = config.get_config()
    c.model.update(fp8=True, num_layers=4, vocab_size=256)
    c.parallel.update(**parallel)
    return c


def test_fp8_is_refused_on_cpus_and_with_zb_h1():
    with pytest.raises(ConfigError, match=r"model\.fp8=True: the cpu backend has no FP8 matmuls"):
        resolve(_fp8_config(), num_devices=1, data_files=False)
    resolve(_fp8_config(), num_devices=1, data_files=False, backend="cuda")  # planned for a GPU from here
    spec = _fp8_config(pipeline_schedule="zb_h1")
    spec.mesh.pipeline = 2
    spec.train.micro_batch_size = 8
    with pytest.raises(ConfigError, match="zb_h1 computes the weight gradients outside the FP8 matmuls"):
        resolve(spec, num_devices=2, data_files=False, backend="cuda")
