"""The device mesh and the one table that maps the model's logical axes to mesh axes.

The model names logical axes only (``batch``, ``length``, ``residual``,
``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``,
``layers``); :func:`rules` says which mesh axes each one is split over, and
every sharding of the program (parameters, optimizer state, batch,
activations) is derived from that table.
"""

from __future__ import annotations

import contextlib

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config import MESH_AXES


def rules(cfg) -> dict[str, tuple[str, ...]]:
    """The rules table: logical axis -> mesh axes it is split over, in order.

    A mesh axis is used at most once per array: when two logical axes of one
    array ask for the same mesh axis, the first keeps it (so an activation's
    ``embed`` is not split over ``fsdp`` once its ``batch`` is).
    """
    return {
        "batch": ("data", "fsdp"),
        "length": ("sequence",),
        "residual": ("sequence",),
        "embed": ("fsdp",),
        "heads": ("tensor",),
        "kv_heads": ("tensor",),
        "mlp": ("tensor",),
        "vocab": ("tensor",),
        "head_dim": (),
        "layers": (),
    }


def logical_to_spec(axes, table) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have the logical names ``axes`` (None: not split)."""
    used, spec = set(), []
    for name in axes:
        mesh_axes = tuple(a for a in table.get(name, ()) if a not in used) if name else ()
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*spec)


_ACTIVE: list[tuple[jax.sharding.Mesh, dict]] = []


@contextlib.contextmanager
def activation_sharding(mesh, table):
    """Within this context, :func:`constrain` pins activations to ``mesh`` by ``table``."""
    _ACTIVE.append((mesh, table))
    try:
        yield
    finally:
        _ACTIVE.pop()


def constrain(x, axes):
    """Constrains activation ``x`` (dimensions named ``axes``) to its sharding; identity outside
    :func:`activation_sharding`, so the model runs unchanged on one device."""
    if not _ACTIVE:
        return x
    mesh, table = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, table)))


def make_mesh(cfg, devices=None) -> jax.sharding.Mesh:
    """The device mesh with axes ``data, fsdp, pipeline, tensor, sequence`` sized from ``cfg.mesh``."""
    devices = jax.devices() if devices is None else devices
    shape = tuple(cfg.mesh[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def param_specs(logical, table):
    """PartitionSpecs of the parameters from their logical axes (see :func:`jaxllm.model.logical_axes`)."""
    return jax.tree.map(lambda axes: logical_to_spec(axes, table), logical, is_leaf=lambda x: isinstance(x, tuple))


def state_shardings(abstract_state, logical, optimizer, mesh, table):
    """NamedShardings of the training state ``{"step", "params", "opt_state"}``.

    Optimizer moments take their parameter's spec (``optax.tree_map_params`` finds them);
    scalars such as Adam's count are replicated.
    """
    specs = param_specs(logical, table)
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    opt = optax.tree_map_params(optimizer, lambda _, spec: named(spec), abstract_state["opt_state"], specs,
                                transform_non_params=lambda _: named(PartitionSpec()),
                                is_leaf=lambda x: isinstance(x, PartitionSpec))
    return {"step": named(PartitionSpec()), "params": jax.tree.map(named, specs), "opt_state": opt}
