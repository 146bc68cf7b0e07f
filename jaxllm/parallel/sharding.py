"""The device mesh and the one table that maps the model's logical axes to mesh axes.

The model names logical axes only.  Weights: ``vocab``, ``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``layers``, multi-head latent attention's ``q_lora`` and
``kv_lora``, and a mixture of experts' ``experts``, ``expert_embed``, ``expert_mlp``.  Activations:
``batch``, ``length`` (the sequence inside attention and MLP), ``expert_length`` (the sequence of the
tokens dispatched to a mixture of experts), ``residual`` (the sequence of the residual
stream between blocks), ``act_embed``, the head and MLP axes as for weights, and
``stage`` (the pipeline stages, see :mod:`jaxllm.parallel.pipeline`).  :data:`RULES` says which
mesh axes each one is split over, and every sharding of the program (parameters,
optimizer state, gradients, batch, activations) is derived from it by :func:`rules`;
so is every divisibility requirement of a config (:func:`check`).

Parallelism this gives, under XLA's SPMD partitioner (GSPMD):

* data parallelism: ``batch`` over ``data`` (and ``fsdp``, and ``expert``);
* expert parallelism (Lepikhin et al. 2021, GShard; Megatron-LM's expert model parallelism): a mixture
  of experts' ``experts`` dimension over ``expert``, whose devices also split the batch as data-parallel
  ones do (the other weights are replicas there); tokens reach their experts' devices in
  :mod:`jaxllm.parallel.experts`, each device dispatching its ``(batch, expert_length)`` tokens; the
  experts' ``expert_mlp`` over ``tensor``, or, with ``mesh.expert_tensor=1``, ``experts`` over ``expert`` x
  ``tensor`` and ``expert_length`` over ``sequence`` x ``tensor`` (:func:`rules`);
* pipeline parallelism: ``layers`` (so each stage holds its own layers) and
  ``stage`` over ``pipeline`` (:mod:`jaxllm.parallel.pipeline`);
* ZeRO (Rajbhandari et al. 2020): stage 1 splits the optimizer state's
  ``embed`` dimension over the data-parallel axes and the ``sequence`` axis (whose
  devices hold the same model, as data-parallel ones do: DeepSpeed-Ulysses runs
  ZeRO-3 over data x sequence, Megatron-LM's distributed optimizer spans data x
  context), stage 2 also the gradients (the all-reduce becomes a reduce-scatter),
  stage 3 also the parameters, which is what the ``fsdp`` axis always does (FSDP:
  ``embed`` over ``fsdp``);
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

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config import MESH_AXES
from jaxllm.errors import ConfigError

# The rules table: logical axis -> the mesh axes it is split over.  Weights and activations
# have distinct names where their layouts differ: a weight's ``embed`` is split over ``fsdp``
# (ZeRO-3), an activation's ``act_embed`` never is (its ``batch`` already is).
RULES: dict[str, tuple[str, ...]] = {
    # weights
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "layers": ("pipeline",),
    "mtp_layers": (),  # the multi-token prediction modules' stack (resolve refuses them with a pipeline)
    "experts": ("expert",),  # the experts of a mixture of experts
    "expert_embed": ("fsdp",),  # an expert's embed dimension (ZeRO splits it over fewer axes than embed)
    "expert_mlp": ("tensor",),
    # multi-head latent attention's latent widths (q_lora_rank, kv_lora_rank + the rotary key's): small, and
    # their projections' embed is split already, so whole on every device
    "q_lora": (),
    "kv_lora": (),
    # activations (heads, kv_heads, head_dim, mlp and vocab as for weights)
    "batch": ("data", "fsdp", "expert"),
    "length": ("sequence",),
    "expert_length": ("sequence",),  # the sequence of the tokens a mixture of experts' devices dispatch
    "residual": ("sequence",),
    "act_embed": (),
    "stage": ("pipeline",),
}

# The weight dimensions split only to store them (FSDP, and ZeRO's data-parallel split): any size, stored
# padded to a multiple of their devices (:func:`stored`), computed on unpadded.  The others must divide.
STORED = ("embed", "expert_embed")


def rules(cfg, *, zero: bool = False, replica: bool = False) -> dict[str, tuple[str, ...]]:
    """:data:`RULES` as ``cfg`` configures it.

    Args:
      cfg: the run config (``parallel.megatron_sp`` adds ``tensor`` to ``residual``; ``mesh.expert_tensor=1``
        folds ``tensor`` into the experts' parallelism, Megatron-LM's expert tensor-parallel size 1: ``experts``
        over ``expert`` x ``tensor``, ``expert_mlp`` over nothing, and the dispatched tokens' ``expert_length``
        over ``sequence`` x ``tensor``: each tensor device dispatches ``1 / tensor`` of the tokens its tensor
        group holds alike, to whole experts).
      zero: the table for ZeRO-partitioned arrays: ``embed`` also over every axis whose devices hold
        replicas of the same weights (``batch``'s and ``length``'s: data, expert, sequence; pipeline and
        tensor hold other weights), an expert's ``expert_embed`` over those but ``experts``' own (data,
        sequence).  Which parts of the training state use it: :func:`zero_tables`.
      replica: the table of one data-parallel replica's computation, inside the train step's ``vmap`` over
        the replicas (``spmd_axis_name="data"``, :func:`jaxllm.runtime.step.reduces_once`): ``batch``
        without ``data``, which the ``vmap`` adds.
    """
    table = dict(RULES)
    if cfg.parallel.megatron_sp:
        table["residual"] = ("sequence", "tensor")
    if cfg.mesh.expert_tensor == 1:  # Megatron-LM's MoE parallel folding: tensor joins expert for the experts
        table.update(experts=("expert", "tensor"), expert_mlp=(), expert_length=("sequence", "tensor"))
    if zero:
        replicas = RULES["batch"] + RULES["length"]
        for name, taken in (("embed", ()), ("expert_embed", table["experts"])):
            table[name] = RULES[name] + tuple(a for a in replicas if a not in RULES[name] + taken)
    if replica:
        table["batch"] = tuple(a for a in table["batch"] if a != "data")
    return table


# What each ZeRO stage splits over the data-parallel axes, as DeepSpeed and Megatron-LM define the stages
# (Rajbhandari et al. 2020): stage 1 the optimizer state (Megatron-LM's distributed optimizer), stage 2
# also the gradients, stage 3 also the parameters.  The ``fsdp`` axis splits all three at every stage.
ZERO_STAGES: dict[int, tuple[str, ...]] = {0: (), 1: ("opt_state",), 2: ("opt_state", "grads"),
                                           3: ("opt_state", "grads", "params")}


@dataclasses.dataclass(frozen=True)
class StateTables:
    """The rules tables of the training state's parts (:func:`zero_tables`).

    Attributes:
      params, grads, opt_state: each a rules table (logical axis -> mesh axes), :func:`rules`' ZeRO one
        for the parts ZeRO splits, else the plain one.
      sharded: the parts ZeRO splits over the data-parallel axes (:data:`ZERO_STAGES`).
    """

    params: Mapping[str, tuple[str, ...]]
    grads: Mapping[str, tuple[str, ...]]
    opt_state: Mapping[str, tuple[str, ...]]
    sharded: tuple[str, ...]


def zero_tables(cfg) -> StateTables:
    """The parameter, gradient and optimizer-state rules tables of ``cfg``'s ZeRO stage
    (``parallel.zero_stage``, read here alone below :func:`jaxllm.resolve.resolve`).

    The tables do not depend on the mesh: ``NamedSharding(mesh, logical_to_spec(axes, table))`` places
    an array (:func:`param_shardings`, :func:`grad_shardings`, :func:`state_shardings`).
    """
    sharded = ZERO_STAGES[cfg.parallel.zero_stage]
    plain, zero = rules(cfg), rules(cfg, zero=True)
    return StateTables(**{part: zero if part in sharded else plain for part in ("params", "grads", "opt_state")},
                       sharded=sharded)


def logical_to_spec(axes, table) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have the logical names ``axes`` (None: not split).

    Raises:
      ValueError: two dimensions map to the same mesh axis (the names are wrong).
    """
    spec, used = [], []
    for name in axes:
        mesh_axes = tuple(table[name]) if name else ()
        used += mesh_axes
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {axes} use a mesh axis twice: {used}")
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """A device mesh and a rules table: where every logically named dimension lives.

    ``eq=False``: hashed by identity, so the model's graph definition can hold its methods.
    """

    mesh: jax.sharding.Mesh
    table: Mapping[str, tuple[str, ...]]

    def spec(self, axes) -> PartitionSpec:
        return logical_to_spec(axes, self.table)

    def sharding(self, axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    def constrain(self, x, axes):
        """Pins activation ``x`` (dimensions named ``axes``) to its sharding while tracing."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes))

    def mesh_axes(self, name) -> tuple[str, ...]:
        """The mesh axes logical axis ``name`` is split over."""
        return tuple(self.table[name])

    def size(self, name) -> int:
        """Devices logical axis ``name`` is split over."""
        return math.prod(self.mesh.shape[a] for a in self.table[name])


def check(cfg, sizes: Mapping[str, tuple[int, str]]) -> None:
    """Every dimension must divide by the devices the rules table splits it over, but the weights'
    :data:`STORED` dimensions, which are padded to any device count (:func:`stored`).

    Args:
      cfg: a config being resolved (``mesh_shape`` filled).
      sizes: logical axis -> (size, the config key that sets it), see :func:`jaxllm.model.gpt.logical_sizes`.
    Raises:
      ConfigError: the first dimension that does not divide, with its key.
    """
    state = zero_tables(cfg)
    tables = [rules(cfg)] + ([state.opt_state] if state.sharded else [])  # ZeRO's table, where a part uses it
    for table in tables:
        for name, (size, key) in sizes.items():
            axes = () if name in STORED else table.get(name, ())
            n = math.prod(cfg.mesh_shape[a] for a in axes)
            if size % n:
                what = " x ".join(f"mesh.{a}" + (f" x mesh.dcn_{a}" if getattr(cfg.mesh, f"dcn_{a}") > 1 else "")
                                  for a in axes)
                raise ConfigError(key, size, f"must be divisible by {what} = {n} (the rules table splits the "
                                             f"logical axis {name!r} over {', '.join(axes)})")


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
    ici = tuple(getattr(cfg.mesh, a) for a in MESH_AXES)
    dcn = tuple(getattr(cfg.mesh, f"dcn_{a}") for a in MESH_AXES)
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
            raise ConfigError("mesh", cfg.mesh.to_dict(),
                              f"{len(devices)} devices do not split into {granules} (prod of mesh.dcn_*) granules "
                              f"of {math.prod(ici)} (prod of mesh.*) devices each")
        per_granule = np.stack([mesh_utils.create_device_mesh(ici, g, allow_split_physical_axes=True)
                                for g in groups]).reshape(dcn + ici)
        # interleave (dcn_0, ici_0, dcn_1, ici_1, ...) so each mesh axis is dcn-major
        order = [i for pair in zip(range(len(dcn)), range(len(dcn), 2 * len(dcn))) for i in pair]
        grid = per_granule.transpose(order).reshape([d * i for d, i in zip(dcn, ici)])
    return jax.sharding.Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def param_specs(logical, table):
    """PartitionSpecs of the parameters from their logical axes (a tree of tuples, as
    :class:`jaxllm.model.gpt.Spec` holds them)."""
    return jax.tree.map(lambda axes: logical_to_spec(axes, table), logical, is_leaf=lambda x: isinstance(x, tuple))


def state_shardings(cfg, abstract_state, logical, mesh):
    """NamedShardings of the training state ``{"step", "params", "opt_state", ...}``, whatever the optimizer.

    Parameters follow :func:`param_shardings`.  Each array of the optimizer state that belongs to a
    parameter (its path in the state ends with the parameter's path) follows the optimizer-state table of
    :func:`zero_tables` (:func:`optimizer_spec`): a moment of the parameter's shape is laid out as
    the parameter; one with a dimension fewer (Adafactor's factored row and column statistics) as the
    parameter without that dimension.  Everything else (counters, Adafactor's placeholders, Muon's
    coefficients) is replicated, as are ``step`` and the other top-level counters.  The shardings are
    of the stored arrays (:func:`stored`): a :data:`STORED` dimension the mesh does not divide is padded.
    """
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    table = zero_tables(cfg).opt_state
    owners = {tuple(path): (leaf.shape, axes) for (path, leaf), axes in zip(
        jax.tree_util.tree_flatten_with_path(abstract_state["params"])[0],
        jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple)))}

    def opt_sharding(path, leaf):
        for k in range(len(path)):
            owner = owners.get(tuple(path[k:]))
            if owner is not None:
                return named(optimizer_spec(leaf.shape, *owner, table))
        return named(PartitionSpec())

    opt = jax.tree_util.tree_map_with_path(opt_sharding, abstract_state["opt_state"])
    scalars = {k: named(PartitionSpec()) for k in abstract_state if k not in ("params", "opt_state")}
    return {**scalars, "params": param_shardings(cfg, logical, mesh), "opt_state": opt}


def param_shardings(cfg, logical, mesh):
    """NamedShardings of the parameters (logical axes ``logical``, as :class:`jaxllm.model.gpt.Spec` holds
    them) on ``mesh``: split over the data-parallel axes from ZeRO stage 3 (:func:`zero_tables`)."""
    return _shardings(logical, zero_tables(cfg).params, mesh)


def grad_shardings(cfg, logical, mesh):
    """Where gradients live after the data-parallel reduction: reduce-scattered over the data-parallel
    axes from ZeRO stage 2 (:func:`zero_tables`), else laid out like the parameters."""
    return _shardings(logical, zero_tables(cfg).grads, mesh)


def _shardings(logical, table, mesh):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(logical, table))


def optimizer_spec(shape, param_shape, axes, table) -> PartitionSpec:
    """The PartitionSpec of an optimizer-state array of ``shape`` that belongs to a parameter of
    ``param_shape`` with logical ``axes``: the parameter's, or with the one dimension it lacks left
    out; replicated if it is neither."""
    names = None
    if tuple(shape) == tuple(param_shape):
        names = tuple(axes)
    elif len(shape) == len(param_shape) - 1:
        names = next((tuple(axes[:i] + axes[i + 1:]) for i in range(len(param_shape))
                      if tuple(param_shape[:i]) + tuple(param_shape[i + 1:]) == tuple(shape)), None)
    return PartitionSpec() if names is None else logical_to_spec(names, table)


def stored_shape(shape, sharding: NamedSharding) -> tuple[int, ...]:
    """How an array of ``shape`` is stored in ``sharding``: each dimension rounded up to a multiple of
    the devices it is split over, so that every device holds an equal shard (JAX's arrays must split
    evenly).  Only :data:`STORED` dimensions can need it (:func:`check`); DeepSpeed's ZeRO and Megatron-LM's
    distributed optimizer pad their flat buffers alike.  The padding is zeros no computation reads."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    parts = [math.prod(sharding.mesh.shape[a] for a in ((p,) if isinstance(p, str) else p or ())) for p in spec]
    return tuple(-(-n // k) * k for n, k in zip(shape, parts))


def stored(abstract, shardings):
    """``jax.ShapeDtypeStruct`` leaves of ``abstract`` (unpadded shapes) in ``shardings``, padded as stored
    (:func:`stored_shape`)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(stored_shape(a.shape, s), a.dtype, sharding=s),
                        abstract, shardings)


def pad(tree, like):
    """Each array of ``tree`` zero-padded at the end of its dimensions to the shape of ``like``'s leaf (its
    stored shape, :func:`stored`); arrays of that shape are returned as they are."""
    return jax.tree.map(lambda x, a: x if x.shape == a.shape else
                        jnp.pad(x, [(0, m - n) for n, m in zip(x.shape, a.shape)]), tree, like)


def unpad(tree, like):
    """Each array of ``tree`` (stored, padded) cut to the shape of ``like``'s leaf: inside ``jit`` a slice
    GSPMD keeps sharded, outside it works on host (NumPy) arrays too."""
    return jax.tree.map(lambda x, a: x if x.shape == a.shape else x[tuple(slice(0, n) for n in a.shape)],
                        tree, like)


def per_device_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays held by one device (the first), from the arrays' shardings;
    leaves may be arrays or ``jax.ShapeDtypeStruct`` with a sharding."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total
