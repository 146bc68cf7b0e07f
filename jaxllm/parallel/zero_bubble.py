"""zb_h1's split backward (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): B, the input gradient,
and W, the weight gradient, as two passes over a chunk of layers (:class:`SplitBackward`), the layers'
matmuls routed through the model's ``dense`` operation (:class:`Router`).  Used by the fused loop of
:mod:`jaxllm.parallel.pipeline`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model import layers
from jaxllm.model.remat import POLICIES as REMAT_POLICIES  # `remat` names the policy below


@dataclasses.dataclass(frozen=True)
class Matmul:
    weight: int  # index of the weight among the layer's parameter leaves
    bias: int | None
    spec: str  # the einsum, e.g. "bse,ehd->bshd"
    dtype: object
    input: int  # which of the layer's distinct matmul inputs
    out: jax.ShapeDtypeStruct


class Router:
    """The ``dense`` operation (:class:`jaxllm.model.gpt.Ops`) of zb_h1's copy of the layers: the
    matmul function :meth:`using` sets while a layer is traced (:func:`jaxllm.model.layers.dense` otherwise)."""

    def __init__(self):
        self.fn = layers.dense

    def __call__(self, x, w, b, spec, dtype):
        return self.fn(x, w, b, spec, dtype)

    @contextlib.contextmanager
    def using(self, fn):
        previous, self.fn = self.fn, fn
        try:
            yield
        finally:
            self.fn = previous


class SplitBackward:
    """zb_h1's backward of a chunk in two passes: B (input gradient) and W (weight gradient).

    Every matmul ``y = einsum(x, w) + b`` of a layer goes through the model's ``dense``
    operation, here a :class:`Router`.
    B: the vjp of the chunk with ``w``, ``b`` held constant and a zero ``tap`` added to each ``y``
    gives the input gradient, the gradients of the other parameters (norms) and each ``dy`` as its
    tap's gradient; it also returns each matmul's input ``x`` (as the matmul casts it).  W: per
    matmul the vjp of ``einsum(x, w) + b`` alone with ``dy``: ``dw = x^T dy``, ``db = sum dy``, the
    same operations autodiff runs, so B + W give the 1F1B gradients.

    Args:
      layer_graphdef: ``nnx.graphdef`` of the model's layers, built with ``router`` as the ``dense``
        operation; router: that :class:`Router`; layer_params: one layer's parameters
        (arrays or ``ShapeDtypeStruct``); x: ``[micro_batch, seq, embed]`` abstract input;
      positions: int32 ``[micro_batch, seq]``; remat: ``model.remat``; layer_axes: the logical
        axes of one layer's parameters (leading ``layers`` removed).
    Raises:
      RuntimeError: a matmul's weight is not one of the layer's parameters.
    """

    def __init__(self, layer_graphdef, router, layer_params, x, positions, remat, layer_axes):
        self.graphdef, self.router, self.positions = layer_graphdef, router, positions
        self.treedef = jax.tree.structure(layer_params)
        self.matmuls, self.inputs = [], []

        def probe(params, x):
            ids = {id(a): i for i, a in enumerate(jax.tree.leaves(params))}
            seen = []

            def hook(xin, w, b, spec, dtype):
                if id(w) not in ids or (b is not None and id(b) not in ids):
                    raise RuntimeError(f"zb_h1: the weight of a {spec} matmul is not a layer parameter")
                j = next((i for i, a in enumerate(seen) if a is xin), None)
                if j is None:
                    seen.append(xin)
                    j = len(seen) - 1
                    self.inputs.append(jax.ShapeDtypeStruct(xin.shape, jnp.dtype(dtype)))
                y = layers.dense(xin, w, b, spec, dtype)
                self.matmuls.append(Matmul(ids[id(w)], None if b is None else ids[id(b)], spec, dtype, j,
                                            jax.ShapeDtypeStruct(y.shape, y.dtype)))
                return y

            with router.using(hook):
                return nnx.merge(self.graphdef, params)(x, positions, None, None, positions)[0]

        jax.eval_shape(probe, layer_params, x)
        self.layer = self._layer if remat == "none" else jax.checkpoint(
            self._layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
        # logical axes of the kept [layers, micro_batch, seq, ...] inputs and gradients, from the einsums
        axes = jax.tree.leaves(layer_axes, is_leaf=lambda a: isinstance(a, tuple))

        def names(mm, operand):  # logical axes of the matmul's input ("x") or output ("y") [layers, b, s, ...]
            (x, w), y = (side.split(",") for side in mm.spec.split("->"))
            by_letter = {"b": "batch", "s": "length", **dict(zip(w, axes[mm.weight], strict=True))}
            activation = {"embed": "act_embed"}  # the weights' name of a dimension -> the activations'
            return (None, *(activation.get(by_letter[c], by_letter[c]) for c in (x if operand == "x" else y[0])))

        first_use = {mm.input: mm for mm in reversed(self.matmuls)}
        self.record_axes = (tuple(names(first_use[j], "x") for j in range(len(self.inputs))),
                            tuple(names(mm, "y") for mm in self.matmuls))

    def _layer(self, params, x, taps, key):
        seen, count = [], iter(range(len(self.matmuls)))

        def hook(xin, w, b, spec, dtype):
            if not any(a is xin for a in seen):
                seen.append(xin)
            sg = jax.lax.stop_gradient
            return layers.dense(xin, sg(w), None if b is None else sg(b), spec, dtype) + taps[next(count)]

        with self.router.using(hook):
            y = nnx.merge(self.graphdef, params)(x, self.positions, key, None, self.positions)[0]
        return y, tuple(a.astype(s.dtype) for a, s in zip(seen, self.inputs, strict=True))

    def record_shapes(self, n):
        """Abstract ``(inputs, output gradients)`` of a chunk of ``n`` layers."""
        stack = lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype)  # noqa: E731
        return tuple(map(stack, self.inputs)), tuple(stack(mm.out) for mm in self.matmuls)

    def input_grad(self, w, h, g, keys):
        """B of a chunk: ``(parameter gradients (zero for the matmuls), dh, (inputs, dys))`` from its
        input ``h [micro_batch, seq, embed]``, output gradient ``g`` and parameters ``w [n, ...]``."""
        n = jax.tree.leaves(w)[0].shape[0]
        taps = tuple(jnp.zeros((n, *mm.out.shape), mm.out.dtype) for mm in self.matmuls)

        def chunk(w, h, taps):
            return jax.lax.scan(lambda x, xs: self.layer(xs[0], x, xs[1], xs[2]), h, (w, taps, keys))

        _, vjp, inputs = jax.vjp(chunk, w, h, taps, has_aux=True)
        dw, dh, dys = vjp(g)
        return dw, dh, (inputs, dys)

    def weight_grad(self, w, record):
        """W of a chunk: the matmul weight and bias gradients ``[n, ...]`` (zero elsewhere), float32."""
        def layer(params, inputs, dys):
            leaves = jax.tree.leaves(params)
            grads = [jnp.zeros(a.shape, jnp.float32) for a in leaves]
            for mm, dy in zip(self.matmuls, dys, strict=True):
                bias = None if mm.bias is None else leaves[mm.bias]
                _, vjp = jax.vjp(lambda w, b: layers.dense(inputs[mm.input], w, b, mm.spec, mm.dtype),  # noqa: B023
                                 leaves[mm.weight], bias)
                gw, gb = vjp(dy)
                grads[mm.weight] = grads[mm.weight] + gw
                if mm.bias is not None:
                    grads[mm.bias] = grads[mm.bias] + gb
            return jax.tree.unflatten(self.treedef, grads)

        return jax.vmap(layer)(w, *record)
