"""A model's parameters by path: flat ``{"layers/attn/wq": array}`` dicts, and each parameter's shape without the
vocabulary's padding rows (what other frameworks hold, and what a checkpoint of any layout restores to)."""

from __future__ import annotations

from typing import Any

import jax

from jaxllm import config
from jaxllm.model import gpt


def by_path(tree) -> dict[str, Any]:
    """A nested parameter dict (leaves: arrays, shapes or logical-axes tuples) as ``{"layers/attn/wq": leaf}``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {"/".join(k.key for k in path): leaf for path, leaf in leaves}


def unpadded_shapes(m: config.Model, spec: gpt.Spec) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape with ``vocab_size`` rows on its ``vocab`` axis: what HF holds.  jaxllm
    masks the logits of the padding rows, so without them HF's softmax is exactly jaxllm's."""
    axes = by_path(spec.axes)
    return {k: tuple(m.vocab_size if a == "vocab" else n for a, n in zip(axes[k], v.shape, strict=True))
            for k, v in by_path(spec.params).items()}
