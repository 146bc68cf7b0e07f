"""The one attention entry point of the model, dispatched on ``model.attention_impl``.

Implementations (keys of :data:`IMPLS`; with ``auto`` the choices of ``model.attention_impl``, :data:`CHOICES`):

``xla``
    :func:`jaxllm_kernels.reference.attention`: plain XLA, every backend.  Materialises
    the ``[q_len, kv_len]`` scores, so memory grows with the square of the sequence.
``cudnn``
    cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``,
    NVIDIA GPUs only.  Grouped-query attention is passed straight through (jax's API
    accepts fewer key/value heads).  Calls that API cannot express with the reference's
    semantics go to the ``pallas`` kernel instead (see :func:`cudnn_unsupported`):
    ``return_lse`` (jax returns cuDNN's softmax statistics only cast to the output dtype
    and not differentiably; ring attention needs float32 and its gradient), explicit
    positions, causal with ``q_len != kv_len`` (cuDNN's causal mask is aligned top-left, the
    reference's bottom-right), a window without causal, float32 inputs, head_dim not a
    multiple of 8 or above 128, and segment ids but in the one form cuDNN takes (below).

    Segment ids (packed documents, ``data.reset_attention_mask``) go to cuDNN's packed
    layout (:func:`packed_segments`: each row's document lengths and offsets) when the
    same array is given for queries and keys, without a window, on Hopper or later (jax's
    packed cuDNN attention requires compute capability 9.0), and with a static bound on
    documents per row, ``data.max_documents_per_sample`` (checked on every batch by the
    loader).  jax sizes cuDNN's softmax statistics by it, float32 ``[batch * bound, heads,
    seq]``; the only bound that holds for any data, the sequence length, would make them as
    large as the ``xla`` path's scores, so without one (0, the default) segment ids stay
    with the Pallas kernel, whose memory is linear in the sequence.
``pallas``
    :func:`jaxllm_kernels.pallas_attention.flash_attention`: FlashAttention-2 in Pallas,
    lowered through Triton; NVIDIA and AMD (ROCm) GPUs.  Supports everything the reference
    does, explicit positions included.  On CPU the same kernel runs in Pallas's interpret
    mode: exact but slow, for tests and debugging (``auto`` never picks it there).
``triton``
    :func:`jaxllm_kernels.triton_attention.flash_attention`: the same algorithm written in
    the Triton language, through ``jax_triton``; GPUs where ``jax_triton`` imports.
``auto``
    :func:`resolve_impl` picks ``cudnn`` on NVIDIA GPUs, ``pallas`` on AMD (ROCm) GPUs and
    ``xla`` elsewhere (CPU, TPU), once, when the config is resolved
    (:func:`jaxllm.resolve.resolve_model`): below that ``model.attention_impl`` is concrete.

The model, sequence parallelism and the CPU's operations call an :class:`Implementation`, the resolved
name bound once (:func:`implementation`), never the string.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

from jaxllm.errors import ConfigError
from jaxllm.platform.hardware import backend_kind
from jaxllm_kernels import lowering, pallas_attention, reference, triton_attention

AUTO = {"cuda": "cudnn", "rocm": "pallas", "cpu": "xla"}  # any other backend: xla
# Pallas tiles when lowering for a GPU that is not here: Pallas itself then lowers for compute
# capability 9.0 (its fallback without a GPU), so Hopper's; CDNA's for ROCm.
TARGET_FAMILY = {"cuda": "hopper", "rocm": "cdna"}
# compute capability of a GPU family (as jax's cuDNN checks compare it), for lowering without that GPU
CAPABILITY = {"hopper": (9, 0), "ampere": (8, 0)}
# (kind, family) inside lowering_target; family None: compiled here, the Pallas kernel interpreted
_TARGET: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar("jaxllm_attention_target",
                                                                                  default=None)


@contextlib.contextmanager
def lowering_target(kind: str, family: str | None = None, *, interpret: bool = False):
    """Trace attention for the GPU backend ``kind`` (``"cuda"`` or ``"rocm"``) instead of the default backend.

    Inside the block the dispatch's backend kind is ``kind``, so ``auto`` and the availability
    checks follow it.  JAX's tracing caches do not know this setting, so they are cleared on
    entry and exit (``jax.clear_caches``): nothing traced inside is reused outside, or the reverse.

    ``interpret=False``: for lowering ahead of time for a GPU this machine lacks (``jax.export``
    with ``platforms=[kind]``); the Pallas kernel is traced for Triton (not interpret mode) with
    the tiles of ``family`` (a key of :data:`jaxllm_kernels.pallas_attention.DEFAULT_BLOCK_SIZES`;
    default :data:`TARGET_FAMILY` of ``kind``).  A program traced inside runs only on ``kind``.

    ``interpret=True``: for compiling here what ``kind`` would run, as :mod:`jaxllm.plan` does to
    measure a GPU's memory.  Every flash implementation (``cudnn``, ``pallas``, ``triton``) is
    traced as the Pallas kernel in interpret mode: the same residuals for the backward pass (the
    output and the float32 log-sum-exp) and a working set of one tile, so XLA's temporaries grow
    linearly with the sequence as on the GPU, not with its square as the ``xla`` path's scores do.
    ``family`` is ignored (a tile's registers are not device memory).

    jax's cuDNN attention checks the compute capability of the default backend's GPU while tracing
    (packed documents need 9.0); inside the block, for ``kind="cuda"`` and ``interpret=False``, it
    is answered for ``family`` (:data:`CAPABILITY`) instead.

    Raises:
      ValueError: ``kind`` is not ``"cuda"`` or ``"rocm"``, or ``family`` is unknown.
    """
    family = family or TARGET_FAMILY.get(kind)
    if kind not in TARGET_FAMILY or family not in pallas_attention.DEFAULT_BLOCK_SIZES:
        raise ValueError(f"lowering_target({kind!r}, {family!r}): choose a kind of {', '.join(TARGET_FAMILY)} and a "
                         f"family of {', '.join(pallas_attention.DEFAULT_BLOCK_SIZES)}")
    jax.clear_caches()
    token = _TARGET.set((kind, None if interpret else family))
    check = cudnn_fa.check_compute_capability
    if kind == "cuda" and not interpret:
        cudnn_fa.check_compute_capability = lambda c: CAPABILITY[family] >= tuple(int(p) for p in c.split("."))
    try:
        with lowering.without_gpu():  # Pallas's Triton lowering for a GPU that is not here
            yield
    finally:
        cudnn_fa.check_compute_capability = check
        _TARGET.reset(token)
        jax.clear_caches()


def _backend_kind(backend=None) -> str:
    """:func:`jaxllm.platform.hardware.backend_kind`, or the kind of an enclosing :func:`lowering_target`."""
    target = _TARGET.get()
    return target[0] if backend is None and target is not None else backend_kind(backend)


def _why_not(impl, kind):
    """None if ``impl`` runs on backend kind ``kind``, else the reason."""
    if impl == "xla":
        return None
    if impl == "cudnn":
        return None if kind == "cuda" else "cuDNN exists only on NVIDIA GPUs (the cuda backend)"
    if impl == "pallas":
        if kind in ("cuda", "rocm", "cpu"):  # on CPU: Pallas's interpret mode, slow, for tests and debugging
            return None
        return "the Pallas kernel lowers through Triton to NVIDIA and AMD GPUs (and runs interpreted on CPU)"
    if impl == "triton":
        if kind not in ("cuda", "rocm"):
            return "jax_triton runs only on GPUs"
        ok, why = triton_attention.available()
        return None if ok else why
    raise KeyError(impl)


def available_impls(backend=None) -> list[str]:
    """The concrete implementations that run on ``backend`` (see :func:`jaxllm.platform.hardware.backend_kind`), in
    preference order.

    ``"auto"`` is always accepted as well and resolves to one of these.
    """
    kind = _backend_kind(backend)
    return [name for name in ("xla", "cudnn", "pallas", "triton") if _why_not(name, kind) is None]


def resolve_impl(impl, backend=None, *, sinks: bool = False) -> str:
    """The concrete implementation ``impl`` means on ``backend`` (``sinks``: the model's attention has sinks, which
    ``auto`` takes to the Pallas kernel where it would take cuDNN: jax's cuDNN attention has none).

    Raises:
      ValueError: ``impl`` is unknown, or not available on this backend; the message says why
        and names the ones that are.
    """
    if impl == "auto":
        chosen = AUTO.get(_backend_kind(backend), "xla")
        return "pallas" if sinks and chosen == "cudnn" else chosen
    _check_available(impl, backend)
    return impl


def model_impl(m, backend=None, impl: str | None = None) -> str:
    """:func:`resolve_impl` of ``impl`` (None: ``m.attention_impl``) for the model ``m`` (``config.Model``), its
    attention sinks (``m.softmax_type``) included: what every caller that has the model passes."""
    return resolve_impl(impl or m.attention_impl, backend, sinks=m.softmax_type != "vanilla")


def _check_available(impl, backend=None) -> None:
    """Raises ValueError: ``impl`` is unknown or does not run on ``backend`` (the message names those that do)."""
    if impl not in CHOICES:
        raise ValueError(f"model.attention_impl={impl!r} is unknown; choose one of {', '.join(CHOICES)}")
    if impl == "auto":
        raise ValueError("attention(impl='auto'): auto is decided once, by resolve_impl (as "
                         "jaxllm.resolve.resolve_model does); pass the implementation it gives")
    kind = _backend_kind(backend)
    why = _why_not(impl, kind)
    if why is not None:
        raise ValueError(f"model.attention_impl={impl!r} is not available on the {kind} backend: {why}. "
                         f"Available here: auto, {', '.join(available_impls(kind))}")


def check_config(cfg, backend=None) -> None:
    """Checks ``model.attention_impl`` against ``backend`` and the model's head widths before anything compiles.

    Raises:
      ConfigError: the implementation is unknown or not available here (the fix names those that are); cuDNN with
        attention sinks (``model.softmax_type``);
        value heads wider than query/key heads (``model.v_head_dim`` of multi-head latent attention) for a
        flash implementation (:func:`attention` pads only narrower ones).
    """
    m = cfg.model
    try:
        impl = model_impl(m, backend)
    except ValueError as e:
        raise ConfigError("model.attention_impl", m.attention_impl, str(e).split(": ", 1)[-1]) from None
    if impl == "cudnn" and m.softmax_type != "vanilla":
        raise ConfigError("model.attention_impl", "cudnn", f"jax's cuDNN attention takes no attention sinks "
                          f"(model.softmax_type={m.softmax_type}): set model.attention_impl=pallas, triton or auto")
    dq, dv = m.attention_head_dims
    if impl != "xla" and dv > dq:
        raise ConfigError("model.v_head_dim", dv, f"model.attention_impl={impl} takes value heads no wider than "
                          f"query/key heads (qk_head_dim + qk_pos_emb_head_dim = {dq}): set v_head_dim <= {dq} or "
                          f"model.attention_impl=xla")


def cudnn_unsupported(q, k, *, causal, q_segment_ids, kv_segment_ids, window, q_positions, kv_positions,
                      return_lse, max_documents=None):
    """None if the cuDNN path computes exactly the reference's attention for this call (in memory linear in
    the sequence), else the reason."""
    d = q.shape[-1]
    if return_lse:
        return "return_lse (cuDNN's softmax statistics come back in the output dtype, not differentiable)"
    if q_segment_ids is not None:
        if kv_segment_ids is not q_segment_ids:
            return "different query and key segment ids (cuDNN's packed layout: the same documents for both)"
        if window is not None:
            return "a window with segment ids"
        if not max_documents:
            return ("segment ids without data.max_documents_per_sample (cuDNN's statistics would be "
                    "[batch x seq, heads, seq])")
        if not cudnn_fa.check_compute_capability("9.0"):
            return "segment ids before Hopper (jax's packed cuDNN attention needs compute capability 9.0)"
    if q_positions is not None or kv_positions is not None:
        return "explicit positions"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (cuDNN flash attention takes bfloat16/float16)"
    if causal and q.shape[1] != k.shape[1]:
        return "causal with q_len != kv_len (cuDNN aligns the causal mask top-left)"
    if window is not None and not causal:
        return "a window without causal"
    if d % 8 or d > 128:
        return f"head_dim={d}"
    return None


def packed_segments(segment_ids, max_documents=None):
    """Segment ids as cuDNN's packed layout takes them: each row's documents as (length, offset).

    A document is a run of equal ids (Megatron's segment ids, :func:`jaxllm.data.loader.document_masks`,
    never repeat an id after a change, so this is the reference's mask: tokens attend within their id).
    The bound on documents per row is static: ``max_documents``, default ``seq`` (the only one that holds for
    any data); a row with more has its documents past the bound merged into its last counted one.

    Args:
      segment_ids: int ``[batch, seq]``.
      max_documents: the static bound ``m`` (``data.max_documents_per_sample``; None: ``seq``).
    Returns:
      ``(lengths [batch, m], offsets [batch, m + 1])`` int32, in the form of
      ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``'s ``q_seqlen`` and ``q_offsets``:
      row ``b``'s documents in order, the ``j``-th from token ``offsets[b, j]`` for ``lengths[b, j]``
      tokens; -1 after the row's last document (and always in the last offset column).
    """
    b, s = segment_ids.shape
    m = max_documents or s
    first = jnp.ones((b, 1), bool)
    starts_here = jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    # start of each row's j-th document, s past the last one
    starts = jax.vmap(lambda x: jnp.nonzero(x, size=m, fill_value=s)[0])(starts_here).astype(jnp.int32)
    ends = jnp.concatenate([starts[:, 1:], jnp.full((b, 1), s, jnp.int32)], axis=1)
    real = starts < s
    lengths = jnp.where(real, ends - starts, -1)
    offsets = jnp.concatenate([jnp.where(real, starts, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return lengths, offsets


def _cudnn_packed(q, k, v, segment_ids, causal, max_documents):
    """cuDNN attention within the documents of ``segment_ids`` (:func:`packed_segments`), BTNH layout."""
    lengths, offsets = packed_segments(segment_ids, max_documents)
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads != heads:  # jax strides the key offsets by the query heads (_fix_seqlen_offsets): repeat K/V
        k, v = (jnp.repeat(a, heads // kv_heads, axis=2) for a in (k, v))
    return cudnn_fa.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5, mask_type=cudnn_fa.MaskType.CAUSAL if causal else cudnn_fa.MaskType.NO_MASK)


def _xla(q, k, v, **kw):
    return reference.attention(q, k, v, **kw)


def planned_gpu() -> str | None:
    """The GPU kind (``"cuda"``, ``"rocm"``) a step traced inside ``lowering_target(kind, interpret=True)`` is
    planned for (compiled by this machine's XLA with that GPU's memory, :mod:`jaxllm.plan`), else None: what
    the other GPU-only operations (a mixture of experts' grouped GEMMs and ragged exchange) stand in for too."""
    target = _TARGET.get()
    return target[0] if target is not None and target[1] is None else None


def _interpreted():
    """True inside ``lowering_target(..., interpret=True)``: flash implementations run as the interpreted kernel."""
    target = _TARGET.get()
    return target is not None and target[1] is None


def _pallas(q, k, v, **kw):
    target = _TARGET.get()
    if _interpreted():
        kw.update(interpret=True)
    elif target is not None:  # lowering for a GPU that is not here: Triton, that GPU family's tiles
        kw.update(interpret=False, block_sizes=pallas_attention.default_block_sizes(target[1], q.shape[-1]))
    return pallas_attention.flash_attention(q, k, v, **kw)


def _triton(q, k, v, **kw):
    if _interpreted():
        return _pallas(q, k, v, **kw)
    return triton_attention.flash_attention(q, k, v, **kw)


def _cudnn(q, k, v, *, causal, q_segment_ids, kv_segment_ids, window, q_positions, kv_positions, return_lse,
           max_documents=None):
    reason = cudnn_unsupported(q, k, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                               window=window, q_positions=q_positions, kv_positions=kv_positions,
                               return_lse=return_lse, max_documents=max_documents)
    # the documented fallback (the Pallas kernel has the reference's exact semantics), and a plan's stand-in
    if reason is not None or _interpreted():
        return _pallas(q, k, v, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                       window=window, q_positions=q_positions, kv_positions=kv_positions, return_lse=return_lse)
    if q_segment_ids is not None:
        return _cudnn_packed(q, k, v, q_segment_ids, causal, max_documents)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn",
        local_window_size=None if window is None else (int(window) - 1, 0))


IMPLS = {"xla": _xla, "cudnn": _cudnn, "pallas": _pallas, "triton": _triton}
CHOICES = ("auto", *IMPLS)  # model.attention_impl's


def merge_sinks(out, lse, sinks):
    """Attention ``out`` ``[batch, q_len, heads, v_dim]`` with its log-sum-exp ``lse`` float32 ``[batch, heads, q_len]``
    as if each head's softmax had also held the logit ``sinks`` ``[heads]`` (attention sinks, no value): ``out x
    exp(lse - lse')`` and ``lse' = logaddexp(lse, sink)`` (the log-sum-exp merge of ring attention with a block of
    zeros).  Differentiable in all three, so any implementation that returns its ``lse`` takes sinks."""
    total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
    w = jnp.exp(lse - total).transpose(0, 2, 1)[..., None]
    return (out.astype(jnp.float32) * w).astype(out.dtype), total


def attention(q, k, v, *, impl="xla", causal=True, q_segment_ids=None, kv_segment_ids=None, window=None,
              q_positions=None, kv_positions=None, return_lse=False, max_documents=None, sinks=None):
    """Attention by the implementation ``impl`` names.

    Args:
      q, k: ``[batch, q_len or kv_len, heads or kv_heads, head_dim]``; v: ``[batch, kv_len, kv_heads, v_dim]``,
        ``v_dim`` <= ``head_dim`` (multi-head latent attention's narrower values; the flash kernels, which take one
        width, get them padded with zeros to ``head_dim`` and their output cut back).
      impl: a key of :data:`IMPLS` (``model.attention_impl`` resolved; not ``"auto"``).
      max_documents: ``cudnn`` with segment ids: the most documents (runs of equal ids) a row holds, the static
        bound of :func:`packed_segments` (None: the call goes to the Pallas kernel); the others need none.
      sinks: float32 ``[heads]`` attention sinks or None: the reference computes them in its softmax, the flash
        kernels' output is merged with them by its log-sum-exp (:func:`merge_sinks`; cuDNN's, which jax does not
        return differentiably, is the Pallas kernel's).
      The other arguments are those of :func:`jaxllm_kernels.reference.attention`.
    Returns:
      ``[batch, q_len, heads, v_dim]``, and with ``return_lse`` the float32
      log-sum-exp ``[batch, heads, q_len]`` that ring attention merges partial results with.
    Raises:
      ValueError: ``impl`` is unknown, ``"auto"``, or not available on the default backend (the
        message names the ones that are); ``v_dim`` > ``head_dim`` but for ``xla``.
    """
    _check_available(impl)
    if sinks is not None and impl != "xla":
        out, lse = attention(q, k, v, impl=impl, causal=causal, q_segment_ids=q_segment_ids,
                             kv_segment_ids=kv_segment_ids, window=window, q_positions=q_positions,
                             kv_positions=kv_positions, return_lse=True, max_documents=max_documents)
        out, lse = merge_sinks(out, lse, sinks)
        return (out, lse) if return_lse else out
    dq, dv = q.shape[-1], v.shape[-1]
    if impl != "xla" and dv != dq:  # the kernels take one head width: values padded with zero columns to q's
        if dv > dq:
            raise ValueError(f"attention(impl={impl!r}): value heads ({dv}) wider than query/key heads ({dq}); "
                             "only xla takes them")
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, dq - dv)])
    bound = {"max_documents": max_documents} if impl == "cudnn" else {"sinks": sinks} if sinks is not None else {}
    out = IMPLS[impl](q, k, v, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                      window=window, q_positions=q_positions, kv_positions=kv_positions, return_lse=return_lse,
                      **bound)
    if dv == dq:
        return out
    return (out[0][..., :dv], out[1]) if return_lse else out[..., :dv]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One concrete attention implementation, chosen once: what the model's operations, sequence
    parallelism and the CPU's operations call instead of passing ``model.attention_impl`` down.

    Attributes:
      name: a key of :data:`IMPLS` (not ``"auto"``: :func:`resolve_impl` decides that once).
      window: ``model.sliding_window`` (None: no window), every call's ``window`` unless it passes one.
      max_documents: ``data.max_documents_per_sample`` (None: none, and segment ids stay with Pallas), every
        call's bound on documents per row for cuDNN's packed layout (:func:`packed_segments`).
    """

    name: str = "xla"
    window: int | None = None
    max_documents: int | None = None

    @property
    def flash(self) -> bool:
        """True for a flash kernel (a custom call, run whole: XLA cannot partition or chunk it); False
        for the ``xla`` reference."""
        return self.name != "xla"

    def __call__(self, q, k, v, **kw):
        """:func:`attention` by this implementation: same arguments but ``impl``, same result and errors."""
        return attention(q, k, v, impl=self.name, **{"window": self.window, "max_documents": self.max_documents, **kw})


def implementation(cfg, max_documents: int = 0) -> Implementation:
    """The attention of the resolved ``model`` section ``cfg`` (:class:`jaxllm.config.Model`): its
    ``attention_impl``, concrete after :func:`jaxllm.resolve.resolve_model`, and ``sliding_window`` bound;
    ``max_documents``: ``data.max_documents_per_sample`` (0: none)."""
    return Implementation(cfg.attention_impl, cfg.sliding_window or None, max_documents or None)
