"""Plain XLA attention: the reference every kernel is tested against, and the ``xla`` path.

Grouped-query attention is computed by viewing the query heads as
``[kv_heads, group]`` so that repeated keys and values are never materialized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # a masked score or logit: finite, so a fully masked row gives zeros instead of NaN


def default_positions(q_positions, kv_positions, batch, q_len, kv_len):
    """Fills missing positions with ``arange``, the queries aligned to the end of the keys."""
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(q_len) + (kv_len - q_len), (batch, q_len))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(jnp.arange(kv_len), (batch, kv_len))
    return q_positions, kv_positions


def attention_mask(q_positions, kv_positions, *, causal, q_segment_ids=None, kv_segment_ids=None, window=None):
    """Boolean mask ``[batch, q_len, kv_len]``: True where a query may attend to a key.

    Args:
      q_positions: int ``[batch, q_len]``, the token position of each query.
      kv_positions: int ``[batch, kv_len]``, the token position of each key.
      causal: keys after the query are masked.
      q_segment_ids, kv_segment_ids: int ``[batch, q_len]`` / ``[batch, kv_len]`` or None;
        tokens of different segments (packed documents) never attend to each other.
      window: int or None; a query attends only to keys at most ``window - 1`` positions back.
    """
    qp, kp = q_positions[:, :, None], kv_positions[:, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(qp.shape, kp.shape), bool)
    if causal:
        mask &= kp <= qp
    if window is not None:
        mask &= qp - kp < window
    if q_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return mask


def attention(q, k, v, *, causal=True, q_segment_ids=None, kv_segment_ids=None, window=None,
              q_positions=None, kv_positions=None, return_lse=False, sinks=None):
    """Softmax attention, ``softmax(q k^T / sqrt(head_dim)) v`` (Vaswani et al. 2017, eq. 1); with ``sinks``, a logit
    per head in each softmax's denominator that takes no value (attention sinks: gpt-oss; Megatron-LM's learnable
    softmax offset; Miller 2023's "off by one" when 0), ``exp(s_i) / (sum_j exp(s_j) + exp(sink))``.

    Args:
      q: ``[batch, q_len, heads, head_dim]``.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``; v's last
        dimension may differ from q's and k's (multi-head latent attention), the output's is v's.
      causal, q_segment_ids, kv_segment_ids, window: see :func:`attention_mask`.
      q_positions, kv_positions: int ``[batch, len]``; default ``arange``, with the queries
        aligned to the end of the keys (so a single decoding query sees every key).
      return_lse: also return the log-sum-exp of the scaled scores.
      sinks: ``[heads]`` (float32 logits, in the scaled scores' units) or None.
    Returns:
      out ``[batch, q_len, heads, head_dim]`` in q's dtype; with ``return_lse`` also
      lse ``[batch, heads, q_len]`` float32 (``-1e30`` for a query that sees no key; with ``sinks`` the sink's
      logit joins the sum: the sink's alone for a query that sees no key).
    Softmax statistics are accumulated in float32 whatever the input dtype.
    """
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if h % kvh:
        raise ValueError(f"heads={h} is not a multiple of kv_heads={kvh}")
    q_positions, kv_positions = default_positions(q_positions, kv_positions, b, sq, sk)
    mask = attention_mask(q_positions, kv_positions, causal=causal, q_segment_ids=q_segment_ids,
                          kv_segment_ids=kv_segment_ids, window=window)
    qg = q.reshape(b, sq, kvh, h // kvh, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, MASKED)
    lse = jax.nn.logsumexp(scores, axis=-1)
    if sinks is not None:  # [kv_heads, group] as the query heads are viewed
        lse = jnp.logaddexp(lse, sinks.astype(jnp.float32).reshape(kvh, h // kvh)[None, :, :, None])
    probs = jnp.exp(scores - lse[..., None])
    probs = jnp.where(mask[:, None, None], probs, 0.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(b, sq, h, v.shape[-1]).astype(q.dtype)
    if return_lse:
        lse = lse if sinks is not None else jnp.where(mask.any(-1)[:, None, None], lse, MASKED)
        return out, lse.reshape(b, h, sq)
    return out
