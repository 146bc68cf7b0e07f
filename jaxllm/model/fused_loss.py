"""The language-model loss without the full logits: output layer and cross entropy fused, in chunks.

:func:`cross_entropy` is ``sum_t (logsumexp(h_t W^T) - (h_t W^T)[y_t])`` over the tokens
``t`` of ``h``: the summed cross entropy (nats) of the targets ``y`` under the logits of
the output layer ``W`` (``[vocab, embed]``; the tied embedding, or the output matrix
transposed), where the logits of ids ``>= vocab_size`` (the padded rows) are
:data:`~jaxllm_kernels.reference.MASKED`, as :meth:`jaxllm.model.gpt.GPT.head` gives them.
It never materialises the ``[tokens, vocab]`` float32 logits or their gradient for all
tokens at once: the tokens are processed in chunks of at most :data:`CHUNK_LOGITS`
logits, and the forward pass also computes the gradients, ``d logits = softmax - onehot``
never leaving its chunk (a custom VJP; the backward pass only scales them by the
incoming cotangent).  So the output layer costs its three matmuls (logits, the
gradients of ``h`` and ``W``), none recomputed, and memory holds one chunk of logits.
This is the fused linear cross entropy of Liger Kernel (Hsu et al. 2024) and of "Cut
Your Losses in Large-Vocabulary Language Models" (Wijmans et al. 2024), in plain XLA.

With ``vocab_axes`` the table is one device's vocabulary shard (rows ``vocab_start`` to
``vocab_start + rows``) and the softmax statistics are reduced over those mesh axes:
Megatron-LM's vocabulary-parallel cross entropy (Shoeybi et al. 2019, section 3: each
device holds a slice of the logits; only per-token maxima, sums and target logits
cross the network).  :mod:`jaxllm.parallel.vocab_parallel` runs it under ``shard_map``; with no
axes it is the single-device loss (:data:`jaxllm.model.gpt.LOCAL`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxllm_kernels.reference import MASKED

# logits per chunk (256 MiB in float32): the loss's working set, per device; chunks of 1,024 tokens or more for
# a 50k vocabulary, so that the output layer's matmuls keep a GPU busy (256-token chunks ran the logits' matmul
# at 18 % of an H100's peak, docs/performance.md)
CHUNK_LOGITS = 1 << 26


def chunk_rows(tokens: int, vocab: int) -> int:
    """Tokens per chunk: the largest divisor of ``tokens`` whose ``chunk x vocab`` logits fit
    :data:`CHUNK_LOGITS` (at least 1)."""
    n = min(tokens, max(1, math.ceil(tokens * vocab / CHUNK_LOGITS)))
    while tokens % n:
        n += 1
    return tokens // n


@dataclasses.dataclass(frozen=True)
class Local:
    """The loss on one device's arrays: ``h [tokens, embed]``, the table ``[rows, embed]`` holding
    vocabulary ids ``[start, start + rows)`` (start: :meth:`start`), targets int32 ``[tokens]``.

    Attributes:
      vocab_size: the real vocabulary (ids at or above it are masked).
      padded_vocab_size: rows of the whole table (all shards).
      vocab_axes: mesh axes the vocabulary is split over (inside ``shard_map``), or ``()``.
    """

    vocab_size: int
    padded_vocab_size: int
    vocab_axes: tuple = ()

    def start(self, rows: int):
        return 0 if not self.vocab_axes else jax.lax.axis_index(self.vocab_axes) * rows

    def _reduce(self, op, x):
        return op(x, self.vocab_axes) if self.vocab_axes else x

    def _chunk(self, h, table, targets, start):
        """Masked float32 logits ``[c, rows]``, their lse (as ``jax.nn.logsumexp``: :func:`max_and_sum`'s
        statistics, one pass) and the target logits ``[c]``."""
        logits = jnp.einsum("ce,ve->cv", h, table, preferred_element_type=jnp.float32)
        ids = start + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        if self.padded_vocab_size > self.vocab_size:
            logits = jnp.where(ids < self.vocab_size, logits, MASKED)
        local_peak, local_total = max_and_sum(logits)
        peak = self._reduce(jax.lax.pmax, local_peak)
        lse = jnp.log(self._reduce(jax.lax.psum, local_total * jnp.exp(local_peak - peak))) + peak
        hit = ids == targets[:, None]
        target = self._reduce(jax.lax.psum, jnp.sum(jnp.where(hit, logits, 0.0), axis=-1))
        return logits, lse, target, hit

    def value(self, h, table, targets, weights=None):
        """Summed loss (float32 scalar) of this device's tokens, each weighted by ``weights`` float32
        of ``tokens`` elements, any shape (None: all 1)."""
        start, weights = self.start(table.shape[0]), _flat(weights)

        def one(h, t, w=None):
            _, lse, target, _ = self._chunk(h, table, t, start)
            return jnp.sum(lse - target if w is None else (lse - target) * w)

        c = chunk_rows(h.shape[0], table.shape[0])
        if c == h.shape[0]:
            return one(h, targets, weights)
        chunks = _chunked(c, h, targets, weights)
        return jax.lax.scan(lambda acc, x: (acc + one(*x), None), jnp.zeros((), jnp.float32), chunks)[0]

    def value_and_grads(self, h, table, targets, weights=None):
        """``(loss, d loss / d h, d loss / d table)``, float32: the (weighted, as :meth:`value`) summed loss
        of this device's tokens, ``[tokens, embed]`` (this vocabulary shard's part: the caller sums it over
        ``vocab_axes``) and ``[rows, embed]`` (this device's tokens only)."""
        start, weights = self.start(table.shape[0]), _flat(weights)

        def one(h, t, w=None):
            logits, lse, target, hit = self._chunk(h, table, t, start)
            d = jnp.exp(logits - lse[:, None]) - hit  # d loss / d logits, softmax - onehot
            d = (d if w is None else d * w[:, None]).astype(h.dtype)
            dh = jnp.einsum("cv,ve->ce", d, table, preferred_element_type=jnp.float32)
            dtable = jnp.einsum("cv,ce->ve", d, h, preferred_element_type=jnp.float32)
            return jnp.sum(lse - target if w is None else (lse - target) * w), dh, dtable

        c = chunk_rows(h.shape[0], table.shape[0])
        if c == h.shape[0]:
            return one(h, targets, weights)

        def body(carry, x):
            loss, dtable = carry
            l, dh, dt = one(*x)
            return (loss + l, dtable + dt), dh

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros(table.shape, jnp.float32))
        (loss, dtable), dh = jax.lax.scan(body, zeros, _chunked(c, h, targets, weights))
        return loss, dh.reshape(h.shape), dtable


def max_and_sum(x):
    """``(max(x), sum(exp(x - max(x))))`` over the last axis of float32 ``x`` ``[..., n]``, each ``[...]``, in one
    pass over ``x`` (one reduction of pairs, the online softmax's: Milakov & Gimelshein 2018, "Online normalizer
    calculation for softmax", algorithm 3) where ``jnp.max`` then ``jnp.sum`` read it twice.  Its start is the
    smallest float32 with a sum of 0 (not -inf: two starts combined would give ``exp(-inf + inf)``)."""

    def combine(a, b):
        (m1, s1), (m2, s2) = a, b
        m = jnp.maximum(m1, m2)
        return m, s1 * jnp.exp(m1 - m) + s2 * jnp.exp(m2 - m)

    start = (jnp.array(jnp.finfo(jnp.float32).min, jnp.float32), jnp.array(0.0, jnp.float32))
    return jax.lax.reduce((x, jnp.ones_like(x)), start, combine, (x.ndim - 1,))


def _chunked(c, h, targets, weights):
    """``h [tokens, embed]``, targets and weights (or None) ``[tokens]`` cut into chunks of ``c`` tokens."""
    chunks = (h.reshape(-1, c, h.shape[1]), targets.reshape(-1, c))
    return chunks if weights is None else (*chunks, weights.reshape(-1, c))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(run, h, table, targets, weights):
    return run.value(h, table, targets, weights)


def _fused_fwd(run, h, table, targets, weights):
    loss, dh, dtable = run.value_and_grads(h, table, targets, weights)
    return loss, (dh, dtable, jnp.zeros((), h.dtype), jnp.zeros((), table.dtype))


def _fused_bwd(run, res, g):
    dh, dtable, h_like, table_like = res
    return (g * dh).astype(h_like.dtype), (g * dtable).astype(table_like.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


@dataclasses.dataclass(frozen=True)
class _Flat:
    """Runs :class:`Local` on flattened tokens (one device)."""

    local: Local

    def value(self, h, table, targets, weights=None):
        return self.local.value(h.reshape(-1, h.shape[-1]), table, targets.reshape(-1), weights)

    def value_and_grads(self, h, table, targets, weights=None):
        loss, dh, dtable = self.local.value_and_grads(h.reshape(-1, h.shape[-1]), table, targets.reshape(-1), weights)
        return loss, dh.reshape(h.shape), dtable


def _flat(weights):
    return None if weights is None else weights.reshape(-1)


def fused(run, h, table, targets, weights=None):
    """The custom-VJP loss with ``run`` (an object with ``value`` and ``value_and_grads`` of
    ``(h, table, targets, weights)``, hashable: :class:`jaxllm.parallel.vocab_parallel.CrossEntropy` or one
    device's)."""
    return _fused(run, h, table, targets, weights)


def cross_entropy(h, table, targets, vocab_size: int, weights=None):
    """Summed next-token cross entropy (nats, float32 scalar) on one device.

    Args:
      h: the final norm's output ``[..., embed]`` in the compute dtype.
      table: the output layer ``[padded_vocab, embed]`` in the compute dtype.
      targets: int32 ``[...]`` (``h``'s leading dimensions), each ``< vocab_size``.
      vocab_size: the real vocabulary; the logits of the padded rows are masked.
      weights: float32 ``[...]`` (as targets), each token's weight (``data.eod_mask_loss``'s loss
        mask), or None: all 1.
    Returns:
      ``sum over tokens of weight x (logsumexp(logits) - logits[target])``; differentiable in ``h`` and
      ``table`` (not in ``weights``).
    """
    return fused(_Flat(Local(vocab_size, table.shape[0])), h, table, targets, weights)
