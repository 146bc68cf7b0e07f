"""Sequence-parallel attention over the mesh axis the rules table gives ``length``.

With ``mesh.sequence`` = n > 1 every activation from the embedding to the loss is
split along the sequence (the rules table maps ``length`` and ``residual`` to
``sequence``; GSPMD partitions the position-wise layers by itself).  Attention is
the one layer whose tokens talk to each other; :func:`attention` runs it under
``jax.shard_map`` with one of four algorithms (``parallel.sequence_impl``):

``allgather``
    Queries stay split, keys and values are all-gathered (MaxText's default).
``ulysses``
    DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns the sequence-split
    q, k, v into head-split ones over the full sequence, attention runs locally,
    and a second all-to-all turns the output back.  Needs the heads (and key/value
    heads) of each tensor shard divisible by n (:func:`jaxllm.resolve.resolve`).
``ring``
    Ring attention / context parallelism (Liu et al. 2023, "Ring Attention with
    Blockwise Transformers"; Megatron-LM CP): key/value blocks travel around the
    ring with collective permutes, partial results merge by their log-sum-exp
    (online softmax, Milakov & Gimelshein 2018), and the backward pass sends the
    key/value gradients around the ring with the blocks.  Causal load balancing:
    the sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i
    (the "zigzag" order of Megatron-LM / Transformer Engine context parallelism;
    Striped Attention, Brandon et al. 2023, balances with a stride instead), so at every ring
    step each device computes exactly two fully visible chunk x chunk blocks;
    :func:`zigzag` reorders the tokens, targets and positions of a batch before
    the model (the mean loss does not depend on the order).  Double buffering:
    each step sends the next step's block (and, backward, the gradients gathered
    for its own) before computing on the current one, which does not read them,
    so XLA's latency-hiding scheduler can overlap the transfer with the attention.
``usp``
    Unified sequence parallelism (Fang & Zhao 2024, "USP: A Unified Sequence
    Parallelism Approach"; Megatron-LM's hierarchical ``a2a+p2p`` context
    parallelism): the n devices of the sequence axes form n / U groups of U
    consecutive ones (``parallel.ulysses_degree``; consecutive is inside a node, as
    the mesh puts ``dcn_sequence`` outermost).  Ulysses' all-to-all runs inside each
    group (as U - 1 collective permutes: a grouped all-to-all has no batching rule,
    and pipeline stages are a ``vmap``), and ring attention runs over the groups, in
    the zigzag order of n / U ring devices, among the devices that hold the same
    heads.  U = n is ``ulysses``, U = 1 is ``ring``.

Grouped-query attention under ``ulysses`` and ``usp``: when a tensor shard's key/value
heads do not divide by U, each is repeated until they do (as USP and Megatron-LM's
context parallelism do), so only the query heads must divide by U.

The shard_map is manual over every mesh axis, with in/out specs derived from the
rules table (batch over the data axes, heads over ``tensor``, length over the
sequence axes), and the collectives run over the mesh axes the table assigns to
``length``: model code names no mesh axis.  Local attention goes through
:func:`jaxllm.model.attention.attention` (``return_lse`` where ring merges), so a
kernel serves all four; with the ``xla`` reference the queries are processed in
rematerialized chunks so no ``[seq, seq]`` score matrix is kept for the backward
pass.  With one device on the sequence axes and the ``xla`` implementation,
:class:`Attention` is exactly the model's plain causal attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.errors import ConfigError
from jaxllm.model import attention as attn
from jaxllm.parallel.sharding import Layout, rules
from jaxllm_kernels.reference import MASKED

_CHUNK_SCORES = 1 << 22  # query chunk x key length of the xla reference's rematerialized chunks


def groups(sequence_impl: str, n: int, degree: int) -> tuple[int, int]:
    """``(devices in each all-to-all group, devices on the ring)`` of ``n`` sequence devices: ``(n, 1)``
    for ``ulysses``, ``(degree, n / degree)`` for ``usp`` (``degree``: ``parallel.ulysses_degree``,
    resolved), ``(1, n)`` for ``ring``, ``(1, 1)`` for ``allgather``."""
    group = {"ulysses": n, "usp": degree}.get(sequence_impl, 1)
    return group, (n // group if sequence_impl in ("ring", "usp") else 1)


def ring_devices(layout: Layout | None, parallel) -> int:
    """Devices on the ring of ring attention: the sequence devices for ``ring``, their ``usp`` groups
    for ``usp``, 1 (no ring) otherwise or with ``layout`` None.  ``parallel``: the resolved
    ``parallel`` section."""
    if layout is None:
        return 1
    return groups(parallel.sequence_impl, layout.size("length"), parallel.ulysses_degree)[1]


def check(cfg) -> None:
    """What ``parallel.sequence_impl`` needs of a config being resolved (``mesh_shape`` filled,
    ``parallel.ulysses_degree`` resolved).

    Raises:
      ConfigError: ``parallel.ulysses_degree`` set without ``usp`` or not dividing the sequence
        devices; ring or usp with a sequence not divisible by 2 x the ring devices; ulysses or usp
        with heads not divisible by the tensor devices x the all-to-all group.
    """
    table, m, p = rules(cfg), cfg.model, cfg.parallel
    n = math.prod(cfg.mesh_shape[a] for a in table["length"])
    devices = " x ".join(f"mesh.{a} x mesh.dcn_{a}" for a in table["length"]) + f" = {n}"
    if p.sequence_impl != "usp" and p.ulysses_degree:
        raise ConfigError("parallel.ulysses_degree", p.ulysses_degree,
                          "only parallel.sequence_impl=usp takes it (ulysses spans every sequence device); "
                          "set parallel.sequence_impl=usp or leave parallel.ulysses_degree at 0")
    if p.sequence_impl == "usp" and n % p.ulysses_degree:
        raise ConfigError("parallel.ulysses_degree", p.ulysses_degree,
                          f"must divide the sequence devices ({devices}): usp's all-to-all groups tile them")
    if n == 1:
        return
    degree, ring = groups(p.sequence_impl, n, p.ulysses_degree)
    if ring > 1 and cfg.train.seq_length % (2 * ring):
        what = "mesh.sequence" if p.sequence_impl == "ring" else "(mesh.sequence x mesh.dcn_sequence / " \
                                                                 "parallel.ulysses_degree)"
        raise ConfigError("train.seq_length", cfg.train.seq_length,
                          f"must be divisible by 2 x {what} = {2 * ring} (parallel.sequence_impl="
                          f"{p.sequence_impl} cuts the sequence into 2 chunks per ring device)")
    if degree > 1:
        split = degree * math.prod(cfg.mesh_shape[a] for a in table["heads"])
        group = "mesh.sequence" if p.sequence_impl == "ulysses" else "parallel.ulysses_degree"
        if m.num_attention_heads % split:
            raise ConfigError("model.num_attention_heads", m.num_attention_heads,
                              f"must be divisible by mesh.tensor x {group} = {split} (parallel.sequence_impl="
                              f"{p.sequence_impl} splits each tensor shard's heads over the all-to-all group)")


def zigzag_order(seq_len: int, n: int) -> np.ndarray:
    """The load-balanced order of ``seq_len`` tokens over ``n`` devices (int32 ``[seq_len]``).

    The sequence is cut into ``2n`` chunks; slot ``i`` (device ``i``) gets chunks ``i`` and
    ``2n-1-i``.  Entry ``p`` is the true position of the token placed at index ``p``.
    Raises:
      ValueError: ``seq_len`` is not divisible by ``2n``.
    """
    if seq_len % (2 * n):
        raise ValueError(f"ring attention needs the sequence ({seq_len}) divisible by 2 x sequence devices = {2 * n}")
    c = seq_len // (2 * n)
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def zigzag(ring: int, inputs, targets, docs=None):
    """Puts a batch in ring attention's load-balanced order (see :func:`zigzag_order`).

    Args:
      ring: the devices on the ring (:func:`ring_devices`); 1 reorders nothing.
      inputs, targets: int ``[..., seq]``, permuted identically along the last axis.
      docs: a dict of ``[..., seq]`` arrays (the data options' positions, segment ids, loss
        mask), permuted alike, or None.
    Returns:
      ``(inputs, targets, order, docs)``: order int32 broadcast to ``inputs.shape`` (the
      index in the sequence of each token, which the causal mask follows, and its position
      unless ``docs`` holds positions), or None where nothing is reordered (``ring`` 1);
      ``docs`` ``{}`` for None.
    Raises:
      ValueError: the sequence is not divisible by ``2 x ring``.
    """
    docs = docs or {}
    if ring == 1:
        return inputs, targets, None, docs
    order = jnp.asarray(zigzag_order(inputs.shape[-1], ring))
    return (inputs[..., order], targets[..., order], jnp.broadcast_to(order, inputs.shape),
            {k: a[..., order] for k, a in docs.items()})


@dataclasses.dataclass(frozen=True)
class Attention:
    """Causal self-attention, sequence-parallel over the ``length`` axes of ``layout``
    (the ``attention`` of the model's :class:`jaxllm.model.gpt.Ops`).

    ``allgather``: keys/values all-gathered (MaxText); ``ulysses``: DeepSpeed-Ulysses
    all-to-all (Jacobs et al. 2023); ``ring``: ring attention (Liu et al. 2023) in zigzag
    order with a log-sum-exp merge and a ring backward pass; ``usp``: Ulysses inside groups
    of ``ulysses_degree`` devices, ring across them (Fang & Zhao 2024; see the module docstring).
    A kernel (any impl but ``xla``) runs under ``shard_map`` on every mesh, sequence-split
    or not: it is a custom call, which XLA's partitioner would feed the gathered inputs.

    Attributes:
      layout: the mesh and rules table.
      sequence_impl: ``"allgather"``, ``"ring"``, ``"ulysses"`` or ``"usp"`` (``parallel.sequence_impl``).
      ulysses_degree: ``usp``'s all-to-all group (``parallel.ulysses_degree``, resolved: > 0).
      kernel: the local attention (``model.attention_impl`` bound, :func:`jaxllm.model.attention.implementation`).
    """

    layout: Layout
    sequence_impl: str = "allgather"
    ulysses_degree: int = 1
    kernel: attn.Implementation = attn.Implementation()

    def __call__(self, q, k, v, order=None, segment_ids=None, **layer):
        """Attention of one layer.

        Args:
          q: ``[batch, len, heads, head_dim]``; k, v: ``[batch, len, kv_heads, head_dim]``
            (global shapes, split along ``len`` over the sequence axes).
          order: int ``[batch, len]``, each token's index in the sequence, which the causal mask
            follows (so any order works for ``allgather`` and ``ulysses``; ``ring`` and ``usp``
            expect the order of :func:`zigzag` over :func:`ring_devices`); None: the array's order.
          segment_ids: int ``[batch, len]`` (in the order of ``q``) or None: a token attends only
            within its segment (``data.reset_attention_mask``).
          layer: the layer's own ``window`` (int, or None: every earlier position) where it is not the bound one, and
            its attention ``sinks`` (float32 ``[heads]``, split like the heads), merged into each implementation's
            result by its log-sum-exp (:func:`jaxllm.model.attention.merge_sinks`; ring attention's after the ring).
        Returns:
          ``[batch, len, heads, head_dim]`` in q's dtype, split like q.
        Raises:
          ValueError: unknown ``sequence_impl``; ring or usp with a ring device's length odd.
        """
        layout, sinks = self.layout, layer.get("sinks")
        kernel = dataclasses.replace(self.kernel, window=layer["window"]) if "window" in layer else self.kernel
        n = layout.size("length")
        if n == 1 and not kernel.flash:
            return kernel(q, k, v, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                          **({} if sinks is None else {"sinks": sinks}))
        q_spec, kv_spec = layout.spec(("batch", "length", "heads", "head_dim")), layout.spec(
            ("batch", "length", "kv_heads", "head_dim"))
        axes = layout.mesh_axes("length")
        axis = axes[0] if len(axes) == 1 else axes
        if n == 1:  # a kernel is a custom call XLA cannot partition (it would gather q, k, v): run it per shard
            def body(q, k, v, order, segment_ids=None, sinks=None):
                return kernel(q, k, v, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                              **({} if sinks is None else {"sinks": sinks}))
        elif self.sequence_impl == "allgather":
            body = functools.partial(_allgather, axis=axis, kernel=kernel)
        elif self.sequence_impl in ("ulysses", "usp"):
            degree, ring = groups(self.sequence_impl, n, self.ulysses_degree)
            body = functools.partial(_ulysses, axis=axis, degree=degree, ring=ring, kernel=kernel)
        elif self.sequence_impl == "ring":
            def body(q, k, v, order, segment_ids=None, sinks=None):
                return _ring((axis, n, 1, kernel), q, k, v, order, segment_ids, sinks)
        else:
            raise ValueError(f"parallel.sequence_impl={self.sequence_impl!r}: choose allgather, ring, ulysses or usp")
        if order is None:
            order = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
        token_spec = layout.spec(("batch", "length"))
        args, specs = (q, k, v, order.astype(jnp.int32)), (q_spec, kv_spec, kv_spec, token_spec)
        segment_ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
        optional = [(a, spec) for a, spec in ((segment_ids, token_spec), (sinks, layout.spec(("heads",))))
                    if a is not None]
        args, specs = (*args, *(a for a, _ in optional)), (*specs, *(spec for _, spec in optional))

        def run(q, k, v, order, *rest):  # the optional arguments back in their places
            rest = list(rest)
            seg = rest.pop(0) if segment_ids is not None else None
            return body(q, k, v, order, seg, rest.pop(0) if sinks is not None else None)

        return jax.shard_map(run, mesh=layout.mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def local_attention(q, k, v, q_positions, kv_positions, kernel, q_segment_ids=None, kv_segment_ids=None, sinks=None):
    """``(out, lse)`` of causal attention by true positions (and segment ids, or None; attention ``sinks`` ``[heads]``
    or None) on one device's shards.

    The ``xla`` reference is run over query chunks of at most ``_CHUNK_SCORES / kv_len``
    rows, each under ``jax.checkpoint``, so the backward pass keeps no score matrix; kernels
    (flash attention) are called once.  ``kernel``: the :class:`jaxllm.model.attention.Implementation`.
    Shapes as :func:`jaxllm.model.attention.attention`.
    """
    def one(q, qp, qs=None):
        return kernel(q, k, v, causal=True, q_positions=qp, kv_positions=kv_positions,
                      q_segment_ids=qs, kv_segment_ids=kv_segment_ids, return_lse=True,
                      **({} if sinks is None else {"sinks": sinks}))

    sq, sk = q.shape[1], k.shape[1]
    if kernel.flash or sq * sk <= _CHUNK_SCORES:
        return one(q, q_positions, q_segment_ids)
    chunk = max(1, _CHUNK_SCORES // sk)
    while sq % chunk:
        chunk -= 1
    m = sq // chunk
    b, _, h, d = q.shape
    qc = q.reshape(b, m, chunk, h, d).swapaxes(0, 1)
    pc, sc = (None if a is None else a.reshape(b, m, chunk).swapaxes(0, 1) for a in (q_positions, q_segment_ids))
    out, lse = jax.lax.map(lambda xs: jax.checkpoint(one)(*xs), (qc, pc, sc))
    return out.swapaxes(0, 1).reshape(b, sq, h, v.shape[-1]), lse.transpose(1, 2, 0, 3).reshape(b, h, sq)


def _allgather(q, k, v, pos, seg=None, sinks=None, *, axis, kernel):
    """Local queries against all-gathered keys and values; the gather is redone in the backward pass."""

    def f(q, k, v, pos, seg, sinks):
        gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
        return local_attention(q, gather(k), gather(v), pos, gather(pos), kernel, seg, gather(seg), sinks)[0]

    return jax.checkpoint(f)(q, k, v, pos, seg, sinks)


def _repeat_kv(x, degree):
    """Key/value heads ``[b, s, kvh, d]`` repeated (each head in place) until ``degree`` divides them:
    ``lcm(kvh, degree)`` heads, so that head ``j`` of the queries still reads key/value head
    ``j // (heads / kvh)`` after the all-to-all gives each device ``1 / degree`` of both."""
    kvh = x.shape[2]
    return x if kvh % degree == 0 else jnp.repeat(x, math.lcm(kvh, degree) // kvh, axis=2)


def _group_all_to_all(x, split_axis, concat_axis, *, axis, degree, ring):
    """A tiled all-to-all inside each group of ``degree`` consecutive devices on ``axis``, as ``degree - 1``
    collective permutes (the member ``s`` places on receives chunk ``s`` places on): JAX has no batching
    rule for an all-to-all over ``axis_index_groups``, which pipeline stages (a ``vmap``) need.  With
    ``split_axis`` None every member's whole ``x`` is gathered (an all-gather)."""
    u = jax.lax.axis_index(axis) % degree

    def send(piece, s):  # to the member s places on
        return jax.lax.ppermute(piece, axis, [(g * degree + v, g * degree + (v + s) % degree)
                                              for g in range(ring) for v in range(degree)])

    chunks = jnp.stack(jnp.split(x, degree, axis=split_axis)) if split_axis is not None else None
    pieces = [x if chunks is None else chunks[(u + s) % degree] for s in range(degree)]
    got = jnp.stack([pieces[0], *(send(p, s) for s, p in enumerate(pieces) if s)])  # got[s]: member u - s's
    got = got[(u - jnp.arange(degree)) % degree]  # by member
    return jnp.concatenate([got[j] for j in range(degree)], axis=concat_axis)


def _ulysses(q, k, v, pos, seg=None, sinks=None, *, axis, degree, ring, kernel):
    """All-to-all sequence-split -> head-split inside groups of ``degree`` consecutive devices, attention on
    ``1 / degree`` of the heads over the group's tokens (ring attention across the ``n / degree`` groups
    where there are several: USP), and the all-to-all back; ``sinks``: the heads' attention sinks, each member
    taking its heads'."""
    if ring == 1:  # one group: the axis's own collectives
        exchange = functools.partial(jax.lax.all_to_all, axis_name=axis, tiled=True)
        gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
    else:
        exchange = functools.partial(_group_all_to_all, axis=axis, degree=degree, ring=ring)
        gather = functools.partial(exchange, split_axis=None, concat_axis=1)

    def f(q, k, v, pos, seg, sinks):
        to_heads = lambda x: exchange(x, split_axis=2, concat_axis=1)  # noqa: E731
        q, k, v = to_heads(q), to_heads(_repeat_kv(k, degree)), to_heads(_repeat_kv(v, degree))
        pos, seg = gather(pos), None if seg is None else gather(seg)
        if sinks is not None:  # member u of the group holds the u-th of its heads
            sinks = sinks.reshape(degree, -1)[jax.lax.axis_index(axis) % degree]
        if ring == 1:
            out = local_attention(q, k, v, pos, pos, kernel, seg, seg, sinks)[0]
        else:
            out = _ring((axis, ring, degree, kernel), q, k, v, pos, seg, sinks)
        return exchange(out, split_axis=1, concat_axis=2)

    # Ulysses alone redoes the all-to-alls in the backward pass rather than keep q, k, v twice; under USP
    # the ring's backward needs its head-split inputs, which recomputing would cost a whole ring pass.
    return (jax.checkpoint(f) if ring == 1 else f)(q, k, v, pos, seg, sinks)


# ----- ring attention -------------------------------------------------------------------------

def _merge(o1, l1, o2, l2):
    """Merges two partial attentions by log-sum-exp: outs float32 ``[b, q, h, d]``, lse ``[b, h, q]``."""
    lse = jnp.logaddexp(l1, l2)
    w = lambda l: jnp.exp(l - lse).transpose(0, 2, 1)[..., None]  # noqa: E731
    return o1 * w(l1) + o2 * w(l2), lse


def _attend(q, k, v, qt, kt, kernel):
    """:func:`local_attention` with the tokens ``qt``, ``kt`` as ``(positions, segment ids or None)``."""
    return local_attention(q, k, v, qt[0], kt[0], kernel, qt[1], kt[1])


def _diagonal(q, k, v, qt, kt, kernel):
    """Ring step 0: the device's queries against its own keys (causal inside)."""
    o, l = _attend(q, k, v, qt, kt, kernel)
    return o.astype(jnp.float32), l


def _zigzag_step(q, k, v, qt, kt, before, kernel):
    """A ring step t > 0 in zigzag order: queries hold chunks (a, b) = (i, 2n-1-i), keys (a', b') =
    (j, 2n-1-j) with j = i - t mod n.  Visible blocks: (b, a') always; (a, a') when j < i
    (``before``), (b, b') when j > i; (a, b') never.  Two c x c blocks, every pair visible.
    ``qt``, ``kt``: the tokens' ``(positions, segment ids or None)``."""
    def half(tree):  # (first half, second half) along the sequence of every array in ``tree``
        return tuple(jax.tree.map(lambda x, i=i: jnp.split(x, 2, axis=1)[i], tree) for i in (0, 1))

    (qa, qb), (ka, kb), (va, vb), (qta, qtb), (kta, ktb) = map(half, (q, k, v, qt, kt))
    pick = lambda x, y: jax.tree.map(lambda a, b: jnp.where(before, a, b), x, y)  # noqa: E731
    o1, l1 = _attend(qb, ka, va, qtb, kta, kernel)
    o2, l2 = _attend(pick(qa, qb), pick(ka, kb), pick(va, vb), pick(qta, qtb), pick(kta, ktb), kernel)
    o1, o2 = o1.astype(jnp.float32), o2.astype(jnp.float32)
    empty_o, empty_l = jnp.zeros_like(o2), jnp.full_like(l2, MASKED)
    oa, la = pick(o2, empty_o), pick(l2, empty_l)
    ob, lb = _merge(o1, l1, pick(empty_o, o2), pick(empty_l, l2))
    return jnp.concatenate([oa, ob], axis=1), jnp.concatenate([la, lb], axis=2)


def _ring_index_and_send(axis, n, stride):
    """This device's place on the ring and the send to the next: ``n`` ring devices, each ``stride``
    apart on ``axis`` (USP: the devices of the other all-to-all groups that hold the same heads)."""
    perm = [(r * stride + u, (r + 1) % n * stride + u) for r in range(n) for u in range(stride)]
    return jax.lax.axis_index(axis) // stride, lambda xs: jax.lax.ppermute(xs, axis, perm)


def _ring_forward(static, q, k, v, pos, seg=None, sinks=None):
    axis, n, stride, kernel = static
    if q.shape[1] % 2:
        raise ValueError(f"ring attention: local length {q.shape[1]} is odd; the sequence must divide by 2 x {n}")
    i, send = _ring_index_and_send(axis, n, stride)
    pos = (pos, seg)  # the tokens: what the mask reads, travelling with their keys
    # Double buffering: the block of step t + 1 is sent before step t's attention, which does not read
    # it, so the transfer can overlap the compute; the last step sends nothing.
    block = send((k, v, pos))
    o, lse = _diagonal(q, k, v, pos, pos, kernel)

    def attend(o, lse, block, t):  # merges step t's block (keys, values, their tokens) into (o, lse)
        k, v, kp = block
        return _merge(o, lse, *_zigzag_step(q, k, v, pos, kp, t <= i, kernel))

    def body(carry, t):
        o, lse, block = carry
        following = send(block)
        return (*attend(o, lse, block, t), following), None

    (o, lse, block), _ = jax.lax.scan(body, (o, lse, block), jnp.arange(1, n - 1))
    o, lse = attend(o, lse, block, n - 1)
    if sinks is not None:  # the sinks join once, after the ring: a block of zeros with their logit
        o, lse = attn.merge_sinks(o, lse, sinks)
    return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(static, q, k, v, pos, seg, sinks=None):
    """Ring attention on one device's zigzag shards: ``[b, 2c, h, d]`` queries, ``[b, 2c, kvh, d]`` keys,
    positions and segment ids (or None) ``[b, 2c]``, the heads' attention sinks ``[h]`` (or None).  ``static``:
    ``(axis, ring devices, their stride on the axis, the local attention's Implementation)``."""
    return _ring_forward(static, q, k, v, pos, seg, sinks)[0]


def _ring_fwd(static, q, k, v, pos, seg, sinks=None):
    out, lse = _ring_forward(static, q, k, v, pos, seg, sinks)
    return out, (q, k, v, (pos, seg), out, lse, sinks)


def _ring_bwd(static, res, dout):
    """Backward pass: the key/value blocks go around the ring again, each with the gradient
    accumulated for it so far; after n steps every accumulator is back on its owner.  Each
    block's gradient is the vjp of its (out, lse) (recomputed), with the cotangents the
    log-sum-exp merge gives: ``d out_b = w_b dout``, ``d lse_b = w_b (<dout, out_b> - <dout, out>)``,
    ``w_b = exp(lse_b - lse)`` (``lse`` and ``out`` the sinks' too, whose gradient is ``-exp(sink - lse) <dout,
    out>``, summed over the queries)."""
    axis, n, stride, kernel = static
    q, k, v, pos, out, lse, sinks = res
    i, send = _ring_index_and_send(axis, n, stride)
    dout = dout.astype(jnp.float32)
    d_all = jnp.sum(dout * out.astype(jnp.float32), axis=-1)  # [b, q, h]

    def block_grads(fn, k, v, kp):
        (ob, lb), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, kp), q, k, v)
        w = jnp.exp(lb - lse)  # [b, h, q]
        wt = w.transpose(0, 2, 1)
        d_o = wt[..., None] * dout
        d_l = w * (jnp.sum(dout * ob, axis=-1) - d_all).transpose(0, 2, 1)
        return vjp((d_o.astype(ob.dtype), d_l))

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    # Double buffering as in the forward pass: step t sends the block of step t + 1 and the gradients
    # accumulated for its own block (``pending``) before its vjp, which reads neither.
    block = send((k, v, pos))
    dq, dk, dv = block_grads(lambda q, k, v, kp: _diagonal(q, k, v, pos, kp, kernel), k, v, pos)
    dq, pending = f32(dq), (f32(dk), f32(dv))

    def grads(dq, block, acc, t):  # adds step t's block's gradients: to dq and to the block's ``acc``
        gq, gk, gv = block_grads(lambda q, k, v, kp: _zigzag_step(q, k, v, pos, kp, t <= i, kernel), *block)
        return dq + gq, (acc[0] + gk, acc[1] + gv)

    def body(carry, t):
        dq, block, pending = carry
        following, acc = send(block), send(pending)
        dq, pending = grads(dq, block, acc, t)
        return (dq, following, pending), None

    (dq, block, pending), _ = jax.lax.scan(body, (dq, block, pending), jnp.arange(1, n - 1))
    dq, pending = grads(dq, block, send(pending), n - 1)
    dk, dv = send(pending)  # one more hop: every block's gradients back on its owner
    dsinks = None if sinks is None else -jnp.sum(
        jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse) * d_all.transpose(0, 2, 1), axis=(0, 2))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)

