"""The device mesh and the one table that maps the model's logical axes to mesh axes.

The model names logical axes only: ``batch``, ``length`` (the sequence inside
attention and MLP), ``residual`` (the sequence of the residual stream between
blocks), ``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``,
``layers``, and ``stage`` (the pipeline stages, see :mod:`jaxllm.pipeline`).  :data:`RULES` says which mesh axes each one is split over, and
every sharding of the program (parameters, optimizer state, gradients, batch,
activations) is derived from it by :func:`rules`.

Parallelism this gives, under XLA's SPMD partitioner (GSPMD):

* data parallelism: ``batch`` over ``data`` (and ``fsdp``);
* pipeline parallelism: ``layers`` (so each stage holds its own layers) and
  ``stage`` over ``pipeline`` (:mod:`jaxllm.pipeline`);
* ZeRO (Rajbhandari et al. 2020): stage 1 splits the optimizer state's
  ``embed`` dimension over the data-parallel axes, stage 2 also the gradients
  (the all-reduce becomes a reduce-scatter), stage 3 also the parameters, which
  is what the ``fsdp`` axis always does (FSDP: ``embed`` over ``fsdp``);
* Megatron-LM tensor parallelism (Shoeybi et al. 2019): ``heads``, ``kv_heads``,
  ``mlp`` and ``vocab`` over ``tensor``, so QKV and the first MLP matrix are
  column-parallel, the output projections row-parallel, the embedding and the
  output layer vocabulary-parallel; with ``parallel.megatron_sp`` the
  ``residual`` stream is also split along the sequence over ``tensor``
  (Korthikanti et al. 2022), turning the all-reduces into reduce-scatter +
  all-gather.

The mesh uses ``AxisType.Auto`` (GSPMD) on purpose: the model constrains
activations at a few logical boundaries and XLA propagates the rest, so model
code stays free of mesh axes.  ``Explicit`` mode would make every einsum name
its output sharding.
"""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config import MESH_AXES, ConfigError

# The rules table: logical axis -> mesh axes it is split over, in order of preference.
RULES = {
    "batch": ("data", "fsdp"),
    "length": ("sequence",),
    "residual": ("sequence",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": ("pipeline",),
    "stage": ("pipeline",),
}


def rules(cfg, *, zero: bool = False) -> dict[str, tuple[str, ...]]:
    """:data:`RULES` as ``cfg`` configures it.

    Args:
      cfg: the run config (``parallel.megatron_sp`` adds ``tensor`` to ``residual``).
      zero: the table for ZeRO-partitioned arrays: ``embed`` also over ``data``.
    """
    table = dict(RULES)
    if cfg.parallel.megatron_sp:
        table["residual"] = ("sequence", "tensor")
    if zero:
        table["embed"] = ("fsdp", "data")
    return table


def logical_to_spec(axes, table) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have the logical names ``axes`` (None: not split).

    A mesh axis is used at most once per array: when two logical axes ask for the same
    one, the first keeps it (so an activation's ``embed`` is not split over ``fsdp`` once
    its ``batch`` is).
    """
    used, spec = set(), []
    for name in axes:
        mesh_axes = tuple(a for a in table.get(name, ()) if a not in used) if name else ()
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*spec)


_ACTIVE: list[tuple[jax.sharding.Mesh, dict]] = []


@contextlib.contextmanager
def activation_sharding(mesh, table):
    """Within this context (while tracing), :func:`constrain` pins activations to ``mesh`` by ``table``."""
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


def mesh_axes(name) -> tuple[str, ...]:
    """The mesh axes the active table (see :func:`activation_sharding`) splits logical axis ``name`` over."""
    return tuple(_ACTIVE[-1][1].get(name, ()))


def make_mesh(cfg, devices=None) -> jax.sharding.Mesh:
    """The device mesh with axes ``data, fsdp, pipeline, tensor, sequence``.

    Each axis spans ``mesh.AXIS x mesh.dcn_AXIS`` devices.  With any ``dcn_*`` > 1 the
    mesh is hierarchical, as ``mesh_utils.create_hybrid_device_mesh`` builds it: the
    devices are split into ``prod(dcn_*)`` granules (slices where the devices report
    several, else consecutive groups of processes: nodes, when process ids are numbered
    node by node as Slurm and PALS do), each granule is laid out as the ``mesh.*`` (ICI)
    shape, and the granules along the ``dcn_*`` shape, outermost.  So tensor parallelism
    stays on the fast links inside a node.  ``cfg`` must be resolved (no -1).

    Raises:
      ConfigError: the devices do not split into ``prod(dcn_*)`` equal granules.
    """
    devices = jax.devices() if devices is None else devices
    ici = tuple(cfg.mesh[a] for a in MESH_AXES)
    dcn = tuple(cfg.mesh[f"dcn_{a}"] for a in MESH_AXES)
    granules = math.prod(dcn)
    if granules == 1:
        grid = (np.asarray(devices).reshape(ici) if len(devices) == 1 else
                mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True))
    else:
        slices = sorted({getattr(d, "slice_index", 0) for d in devices})
        if len(slices) == granules:
            groups = [[d for d in devices if getattr(d, "slice_index", 0) == s] for s in slices]
        else:
            ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
            size = len(ordered) // granules
            groups = [ordered[i * size:(i + 1) * size] for i in range(granules)]
        if len({len(g) for g in groups}) != 1 or len(groups[0]) != math.prod(ici):
            raise ConfigError("mesh", {k: cfg.mesh[k] for k in cfg.mesh},
                              f"{len(devices)} devices do not split into {granules} (prod of mesh.dcn_*) granules "
                              f"of {math.prod(ici)} (prod of mesh.*) devices each")
        per_granule = np.stack([mesh_utils.create_device_mesh(ici, g, allow_split_physical_axes=True)
                                for g in groups]).reshape(dcn + ici)
        # interleave (dcn_0, ici_0, dcn_1, ici_1, ...) so each mesh axis is dcn-major
        order = [i for pair in zip(range(len(dcn)), range(len(dcn), 2 * len(dcn))) for i in pair]
        grid = per_granule.transpose(order).reshape([d * i for d, i in zip(dcn, ici)])
    return jax.sharding.Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def param_specs(logical, table):
    """PartitionSpecs of the parameters from their logical axes (see :func:`jaxllm.model.logical_axes`)."""
    return jax.tree.map(lambda axes: logical_to_spec(axes, table), logical, is_leaf=lambda x: isinstance(x, tuple))


def state_shardings(cfg, abstract_state, logical, optimizer, mesh):
    """NamedShardings of the training state ``{"step", "params", "opt_state", ...}``.

    Parameters follow :func:`rules` (ZeRO table from stage 3); optimizer moments follow
    the ZeRO table from stage 1 (``optax.tree_map_params`` finds them); scalars such as
    ``step``, the other top-level counters and Adam's count are replicated.
    """
    stage = cfg.parallel.zero_stage
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    opt_specs = param_specs(logical, rules(cfg, zero=stage >= 1))
    opt = optax.tree_map_params(optimizer, lambda _, spec: named(spec), abstract_state["opt_state"], opt_specs,
                                transform_non_params=lambda _: named(PartitionSpec()),
                                is_leaf=lambda x: isinstance(x, PartitionSpec))
    params = jax.tree.map(named, param_specs(logical, rules(cfg, zero=stage >= 3)))
    scalars = {k: named(PartitionSpec()) for k in abstract_state if k not in ("params", "opt_state")}
    return {**scalars, "params": params, "opt_state": opt}


def grad_shardings(cfg, logical, mesh):
    """Where gradients live after the data-parallel reduction: reduce-scattered over the
    data axes for ZeRO stage >= 2, else laid out like the parameters."""
    stage = cfg.parallel.zero_stage
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(logical, rules(cfg, zero=stage >= 2)))


def per_device_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays held by one device (the first), from the arrays' shardings;
    leaves may be arrays or ``jax.ShapeDtypeStruct`` with a sharding."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total
