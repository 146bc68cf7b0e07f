"""Memory plan without the hardware: ``python -m jaxllm.plan --config=... --devices=N [--device=H100]``.

Compiles the training step ahead of time for N devices (fake CPU devices: the
same SPMD partitioning, nothing allocated) and prints per-device bytes of
parameters, gradients, optimizer state and XLA's temporaries, the FLOPs of a
step, and whether it fits the named accelerator's memory.  Above the devices one
process holds (:data:`jaxllm.cli.MAX_HOST_DEVICES`), the others are on stand-in processes
(:func:`jaxllm.cli.stand_in_processes`): the compile is the whole mesh's at any count.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time

if __name__ == "__main__":  # the device count must be fixed before jax is imported
    from jaxllm.cli import force_host_devices

    force_host_devices(sys.argv)  # this process's devices; the rest on stand-in processes (main)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jaxllm import cli, config, model  # noqa: E402
from jaxllm.data.tokenizers import KNOWN_VOCAB_SIZES  # noqa: E402
from jaxllm.model import attention  # noqa: E402
from jaxllm.parallel import collectives as comms  # noqa: E402
from jaxllm.parallel import schedules, sharding  # noqa: E402
from jaxllm.platform.hardware import CLUSTERS, DEVICES, GiB, named_cluster, named_device  # noqa: E402
from jaxllm.resolve import resolve  # noqa: E402
from jaxllm.runtime import flops, step_time  # noqa: E402
from jaxllm.runtime.run import Run  # noqa: E402


def parse_bytes(text: str) -> float:
    """``"80GiB"``, ``"80GB"``, ``"1.5e9"`` -> bytes. Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", text)
    if not m:
        raise ValueError(f"--device-memory={text!r}: give a size such as 80GiB or 80GB")
    unit = {"GiB": GiB, "GB": 1e9, "MiB": 2**20, "MB": 1e6, "TiB": 2**40, "TB": 1e12, None: 1}[m.group(2)]
    return float(m.group(1)) * unit


def memory_report(compiled) -> dict:
    """Per-device bytes of a compiled step from XLA's ``memory_analysis()``: ``{"argument",
    "output", "alias", "temp", "total"}``, ``total`` = arguments + temporaries + outputs not
    aliased to donated inputs."""
    mem = compiled.memory_analysis()
    return {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
            "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes,
            "total": mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes}


def resolved(spec: config.Config, num_devices: int, backend: str | None = None):
    """``spec`` resolved for a plan of ``num_devices`` devices on ``backend`` (:func:`plan`), reading no data:
    the vocabulary is ``model.vocab_size`` or the tokenizer's.  Raises ConfigError."""
    vocab = KNOWN_VOCAB_SIZES.get(spec.data.tokenizer)
    if not spec.model.vocab_size and vocab is None:
        raise config.ConfigError("model.vocab_size", 0, "the plan reads no data: set the vocabulary size")
    return resolve(spec, num_devices=num_devices, vocab_size=vocab, data_files=False, backend=backend)


def plan(spec: config.Config, num_devices: int, backend: str | None = None, collectives: bool = False) -> dict:
    """Compiles ``spec``'s train step for ``num_devices`` devices; returns per-device bytes and FLOPs.

    ``backend`` is the kind of machine planned for (``"cuda"``, ``"rocm"``; None: this one): it
    decides what ``model.dtype="auto"`` is (bfloat16 on GPUs) and which attention implementations
    the config may name (``auto`` is the GPU's); the step is compiled by this machine's XLA either
    way, on a GPU's plan with its flash attention's memory (the Pallas kernel interpreted,
    :func:`jaxllm.model.attention.lowering_target`): linear in the sequence, where this machine's
    ``xla`` attention holds the ``[seq, seq]`` scores.  A GPU's bfloat16 is compiled here as float16,
    its stand-in of the same bytes: XLA:CPU runs few operations in bfloat16 and widens their buffers
    to float32 around them (a scan's stacked layer inputs, all-gathered weights), which a GPU does not;
    float16 it runs as it is.  ``model.remat=offload`` keeps the layer inputs in host memory, which
    this machine's compile does not separate: :func:`offloaded_bytes` are taken off its total.

    The compile is the whole mesh's: with more devices than one process holds, the others are on stand-in
    processes (:func:`jaxllm.cli.stand_in_processes`, which ``python -m jaxllm.plan`` starts).

    Returns a dict: ``params, grads, opt_state, batch`` (bytes per device from the shardings),
    ``split`` (for each of ``params, grads, opt_state``: the mesh axes ``{name: size}`` its ``embed``
    dimension is split over, the ZeRO stage's rules table), ``temp`` (XLA's temporaries), ``total``
    (arguments + temporaries + outputs not aliased to donated inputs), ``host`` (:func:`offloaded_bytes`),
    ``device`` (``total - host``: what the verdict checks), ``model_flops`` (per step, all
    devices, :func:`jaxllm.runtime.flops.flops_per_step`), ``compile_s``, ``dtype`` (the compute dtype
    planned), ``pipeline`` (stages, virtual stages, microbatches, and the schedule's summary: bubble and
    activations in flight, :func:`jaxllm.parallel.schedules.summary`), ``mesh`` (``{axis: size}``),
    ``collectives`` (with ``collectives=True``: :func:`jaxllm.parallel.collectives.collectives`, else None).
    Raises:
      ConfigError: the config does not fit the mesh or the model, or this process sees fewer than
        ``num_devices`` devices.
    """
    cfg = resolved(spec, num_devices, backend)
    if num_devices > len(jax.devices()):
        raise config.ConfigError(
            "devices", num_devices, f"this process has {len(jax.devices())} devices to compile for (python -m "
            "jaxllm.plan makes any count: jaxllm.cli.stand_in_processes)")
    dtype = cfg.model.dtype
    if cfg.backend in attention.TARGET_FAMILY and dtype == "bfloat16":
        half = config.from_dict(cfg.to_dict())
        half.model.dtype = "float16"
        cfg = resolved(half, num_devices, backend)
    run = Run(cfg, devices=jax.devices()[:num_devices])
    batch = jax.ShapeDtypeStruct(cfg.batch_shape, "int32", sharding=run.batch_sharding)
    # a GPU's flash attention keeps memory linear in the sequence: planned with the interpreted kernel
    gpu = attention.lowering_target(cfg.backend, interpret=True) if cfg.backend in attention.TARGET_FAMILY \
        else contextlib.nullcontext()
    t0 = time.perf_counter()
    with gpu:
        compiled = run.train_step.lower(run.abstract_state, batch, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = memory_report(compiled)
    state = run.abstract_state
    grads = sharding.stored(run.logical_state["params"], sharding.grad_shardings(cfg, run.spec.axes, run.mesh))
    stage, host = cfg.parallel.zero_stage, offloaded_bytes(cfg, run)
    split = lambda zero: {a: run.mesh.shape[a] for a in sharding.rules(cfg, zero=zero)["embed"]  # noqa: E731
                          if run.mesh.shape[a] > 1}
    return {
        "split": {"params": split(stage >= 3), "grads": split(stage >= 2), "opt_state": split(stage >= 1)},
        "params": sharding.per_device_bytes(state["params"]),
        "grads": sharding.per_device_bytes(grads),
        "opt_state": sharding.per_device_bytes(state["opt_state"]),
        "batch": 2 * sharding.per_device_bytes(batch),
        "temp": mem["temp"],
        "total": mem["total"],
        "host": host,
        "device": mem["total"] - (host or 0),
        "model_flops": flops.flops_per_step(cfg),
        "compile_s": compile_s,
        "dtype": dtype if dtype == cfg.model.dtype else f"{dtype} (compiled as {cfg.model.dtype}, the same bytes)",
        "num_params": model.num_params(run.logical_state["params"]),
        "active_params": model.active_params(cfg.model, run.logical_state["params"]),
        "mesh": dict(run.mesh.shape),
        "pipeline": (cfg.stages, cfg.parallel.pipeline_virtual_stages, cfg.microbatches, schedules.summary(cfg)),
        "bubble": schedules.schedule_bubble(cfg) if cfg.stages > 1 else 0.0,
        "compute_dtype": dtype,
        "seq_tokens": cfg.train.global_batch_size * cfg.train.seq_length,
        "collectives": comms.collectives(compiled.as_text(), dict(run.mesh.shape)) if collectives else None,
    }


def offloaded_bytes(cfg, run: Run) -> int | None:
    """Bytes per device that ``model.remat=offload`` keeps in host memory: every layer's input, ``[rows,
    seq, embed]`` of one micro batch in the compute dtype, split as the residual stream
    (:data:`jaxllm.model.RESIDUAL`); 0 for the other policies (the ``*_offloaded`` ones' host bytes are
    counted on the device: an overestimate); None with pipeline stages, whose schedules keep several
    micro batches' inputs at once (not computed: counted on the device)."""
    if cfg.model.remat != "offload":
        return 0
    if cfg.stages > 1:
        return None
    shape = (cfg.batch_shape[1], cfg.train.seq_length, cfg.model.hidden_size)
    local = run.layout.sharding(model.RESIDUAL).shard_shape(shape)
    return cfg.model.num_layers * math.prod(local) * jnp.dtype(cfg.model.dtype).itemsize


def report(p: dict, device_memory: float | None, device_name: str | None) -> str:
    """The plan as text, with a fits / does-not-fit verdict against ``device_memory`` bytes."""
    gib = lambda b: f"{b / GiB:10.2f} GiB"  # noqa: E731
    over = lambda axes: ("   (embed over " + " x ".join(f"{a} {n}" for a, n in axes.items()) + ")") if axes else ""  # noqa: E731
    state = p["params"] + p["grads"] + p["opt_state"]
    lines = [
        f"mesh {p['mesh']}; {p['num_params'] / 1e9:.3f}B parameters"
        + (f" ({p['active_params'] / 1e9:.3f}B active per token)" if p["active_params"] != p["num_params"] else "")
        + f"; {p['dtype']}; compiled in {p['compile_s']:.1f} s",
        "per device:",
        f"  parameters            {gib(p['params'])}{over(p['split']['params'])}",
        f"  gradients             {gib(p['grads'])}{over(p['split']['grads'])}",
        f"  optimizer state       {gib(p['opt_state'])}{over(p['split']['opt_state'])}",
        f"  model state (sum)     {gib(state)}   "
        f"({state / p['num_params'] * math.prod(p['mesh'].values()):.1f} bytes/param x N / devices)",
        f"  XLA temporaries       {gib(p['temp'])}   (activations, gradients in flight, collectives' buffers)",
        f"  total (compiled)      {gib(p['total'])}",
        *([f"  offloaded to host     {gib(p['host'])}   (model.remat=offload: the layer inputs; this machine's "
           "compile holds them, a GPU's does not)", f"  total on the device   {gib(p['device'])}"]
          if p["host"] else []),
        *(["  offloaded to host     (with pipeline stages not computed: counted on the device above)"]
          if p["host"] is None else []),
        f"FLOPs per step: {p['model_flops'] / 1e15:.3f} PFLOP (all devices; jaxllm.runtime.flops.flops_per_step)",
    ]
    stages, virtual, microbatches, schedule = p["pipeline"]
    if stages > 1:
        lines.append(f"pipeline: {stages} stages x {virtual} virtual, {microbatches} microbatches, {schedule}")
    if device_memory:
        verdict = "FITS" if p["device"] <= device_memory else "DOES NOT FIT"
        lines.append(f"{verdict} in {device_name or ''} {device_memory / GiB:.1f} GiB "
                     f"({p['device'] / device_memory:.0%} used)")
    return "\n".join(lines)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    F = flags.FLAGS
    memory, backend = None, None  # no GPU named: plan for this machine's backend
    try:
        cluster = named_cluster(F.cluster) if F.cluster else None
        if cluster is not None:
            step_time.check_mfu(F.cluster, F.mfu)
            F.device = F.device or cluster.device
        if F.device:  # a GPU named: plan for its backend (model.dtype=auto is bfloat16 there)
            memory, backend = named_device(F.device)
        if F.device_memory:
            memory = parse_bytes(F.device_memory)
        if F.devices > F.devices_per_process:  # the config checked, then the processes started before the backend
            resolved(F.config, F.devices, backend or "cpu")  # (stand-in processes are CPU devices)
            cli.stand_in_processes(F.devices, F.devices_per_process)
        p = plan(F.config, F.devices, backend=backend, collectives=cluster is not None)
        estimate = step_time.estimate(p, cluster, F.mfu) if cluster is not None else None
    except (config.ConfigError, ValueError) as e:
        cli.fail(e, now=True)
    print(report(p, memory, F.device))
    if estimate is not None:
        print(step_time.report(estimate, p, F.cluster, cluster, F.mfu))
    cli.exit_now()  # XLA:CPU would join a thread per fake device


if __name__ == "__main__":
    cli.define_config_flag()
    flags.DEFINE_integer("devices", 1, "number of devices to plan for")
    flags.DEFINE_string("device", None, f"accelerator whose memory to check against: {', '.join(DEVICES)}")
    flags.DEFINE_string("device_memory", None, "memory per device, e.g. 80GiB (overrides --device)")
    flags.DEFINE_string("cluster", None, f"also model the step's time on a cluster: {', '.join(CLUSTERS)} "
                        "(its device is the --device; jaxllm/runtime/step_time.py)")
    flags.DEFINE_integer("devices_per_process", cli.MAX_HOST_DEVICES, "compile as processes of this many devices, this "
                         "one's and stand-ins for the others (cli.stand_in_processes); the default is XLA:CPU's most")
    flags.DEFINE_float("mfu", None, "with --cluster: the model FLOPs utilization of the compute, e.g. 0.4")
    app.run(main, flags_parser=cli.parse_flags)
