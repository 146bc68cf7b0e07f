"""A run's compiled pieces on a device mesh: :class:`Run`.

From a resolved config (:func:`jaxllm.resolve.resolve`) it builds, once: the mesh and
rules table (:class:`jaxllm.parallel.sharding.Layout`), the model's description with the
mesh's operations (:func:`jaxllm.model.gpt.describe`: graph definition, shapes, logical
axes, weight-decay mask), the optimizer, the shardings of the training state, batch
and gradients, and the jitted train and eval steps (:mod:`jaxllm.runtime.step`).  The
training CLI, ``plan``, ``bench`` and ``tune`` all use it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxllm.config import Resolved
from jaxllm.data.loader import document_arrays
from jaxllm.model import attention, fp8, gpt, moe
from jaxllm.parallel import context_parallel, experts, sharding, vocab_parallel
from jaxllm.runtime import cpu, evaluation, optim, step


class Run:
    """The compiled pieces of a run on a device mesh: layout, model, shardings, state, train and eval steps.

    Args:
      cfg: a resolved config.
      devices: the devices of the mesh (default: all).
    Attributes:
      cfg, layout (mesh + rules table), mesh, spec (:class:`jaxllm.model.gpt.Spec`), optimizer,
      logical_state (the state's ``jax.ShapeDtypeStruct`` leaves), state_sharding, abstract_state (the state
      as stored: ``jax.ShapeDtypeStruct`` leaves with shardings, :data:`jaxllm.parallel.sharding.STORED`
      dimensions padded to their devices, :func:`jaxllm.parallel.sharding.stored`),
      batch_sharding (``[microbatches, rows, seq]``), eval_sharding (``[rows, seq]``),
      documents (the names of the batch's ``docs`` arrays the data options ask for,
      :func:`jaxllm.data.loader.document_arrays`; ``()``: the steps take no ``docs``), train_step,
      eval_step (jitted; see :mod:`jaxllm.runtime.step`).
    """

    def __init__(self, cfg: Resolved, devices=None):
        self.cfg = cfg
        self.layout = layout = sharding.Layout(sharding.make_mesh(cfg, devices), sharding.rules(cfg))
        self.mesh = layout.mesh
        self.spec = spec = gpt.describe(cfg.model, _ops(cfg, layout))
        self.optimizer = optim.make_optimizer(cfg.train, spec.decay, spec.axes)
        self.logical_state = logical = jax.eval_shape(lambda p: step.init_state(p, self.optimizer), spec.params)
        self.state_sharding = sharding.state_shardings(cfg, logical, spec.axes, self.mesh)
        self.abstract_state = stored = sharding.stored(logical, self.state_sharding)
        self.batch_sharding = layout.sharding((None, "batch", "length"))
        self.eval_sharding = layout.sharding(("batch", "length"))
        self.documents = document_arrays(cfg.data)
        arrays = 3 if self.documents else 2  # inputs, targets[, docs]: no docs argument without the data options
        replica_layout = replica_spec = None
        if step.reduces_once(cfg):  # the model inside the vmap over data-parallel replicas
            replica_layout = sharding.Layout(self.mesh, sharding.rules(cfg, replica=True))
            replica_spec = gpt.describe(cfg.model, _ops(cfg, replica_layout))
        train_fn = step.make_train_step(cfg, spec, self.optimizer, layout, sharding.grad_shardings(
            cfg, spec.axes, self.mesh), replica_layout, replica_spec)

        def train_step(state, *batch):  # the step computes on unpadded arrays (sharding.stored)
            state, metrics = train_fn(sharding.unpad(state, logical), *batch)
            return sharding.pad(state, stored), metrics

        unpadded_eval = step.make_eval_step(cfg, spec, layout)

        def eval_step(params, *batch):
            return unpadded_eval(sharding.unpad(params, logical["params"]), *batch)

        self.train_step = jax.jit(train_step, in_shardings=(self.state_sharding, *[self.batch_sharding] * arrays),
                                  out_shardings=(self.state_sharding, None), donate_argnums=0)
        self.eval_step = jax.jit(eval_step,
                                 in_shardings=(self.state_sharding["params"], *[self.eval_sharding] * arrays))
        # [chunk, batch, seq] stacks of validation batches -> [chunk] losses and token counts
        self.eval_losses = jax.jit(evaluation.batched(eval_step), in_shardings=(
            self.state_sharding["params"], *[self.batch_sharding] * arrays), out_shardings=layout.sharding(()))

    def initial_state(self, checkpointer=None) -> dict:
        """The latest checkpoint's state, or a fresh one created directly in its sharding."""
        state = checkpointer.restore(self.abstract_state) if checkpointer else None
        if state is None:
            cfg = self.cfg
            init = jax.jit(lambda: sharding.pad(step.init_state(gpt.init(cfg.model, cfg.train.seed), self.optimizer),
                                                self.abstract_state), out_shardings=self.state_sharding)
            state = init()
        return state

    def params(self, state) -> dict:
        """The parameters of ``state`` on this host, unpadded (NumPy arrays; single-process runs)."""
        return sharding.unpad(jax.device_get(state["params"]), self.logical_state["params"])

    def process_rows(self) -> slice:
        """The rows of the global batch this process feeds (its devices' part of the batch axis)."""
        m, rows_per_microbatch, _ = shape = self.cfg.batch_shape
        index = self.batch_sharding.addressable_devices_indices_map(shape)
        rows = [i[1].indices(rows_per_microbatch)[:2] for i in index.values()]
        return slice(min(r[0] for r in rows) * m, max(r[1] for r in rows) * m)

    def global_batch(self, inputs: np.ndarray, targets: np.ndarray, docs: dict | None = None) -> list:
        """This process's rows ``[rows, seq]`` -> global arrays ``[microbatches, rows/microbatches, seq]``:
        ``[inputs, targets]``, and with the data options ``docs`` (a dict of such arrays, the names
        :attr:`documents`; :meth:`jaxllm.data.loader.Batches.train_batch` gives them) laid out alike.

        Row ``r`` goes to micro batch ``r % microbatches``, so each process's contiguous
        rows stay contiguous within every micro batch.

        Raises:
          ValueError: ``docs`` does not hold exactly the arrays :attr:`documents` names.
        """
        if tuple(sorted(docs or ())) != tuple(sorted(self.documents)):
            raise ValueError(f"global_batch: the data options ask for the arrays {list(self.documents)}, given "
                             f"{sorted(docs or ())}")
        m = self.cfg.microbatches
        put = lambda x: jax.make_array_from_process_local_data(  # noqa: E731
            self.batch_sharding, np.ascontiguousarray(x.reshape(-1, m, x.shape[-1]).swapaxes(0, 1)))
        batch = [put(inputs), put(targets)]
        return batch + [{k: put(v) for k, v in docs.items()}] if docs else batch

    def abstract_batch(self) -> list:
        """The train step's batch arguments as :meth:`global_batch` gives them, abstract (``jax.ShapeDtypeStruct``
        ``[microbatches, rows/microbatches, seq]``, :attr:`batch_sharding`): for compiling ahead of time."""
        shape = lambda dtype: jax.ShapeDtypeStruct(self.cfg.batch_shape, dtype, sharding=self.batch_sharding)  # noqa: E731
        dtypes = {"positions": "int32", "segment_ids": "int32", "loss_mask": "float32"}  # document_masks' dtypes
        docs = {name: shape(dtypes[name]) for name in self.documents}
        return [shape("int32"), shape("int32")] + ([docs] if docs else [])

    def evaluate(self, params, loader, progress=None) -> float:
        """Mean loss (nats/token) over the ``train.eval_iters`` fixed validation batches, as few
        compiled programs over stacks of batches (:func:`jaxllm.runtime.evaluation.mean_loss`; ``progress``
        is called after each)."""
        return evaluation.mean_loss(self.eval_losses, params, loader.eval_batch, self.cfg.train.eval_iters,
                                    self.batch_sharding, progress=progress)

    def describe(self, params) -> str:
        """The mesh, a mixture of experts' token dispatcher as it runs (``auto`` resolved), and a table of every
        parameter: shape, partition spec, bytes per device."""
        m = self.cfg.model
        lines = [f"mesh {dict(self.mesh.shape)} over {self.mesh.devices.size} device(s)"]
        if m.num_experts:
            lines.append(f"experts' token dispatcher: {m.moe_token_dispatcher_type} (model.moe_token_dispatcher_type; "
                         "jaxllm/parallel/experts.py)")
        lines += [f"{'parameter':<28} {'shape':<22} {'partition spec':<44} {'bytes/device':>13}"]
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            spec = str(tuple(leaf.sharding.spec))
            lines.append(f"{name:<28} {str(leaf.shape):<22} {spec:<44} {sharding.per_device_bytes(leaf):>13,}")
        lines.append(f"{'total':<96}{sharding.per_device_bytes(params):>13,}")
        return "\n".join(lines)


def _ops(cfg, layout: sharding.Layout) -> gpt.Ops:
    """The model's operations on ``layout`` (:class:`jaxllm.model.gpt.Ops`)."""
    ops = gpt.Ops(constrain=layout.constrain,
                    attention=context_parallel.Attention(layout, cfg.parallel.sequence_impl,
                                                         cfg.parallel.ulysses_degree,
                                                         attention.implementation(
                                                             cfg.model, cfg.data.max_documents_per_sample)),
                    embed=vocab_parallel.Embed(layout), cross_entropy=vocab_parallel.CrossEntropy(layout),
                    param=sharding.Layout(layout.mesh, sharding.zero_tables(cfg).params).constrain,
                    experts=experts.Experts(layout, cfg.model.moe_token_dispatcher_type,
                                            cfg.model.moe_capacity_factor),
                    router_loss=moe.loss_scaler(1.0 / cfg.microbatches))
    if cfg.model.fp8:
        ops = dataclasses.replace(ops, dense=fp8.dense)
    if cfg.backend == "cpu":  # the CPU's operations (docs/performance.md has what each buys)
        ops = cpu.ops(ops, layout.mesh.size)
    return ops
