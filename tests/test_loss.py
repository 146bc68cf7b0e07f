"""The fused, chunked loss (jaxllm.model.fused_loss) against the logits loss it replaces, and GPT-2's GELU with its
one-residual derivative against autodiff of jax.nn.gelu."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxllm.model import fused_loss as loss
from jaxllm.model import layers
from jaxllm_kernels.reference import MASKED

VOCAB, PADDED, EMBED = 97, 128, 32


def logits_loss(h, table, targets, vocab_size):
    """What the model computed before: float32 logits, padded ids masked, optax's cross entropy, summed."""
    logits = jnp.einsum("...e,ve->...v", h, table, preferred_element_type=jnp.float32)
    logits = jnp.where(jnp.arange(table.shape[0]) < vocab_size, logits, MASKED)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()


def inputs(shape, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (*shape, EMBED), jnp.float32).astype(dtype)
    table = (0.3 * jax.random.normal(k[1], (PADDED, EMBED), jnp.float32)).astype(dtype)
    table = table.at[VOCAB:].set(0)  # the padded rows are zeros, as in the model
    return h, table, jax.random.randint(k[2], shape, 0, VOCAB)


@pytest.mark.parametrize("shape,chunk_logits", [((4, 24), loss.CHUNK_LOGITS), ((4, 24), 16 * PADDED),
                                                ((3, 2, 8), 5 * PADDED)],
                         ids=["one-chunk", "6-chunks", "leading-dims-12-chunks"])
def test_fused_loss_and_gradients_equal_the_logits_loss(monkeypatch, shape, chunk_logits):
    monkeypatch.setattr(loss, "CHUNK_LOGITS", chunk_logits)
    h, table, targets = inputs(shape)
    tokens = int(np.prod(shape))
    assert loss.chunk_rows(tokens, PADDED) == max(c for c in range(1, tokens + 1)
                                                   if tokens % c == 0 and c * PADDED <= chunk_logits)
    f = lambda h, w: loss.cross_entropy(h, w, targets, VOCAB) / tokens  # noqa: E731
    ref = lambda h, w: logits_loss(h, w, targets, VOCAB) / tokens  # noqa: E731
    (value, grads), (want, want_grads) = (jax.value_and_grad(g, (0, 1))(h, table) for g in (f, ref))
    assert value == pytest.approx(float(want), rel=1e-6) and value > 4.0  # ~ln(97) + spread at this scale
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert not np.any(grads[1][VOCAB:])  # no gradient flows into the padding
    assert jax.jit(f)(h, table) == pytest.approx(float(want), rel=1e-6)  # the forward alone (evaluation)


def test_fused_loss_in_bfloat16():
    """bfloat16 activations and table (the compute dtype on GPUs): the logits loss's value; gradients
    within 1% of their largest entry of the float32 ones (autodiff's bfloat16 gradients are too:
    both round softmax - onehot to bfloat16 for the matmuls)."""
    h, table, targets = inputs((4, 24), jnp.bfloat16)
    value, grads = jax.value_and_grad(lambda h, w: loss.cross_entropy(h, w, targets, VOCAB), (0, 1))(h, table)
    want = logits_loss(h, table, targets, VOCAB)
    exact = jax.grad(lambda h, w: logits_loss(h, w, targets, VOCAB), (0, 1))(h.astype(jnp.float32),
                                                                              table.astype(jnp.float32))
    assert value == pytest.approx(float(want), rel=1e-6)
    for got, expected in zip(grads, exact, strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(got.astype(jnp.float32), expected, atol=0.01 * float(jnp.abs(expected).max()))


def test_chunk_rows_divides_the_tokens_within_the_budget(monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_LOGITS", 1000)
    for tokens, vocab in ((96, 10), (96, 7), (97, 10), (8, 2000)):
        c = loss.chunk_rows(tokens, vocab)
        assert tokens % c == 0 and (c * vocab <= 1000 or c == 1)
        assert c == tokens or (c + 1) * vocab > 1000 or tokens % (c + 1)  # no larger chunk would do


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2 ** -7)])
def test_gelu_is_jax_nn_gelu_with_its_derivative(dtype, tol):
    """Values bitwise jax.nn.gelu's; the derivative within the dtype's precision of float32 autodiff
    at the same inputs (in bfloat16 4x closer than bfloat16 autodiff, which rounds each intermediate)."""
    x = jnp.linspace(-6, 6, 1001, dtype=jnp.float32).astype(dtype)
    np.testing.assert_array_equal(layers.gelu(x), jax.nn.gelu(x, approximate=True))
    ours = jax.grad(lambda x: layers.gelu(x).astype(jnp.float32).sum())(x)
    exact = jax.grad(lambda x: jax.nn.gelu(x, approximate=True).sum())(x.astype(jnp.float32))
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours.astype(jnp.float32), exact, rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk_logits", [loss.CHUNK_LOGITS, 16 * PADDED], ids=["one-chunk", "6-chunks"])
def test_weighted_loss_equals_the_masked_logits_loss(monkeypatch, chunk_logits):
    """Per-token weights (data.eod_mask_loss's loss mask): sum(weight x loss) and its gradients."""
    monkeypatch.setattr(loss, "CHUNK_LOGITS", chunk_logits)
    h, table, targets = inputs((4, 24))
    weights = (jax.random.uniform(jax.random.key(5), (4, 24)) > 0.3).astype(jnp.float32)
    f = lambda h, w: loss.cross_entropy(h, w, targets, VOCAB, weights) / weights.sum()  # noqa: E731

    def ref(h, w):
        logits = jnp.einsum("...e,ve->...v", h, w, preferred_element_type=jnp.float32)
        logits = jnp.where(jnp.arange(PADDED) < VOCAB, logits, MASKED)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights) / weights.sum()

    (value, grads), (want, want_grads) = (jax.value_and_grad(g, (0, 1))(h, table) for g in (f, ref))
    assert value == pytest.approx(float(want), rel=1e-6)
    assert float(want) != pytest.approx(float(logits_loss(h, table, targets, VOCAB)) / targets.size, rel=1e-3)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert not np.any(grads[0][weights == 0])  # masked tokens get no gradient
    assert jax.jit(f)(h, table) == pytest.approx(float(want), rel=1e-6)


def test_max_and_sum_are_logsumexps_statistics_in_one_pass():
    """The online softmax's pair reduction against jnp.max and jax.nn.logsumexp: large logits, masked columns and
    a row with every column masked (the padded rows' logits)."""
    x = 40 * jax.random.normal(jax.random.key(3), (5, 300), jnp.float32)
    x = x.at[:, 250:].set(MASKED).at[4].set(MASKED)
    peak, total = loss.max_and_sum(x)
    np.testing.assert_array_equal(peak, x.max(-1))
    np.testing.assert_allclose(jnp.log(total) + peak, jax.nn.logsumexp(x, -1), rtol=1e-6)
    assert float(total[4]) == 300.0  # every column at the row's maximum: exp(0) each
