"""The layers by kind (:class:`LayerKind`, :func:`layer_kinds`) and the groups they are stacked and scanned in
(:class:`Group`, :func:`layer_groups`), which :class:`jaxllm.model.gpt.GPT` builds and runs.

A layer's kind is what sets it apart: a mixture of experts or a dense MLP (``model.moe_layer_freq``), which changes
its parameters, and its attention's window and rotary base (``model.window_attn_skip_freq``,
``model.local_rotary_base``: Gemma 3's five local layers per global one, gpt-oss's alternating ones), which do not.
Layers of different parameters are stacked apart; layers whose kinds differ only in their attention are stacked
together when the kinds repeat with a period (Gemma 3's six, gpt-oss's two), each scan step then running one period
of layers, each of its own kind: so a model of such a pattern is one scan (and pipelines whole periods) however
many local and global layers it has.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jaxllm.config import Model as ModelConfig


class LayerKind(NamedTuple):
    """What sets layers apart (:func:`layer_kinds`).

    Attributes:
      moe: its MLP is a mixture of experts (:class:`jaxllm.model.layers.MoE`, ``cfg.moe_layers``), else dense.
      window: it attends to itself and the ``window - 1`` positions before it (``model.sliding_window`` where
        ``cfg.window_layers`` says so); 0: to every earlier position.
      rotary_base: its own rotary base, unscaled (``model.local_rotary_base``, a windowed layer's); 0: the model's
        rotary (``model.rotary_base`` with its scaling).
    """

    moe: bool
    window: int = 0
    rotary_base: float = 0.0


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    """Each layer's kind, in order.

    Raises:
      ConfigError: a ``model.moe_layer_freq`` or ``model.window_attn_skip_freq`` that names no layers
        (:attr:`jaxllm.config.Model.moe_layers`, :attr:`jaxllm.config.Model.window_layers`).
    """
    return tuple(LayerKind(moe, cfg.sliding_window if local else 0, cfg.local_rotary_base if local else 0.0)
                 for moe, local in zip(cfg.moe_layers, cfg.window_layers, strict=True))


@dataclasses.dataclass(frozen=True)
class Group:
    """Consecutive layers of one kind, or of a repeating pattern of kinds with the same parameters, whose parameters
    are stacked on a leading ``layers`` axis in ``params[name]`` and which run as one scan
    (:meth:`jaxllm.model.gpt.GPT.run_layers`).

    Attributes:
      name: the parameters' key: ``"layers"`` when the model has one group, else ``"layers_0"``, ``"layers_1"``...
      pattern: its layers' kinds, in order, repeated: layer ``first + j`` is of kind ``pattern[j % len(pattern)]``;
        one kind for a group of one kind.  ``num_layers`` is a multiple of its length (a scan step's layers).
      first: the model's index of its first layer.
      num_layers: how many layers.
    """

    name: str
    pattern: tuple[LayerKind, ...]
    first: int
    num_layers: int

    @property
    def kind(self) -> LayerKind:
        """Its first layer's kind: every layer of the group has its parameters (``moe``)."""
        return self.pattern[0]

    @property
    def stop(self) -> int:
        """The model's index after its last layer."""
        return self.first + self.num_layers


def _period(kinds: tuple[LayerKind, ...]) -> int:
    """The smallest period of ``kinds`` that repeats at least twice (``kinds[i] == kinds[i + p]``), or 1 (one kind,
    or no period)."""
    for p in range(1, len(kinds) // 2 + 1):
        if all(kinds[i] == kinds[i + p] for i in range(len(kinds) - p)):
            return p
    return 1


def _runs(kinds: tuple[LayerKind, ...], first: int) -> list[tuple[tuple[LayerKind, ...], int, int]]:
    """``kinds`` (layers of the same parameters from layer ``first``) as ``(pattern, first, layers)`` runs: one
    of a repeating pattern (:func:`_period`), the layers before its last whole periods as runs of one kind."""
    p, out = _period(kinds), []
    head = len(kinds) % p if p > 1 else len(kinds)  # the repeating part is the last whole periods
    for kind, run in itertools.groupby(kinds[:head]):
        out.append(((kind,), first, len(list(run))))
        first += out[-1][2]
    if head < len(kinds):
        out.append((kinds[head:head + p], first, len(kinds) - head))
    return out


def layer_groups(cfg: ModelConfig) -> tuple[Group, ...]:
    """The groups of layers, in order: the runs of layers of the same parameters (``moe``), each one group of one
    kind, or, where the kinds' attention repeats with a period (:func:`layer_kinds`: Gemma 3's ``[local]*5 +
    [global]``), the layers before its last whole periods in groups of one kind, then one group of that pattern.  One
    group for a homogeneous model; with ``moe_layer_freq`` ``([0]*3+[1]*58)`` (DeepSeek-V3) a dense group of 3 then an
    MoE group of 58; Gemma 3's 62 layers: 2 local ones, then 10 periods of ``[local]*3 + [global] + [local]*2``.

    Raises:
      ConfigError: a ``model.moe_layer_freq`` or ``model.window_attn_skip_freq`` that names no layers.
    """
    runs, first = [], 0
    for _, same in itertools.groupby(layer_kinds(cfg), key=lambda k: k.moe):
        kinds = tuple(same)
        runs += _runs(kinds, first)
        first += len(kinds)
    names = ["layers"] if len(runs) == 1 else [f"layers_{i}" for i in range(len(runs))]
    return tuple(Group(name, *run) for name, run in zip(names, runs, strict=True))
