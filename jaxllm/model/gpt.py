"""A GPT decoder in Flax NNX (Radford et al. 2019; Megatron-LM's pre-norm layout).

Options: learned or rotary positions (Su et al. 2021), LayerNorm or RMSNorm,
GELU or SwiGLU MLP (Shazeer 2020), multi-head or grouped-query attention
(Ainslie et al. 2023), tied or untied embeddings, dropout on the embedding and
on each residual branch, mixture-of-experts layers (all, or those ``model.moe_layer_freq``
names).  Consecutive layers of one kind form a group (:func:`layer_groups`: one group
``layers`` for a homogeneous model; DeepSeek-V3's dense layers then its MoE layers, two);
a group's layers are stacked on a leading ``layers`` axis and run with ``jax.lax.scan``, so
compile time does not grow with depth, or written out one after another (``model.layer_loop``).

Parameters are float32; matmuls run in ``model.dtype``; norms, softmax and
logits are float32.  Every parameter carries logical axis names in its
``out_sharding`` metadata, and large activations pass through
``ops.constrain(x, logical_names)``.  The model knows nothing of parallelism: the
operations where a layout enters (that constraint; attention, which sequence
parallelism replaces; the embedding lookup and the loss, which are split over the
vocabulary; the layer matmuls, which the zb_h1 pipeline schedule splits) come in an
:class:`Ops` object, by default the plain single-device ones; :class:`jaxllm.runtime.run.Run`
gives the mesh's.  The loss (:meth:`GPT.loss`) is the
output layer and cross entropy fused in chunks (:mod:`jaxllm.model.fused_loss`): training never
holds the ``[batch, len, vocab]`` logits; :meth:`GPT.__call__` gives them (sampling).

Parameters are handled as a plain nested dict (``params``) outside this file:
``describe(cfg)`` gives the graph definition, parameter shapes, logical axes and
weight-decay mask in one pass (:class:`Spec`), ``init(cfg, seed)`` the parameters,
and ``forward(graphdef, params, tokens)`` runs the model.  ``cfg`` is the ``model``
section of a resolved config (:class:`jaxllm.config.Model`).

This module is the assembly (the GPT, its layer stack and scan, :class:`Ops`, the functions on
``params``); the layers are in :mod:`jaxllm.model.layers`, the remat policies in :mod:`jaxllm.model.remat`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model import attention as dispatch
from jaxllm.model import fused_loss, layers, moe, remat
from jaxllm.model.groups import Group, layer_groups, layer_kinds
from jaxllm_kernels.reference import MASKED

if TYPE_CHECKING:
    from jaxllm.config import Model as ModelConfig


def _unconstrained(x, axes):
    return x


@dataclasses.dataclass(frozen=True)
class PlainAttention:
    """The single-device ``attention`` of :class:`Ops`: causal attention by ``kernel`` (the
    :class:`jaxllm.model.attention.Implementation` of ``model.attention_impl``); ``order`` is not
    needed, the arrays being in sequence order; ``layer``: the layer's ``window`` (where not the bound one)."""

    kernel: dispatch.Implementation

    def __call__(self, q, k, v, order=None, segment_ids=None, **layer):
        return self.kernel(q, k, v, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, **layer)


def _plain_embed(table, ids):
    return table[ids]


@dataclasses.dataclass(frozen=True)
class Ops:
    """The operations through which a parallel layout enters the model.

    Attributes:
      constrain: ``(x, axes) -> x``: pins activation ``x``, whose dimensions have the
        logical names ``axes``, to its layout (identity on one device).
      attention: ``(q, k, v, order, segment_ids, **layer) -> out``: causal self-attention of q
        ``[batch, len, heads, head_dim]`` and k, v ``[batch, len, kv_heads, head_dim]``, the implementation
        bound (:class:`jaxllm.model.attention.Implementation`); None (the default): :class:`PlainAttention`
        of the model's ``attention_impl``, which :class:`GPT` fills in; ``order`` int32 ``[batch, len]`` is
        each token's index in the sequence, which the causal mask follows (None: the array's order; ring attention's
        reordered batch gives it), ``segment_ids`` int32 ``[batch, len]`` or None: a token attends
        only to tokens of its segment (its document, ``data.reset_attention_mask``); ``layer``: a layer's own
        ``window`` (int or None: every earlier position) where it is not the model's, its attention ``sinks``
        (float32 ``[heads]``, ``model.softmax_type``) where it has them; returns
        ``[batch, len, heads, head_dim]``.
      embed: ``(table, ids) -> x``: the rows of ``table`` ``[padded_vocab, embed]`` at int32 ``ids``
        ``[batch, len]``: ``[batch, len, embed]``.
      cross_entropy: ``(h, table, targets, vocab_size, weights=None) -> float32 []``: the summed
        next-token cross entropy of the output layer ``table`` ``[padded_vocab, embed]`` applied to ``h``
        ``[..., batch, len, embed]``, targets int32 ``[..., batch, len]``, each token's loss times
        ``weights`` float32 ``[..., batch, len]`` (None: 1), logits of ids ``>= vocab_size`` masked
        (:func:`jaxllm.model.fused_loss.cross_entropy`).
      param: ``(w, axes) -> w``: pins a parameter cast to the compute dtype to the parameters' own
        layout, so that a table consumed whole (the embeddings, the loss's output layer) is gathered
        after the cast, in the compute dtype (identity on one device).
      dense: ``(x, w, b, spec, dtype) -> y``: every layer matmul with a weight (q, k, v,
        attention output, MLP), :func:`jaxllm.model.layers.dense` by default; ``w`` and ``b`` (or None) are the very
        parameter values of the layer (the zb_h1 pipeline schedule takes input and weight
        gradients apart here, :mod:`jaxllm.parallel.pipeline`).
      experts: ``(x, ids, weights, w1, wg, w2, b1, b2, *, activation, dtype) -> y``: the mixture of
        experts' expert computation, ``x`` ``[batch, len, embed]``, routing ``[batch, len, topk]``
        (:func:`jaxllm.model.moe.local_experts`; expert parallelism replaces it).
      router_loss: ``(x, loss) -> x``: joins a router's auxiliary loss to the objective
        (:func:`jaxllm.model.moe.attach_loss`, its gradient the step's 1 / micro batches).
    """

    constrain: Callable = _unconstrained
    attention: Callable | None = None
    embed: Callable = _plain_embed
    cross_entropy: Callable = fused_loss.cross_entropy
    param: Callable = _unconstrained
    dense: Callable = layers.dense
    experts: Callable = moe.local_experts
    router_loss: Callable = moe.loss_scaler(1.0)


LOCAL = Ops()


MOE_STATS = ("moe_aux_loss", "moe_z_loss", "moe_max_load", "moe_dropped")  # the logged routing statistics


def _concat(trees):
    """Trees of ``[layers, ...]`` leaves (None skipped) joined along ``layers``; None when all are None."""
    trees = [t for t in trees if t is not None]
    return None if not trees else trees[0] if len(trees) == 1 else jax.tree.map(
        lambda *a: jnp.concatenate(a), *trees)


class GPT(nnx.Module):
    """GPT decoder.

    Args:
      cfg: the ``model`` section of a resolved config (:class:`jaxllm.config.Model`).
      rngs: ``nnx.Rngs`` for initialization: normal(0, ``init_std``), output projections
        of each layer scaled by ``1/sqrt(2 * num_layers)`` (GPT-2, Megatron-LM); the embedding's row of
        ``model.pad_token_id`` zero.
      ops: how a parallel layout enters (:class:`Ops`); default: one device.  Without an attention, the
        plain one of ``cfg.attention_impl`` (:func:`jaxllm.model.attention.implementation`) is bound here.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: Ops = LOCAL):
        if ops.attention is None:
            ops = dataclasses.replace(ops, attention=PlainAttention(dispatch.implementation(cfg)))
        self.cfg, self.ops = cfg, ops
        vocab, padded = cfg.vocab_size, cfg.padded_vocab_size
        self.wte = layers.param(rngs.params(), (vocab, cfg.hidden_size), cfg.init_std, ("vocab", "embed"), (0, padded))
        if cfg.pad_token_id >= 0:  # the padding row starts at zero, as nn.Embedding(padding_idx=...)'s
            self.wte[cfg.pad_token_id] = 0.0
        self.wpe = (layers.param(rngs.params(), (cfg.max_position_embeddings, cfg.hidden_size), cfg.init_std,
                           (None, "embed")) if cfg.position_embedding == "learned" else None)

        self.groups = layer_groups(cfg)
        for group in self.groups:
            setattr(self, group.name, self._stack(group, rngs))
        self.ln_f = layers.Norm(cfg)
        self.lm_head = (None if cfg.tie_embeddings else
                        layers.param(rngs.params(), (cfg.hidden_size, vocab), cfg.init_std, ("embed", "vocab"),
                                     (1, padded)))
        # drawn last: the other parameters are those of the same model without them
        self.mtp = self._stack_mtp(rngs) if cfg.mtp_num_layers else None

    def _stack(self, group: Group, rngs):
        """The layers of ``group``, each parameter stacked on a leading ``layers`` axis."""
        @nnx.split_rngs(splits=group.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs):
            return layers.Block(self.cfg, rngs, self.ops, kind=group.kind)

        return stack(rngs)

    def _stack_mtp(self, rngs):
        """The ``mtp_num_layers`` multi-token prediction modules (:class:`jaxllm.model.layers.MTPLayer`, each with
        a layer of the last layer's kind, as DeepSeek-V3's), stacked on a leading ``mtp_layers`` axis."""
        @nnx.split_rngs(splits=self.cfg.mtp_num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "mtp_layers"})
        def stack(rngs):
            return layers.MTPLayer(self.cfg, rngs, self.ops, kind=layer_kinds(self.cfg)[-1])

        return stack(rngs)

    def layer_params(self, groups=None) -> dict:
        """The parameters of ``groups`` (default: all), ``{group.name: nested dict}``, as :meth:`run_groups` takes."""
        return {g.name: nnx.to_pure_dict(nnx.state(getattr(self, g.name))) for g in groups or self.groups}

    def __call__(self, tokens, *, positions=None, order=None, segment_ids=None, dropout_key=None, cache=None):
        """Logits of the next token.

        Args:
          tokens: int32 ``[batch, len]``.
          positions: int32 ``[batch, len]``, each token's position for the position embedding
            (learned or rotary); default ``arange(len)``.
          order: int32 ``[batch, len]``, each token's index in the sequence, for the causal mask,
            when the batch is reordered (ring attention's zigzag order); None: the array's order.
          segment_ids: int32 ``[batch, len]``: a token attends only to earlier tokens of the same
            segment (its document); None: one segment.
          dropout_key: PRNG keys ``[batch]``, one per row (the training step derives each from the
            row's index in the global batch), or one key, folded with each row's index here;
            None disables dropout (evaluation, decoding).
          cache: None, or the decoding cache from :func:`init_cache`; its keys and
            values are written at ``positions`` (which must be contiguous).
        Returns:
          float32 logits ``[batch, len, vocab]``, and the updated cache when one was given.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, keys = self.embed(tokens, positions, dropout_key, order)
        x, cache_out = self.run_groups(x, positions, self.layer_params(), keys, cache, order=order,
                                       segment_ids=segment_ids)
        logits = self.head(x)
        return logits if cache is None else (logits, cache_out)

    def loss(self, tokens, targets, *, positions=None, order=None, segment_ids=None, loss_mask=None,
             dropout_key=None, with_stats=False):
        """Summed next-token cross entropy (nats, float32 scalar) of ``targets`` int32 ``[batch, len]``
        after ``tokens``, each token's loss times ``loss_mask`` float32 ``[batch, len]`` (None: 1), the
        other arguments as :meth:`__call__`, without the logits (:meth:`output_loss`).  ``with_stats``:
        ``(loss, stats)`` with the mixture of experts' statistics (:meth:`moe_stats`; ``{}`` when dense) and, with
        ``model.mtp_num_layers``, ``stats["mtp"]``: the multi-token prediction depths' summed losses, float32
        ``[mtp_num_layers]`` (:meth:`mtp_losses`; computed only here: training's objective)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, keys = self.embed(tokens, positions, dropout_key, order)
        x, stats = self.run_groups(x, positions, self.layer_params(), keys, order=order, segment_ids=segment_ids)
        loss = self.output_loss(x, targets, loss_mask)
        if not with_stats:
            return loss
        stats = self.moe_stats(stats)
        if self.mtp is not None:
            stats["mtp"] = self.mtp_losses(self.ln_f(x), tokens, targets, positions,
                                           None if keys is None else keys[self.cfg.num_layers:], order=order,
                                           segment_ids=segment_ids, loss_mask=loss_mask)
        return loss, stats

    def mtp_losses(self, h, tokens, targets, positions, keys=None, *, order=None, segment_ids=None, loss_mask=None):
        """The multi-token prediction depths' summed cross entropies, float32 ``[mtp_num_layers]`` (DeepSeek-V3
        section 2.2; Megatron-LM's ``MultiTokenPredictionBlock`` and ``process_mtp_loss``).

        Depth ``k`` (1..N) rolls the tokens, positions, targets and loss mask one more place to the left (Megatron's
        ``roll_tensor``: the last ``k`` places zero): its module (:class:`jaxllm.model.layers.MTPLayer`) joins the
        previous depth's hidden states with the embedding (and learned position) of the token ``k`` ahead, and the
        shared output layer's loss predicts the token ``k + 1`` ahead, the last ``k`` places masked.  The layer
        attends at the unrolled ``positions`` (Megatron's rotary embedding is the main model's); documents
        (``segment_ids``) are rolled across as Megatron's unpacked batches are.

        Args:
          h: the main model's hidden states after its final norm (``h^0``; Megatron-LM's decoder output),
            ``[batch, len, embed]``.
          tokens, targets, positions: int32 ``[batch, len]``, as :meth:`loss`.
          keys: dropout keys ``[mtp_num_layers, batch]`` (the embedding's and the layer's of each depth), or None.
          order, segment_ids, loss_mask: as :meth:`loss` (``order`` the sequence's: resolve refuses ring attention's).
        """
        cfg = self.cfg
        mask = jnp.ones(targets.shape, jnp.float32) if loss_mask is None else loss_mask
        graphdef, stack = nnx.graphdef(self.mtp), nnx.to_pure_dict(nnx.state(self.mtp))
        roll = lambda a: jnp.concatenate([a[:, 1:], jnp.zeros_like(a[:, :1])], axis=1)  # noqa: E731
        shifted, sums = positions, []
        for k in range(cfg.mtp_num_layers):
            tokens, shifted, targets, mask = roll(tokens), roll(shifted), roll(targets), roll(mask)
            module = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k], stack))
            e_key, block_key = (None, None) if keys is None else layers.split_rows(keys[k], 2)
            e = layers.dropout(self.token_embedding(tokens, shifted), cfg.dropout, e_key, order)
            block_def = nnx.graphdef(module.block)

            def block(x, params, key, block_def=block_def):
                return nnx.merge(block_def, params)(x, positions, key, None, order, segment_ids,
                                                    kind=layer_kinds(cfg)[-1])[0]

            x = self._remat(block, prevent_cse=True)(module.project(h, e), nnx.to_pure_dict(nnx.state(module.block)),
                                                     block_key)
            h = module.norm(x)
            sums.append(self.output_loss(h, targets, mask, norm=lambda x: x))
        return jnp.stack(sums)

    @staticmethod
    def moe_stats(stats) -> dict:
        """The logged routing statistics from the MoE layers' ``[layers]`` ones (:func:`jaxllm.model.moe.route`):
        ``moe_aux_loss`` and ``moe_z_loss`` (the layers' mean, without their coefficients), ``moe_max_load``
        (the largest over the layers: the busiest expert's tokens over the mean) and ``moe_dropped`` (the
        layers' mean fraction of dropped token copies); ``{}`` for a dense model (``stats`` None)."""
        if stats is None:
            return {}
        return dict(zip(MOE_STATS, (stats["aux_loss"].mean(), stats["z_loss"].mean(), stats["max_load"].max(),
                                    stats["dropped"].mean())))

    def embed(self, tokens, positions, dropout_key=None, order=None):
        """Token (+ learned position) embeddings ``[batch, len, embed]`` in ``model.dtype``, with
        dropout, and the per-layer dropout keys ``[layers + mtp_num_layers, batch]`` (the multi-token
        prediction modules' last; None without ``dropout_key``; the arguments as :meth:`__call__`)."""
        x, keys = self.token_embedding(tokens, positions), None
        if dropout_key is not None:
            keys = self.dropout_keys(dropout_key, tokens.shape[0])
            x, keys = layers.dropout(x, self.cfg.dropout, keys[0], order), keys[1:]
        return self.ops.constrain(x, layers.RESIDUAL), keys

    def dropout_keys(self, dropout_key, rows: int):
        """The embedding's, each layer's and each multi-token prediction module's dropout keys, ``[1 + layers +
        mtp_num_layers, rows]``, from one key per row ``[rows]`` or one key (folded with each row's index)."""
        if dropout_key.ndim == 0:
            dropout_key = layers.row_keys(dropout_key, jnp.arange(rows))
        return layers.split_rows(dropout_key, 1 + self.cfg.num_layers + self.cfg.mtp_num_layers)

    def token_embedding(self, tokens, positions):
        """Token (+ learned position) embeddings ``[batch, len, embed]`` in ``model.dtype``, no dropout; the token
        embeddings times ``sqrt(hidden_size)`` with ``model.scale_embeddings`` (Gemma's).  The lookups of
        ``model.pad_token_id`` pass no gradient to its row (torch's ``nn.Embedding(padding_idx=...)``, transformers'
        embedding of every family but GPT-2's)."""
        dt = jnp.dtype(self.cfg.dtype)
        x = self.ops.embed(self.ops.param(self.wte[...].astype(dt), ("vocab", "embed")), tokens)
        if self.cfg.pad_token_id >= 0:
            x = jnp.where((tokens == self.cfg.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
        if self.cfg.scale_embeddings:  # sqrt(hidden), in the embeddings' dtype (as transformers' buffer)
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, dt)
        if self.wpe is not None:  # a small table, gathered whole (the partitioner cannot split a gather on `embed`)
            wpe = self.ops.param(self.wpe[...].astype(dt), (None, "embed"))
            x = x + self.ops.constrain(wpe, (None, None))[positions]
        return x

    def run_groups(self, x, positions, params, keys=None, cache=None, *, groups=None, order=None,
                   segment_ids=None):
        """Applies the layer groups ``groups`` (default: all; consecutive ones) in order, each with
        :meth:`run_layers` on ``params[group.name]``.

        Args:
          x, positions, order, segment_ids: as :meth:`run_layers`.
          params: a dict holding each group's parameters under its name (:meth:`layer_params`; the model's params).
          keys: dropout keys ``[layers, batch]`` of the groups' layers, in order, or None.
          cache: decoding cache ``[layers, ...]`` of the groups' layers (:func:`init_cache`), or None.
        Returns:
          ``(x, out)``: out the updated cache (``[layers, ...]``) when decoding, else the MoE layers' routing
          statistics joined along ``[layers]`` (None without MoE layers).
        """
        groups = groups or self.groups
        outs, start = [], groups[0].first
        for group in groups:
            part = lambda t, g=group: None if t is None else jax.tree.map(  # noqa: E731
                lambda a: a[g.first - start:g.stop - start], t)
            x, out = self.run_layers(x, positions, params[group.name], part(keys), part(cache), group=group,
                                     order=order, segment_ids=segment_ids)
            outs.append(out)
        return x, _concat(outs)

    def run_layers(self, x, positions, layer_params, keys=None, cache=None, *, group: Group, order=None,
                   segment_ids=None):
        """Applies the layers of ``group`` whose parameters are ``layer_params`` (a slice of
        ``params[group.name]`` along its leading ``layers`` axis: all of them, or one pipeline stage's) in order.

        Args:
          x: ``[batch, len, embed]``; positions, order, segment_ids: int32 ``[batch, len]`` (or None
            for the last two), as :meth:`__call__`.
          keys: dropout keys ``[layers, batch]``, per layer of ``layer_params`` and row, or None.
          cache: decoding cache of these layers, or None.
        Returns:
          ``(x, cache)``.

        ``model.layer_loop="scan"`` runs them as one ``jax.lax.scan`` (compile time independent of
        depth); ``"unrolled"`` one after another (which backend gets which: :mod:`jaxllm.runtime.cpu`).  A group of
        a pattern of kinds (:class:`jaxllm.model.groups.Group`) scans its periods, each step its pattern's layers,
        each of its kind (``layer_params`` starts a period: a pipeline stage's or chunk's holds whole periods).
        """
        graphdef, p = nnx.graphdef(getattr(self, group.name)), len(group.pattern)

        def layer(x, xs, kind):
            params, key, layer_cache = xs
            return nnx.merge(graphdef, params)(x, positions, key, layer_cache, order, segment_ids, kind=kind)

        each = [self._remat(functools.partial(layer, kind=kind), prevent_cse=self.cfg.layer_loop == "unrolled")
                for kind in group.pattern]
        if self.cfg.layer_loop != "unrolled" and p == 1:
            return jax.lax.scan(each[0], x, (layer_params, keys, cache))

        def unrolled(x, xs):  # each layer of xs (a period's, or all), the stack's leaves unstacked in one split:
            # its gradient is one stack.  Indexing a[i] per layer made each layer's gradient a pad to the whole
            # stack, summed over the layers: on an H200 XLA fused those L^2 terms into kernels that took 42 % of
            # GPT1_5B's step (docs/performance.md, 2026-11-27)
            leaves, treedef = jax.tree.flatten(xs)
            columns = [jnp.unstack(a) for a in leaves]
            outs = []
            for i in range(leaves[0].shape[0]):
                x, out = each[i % p](x, treedef.unflatten([c[i] for c in columns]))
                outs.append(out)
            return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)

        if self.cfg.layer_loop == "unrolled":
            return unrolled(x, (layer_params, keys, cache))
        by_period = jax.tree.map(lambda a: a.reshape(-1, p, *a.shape[1:]), (layer_params, keys, cache))
        x, outs = jax.lax.scan(unrolled, x, by_period)  # one period's layers a step
        return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outs)

    def _remat(self, layer, *, prevent_cse: bool):
        """``layer`` under ``model.remat``'s policy (unchanged for ``none``); ``prevent_cse`` outside a scan,
        where XLA's common-subexpression elimination would merge the recomputation back."""
        if self.cfg.remat == "none":
            return layer
        return jax.checkpoint(layer, policy=remat.POLICIES[self.cfg.remat], prevent_cse=prevent_cse)

    def head(self, x):
        """Final norm and output layer: float32 logits ``[batch, len, padded_vocab]`` from ``[batch, len,
        embed]``; the padded entries (ids >= ``vocab_size``) are ``MASKED`` (-1e30), so the softmax, the
        loss and sampling see exactly the ``vocab_size`` real tokens whatever the padding."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        x = self.ln_f(x)
        if self.lm_head is None:
            logits = jnp.einsum("bse,ve->bsv", x, self.wte[...].astype(dt), preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("bse,ev->bsv", x, self.lm_head[...].astype(dt), preferred_element_type=jnp.float32)
        if cfg.padded_vocab_size > cfg.vocab_size:
            ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
            logits = jnp.where(ids < cfg.vocab_size, logits, MASKED)
        return self.ops.constrain(logits, ("batch", "length", "vocab"))

    def output_loss(self, x, targets, loss_mask=None, norm=None):
        """Final norm, output layer and summed cross entropy (nats, float32 scalar) of ``targets``
        int32 ``[..., batch, len]`` from the last layer's ``x`` ``[..., batch, len, embed]``, each
        token's loss times ``loss_mask`` float32 ``[..., batch, len]`` (None: 1): the loss of
        :meth:`head`'s logits (padded ids masked alike), computed in chunks with its gradient
        (:func:`jaxllm.model.fused_loss.cross_entropy`).  ``norm``: the final norm (None: ``ln_f``; a
        multi-token prediction module has normed its output already)."""
        dt = jnp.dtype(self.cfg.dtype)
        with jax.named_scope("output_loss"):  # the profile's category (jaxllm.analysis.profile)
            if self.lm_head is None:
                table = self.ops.param(self.wte[...].astype(dt), ("vocab", "embed"))
            else:
                table = self.ops.param(self.lm_head[...].astype(dt), ("embed", "vocab")).T
            return self.ops.cross_entropy((norm or self.ln_f)(x), table, targets, self.cfg.vocab_size, loss_mask)


@dataclasses.dataclass(frozen=True)
class Spec:
    """The model without its values, from one trace (:func:`describe`).

    Attributes:
      graphdef: the NNX graph definition (to :func:`forward` or ``nnx.merge`` with params).
      params: the parameters' ``jax.ShapeDtypeStruct`` (float32), a nested dict as :func:`init` gives.
      axes: each parameter's logical axis names, a dict shaped as ``params`` with tuple leaves.
      decay: which parameters get weight decay (the matrices that multiply the ``embed``
        axis or a latent one of multi-head latent attention: embeddings, projections, routers and experts,
        not norms or biases), bool leaves.
    """

    graphdef: Any
    params: dict
    axes: dict
    decay: dict


def describe(cfg: ModelConfig, ops: Ops = LOCAL) -> Spec:
    """The :class:`Spec` of the model ``cfg`` describes (nothing is allocated)."""
    gpt = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0), ops))
    graphdef, state = nnx.split(gpt, nnx.Param)
    axes = nnx.to_pure_dict(jax.tree.map(
        lambda v: tuple(v.get_metadata()["out_sharding"] or (None,) * v.value.ndim), state,
        is_leaf=lambda v: isinstance(v, nnx.Variable)))
    decay = jax.tree.map(lambda a: bool({"embed", "expert_embed", "q_lora", "kv_lora"} & set(a))
                         and len([n for n in a if n not in ("layers", "mtp_layers", "experts")]) >= 2, axes,
                         is_leaf=lambda x: isinstance(x, tuple))
    return Spec(graphdef, nnx.to_pure_dict(state), axes, decay)


def logical_sizes(cfg: ModelConfig, seq_length: int) -> dict[str, tuple[int, str]]:
    """Each logical axis the rules table may split: ``{name: (size, the config key that sets it)}``
    (for the divisibility checks of :func:`jaxllm.parallel.sharding.check`; ``layers``: the layer groups' sizes'
    greatest common divisor, which a split divides when it divides every group)."""
    groups = layer_groups(cfg)
    layer_key = "model.num_layers" if len(groups) == 1 else (
        f"model.moe_layer_freq or model.window_attn_skip_freq (groups of {', '.join(str(g.num_layers) for g in groups)}"
        " layers; their greatest common divisor)")
    return {
        "heads": (cfg.num_attention_heads, "model.num_attention_heads"),
        "kv_heads": (cfg.num_kv_heads, "model.num_kv_heads"),
        "mlp": (cfg.ffn_hidden_size, "model.ffn_hidden_size"),
        "vocab": (cfg.padded_vocab_size, "model.vocab_size"),
        "embed": (cfg.hidden_size, "model.hidden_size"),
        "layers": (math.gcd(*(g.num_layers for g in groups)), layer_key),
        "experts": (cfg.num_experts, "model.num_experts"),
        "expert_embed": (cfg.hidden_size, "model.hidden_size"),
        "expert_mlp": (cfg.moe_ffn_hidden_size, "model.moe_ffn_hidden_size"),
        "length": (seq_length, "train.seq_length"),
        "expert_length": (seq_length, "train.seq_length"),
        "residual": (seq_length, "train.seq_length"),
    }


# read in float32: the norms (multi-head latent attention's latent ones too), the MoE router
FLOAT32_PARAMS = ("ln1", "ln2", "ln_f", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "q_a_norm", "kv_a_norm",
                  "router", "router_bias", "expert_bias", "sinks")


def cast_layers(cfg: ModelConfig, params: dict) -> dict:
    """``params`` with the layers' parameters that the model reads only in ``model.dtype`` (every projection,
    MLP and expert weight and bias: all but :data:`FLOAT32_PARAMS`) cast to it, once, so that a step of several
    micro batches, and the recomputation and backward pass of each layer, do not cast them again.  The same
    values reach every matmul, and a gradient with respect to a cast copy is the one the model's own cast
    gives before it is converted to float32.  Unchanged with ``model.fp8`` (whose scaling reads the float32
    weights) and for float32 models."""
    names = [g.name for g in layer_groups(cfg) if g.name in params]
    if cfg.fp8 or jnp.dtype(cfg.dtype) == jnp.float32 or not names:
        return params
    dt = jnp.dtype(cfg.dtype)

    def cast(tree, keep=False):
        if isinstance(tree, dict):
            return {k: cast(v, keep or k in FLOAT32_PARAMS) for k, v in tree.items()}
        return tree if keep or tree is None else tree.astype(dt)

    return {**params, **{name: cast(params[name]) for name in names}}


def init(cfg: ModelConfig, seed) -> dict:
    """The initialized float32 parameters as a nested dict of arrays (jit it with
    ``out_shardings`` to create them sharded)."""
    return nnx.to_pure_dict(nnx.state(GPT(cfg, nnx.Rngs(params=seed)), nnx.Param))


def forward(graphdef, params, tokens, **kwargs):
    """Runs the model held in ``params`` (see :meth:`GPT.__call__` for the arguments)."""
    return nnx.merge(graphdef, params)(tokens, **kwargs)


def loss(graphdef, params, tokens, targets, **kwargs):
    """The summed next-token cross entropy of the model held in ``params`` (see :meth:`GPT.loss`)."""
    return nnx.merge(graphdef, params).loss(tokens, targets, **kwargs)


def init_cache(cfg: ModelConfig, batch: int, max_length: int):
    """An empty decoding cache: per layer keys and values ``[layers, batch, max_length, kv_heads, width]``, the
    widths :attr:`jaxllm.config.Model.attention_head_dims` (multi-head latent attention's keys and values
    decompressed, as ordinary attention's)."""
    shape = (cfg.num_layers, batch, max_length, cfg.num_kv_heads)
    return tuple(jnp.zeros((*shape, d), cfg.dtype) for d in cfg.attention_head_dims)


def num_params(params, *, exclude_positions: bool = False) -> int:
    """Parameter count; ``exclude_positions`` leaves out the learned position table."""
    n = sum(x.size for x in jax.tree.leaves(params))
    if exclude_positions and "wpe" in params:
        n -= params["wpe"].size
    return n


def active_params(cfg: ModelConfig, params) -> int:
    """Parameters one token uses (:func:`num_params` for a dense model): a mixture of experts' weights count
    ``moe_router_topk / num_experts`` of theirs, the token's experts (Mixtral-8x7B: 12.9B of 46.7B), the multi-token
    prediction modules' too when their layers are mixtures."""
    n = num_params(params)
    mlps = [params[g.name]["mlp"] for g in layer_groups(cfg) if g.kind.moe]
    if cfg.mtp_num_layers and cfg.moe_layers[-1]:
        mlps.append(params["mtp"]["block"]["mlp"])
    for mlp in mlps:
        experts = sum(mlp[k].size for k in ("w1", "wg", "w2", "b1", "b2") if mlp.get(k) is not None)
        n -= experts * (cfg.num_experts - cfg.moe_router_topk) // cfg.num_experts
    return n
