"""The one attention entry point of the model, dispatched on ``model.attention_impl``."""

from __future__ import annotations

from jaxllm_kernels import reference


def _xla(q, k, v, **kw):
    return reference.attention(q, k, v, **kw)


IMPLS = {"xla": _xla}


def attention(q, k, v, *, impl="xla", causal=True, q_segment_ids=None, kv_segment_ids=None, window=None,
              q_positions=None, kv_positions=None, return_lse=False):
    """Attention by the implementation ``impl`` names.

    Args:
      q: ``[batch, q_len, heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads, head_dim]``.
      impl: a key of :data:`IMPLS` (``model.attention_impl``).
      The other arguments are those of :func:`jaxllm_kernels.reference.attention`.
    Returns:
      ``[batch, q_len, heads, head_dim]``, and with ``return_lse`` the float32
      log-sum-exp ``[batch, heads, q_len]`` that ring attention merges partial results with.
    Raises:
      ValueError: ``impl`` is unknown.
    """
    if impl not in IMPLS:
        raise ValueError(f"model.attention_impl={impl!r} is not available; choose one of {', '.join(IMPLS)}")
    return IMPLS[impl](q, k, v, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                       window=window, q_positions=q_positions, kv_positions=kv_positions, return_lse=return_lse)
