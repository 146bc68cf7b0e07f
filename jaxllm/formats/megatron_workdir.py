"""jaxllm workdirs <-> Megatron-LM ``torch_dist`` checkpoints with their optimizer state, and <- Megatron-DeepSpeed's
DeepSpeed checkpoints (``python -m jaxllm.convert --to-megatron`` / ``--from-megatron``; docs/checkpoints.md,
"Moving a Megatron run"): a run's parameters, Adam's moments and step, schedule and data position both ways,
megatron-core ``GPTModel``'s names and layouts from :mod:`jaxllm.formats.megatron`, the files from
:mod:`jaxllm.formats.torch_dist` (torch's weights-only and metadata-only unpicklers: no unrestricted pickle) and
:mod:`jaxllm.formats.deepspeed`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm import config
from jaxllm.errors import ConvertError
from jaxllm.formats import deepspeed, megatron, torch_dist
from jaxllm.formats.workdir import apply_overrides, importing, resolve_for_its_mesh, save_imported
from jaxllm.model import gpt
from jaxllm.resolve import resolve_model
from jaxllm.runtime import checkpoint, optim, step

_MOMENTS = {"mu": "optimizer.state.exp_avg.", "nu": "optimizer.state.exp_avg_sq."}
# The float32 copies of bf16/fp16 parameters: megatron-core's Float16 optimizer's, its distributed optimizer's
# (fully_reshardable format)
_MASTERS = ("optimizer.state.fp32_param.", "optimizer.state.param.")


def _check_optimizer_format(common: dict, keys: list[str], path: str) -> None:
    """Refuses the distributed optimizer's formats that hold its state in flat buckets by data-parallel rank
    (``dp_reshardable``, Megatron-LM's default, and the older ``dp_zero_gather_scatter``) rather than per
    parameter.  Raises ConvertError."""
    kind = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if any(k.startswith("optimizer.distributed.") for k in keys) or kind in ("dp_reshardable",
                                                                            "dp_zero_gather_scatter"):
        raise ConvertError(f"{path}: the distributed optimizer's state is saved in flat buckets by data-parallel "
                           f"rank ({kind or 'optimizer.distributed.*'}), not per parameter: save the iteration "
                           f"again from Megatron-LM with --dist-ckpt-optim-fully-reshardable")


def _adam_step(opt, found: set) -> set:
    """Every Adam step count in Megatron's saved optimizer state (``state.common_step`` of megatron-core's
    FP32/Float16 optimizers, ``param_groups[*].step`` of its distributed optimizer; nested for chained ones)."""
    if isinstance(opt, dict):
        if "common_step" in opt:
            found.add(int(opt["common_step"]))
        for g in opt.get("param_groups", []) if isinstance(opt.get("param_groups"), list) else []:
            if isinstance(g, dict) and g.get("step") is not None:
                found.add(int(g["step"]))
        for v in opt.values():
            _adam_step(v, found)
    elif isinstance(opt, (list, tuple)):
        for v in opt:
            _adam_step(v, found)
    return found


def _check_position(path: str, iteration: int, args: dict, scheduler: dict | None) -> int:
    """The schedule's count (Megatron's successful updates: fp16's skipped ones leave it behind the
    iteration); checks that the data position is ``iteration`` x the global batch (jaxllm's is the step's).
    Raises ConvertError."""
    batch = args["global_batch_size"]
    consumed = args.get("consumed_train_samples")
    if consumed is not None and int(consumed) != iteration * batch:
        raise ConvertError(f"{path}: args.consumed_train_samples = {consumed}, not iteration {iteration} x global "
                           f"batch {batch}: the run changed its global batch (or ramped it up), and jaxllm's data "
                           f"position is the step's")
    updates = (scheduler or {}).get("num_steps", iteration * batch)  # in samples
    if int(updates) % batch or int(updates) > iteration * batch:
        raise ConvertError(f"{path}: the scheduler's num_steps = {updates} samples, not a whole number of global "
                           f"batches of {batch} up to iteration {iteration}")
    return int(updates) // batch


def _one_step(steps: set[int], default: int, path: str) -> int:
    """Adam's step count, one for every parameter group (``default`` where none is saved).  Raises ConvertError."""
    if len(steps) > 1:
        raise ConvertError(f"{path}: Adam step counts {sorted(steps)} differ between parameter groups")
    return steps.pop() if steps else default


def _with_adam_state(state: dict, mu: dict, nu: dict, count: int, schedule: int, iteration: int) -> dict:
    """``state`` (:func:`jaxllm.runtime.step.init_state`'s, AdamW) at step ``iteration`` with Adam's moments and
    step ``count`` and the learning-rate schedule's count ``schedule`` (Megatron's successful updates)."""
    import optax  # noqa: PLC0415

    def put(node):
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(count=jnp.asarray(count, node.count.dtype), mu=mu, nu=nu)
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=jnp.asarray(schedule, node.count.dtype))
        return node

    leaf = lambda n: isinstance(n, (optax.ScaleByAdamState, optax.ScaleByScheduleState))  # noqa: E731
    return {**state, "step": jnp.asarray(iteration, state["step"].dtype),
            "opt_state": jax.tree.map(put, state["opt_state"], is_leaf=leaf)}


class _Source(NamedTuple):
    """A Megatron checkpoint to import: where, its iteration, its arguments in Megatron-LM's names, the
    learning-rate scheduler's state, and ``read(cfg)``: ``(float32 parameters, {"mu", "nu"}: Adam's moments, Adam's
    step counts)``, tensors under megatron-core's names (what :func:`jaxllm.formats.megatron.from_megatron` takes)."""

    path: str
    iteration: int
    args: dict
    scheduler: dict | None
    read: Callable
    notes: tuple[str, ...] = ()


def _torch_dist_source(directory: str, iteration: int | None) -> _Source:
    """Megatron-LM's ``torch_dist`` checkpoint (:mod:`jaxllm.formats.torch_dist`)."""
    path, iteration = torch_dist.iteration_dir(directory, iteration)
    common = torch_dist.read_common(path)
    if common.get("iteration") != iteration:
        raise ConvertError(f"{path}/common.pt is of iteration {common.get('iteration')}, its directory of "
                           f"{iteration}: the checkpoint is inconsistent")

    def read(cfg):
        metadata = torch_dist.read_metadata(path)
        keys = [k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")]
        _check_optimizer_format(common, keys, path)
        taken = (*_MOMENTS.values(), *_MASTERS)
        left = sorted(k for k in keys if k.startswith("optimizer.") and not k.startswith(taken))
        if left:
            raise ConvertError(f"{path}: optimizer tensors jaxllm has no place for: {', '.join(left[:4])}")
        master = next((p for p in _MASTERS if any(k.startswith(p) for k in keys)), None)
        # the float32 copies, where saved, stand for the model's tensors: those are not read then
        tensors = torch_dist.read_tensors(path, metadata, [k for k in keys if k.startswith("optimizer.") or not master])
        part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
        weights = part(master) if master else {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
        for prefix in _MOMENTS.values():
            if not part(prefix):
                raise ConvertError(f"{path} holds no {prefix}* tensors: saved without Adam's state (--no-save-optim)")
        return weights, {name: part(prefix) for name, prefix in _MOMENTS.items()}, _adam_step(common.get("optimizer"),
                                                                                              set())

    args = vars(common.get("args")) if isinstance(common.get("args"), argparse.Namespace) else None
    if not args:
        raise ConvertError(f"{path}/common.pt holds no Megatron-LM arguments (args): not a Megatron-LM checkpoint")
    return _Source(path, iteration, args, common.get("opt_param_scheduler"), read)


def _deepspeed_source(directory: str, iteration: int | None) -> _Source:
    """Megatron-DeepSpeed's DeepSpeed checkpoint, native or universal (:mod:`jaxllm.formats.deepspeed`)."""
    path = deepspeed.tag_dir(directory, iteration)
    states = deepspeed.model_states(path)
    saved = states[0].get("args")
    if not isinstance(saved, argparse.Namespace):
        raise ConvertError(f"{path}: the model states hold no Megatron arguments (args): not a Megatron-DeepSpeed "
                           f"checkpoint")
    found = states[0].get("iteration")
    if iteration is not None and found != iteration:
        raise ConvertError(f"{path} is of iteration {found}, not --iteration {iteration}")
    args = vars(saved)
    universal = os.path.isdir(os.path.join(path, "zero"))
    if not universal and (args.get("tensor_model_parallel_size") or 1) > 1:
        if not os.path.isdir(path.rstrip(os.sep) + "_universal"):
            raise ConvertError(f"{path}: tensor-parallel ({args['tensor_model_parallel_size']}) shards of DeepSpeed's "
                               f"native layout are not joined here: convert the tag with DeepSpeed's ds_to_universal "
                               f"into {os.path.basename(path.rstrip(os.sep))}_universal first")
        source = _deepspeed_source(path.rstrip(os.sep) + "_universal", iteration)
        return source._replace(notes=(f"{path} holds tensor-parallel shards: read its conversion, {source.path}",))
    scheduler = states[0].get("lr_scheduler")
    if not isinstance(scheduler, dict) or "num_steps" not in scheduler:
        raise ConvertError(f"{path}: the learning-rate scheduler's state is not Megatron's OptimizerParamScheduler's "
                           f"(no num_steps: a DeepSpeed-config scheduler?); jaxllm cannot place the schedule")

    def read(cfg):
        vocab = cfg.model.vocab_size
        raw, steps = (deepspeed.read_universal(path, states, vocab) if universal
                      else deepspeed.read_native(path, states))
        weights, mu, nu = (megatron.from_deepspeed(raw[k], args["num_layers"], "float32 parameters" if k == "fp32"
                                                   else k) for k in deepspeed.KINDS)
        return weights, {"mu": mu, "nu": nu}, steps

    return _Source(path, found, megatron.deepspeed_args(args), scheduler, read)


def import_megatron(directory: str, workdir: str, iteration: int | None = None,
                    overrides: dict[str, str] | None = None) -> tuple[config.Resolved, int, list[str]]:
    """``--from-megatron``: Megatron-LM's ``torch_dist`` checkpoint or Megatron-DeepSpeed's DeepSpeed checkpoint
    (native ZeRO-1/2/3 shards, or DeepSpeed's universal layout) in ``directory`` (its latest iteration, or
    ``iteration``) as a jaxllm checkpoint of that step in ``workdir`` (which must hold none), plus
    ``workdir/config.py``.

    Float32 parameters (the optimizer's float32 copies where a bf16/fp16 run saved them), Adam's moments and
    step count, the schedule at the iteration; the config is what the saved arguments say
    (:func:`jaxllm.formats.megatron.args_overrides`), then ``overrides`` (model keys:
    :data:`jaxllm.formats.workdir.FREE_MODEL_KEYS`).
    The next step, ``iteration`` (jaxllm counts from 0), takes samples ``iteration x global batch`` on, which
    is Megatron-LM's next sample for the same ``--data-path``, ``--split``, ``--seed`` and ``--seq-length``.
    Returns ``(resolved config, iteration, notes)``: the notes say which saved arguments jaxllm leaves
    behind (:func:`jaxllm.formats.megatron.notes`) and which tag was read in a native DeepSpeed tag's place.
    Raises ConvertError (see :mod:`jaxllm.formats.torch_dist`, :mod:`jaxllm.formats.deepspeed`) and
    ConfigError; nothing is written to ``workdir`` then.
    """
    if not os.path.exists(directory):
        raise ConvertError(f"{directory}: no such file or directory")
    with importing(workdir, "jaxllm.convert --from-megatron"):
        cfg, iteration, notes = _import(directory, workdir, iteration, overrides)
    return cfg, iteration, notes


def _import(directory: str, workdir: str, iteration: int | None, overrides: dict[str, str] | None
            ) -> tuple[config.Resolved, int, list[str]]:
    """:func:`import_megatron` inside the workdir's lock."""
    torch_dist.require_torch()
    source = (_deepspeed_source if deepspeed.is_deepspeed(directory) else _torch_dist_source)(directory, iteration)
    path, iteration, args = source.path, source.iteration, source.args
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size",
                           "global_batch_size", "seq_length", "train_iters") if args.get(k) is None]
    if missing:
        raise ConvertError(f"{path}: the saved arguments lack {', '.join(missing)}")
    given = config.get_config()
    for key, text in megatron.args_overrides(args).items():
        config.override(given, key, text)
    apply_overrides(given, dict(overrides or {}), "Megatron checkpoint's arguments")
    cfg = resolve_for_its_mesh(given)
    schedule = _check_position(path, iteration, args, source.scheduler)
    weights, moments, steps = source.read(cfg)
    count = _one_step(steps, schedule, path)
    params = megatron.from_megatron(cfg.model, weights, "float32 parameters")
    moments = {name: megatron.from_megatron(cfg.model, moments[name], what)
               for name, what in (("mu", "exp_avg"), ("nu", "exp_avg_sq"))}
    spec = gpt.describe(cfg.model)
    optimizer = optim.make_optimizer(cfg.train, spec.decay, spec.axes)
    with jax.default_device(jax.devices("cpu")[0]):
        state = _with_adam_state(step.init_state(jax.device_put(params), optimizer), jax.device_put(moments["mu"]),
                                 jax.device_put(moments["nu"]), count, schedule, iteration)
    save_imported(workdir, cfg, state, iteration, given, path, "Megatron checkpoint")
    return cfg, iteration, [*source.notes, *megatron.notes(args)]


def megatron_args(cfg: config.Config, m: config.Model, iteration: int) -> argparse.Namespace:
    """Megatron-LM's arguments for the run ``cfg`` (its resolved ``model`` section ``m``, one device) at
    ``iteration``: what :func:`import_megatron` and a Megatron-LM run of the same model read."""
    t, d = cfg.train, cfg.data
    gelu = m.activation == "gelu"
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.head_dim, group_query_attention=True,
        num_query_groups=m.num_kv_heads, seq_length=t.seq_length, max_position_embeddings=m.max_position_embeddings,
        position_embedding_type="learned_absolute" if m.position_embedding == "learned" else "rope",
        rotary_base=m.rotary_base, rotary_percent=1.0,
        normalization="LayerNorm" if m.norm == "layernorm" else "RMSNorm",
        norm_epsilon=m.norm_eps, swiglu=not gelu, openai_gelu=gelu, add_bias_linear=m.use_bias,
        add_qkv_bias=m.use_bias or m.add_qkv_bias, qk_layernorm=m.qk_layernorm,
        untie_embeddings_and_output_weights=not m.tie_embeddings, num_experts=m.num_experts or None,
        moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size or None,
        moe_router_pre_softmax=m.moe_router_pre_softmax, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        padded_vocab_size=gpt.describe(m).params["wte"].shape[0], vocab_size=m.vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, hidden_dropout=m.dropout,
        init_method_std=m.init_std, bf16=m.dtype == "bfloat16", fp16=m.dtype == "float16",
        optimizer="adam", decoupled_weight_decay=True, lr=t.lr, min_lr=t.min_lr, lr_decay_style=t.lr_decay_style,
        lr_wsd_decay_style=t.lr_wsd_decay_style, lr_warmup_iters=t.warmup_iters,
        lr_warmup_fraction=t.lr_warmup_fraction or None, lr_decay_iters=t.lr_decay_iters,
        train_iters=t.train_iters, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        weight_decay=t.weight_decay, adam_beta1=t.beta1, adam_beta2=t.beta2,
        adam_eps=t.adam_eps, clip_grad=t.grad_clip, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, seed=t.seed, data_path=d.input.split(), split=d.split,
        log_interval=t.log_interval, eval_interval=t.eval_interval, eval_iters=t.eval_iters,
        save_interval=cfg.checkpoint.interval,
        consumed_train_samples=iteration * t.global_batch_size, iteration=iteration, ckpt_format="torch_dist",
        **megatron.tokenizer_args(d))


def _adam_and_schedule(opt_state) -> tuple:
    """AdamW's ``ScaleByAdamState`` (moments and step count) and the learning-rate schedule's count."""
    import optax  # noqa: PLC0415

    kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, kinds)) if isinstance(n, kinds)]
    adam = next(n for n in nodes if isinstance(n, optax.ScaleByAdamState))
    return adam, int(next(n.count for n in nodes if isinstance(n, optax.ScaleByScheduleState)))


def export_megatron(workdir: str, out: str, at_step: int | None = None) -> int:
    """``--to-megatron``: ``workdir``'s checkpoint (the latest, or ``at_step``) as a Megatron-LM checkpoint
    directory ``out`` (``latest_checkpointed_iteration.txt``, ``iter_NNNNNNN/``): megatron-core ``GPTModel``'s
    tensors (:func:`jaxllm.formats.megatron.to_megatron`), Adam's moments as ``optimizer.state.exp_avg(_sq).*``
    (megatron-core's ``optim_state_to_sharding_state`` keys) and its step as ``common_step``, the arguments
    (:func:`megatron_args`), the schedule at the step.  Returns the iteration (the step).
    Raises ConvertError: ``out`` holds that iteration already, the optimizer is not AdamW, or the model is not
    one megatron-core's GPTModel holds."""
    torch = torch_dist.require_torch()
    cfg = checkpoint.load_config(workdir, at_step)
    if config.OPTIMIZER_ALIASES.get(cfg.train.optimizer, cfg.train.optimizer) != "adamw":
        raise ConvertError(f"train.optimizer={cfg.train.optimizer}: Megatron checkpoints are written with AdamW's "
                           f"state only", keys=("train.optimizer",))
    m = resolve_model(cfg.model, seq_length=cfg.train.seq_length)  # one tensor device: Megatron's padding at 1
    megatron.check_representable(m)
    spec = gpt.describe(m)
    optimizer = optim.make_optimizer(cfg.train, spec.decay, spec.axes)
    abstract = jax.eval_shape(lambda p: step.init_state(p, optimizer), spec.params)
    iteration, state = checkpoint.restore_on_host(workdir, {k: abstract[k] for k in ("params", "opt_state")},
                                                at_step)
    target = os.path.join(out, f"iter_{iteration:07d}")
    if os.path.exists(target):
        raise ConvertError(f"{target} exists: export into a new directory")
    adam, schedule = _adam_and_schedule(state["opt_state"])
    tensors = megatron.to_megatron(m, state["params"])
    for name, tree in (("mu", adam.mu), ("nu", adam.nu)):
        tensors.update({_MOMENTS[name] + k: v for k, v in megatron.to_megatron(m, tree).items()})
    t, batch = cfg.train, cfg.train.global_batch_size
    common = {"args": megatron_args(cfg, m, iteration), "checkpoint_version": 3.0, "iteration": iteration,
              "optimizer": {"state": {"common_step": torch.tensor(float(adam.count))}},
              "opt_param_scheduler": {"max_lr": t.lr, "min_lr": t.min_lr, "num_steps": schedule * batch,
                                      "lr_warmup_steps": round(optim.warmup_steps(t) * batch),
                                      "lr_decay_steps": t.lr_decay_iters * batch, "lr_decay_style": t.lr_decay_style},
              "num_floating_point_operations_so_far": 0}
    torch_dist.write(target, common, tensors, dict.fromkeys(megatron.extra_state_keys(m)))
    torch_dist.advance_tracker(out, iteration)
    return iteration
