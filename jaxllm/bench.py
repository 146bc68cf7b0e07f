"""Throughput benchmark: ``python -m jaxllm.bench --config=FILE.py[:KEY] [--config.S.K=V ...] [flags]``.

Compiles the training step of :class:`jaxllm.runtime.run.Run` (timed: compile time), runs
``--warmup`` steps that are not timed, then ``--steps`` timed steps, each ended by
reading its metrics back (as the training loop does every step), and reports
tokens/s, step time, model TFLOP/s per device, MFU and HFU (with the matmuls that
``model.remat`` recomputes: :func:`jaxllm.runtime.flops.hardware_flops_per_step`), peak
memory per device and compile time.  One JSON line per benchmarked config is
appended to ``--output``.

Flags: ``--devices=N`` (CPU: N fake devices, set before jax starts; GPU: the first N;
default all), ``--steps`` (10), ``--warmup`` (2), ``--data=synthetic|real``
(synthetic: uniform random tokens, two batches alternated, no host work in the loop;
real: the config's data through the training loader, each next batch prepared while
the step runs, as ``jaxllm.train`` does), ``--workdir`` (where real data is
tokenized), ``--output`` (JSONL file), ``--compare="K=V,K=V;K=V"``: more configs,
each the base ``--config`` plus these overrides, printed side by side with their ratio to
the base; each config (the base too) then runs in a process of its own, one after another, so
that each record's peak memory is its own (JAX's ``peak_bytes_in_use`` is a maximum over the
process's life).  ``--profile=DIR``: after the timed steps, ``--profile_steps`` more under the
JAX profiler (the trace in ``DIR``, TensorBoard/XProf's format) and the device time by
category (:mod:`jaxllm.analysis.profile`; GPUs: CPU traces hold no kernels), in the
record as ``profile``.

Exit codes: 0 done; 2 a bad flag, config or data (one line); 1 anything unexpected.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the CPU device count and the GPU settings must be fixed before jax starts a backend
    from jaxllm.cli import force_host_devices
    from jaxllm.platform import gpu_env, host_memory

    force_host_devices(sys.argv)
    _gpu = gpu_env.apply()  # the same GPU settings as training
    host_memory.keep_freed_memory()  # and the same host allocator on CPUs
    if _gpu.line():
        print(_gpu.line(), flush=True)

import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm import cli, config, plan  # noqa: E402
from jaxllm.analysis import profile  # noqa: E402
from jaxllm.data.loader import Batches, Data  # noqa: E402
from jaxllm.data.tokenizers import KNOWN_VOCAB_SIZES  # noqa: E402
from jaxllm.model import gpt  # noqa: E402
from jaxllm.parallel import schedules  # noqa: E402
from jaxllm.platform import hardware  # noqa: E402
from jaxllm.resolve import resolve  # noqa: E402
from jaxllm.runtime import flops  # noqa: E402
from jaxllm.runtime.run import Run  # noqa: E402

DATA_MODES = ("synthetic", "real")


def with_overrides(spec: config.Config, overrides: str) -> config.Config:
    """A copy of ``spec`` with ``"SECTION.KEY=VALUE,..."`` applied, each value parsed as its key's type.

    Raises:
      ConfigError: an item that is not ``SECTION.KEY=VALUE``, an unknown key or a value of the wrong type.
    """
    spec = copy.deepcopy(spec)
    for item in filter(None, (x.strip() for x in overrides.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().removeprefix("--config.").removeprefix("config.")
        if not eq or not value.strip():
            raise config.ConfigError(key, value, "write SECTION.KEY=VALUE, e.g. mesh.tensor=2")
        config.override(spec, key, value.strip())
    return spec


def prepare(spec: config.Config, num_devices: int, *, data: str = "synthetic", workdir: str = "runs/bench"):
    """Resolves ``spec`` for ``num_devices``; returns ``(resolved config, Data or None)``.

    The data are read (tokenized into ``WORKDIR/data`` once) when ``data="real"`` or when
    the vocabulary cannot be known otherwise (``model.vocab_size=0`` with the char tokenizer).

    Raises:
      ConfigError: the config does not fit the mesh or the model, or an unavailable attention impl; a
        ``workdir`` that cannot be written where the data are read.
      DataError: the data cannot be read.
      ValueError: ``data`` is not synthetic or real.
    """
    if data not in DATA_MODES:
        raise ValueError(f"--data={data!r}: choose synthetic or real")
    vocab = KNOWN_VOCAB_SIZES.get(spec.data.tokenizer)
    read = data == "real" or (not spec.model.vocab_size and vocab is None)
    resolve(spec, num_devices=num_devices, data_files=read)  # every config error before the data is read
    tokens = None
    if read:
        cli.check_output("--workdir", workdir)  # the data's tokens and sample indices go there
        tokens = Data(spec, workdir, splits=("train",))
        vocab = tokens.vocab_size
    cfg = resolve(spec, num_devices=num_devices, vocab_size=vocab, data_files=read)
    return cfg, (tokens if data == "real" else None)


def benchmark(cfg, *, num_devices: int | None = None, steps: int = 10, warmup: int = 2, data=None,
              name: str = "", profile_dir: str = "", profile_steps: int = 2) -> dict:
    """Compiles and times ``cfg``'s training step; returns one record (the JSON line).

    Args:
      cfg: a config resolved by :func:`prepare`.
      num_devices: the first N of ``jax.devices()`` (default: all).
      steps: timed steps (>= 1); warmup: untimed steps before them (>= 0).
      data: a :class:`jaxllm.data.loader.Data` to feed real batches, or None for synthetic ones.
      name: a label stored in the record.
      profile_dir: when set, ``profile_steps`` more steps after the timed ones under the JAX profiler,
        written there; the record's ``profile`` is then :func:`jaxllm.analysis.profile.summary` of them
        (None on a CPU), ``profile_trace`` the trace's folder.
    Returns:
      A dict; times in seconds, throughput in tokens/s (all devices), ``tflops_per_device``
      and ``hardware_tflops_per_device`` in TFLOP/s (1e12 FLOP/s), ``mfu`` / ``hfu``
      fractions, memory in bytes per device: ``peak_memory_bytes`` with
      ``peak_memory_source`` (``memory_stats peak_bytes_in_use`` where the backend reports
      it, a process-lifetime maximum, else ``compiled memory_analysis``) and
      ``compiled_memory_bytes`` (always the compiled executable's total); ``step_times_s``:
      every timed step; ``pipeline_schedule`` (None without pipeline), ``pipeline_bubble``,
      ``pipeline_in_flight``, ``pipeline_awaiting_w`` (:func:`jaxllm.parallel.schedules.stats`).
    Raises:
      ValueError: ``steps < 1`` or ``warmup < 0``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}: need steps >= 1 and warmup >= 0")
    devices = jax.devices()[:num_devices] if num_devices else jax.devices()
    n = len(devices)
    t = cfg.train
    run = Run(cfg, devices=devices)
    state = run.initial_state()
    next_batch = _batches(cfg, run, data)
    batch = next_batch(0)
    t0 = time.perf_counter()
    compiled = run.train_step.lower(state, *batch).compile()
    compile_s = time.perf_counter() - t0
    memory = plan.memory_report(compiled)
    peak, peak_source = hardware.peak_flops_per_device(devices[0], cfg.model.dtype)
    state, batch, times, loss = _timed(compiled, state, batch, next_batch, warmup, steps)

    profiled = {}
    if profile_dir:
        held = [state]

        def one_step():  # the state is donated: each step takes the last one's
            held[0], metrics = compiled(held[0], *batch)
            return float(metrics["loss"])

        profiled = _profile(one_step, profile_steps, profile_dir, float(np.median(times)), compiled, cfg,
                            devices[0], peak)
    schedule = schedules.schedule_stats(cfg)
    return {
        "name": name,
        "date": datetime.date.today().isoformat(),
        "platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": n,
        "mesh": dict(run.mesh.shape),
        "num_params": gpt.num_params(run.logical_state["params"]),
        "active_params": gpt.active_params(cfg.model, run.logical_state["params"]),
        "global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size,
        "microbatches": cfg.microbatches, "seq_length": t.seq_length,
        "tokens_per_step": t.global_batch_size * t.seq_length,
        "remat": cfg.model.remat, "attention_impl": cfg.model.attention_impl, "dtype": cfg.model.dtype,
        "pipeline_schedule": cfg.parallel.pipeline_schedule if cfg.stages > 1 else None,
        "pipeline_bubble": schedule.bubble, "pipeline_in_flight": schedule.in_flight,
        "pipeline_awaiting_w": schedule.deferred,
        "data": "real" if data is not None else "synthetic",
        "warmup": warmup, "steps": steps, "compile_s": compile_s,
        **flops.step_figures(times, cfg, num_devices=n, peak_flops=peak),
        "peak_flops_per_device": peak, "peak_flops_source": peak_source,
        **_peak_memory(devices[0], memory),
        "compiled_memory_bytes": memory["total"], "compiled_temp_bytes": memory["temp"],
        "final_loss": loss, "step_times_s": times,
        "fp8": cfg.model.fp8,
        **_software(),
        "config": cfg.to_dict(),
        **profiled,
    }


def _batches(cfg, run, data):
    """``i -> (inputs, targets)`` of step ``i`` as the train step takes them: ``data``'s batches, or two
    fixed random ones in turn (seeded by ``train.seed``) without data."""
    t, rows = cfg.train, run.process_rows()
    if data is not None:
        loader = Batches(data, rows=rows)
        return lambda i: run.global_batch(*loader.train_batch(i))
    rng = np.random.default_rng(t.seed)
    fixed = []
    for _ in range(2):
        tok = rng.integers(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_length + 1), dtype=np.int32)
        fixed.append(run.global_batch(tok[rows, :-1], tok[rows, 1:]))
    return lambda i: fixed[i % 2]


def _timed(compiled, state, batch, next_batch, warmup: int, steps: int):
    """Runs ``warmup + steps`` steps; returns ``(state, next batch, seconds of each timed step, last loss)``."""
    times, loss = [], float("nan")
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, m = compiled(state, *batch)
        batch = next_batch(i + 1)  # prepared while the step runs, as in the training loop
        loss = float(m["loss"])  # the step's end: its metrics are back on the host
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return state, batch, times, loss


def _peak_memory(device, memory: dict) -> dict:
    """The record's peak bytes per device: the backend's process-lifetime maximum where it reports one, else
    the compiled program's total (``memory``: :func:`jaxllm.plan.memory_report`)."""
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return {"peak_memory_bytes": int(stats["peak_bytes_in_use"]),
                "peak_memory_source": "memory_stats peak_bytes_in_use"}
    return {"peak_memory_bytes": memory["total"], "peak_memory_source": "compiled memory_analysis"}


def _software() -> dict:
    """The record's XLA flags and versions."""
    return {"xla_flags": os.environ.get("XLA_FLAGS", ""),  # jaxllm's GPU settings and the user's
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform_version": jax.extend.backend.get_backend().platform_version}  # CUDA / ROCm versions on GPUs


def _profile(step, steps: int, logdir: str, step_time_s: float, compiled, cfg, device, peak_flops: float) -> dict:
    """``profile_trace`` (the trace's folder, with the optimized program as ``step.hlo.txt``) and ``profile``
    (:func:`jaxllm.analysis.profile.summary`, None for a CPU's trace) of ``steps`` calls of ``step``."""
    folder = profile.capture(step, steps, logdir)
    hlo = compiled.as_text()
    with open(os.path.join(folder, "step.hlo.txt"), "w", encoding="utf-8") as f:
        f.write(hlo)  # the program the trace's kernels are found in
    runs = profile.kernels(os.path.join(folder, "perfetto_trace.json.gz"))
    bandwidth = hardware.memory_bandwidth(device.device_kind) if device.platform != "cpu" else None
    table = profile.summary(runs, profile.program(hlo), steps, step_time_s, flops.hardware_flops_by_kind(cfg),
                            peak_flops, bandwidth)
    if not table:
        print(f"profile: trace in {folder}; it holds no device kernels (XLA:CPU's operations are not traced)",
              flush=True)
    return {"profile_trace": folder, "profile": table or None}


# ---------------------------------------------------------------------------------------------
# Report and CLI
# ---------------------------------------------------------------------------------------------


def _mesh_text(r: dict) -> str:
    """``"pipeline4 data2 (1f1b, bubble 27.3%, 7 in flight)"``: the mesh axes > 1 and the pipeline schedule."""
    text = " ".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    if r.get("pipeline_schedule"):
        text += (f" ({r['pipeline_schedule']}, bubble {r['pipeline_bubble']:.1%}, {r['pipeline_in_flight']} in flight"
                 + (f" + {r['pipeline_awaiting_w']} awaiting W)" if r["pipeline_awaiting_w"] else ")"))
    return text


def table(records: list[dict]) -> str:
    """Records side by side (Markdown); the ratio column is tokens/s against the first record that ran
    (a record with an ``error``, e.g. out of memory, is a row saying so)."""
    head = ("| config | mesh | tokens/s | vs first | s/step (median) | TFLOP/s/dev | MFU | HFU | "
            "peak mem/dev GiB | compile s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ran = [r for r in records if "error" not in r]
    if not ran:
        return "\n".join(lines + [f"| {r['name'] or 'base'} | {r['error']} |" for r in records])
    base = ran[0]["tokens_per_sec"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['name'] or 'base'} | {r['error']} |" + " |" * 8)
            continue
        lines.append(f"| {r['name'] or 'base'} | {_mesh_text(r)} | {r['tokens_per_sec']:,.0f} | "
                     f"{r['tokens_per_sec'] / base:.2f}x | {r['step_time_s']:.4g} ({r['step_time_median_s']:.4g}) | "
                     f"{r['tflops_per_device']:.4g} | {100 * r['mfu']:.1f}% | {100 * r['hfu']:.1f}% | "
                     f"{r['peak_memory_bytes'] / 2**30:.3f} | {r['compile_s']:.1f} |")
    sources = sorted({r["peak_memory_source"] for r in ran})
    lines.append(f"\npeak memory: {', '.join(sources)}; peak FLOP/s: {ran[0]['peak_flops_source']} "
                 f"= {ran[0]['peak_flops_per_device'] / 1e12:.3g} TFLOP/s/device")
    return "\n".join(lines)


def _variant_flags(name: str) -> list[str]:
    """``"model.remat=full,train.micro_batch_size=8"`` -> ``--config.model.remat=full --config.train...``."""
    items = (o.strip().removeprefix("--config.").removeprefix("config.") for o in name.split(","))
    return [f"--config.{o}" for o in items if o]


def _own_flags() -> list[str]:
    """This command's flags without ``--compare`` (what each variant's own process is given)."""
    return [a for a in sys.argv[1:] if not a.startswith(("--compare=", "--nocompare"))]


def _summary_line(r: dict) -> str:
    return (f"{r['name'] or 'base'}: {r['tokens_per_sec']:,.0f} tokens/s, {r['step_time_s']:.4g} s/step, "
            f"{r['tflops_per_device']:.4g} TFLOP/s/device, MFU {100 * r['mfu']:.2f}% HFU {100 * r['hfu']:.2f}%, "
            f"peak {r['peak_memory_bytes'] / 2**30:.3f} GiB/device ({r['peak_memory_source']}), "
            f"compiled in {r['compile_s']:.1f} s")


def run_here(name: str, cfg, data, F, n: int) -> dict:
    """One config benchmarked in this process: its record, or ``{"name", "error": "out of memory"}``."""
    try:
        r = benchmark(cfg, num_devices=n, steps=F.steps, warmup=F.warmup, data=data, name=name,
                      profile_dir=F.profile, profile_steps=F.profile_steps)
    except jax.errors.JaxRuntimeError as e:  # out of memory is a result (a row saying so)
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"{name or 'base'}: out of memory ({str(e).splitlines()[0][:200]})", flush=True)
        return {"name": name, "error": "out of memory"}
    # how it was run: the command, the config file[:key] and the overrides given (the variant's last)
    given = [a for a in sys.argv[1:] if a.startswith("--config.")] + _variant_flags(name)
    r.update(command=shlex.join(["python", "-m", "jaxllm.bench", *_own_flags(), *_variant_flags(name)]),
             config_file=cli.config_arg(sys.argv) or "jaxllm/default_config.py", overrides=given)
    print(_summary_line(r), flush=True)
    return r


def run_apart(name: str, F) -> dict:
    """One ``--compare`` config in a process of its own (its own peak memory): its record, or
    ``{"name", "error"}`` with the process's last words."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.jsonl")
        flags_ = [a for a in _own_flags() if not a.startswith(("--output=", "--profile="))]
        folder = re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "base"
        profile_dir = [f"--profile={os.path.join(F.profile, folder)}"] if F.profile else []
        cmd = [sys.executable, "-m", "jaxllm.bench", *flags_, *_variant_flags(name), f"--output={out}", *profile_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        for line in proc.stdout.splitlines():  # its progress, without its one-row table
            if not line.startswith(("|", "peak memory:", "wrote ", "device time by")) and line.strip():
                print(line.replace("base:", f"{name or 'base'}:", 1), flush=True)
        if proc.returncode == 0 and os.path.exists(out):
            r = json.loads(open(out, encoding="utf-8").read().splitlines()[-1])
            r.update(name=name, command=shlex.join(["python", "-m", "jaxllm.bench", *_own_flags(),
                                                    *_variant_flags(name)]))
            return r
    words = "out of memory" if "out of memory" in proc.stdout else (proc.stderr.strip().splitlines() or ["?"])[-1]
    print(f"{name or 'base'}: failed ({words[:200]})", file=sys.stderr, flush=True)
    return {"name": name, "error": words[:200]}


@cli.stoppable("jaxllm.bench", "the configs measured before it are in --output")
def _main(argv):
    from absl import flags, logging  # noqa: PLC0415

    logging.set_verbosity(logging.WARNING)
    F = flags.FLAGS
    if len(argv) > 1:
        cli.fail(f"error: unexpected arguments: {' '.join(argv[1:])}")
    with cli.usage_errors({ValueError: "error: "}):
        if F.steps < 1:
            raise ValueError(f"--steps={F.steps}: must be >= 1")
        if F.warmup < 0 or F.profile_steps < 1:
            raise ValueError(f"--warmup={F.warmup}, --profile_steps={F.profile_steps}: need >= 0 and >= 1")
        if F.devices < 0 or F.devices > len(jax.devices()):
            raise ValueError(f"--devices={F.devices}: this machine has {len(jax.devices())} "
                             f"{jax.devices()[0].platform} device(s) (0: all)")
        if F.data not in DATA_MODES:
            raise ValueError(f"--data={F.data!r}: choose synthetic or real")
        for flag, path, directory in (("--output", F.output, False), ("--profile", F.profile, True)):
            if path:  # what it writes, before any config is compiled (--workdir: by prepare, where it is used)
                cli.check_output(flag, path, directory=directory)
        variants = ["", *(v.strip() for v in F.compare.split(";") if v.strip())]
        n = F.devices or len(jax.devices())
        configs = [(name, prepare(with_overrides(F.config, name), n, data=F.data, workdir=F.workdir))
                   for name in variants]  # every variant's config checked before any runs
    if F.output:
        os.makedirs(os.path.dirname(os.path.abspath(F.output)), exist_ok=True)
    records = []
    for name, (cfg, data) in configs:
        r = run_here(name, cfg, data, F, n) if len(configs) == 1 else run_apart(name, F)
        records.append(r)
        if r.get("profile"):
            print(f"{name or 'base'}: device time by category ({F.profile_steps} profiled steps, trace "
                  f"{r['profile_trace']}):\n{profile.markdown(r['profile'])}", flush=True)
        if F.output and "error" not in r:
            with open(F.output, "a", encoding="utf-8") as f:
                f.write(json.dumps(r) + "\n")
    print(table(records))
    if F.output:
        print(f"wrote {sum('error' not in r for r in records)} JSON line(s) to {F.output}")
    if all("error" in r for r in records):
        sys.exit(1)


def define_flags(fv, argv) -> None:
    """``python -m jaxllm.bench``'s flags, in the ``FlagValues`` ``fv`` (``argv``: the command's arguments)."""
    from absl import flags  # noqa: PLC0415

    cli.define_config_flag(argv, fv)
    flags.DEFINE_integer("devices", 0, "devices to run on (CPU: fake devices); 0: all", flag_values=fv)
    flags.DEFINE_integer("steps", 10, "timed steps", flag_values=fv)
    flags.DEFINE_integer("warmup", 2, "untimed steps after compilation", flag_values=fv)
    flags.DEFINE_string("data", "synthetic", "synthetic (random tokens) or real (the config's data)", flag_values=fv)
    flags.DEFINE_string("workdir", "runs/bench", "where real data is tokenized (WORKDIR/data)", flag_values=fv)
    flags.DEFINE_string("output", "runs/bench/bench.jsonl", "JSONL file; one line per benchmarked config is appended",
                        flag_values=fv)
    flags.DEFINE_string("compare", "", "more configs: ';'-separated lists of ','-separated SECTION.KEY=VALUE "
                        "overrides of --config, e.g. 'mesh.data=4,mesh.tensor=2;model.remat=full' (each config "
                        "then runs in a process of its own)", flag_values=fv)
    flags.DEFINE_string("profile", "", "a folder: profile steps after the timed ones, write the trace there and "
                        "print the device time by category (GPUs)", flag_values=fv)
    flags.DEFINE_integer("profile_steps", 2, "steps profiled with --profile", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxllm.bench ARGV``; with ``argv`` (a list) in this process, returning the exit status
    (:func:`jaxllm.cli.run_tool`)."""
    return cli.run_tool(_main, define_flags, argv)


if __name__ == "__main__":
    main()
