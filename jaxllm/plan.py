"""Memory plan without the hardware: ``python -m jaxllm.plan --config=... --devices=N [--device=H100]``.

Compiles the training step ahead of time for N devices (fake CPU devices: the
same SPMD partitioning, nothing allocated) and prints per-device bytes of
parameters, gradients, optimizer state and XLA's temporaries, the FLOPs of a
step, and whether it fits the named accelerator's memory.  Above the devices one
process holds (:data:`jaxllm.cli.MAX_HOST_DEVICES`), the others are on stand-in processes
(:func:`jaxllm.cli.stand_in_processes`): the compile is the whole mesh's at any count.

For one NVIDIA GPU of :data:`jaxllm.platform.xla_gpu.SPECS` (``--device=H100``) with JAX's CUDA plugin
installed, the step is compiled by XLA:GPU for that GPU instead (no GPU needed:
:mod:`jaxllm.platform.xla_gpu`): the memory is XLA:GPU's, and the plan prints the program's kernels by
kind (GEMMs by library and dtype, cuDNN attention, fusions, copies, collectives).  ``--compiler`` picks.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import shlex
import sys
import time

if __name__ == "__main__":  # the device count must be fixed before jax is imported
    from jaxllm.cli import force_host_devices

    force_host_devices(sys.argv)  # this process's devices; the rest on stand-in processes (main)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags, logging  # noqa: E402

from jaxllm import cli, config  # noqa: E402
from jaxllm.analysis import collectives as comms  # noqa: E402
from jaxllm.analysis import gpu_time, step_time  # noqa: E402
from jaxllm.data.tokenizers import KNOWN_VOCAB_SIZES  # noqa: E402
from jaxllm.model import (  # noqa: E402
    attention,  # noqa: E402
    gpt,
    layers,
)
from jaxllm.parallel import schedules, sharding  # noqa: E402
from jaxllm.platform import xla_gpu  # noqa: E402
from jaxllm.platform.hardware import CLUSTERS, DEVICES, GiB, named_cluster, named_device  # noqa: E402
from jaxllm.resolve import resolve  # noqa: E402
from jaxllm.runtime import flops  # noqa: E402
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
    "output", "alias", "temp", "total", "host"}``, ``total`` = arguments + temporaries + outputs not
    aliased to donated inputs, in device memory; ``host``: the same sum in host memory (what a GPU
    program keeps there, ``model.remat=offload``; XLA:CPU's is 0)."""
    mem = compiled.memory_analysis()
    return {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
            "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes,
            "total": mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes,
            "host": mem.host_argument_size_in_bytes + mem.host_temp_size_in_bytes + mem.host_output_size_in_bytes
            - mem.host_alias_size_in_bytes}


def resolved(spec: config.Config, num_devices: int, backend: str | None = None):
    """``spec`` resolved for a plan of ``num_devices`` devices on ``backend`` (:func:`plan`), reading no data:
    the vocabulary is ``model.vocab_size`` or the tokenizer's.  Raises ConfigError."""
    vocab = KNOWN_VOCAB_SIZES.get(spec.data.tokenizer)
    if not spec.model.vocab_size and vocab is None:
        raise config.ConfigError("model.vocab_size", 0, "the plan reads no data: set the vocabulary size")
    return resolve(spec, num_devices=num_devices, vocab_size=vocab, data_files=False, backend=backend)


def plan(spec: config.Config, num_devices: int, backend: str | None = None, collectives: bool = False,
         gpu: str | None = None) -> dict:
    """Compiles ``spec``'s train step for ``num_devices`` devices; returns per-device bytes and FLOPs.

    ``gpu`` (a key of :data:`jaxllm.platform.xla_gpu.SPECS`; ``backend`` is then ``"cuda"``): compiled by
    XLA:GPU for that GPU (:func:`gpu_compile`), in bfloat16, attention as that GPU runs it; the GPU's own
    memory figures, and its program's kernels (``kernels``).  None: compiled by this machine's XLA, as follows.

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
    ``dispatcher`` (a mixture of experts' token dispatcher as it runs, ``auto`` resolved; None without
    experts), ``collectives`` (with ``collectives=True``: :func:`jaxllm.analysis.collectives.collectives`, else None),
    ``gpu`` (the GPU XLA:GPU compiled for, or None), ``kernels`` (with ``gpu``:
    :func:`jaxllm.platform.xla_gpu.kernels`, else None), ``gemm_loops`` (with ``gpu``: its loops of GEMMs whose
    trip count XLA does not know, :func:`jaxllm.platform.xla_gpu.gemm_loops`; else 0), ``cudnn_workspace`` (with
    ``gpu``: the estimate of :func:`jaxllm.platform.xla_gpu.cudnn_workspace`, counted in ``device``; else 0),
    ``gemm_workspace`` (with ``gpu``: the largest cuBLAS workspace, already in ``temp``; else 0), ``predicted`` (with
    ``gpu``: the step-time model of the program, :func:`jaxllm.analysis.gpu_time.predict`'s ``step_s``,
    ``categories``, ``launches``, ``category_launches``; else None).
    Raises:
      ConfigError: the config does not fit the mesh or the model, or this process sees fewer than
        ``num_devices`` devices; ``model.fp8`` on a GPU without FP8 matmuls.
    """
    cfg = resolved(spec, num_devices, "cuda" if gpu else backend)
    dtype = cfg.model.dtype
    run, compiled, compile_s = (gpu_compile(cfg, num_devices, gpu) if gpu is not None else
                                cpu_compile(cfg, num_devices, backend))
    hlo = compiled.as_text()
    mem = memory_report(compiled)
    state = run.abstract_state
    grads = sharding.stored(run.logical_state["params"], sharding.grad_shardings(cfg, run.spec.axes, run.mesh))
    tables, host = sharding.zero_tables(cfg), mem["host"] if gpu else offloaded_bytes(cfg, run)
    on_gpu = _gpu_figures(hlo, gpu, dict(run.mesh.shape))
    split = lambda table: {a: run.mesh.shape[a] for a in table["embed"] if run.mesh.shape[a] > 1}  # noqa: E731
    return {
        "split": {"params": split(tables.params), "grads": split(tables.grads), "opt_state": split(tables.opt_state)},
        "params": sharding.per_device_bytes(state["params"]),
        "grads": sharding.per_device_bytes(grads),
        "opt_state": sharding.per_device_bytes(state["opt_state"]),
        "batch": sum(sharding.per_device_bytes(a) for a in jax.tree.leaves(run.abstract_batch())),
        "temp": mem["temp"],
        "total": mem["total"],
        "host": host,
        "device": mem["total"] + on_gpu["cudnn_workspace"] - (0 if gpu else host or 0),
        "model_flops": flops.flops_per_step(cfg),
        "compile_s": compile_s,
        "dtype": dtype if dtype == run.cfg.model.dtype
        else f"{dtype} (compiled as {run.cfg.model.dtype}, the same bytes)",
        "num_params": gpt.num_params(run.logical_state["params"]),
        "active_params": gpt.active_params(cfg.model, run.logical_state["params"]),
        "dispatcher": cfg.model.moe_token_dispatcher_type if cfg.model.num_experts else None,
        "mesh": dict(run.mesh.shape),
        "pipeline": (cfg.stages, cfg.parallel.pipeline_virtual_stages, cfg.microbatches, schedules.summary(cfg)),
        "bubble": schedules.schedule_bubble(cfg) if cfg.stages > 1 else 0.0,
        "compute_dtype": dtype,
        "seq_tokens": cfg.train.global_batch_size * cfg.train.seq_length,
        "collectives": comms.collectives(hlo, dict(run.mesh.shape)) if collectives else None,
        **on_gpu,
    }


def _gpu_figures(hlo: str, gpu: str | None, mesh_shape: dict) -> dict:
    """:func:`plan`'s ``gpu``, ``kernels``, ``gemm_loops`` (:func:`jaxllm.platform.xla_gpu.gemm_loops`),
    ``cudnn_workspace`` (bytes), ``gemm_workspace`` (bytes) and ``predicted``
    (:func:`jaxllm.analysis.gpu_time.predict`, its ``kernels`` left out) of the optimized program ``hlo`` compiled
    for ``gpu`` over ``mesh_shape`` (None: not for a GPU, and none of them)."""
    predicted = (gpu_time.predict(gpu_time.census(hlo, mesh_shape), gpu_time.device(gpu), mesh_shape, deviceless=True,
                                  hlo_text=hlo) if gpu else None)
    return {"gpu": gpu, "kernels": xla_gpu.kernels(hlo) if gpu else None,
            "gemm_loops": xla_gpu.gemm_loops(hlo) if gpu else 0,
            "cudnn_workspace": xla_gpu.cudnn_workspace(hlo) if gpu else 0,
            "gemm_workspace": xla_gpu.gemm_workspace(hlo) if gpu else 0,
            "predicted": predicted}


def cpu_compile(cfg, num_devices: int, backend: str | None):
    """``cfg``'s train step compiled by this machine's XLA for ``num_devices`` of its devices: ``(Run, compiled,
    seconds)``.  For a GPU ``backend``, attention is the interpreted flash kernel (memory linear in the
    sequence, as the GPU's) and bfloat16 is compiled as float16 (:func:`plan`).  Raises ConfigError: fewer
    devices here."""
    if num_devices > len(jax.devices()):
        raise config.ConfigError(
            "devices", num_devices, f"this process has {len(jax.devices())} devices to compile for (python -m "
            "jaxllm.plan makes any count: jaxllm.cli.stand_in_processes)")
    if cfg.backend in attention.TARGET_FAMILY and cfg.model.dtype == "bfloat16":
        half = config.from_dict(cfg.to_dict())
        half.model.dtype = "float16"
        cfg = resolved(half, num_devices, backend)
    run = Run(cfg, devices=jax.devices()[:num_devices])
    # a GPU's flash attention keeps memory linear in the sequence: planned with the interpreted kernel
    target = attention.lowering_target(cfg.backend, interpret=True) if cfg.backend in attention.TARGET_FAMILY \
        else contextlib.nullcontext()
    t0 = time.perf_counter()
    with target:
        compiled = run.train_step.lower(run.abstract_state, *run.abstract_batch()).compile()
    return run, compiled, time.perf_counter() - t0


def without_persistent_cache() -> None:
    """JAX's persistent compilation cache off for this process, where it compiles for GPUs it does not have: JAX
    writes their programs, but reading one back needs that GPU ("PjRtCompiler must be constructed with a Client":
    a warning, and the program compiled again).  Call before the first compile (JAX decides once per process)."""
    jax.config.update("jax_enable_compilation_cache", False)


def gpu_compile(cfg, num_devices: int, gpu: str):
    """``cfg``'s train step compiled by XLA:GPU for ``num_devices`` GPUs ``gpu`` without them
    (:func:`jaxllm.platform.xla_gpu.devices`): ``(Run, compiled, seconds)``.  Attention is traced for that
    GPU (``attention.lowering_target``: ``auto`` is cuDNN's), the XLA flags are those a GPU run gets
    (:func:`jaxllm.platform.xla_gpu.compiler_options`, and ``XLA_FLAGS``).

    Raises:
      ConfigError: ``model.fp8`` on a GPU without FP8 matmuls (before Hopper).
    """
    arch = xla_gpu.SPECS[gpu].arch
    if cfg.model.fp8 and arch == "ampere":
        raise config.ConfigError("model.fp8", True, f"{gpu} has no FP8 matmuls (H100, H200 have); set model.fp8=False")
    run = Run(cfg, devices=xla_gpu.devices(gpu, num_devices))
    t0 = time.perf_counter()
    with attention.lowering_target("cuda", arch):
        lowered = run.train_step.lower(run.abstract_state, *run.abstract_batch())
    options = xla_gpu.compiler_options()
    try:
        with xla_gpu.deviceless_notes_dropped():
            compiled = lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        if "Block level fusion config is required" not in str(e):
            raise
        # jaxlib 0.10.2's XLA:GPU without autotuning: a Triton GEMM that the while loops' double buffering clones (the
        # layers written out inside the micro batches' loop, at some shapes) loses its tiles; compiled again without
        # the double buffering, which changed no measured step (an H200, 2026-11-27: docs/performance.md)
        compiled = lowered.compile(compiler_options={**options, "xla_gpu_enable_while_loop_double_buffering": False})
    return run, compiled, time.perf_counter() - t0


def offloaded_bytes(cfg, run: Run) -> int | None:
    """Bytes per device that ``model.remat=offload`` keeps in host memory: every layer's input, ``[rows,
    seq, embed]`` of one micro batch in the compute dtype, split as the residual stream
    (:data:`jaxllm.model.layers.RESIDUAL`); 0 for the other policies (the ``*_offloaded`` ones' host bytes are
    counted on the device: an overestimate); None with pipeline stages, whose schedules keep several
    micro batches' inputs at once (not computed: counted on the device)."""
    if cfg.model.remat != "offload":
        return 0
    if cfg.stages > 1:
        return None
    shape = (cfg.batch_shape[1], cfg.train.seq_length, cfg.model.hidden_size)
    local = run.layout.sharding(layers.RESIDUAL).shard_shape(shape)
    return cfg.model.num_layers * math.prod(local) * jnp.dtype(cfg.model.dtype).itemsize


def report(p: dict, device_memory: float | None, device_name: str | None) -> str:
    """The plan as text, with a fits / does-not-fit verdict against ``device_memory`` bytes; with XLA:GPU's
    compile (``p["gpu"]``) also the cuDNN workspace estimate and the program's kernels by kind."""
    gib = lambda b: f"{b / GiB:10.2f} GiB"  # noqa: E731
    over = lambda axes: ("   (embed over " + " x ".join(f"{a} {n}" for a, n in axes.items()) + ")") if axes else ""  # noqa: E731
    state = p["params"] + p["grads"] + p["opt_state"]
    compiler = f"compiled by XLA:GPU for {p['gpu']} (no GPU here)" if p["gpu"] else "compiled"
    lines = [
        f"mesh {p['mesh']}; {p['num_params'] / 1e9:.3f}B parameters"
        + (f" ({p['active_params'] / 1e9:.3f}B active per token)" if p["active_params"] != p["num_params"] else "")
        + f"; {p['dtype']}; {compiler} in {p['compile_s']:.1f} s",
        "per device:",
        f"  parameters            {gib(p['params'])}{over(p['split']['params'])}",
        f"  gradients             {gib(p['grads'])}{over(p['split']['grads'])}",
        f"  optimizer state       {gib(p['opt_state'])}{over(p['split']['opt_state'])}",
        f"  model state (sum)     {gib(state)}   "
        f"({state / p['num_params'] * math.prod(p['mesh'].values()):.1f} bytes/param x N / devices)",
        f"  XLA temporaries       {gib(p['temp'])}   (activations, gradients in flight, collectives' buffers"
        + (f"; cuBLAS workspaces, {p['gemm_workspace'] / 2**20:.0f} MiB the largest)" if p["gemm_workspace"] else ")"),
        f"  total (compiled)      {gib(p['total'])}",
        *([f"  cuDNN workspace       {gib(p['cudnn_workspace'])}   (estimate, not in XLA's figures: "
           "jaxllm.platform.xla_gpu.cudnn_workspace)", f"  total on the device   {gib(p['device'])}"]
          if p["cudnn_workspace"] else []),
        *([f"  offloaded to host     {gib(p['host'])}   (model.remat=offload: the layer inputs; "
           + ("XLA:GPU's host memory, not in the total)" if p["gpu"] else
              "this machine's compile holds them, a GPU's does not)"),
           *([] if p["gpu"] else [f"  total on the device   {gib(p['device'])}"])] if p["host"] else []),
        *(["  offloaded to host     (with pipeline stages not computed: counted on the device above)"]
          if p["host"] is None else []),
        f"FLOPs per step: {p['model_flops'] / 1e15:.3f} PFLOP (all devices; jaxllm.runtime.flops.flops_per_step)",
    ]
    if p["dispatcher"]:
        lines.append(f"experts' token dispatcher: {p['dispatcher']} (jaxllm/parallel/experts.py)")
    stages, virtual, microbatches, schedule = p["pipeline"]
    if stages > 1:
        lines.append(f"pipeline: {stages} stages x {virtual} virtual, {microbatches} microbatches, {schedule}")
    if device_memory:
        verdict = "FITS" if p["device"] <= device_memory else "DOES NOT FIT"
        lines.append(f"{verdict} in {device_name or ''} {device_memory / GiB:.1f} GiB "
                     f"({p['device'] / device_memory:.0%} used)")
    if p["kernels"]:
        lines += [f"kernels of the program (XLA:GPU for {p['gpu']}, without autotuning: on the GPU a Triton GEMM may "
                  "become a cuBLAS call):", xla_gpu.table(p["kernels"])]
    return "\n".join(lines)


def record(p: dict, estimate: dict | None, device: str | None, device_memory: float | None, argv: list[str]) -> dict:
    """The plan as one JSON record (``--output``): how it was made (``date``, ``command``, ``config_file``,
    ``overrides``, ``jax``, ``xla_flags``: the environment's ``XLA_FLAGS`` less the stand-ins' device count), the
    device's ``device_memory_bytes`` and ``fits``, :func:`plan`'s figures (bytes per device, FLOPs per step), its
    ``collectives`` by mesh axes joined by " x " (``ops``, ``wire_bytes`` sent per device per step, ``kinds``), with
    XLA:GPU's compile the step-time model's predictions (:func:`predicted_figures`: ``predicted_step_time_s``,
    ``predicted_tokens_per_sec``, ...) and, with ``--cluster``, ``step_time``: the model's seconds
    (:func:`jaxllm.analysis.step_time.estimate`), each axis's ``[seconds, bytes sent per device, off the node]``."""
    figures = {k: p[k] for k in ("mesh", "num_params", "active_params", "dtype", "dispatcher", "params", "grads",
                                 "opt_state", "batch", "temp", "total", "host", "device", "model_flops",
                                 "compile_s", "gpu", "seq_tokens")}
    traffic = {" x ".join(axes): {"ops": t.ops, "wire_bytes": t.wire, "kinds": t.kinds}
               for axes, t in (p["collectives"] or {}).items()}
    return {"date": datetime.date.today().isoformat(),
            "command": shlex.join(["python", "-m", "jaxllm.plan", *argv[1:]]),
            "config_file": cli.config_arg(argv) or "jaxllm/default_config.py",
            "overrides": [a for a in argv[1:] if a.startswith("--config.")], "jax": jax.__version__,
            "xla_flags": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                  if not f.startswith("--xla_force_host_platform_device_count")),
            "device_name": device, "device_memory_bytes": device_memory,
            "fits": p["device"] <= device_memory if device_memory else None, **figures, "collectives": traffic,
            **predicted_figures(p),
            "step_time": None if estimate is None else {
                **{k: estimate[k] for k in ("cluster", "mfu", "compute", "bubble", "step", "tokens_per_s",
                                     "tflops_per_device")},
                "comms": {" x ".join(axes): list(v) for axes, v in estimate["comms"].items()}}}


def predicted_figures(p: dict) -> dict:
    """:func:`record`'s keys of the GPU step-time model (:mod:`jaxllm.analysis.gpu_time`): ``predicted_step_time_s``,
    ``predicted_tokens_per_sec`` (the whole mesh's), ``predicted_tokens_per_sec_per_device``, ``predicted_mfu``,
    ``predicted_categories`` (seconds a step by the profile's category), ``communication_s`` and
    ``exposed_communication_s`` (the collectives' seconds a step, whole and left exposed by the schedule) and
    ``communication`` (by mesh axes: ``time_s``, ``hidden_s``, ``exposed_s``); None each without an XLA:GPU
    compile or where :func:`jaxllm.analysis.gpu_time.refusal` withholds the step (``prediction_refused``: why)."""
    pred = p["predicted"]
    keys = ("predicted_step_time_s", "predicted_tokens_per_sec", "predicted_tokens_per_sec_per_device",
            "predicted_mfu", "predicted_categories", "communication_s", "exposed_communication_s", "communication")
    devices = math.prod(p["mesh"].values())
    refused = pred and gpu_time.refusal(pred, p["model_flops"], devices, p["gpu"])
    if not pred or refused:
        return {**dict.fromkeys(keys), "prediction_refused": refused or None}
    peak = gpu_time.device(p["gpu"]).peaks["bf16"]
    tokens, mfu = p["seq_tokens"] / pred["step_s"], p["model_flops"] / pred["step_s"] / devices / peak
    values = (pred["step_s"], tokens, tokens / devices, mfu, pred["categories"], pred["communication_s"],
              pred["exposed_communication_s"], pred["communication"])
    return {**dict(zip(keys, values, strict=True)), "prediction_refused": None}


def gpu_target(device: str | None, backend: str | None, num_devices: int, compiler: str) -> tuple[str | None, str]:
    """The GPU that ``--compiler`` asks XLA:GPU to compile for, and a note when ``auto`` cannot: ``(gpu or None,
    note or "")``.  ``auto``: XLA:GPU for one NVIDIA GPU of :data:`jaxllm.platform.xla_gpu.SPECS` where this
    process can compile for it (:func:`jaxllm.platform.xla_gpu.unavailable`), else this machine's XLA (with
    more devices too: their XLA:GPU compile is ``--compiler=gpu``'s); ``gpu``: XLA:GPU or an error; ``cpu``:
    this machine's XLA.

    Raises:
      ValueError: ``--compiler=gpu`` where XLA:GPU cannot compile for ``device``.
    """
    if compiler == "cpu" or (compiler == "auto" and (backend != "cuda" or num_devices > 1)):
        return None, ""
    why = xla_gpu.unavailable(device) if device else f"name a GPU with --device ({', '.join(xla_gpu.SPECS)})"
    if why and compiler == "gpu":
        raise ValueError(f"--compiler=gpu: {why}")
    return (None, f"note: compiled by this machine's XLA with {device}'s memory: {why}") if why else (device, "")


@cli.stoppable("jaxllm.plan")
def _main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    F = flags.FLAGS
    memory, backend = None, None  # no GPU named: plan for this machine's backend
    with cli.usage_errors({ValueError: ""}, now=True):
        if F.output:
            cli.check_output("--output", F.output, directory=False)
        cluster = named_cluster(F.cluster) if F.cluster else None
        if cluster is not None:
            step_time.check_mfu(F.cluster, F.mfu)
            F.device = F.device or cluster.device
        if F.device and F.device != "cpu":  # a GPU named: plan for its backend (model.dtype=auto is bfloat16 there)
            memory, backend = named_device(F.device)
        if F.device_memory:
            memory = parse_bytes(F.device_memory)
        gpu, note = gpu_target(F.device, backend, F.devices, F.compiler)
        if gpu is not None:
            without_persistent_cache()
        if gpu is None and F.devices > F.devices_per_process:  # the config checked, then the processes started
            resolved(F.config, F.devices, backend or "cpu")  # before the backend (stand-ins are CPU devices)
            cli.stand_in_processes(F.devices, F.devices_per_process)
        p = plan(F.config, F.devices, backend=backend, collectives=cluster is not None or bool(F.output), gpu=gpu)
        estimate = step_time.estimate(p, cluster, F.mfu) if cluster is not None else None
        if estimate is not None:  # named in the record
            estimate.update(cluster=F.cluster, mfu=F.mfu)
    if note:
        print(note)
    print(report(p, memory, F.device))
    if p["predicted"]:
        print(gpu_time.report(p["predicted"], p["gpu"], p["seq_tokens"], p["model_flops"], F.devices))
    if estimate is not None:
        print(step_time.report(estimate, p, F.cluster, cluster, F.mfu))
    if F.output:
        os.makedirs(os.path.dirname(F.output) or ".", exist_ok=True)
        with open(F.output, "a", encoding="utf-8") as f:
            f.write(json.dumps(record(p, estimate, F.device, memory, sys.argv)) + "\n")
    cli.exit_now()  # XLA:CPU would join a thread per fake device


def define_flags(fv, argv) -> None:
    """``python -m jaxllm.plan``'s flags, in the ``FlagValues`` ``fv`` (``argv``: the command's arguments)."""
    cli.define_config_flag(argv, fv)
    flags.DEFINE_integer("devices", 1, "number of devices to plan for", flag_values=fv)
    flags.DEFINE_string("device", None, f"accelerator to plan for and check the memory of: {', '.join(DEVICES)}; "
                        "cpu (the default): this machine's", flag_values=fv)
    flags.DEFINE_enum("compiler", "auto", ["auto", "gpu", "cpu"], "who compiles the step: gpu, XLA:GPU for the "
                      f"--device ({', '.join(xla_gpu.SPECS)}; JAX's CUDA plugin installed, no GPU needed); cpu, this "
                      "machine's XLA (a GPU's memory figures, its flash attention interpreted); auto, gpu for one "
                      "such device where it can, else cpu", flag_values=fv)
    flags.DEFINE_string("device_memory", None, "memory per device, e.g. 80GiB (overrides --device)", flag_values=fv)
    flags.DEFINE_string("cluster", None, f"also model the step's time on a cluster: {', '.join(CLUSTERS)} "
                        "(its device is the --device; jaxllm/analysis/step_time.py)", flag_values=fv)
    flags.DEFINE_integer("devices_per_process", cli.MAX_HOST_DEVICES, "compile as processes of this many devices, this "
                         "one's and stand-ins for the others (cli.stand_in_processes); the default is XLA:CPU's most",
                         flag_values=fv)
    flags.DEFINE_float("mfu", None, "with --cluster: the model FLOPs utilization of the compute, e.g. 0.4",
                       flag_values=fv)
    flags.DEFINE_string("output", None, "append the plan to this file as one JSON line (plan.record), with the "
                        "compiled step's collectives by mesh axes", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxllm.plan ARGV``; with ``argv`` (a list) in this process, returning the exit status
    (:func:`jaxllm.cli.run_tool`)."""
    return cli.run_tool(_main, define_flags, argv)


if __name__ == "__main__":
    main()
