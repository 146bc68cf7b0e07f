"""Throughput benchmark: ``python -m jaxllm.bench --config=FILE.py[:KEY] [--config.S.K=V ...] [flags]``.

Compiles the training step of :class:`jaxllm.train.Run` (timed: compile time), runs
``--warmup`` steps that are not timed, then ``--steps`` timed steps, each ended by
reading its metrics back (as the training loop does every step), and reports
tokens/s, step time, model TFLOP/s per device, MFU and HFU (with the matmuls that
``model.remat`` recomputes: :func:`jaxllm.metrics.hardware_flops_per_step`), peak
memory per device and compile time.  One JSON line per benchmarked config is
appended to ``--output``.

Flags: ``--devices=N`` (CPU: N fake devices, set before jax starts; GPU: the first N;
default all), ``--steps`` (10), ``--warmup`` (2), ``--data=synthetic|real``
(synthetic: uniform random tokens, two batches alternated, no host work in the loop;
real: the config's data through the training loader, each next batch prepared while
the step runs, as ``jaxllm.train`` does), ``--workdir`` (where real data is
tokenized), ``--output`` (JSONL file), ``--compare="K=V,K=V;K=V"``: more configs,
each the base ``--config`` plus these overrides, benchmarked in the same process
after the base and printed side by side with their ratio to it.

Exit codes: 0 done; 2 a bad flag, config or data (one line); 1 anything unexpected.
"""

from __future__ import annotations

import os
import sys


if __name__ == "__main__":  # the CPU device count and the GPU settings must be fixed before jax starts a backend
    from jaxllm import gpu_env
    from jaxllm.plan import force_host_devices

    force_host_devices(sys.argv)
    _gpu = gpu_env.apply()  # the same GPU settings as training
    if _gpu.line():
        print(_gpu.line(), flush=True)

import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm import attention, config, metrics, model, plan  # noqa: E402
from jaxllm.data import DataError, Loader, TokenData  # noqa: E402

DATA_MODES = ("synthetic", "real")


# ---------------------------------------------------------------------------------------------
# Config overrides (--compare, jaxllm.tune)
# ---------------------------------------------------------------------------------------------


def _parse_value(key: str, text: str, old):
    if isinstance(old, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{key}={text!r}: give true or false")
    try:
        if isinstance(old, int):
            return int(text)
        if isinstance(old, float):
            return float(text)
    except ValueError:
        raise ValueError(f"{key}={text!r}: give a {type(old).__name__}") from None
    return text


def parse_overrides(spec: str) -> list[tuple[str, str]]:
    """``"mesh.data=4,model.remat=full"`` -> ``[("mesh.data", "4"), ("model.remat", "full")]``.

    Raises:
      ValueError: an item is not ``SECTION.KEY=VALUE``.
    """
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().removeprefix("--config.").removeprefix("config.")
        if not eq or key.count(".") != 1 or not value.strip():
            raise ValueError(f"--compare item {item!r}: write SECTION.KEY=VALUE, e.g. mesh.tensor=2")
        out.append((key, value.strip()))
    return out


def apply_overrides(cfg, overrides) -> ml_collections.ConfigDict:
    """A copy of ``cfg`` with ``[(SECTION.KEY, text value)]`` applied, each parsed as its key's type.

    Raises:
      ValueError: an unknown key or a value that does not parse as the key's type.
    """
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    for key, text in overrides:
        section, name = key.split(".")
        if section not in cfg or name not in cfg[section]:
            raise ValueError(f"{key}: no such config key")
        cfg[section][name] = _parse_value(key, text, cfg[section][name])
    return cfg


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def prepare(cfg, num_devices: int, *, data: str = "synthetic", workdir: str = "runs/bench"):
    """Validates ``cfg`` for ``num_devices`` and resolves it; returns ``(resolved cfg, TokenData or None)``.

    The data are read (tokenized into ``WORKDIR/data`` once) when ``data="real"`` or when
    the vocabulary cannot be known otherwise (``model.vocab_size=0`` with the char tokenizer).

    Raises:
      ConfigError: the config does not fit the mesh or the model, or an unavailable attention impl.
      DataError: the data cannot be read.
      ValueError: ``data`` is not synthetic or real.
    """
    if data not in DATA_MODES:
        raise ValueError(f"--data={data!r}: choose synthetic or real")
    config.validate(cfg, num_devices=num_devices)
    attention.check_config(cfg)
    tokens = None
    vocab = plan.TOKENIZER_VOCAB.get(cfg.data.tokenizer)
    if data == "real" or (not cfg.model.vocab_size and vocab is None):
        from jaxllm.train import data_dir  # noqa: PLC0415

        tokens = TokenData(data_dir(cfg, workdir))
        vocab = tokens.vocab_size
    cfg = config.resolved(cfg, vocab_size=vocab, num_devices=num_devices)
    if tokens is not None:
        tokens.check_vocab(cfg.model.vocab_size)
    return cfg, (tokens if data == "real" else None)


def benchmark(cfg, *, num_devices: int | None = None, steps: int = 10, warmup: int = 2, data=None,
              name: str = "") -> dict:
    """Compiles and times ``cfg``'s training step; returns one record (the JSON line).

    Args:
      cfg: a config resolved by :func:`prepare`.
      num_devices: the first N of ``jax.devices()`` (default: all).
      steps: timed steps (>= 1); warmup: untimed steps before them (>= 0).
      data: a :class:`jaxllm.data.TokenData` to feed real batches, or None for synthetic ones.
      name: a label stored in the record.
    Returns:
      A dict; times in seconds, throughput in tokens/s (all devices), ``tflops_per_device``
      and ``hardware_tflops_per_device`` in TFLOP/s (1e12 FLOP/s), ``mfu`` / ``hfu``
      fractions, memory in bytes per device: ``peak_memory_bytes`` with
      ``peak_memory_source`` (``memory_stats peak_bytes_in_use`` where the backend reports
      it, a process-lifetime maximum, else ``compiled memory_analysis``) and
      ``compiled_memory_bytes`` (always the compiled executable's total); ``step_times_s``:
      every timed step.
    Raises:
      ValueError: ``steps < 1`` or ``warmup < 0``.
    """
    from jaxllm.train import Run  # noqa: PLC0415

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}: need steps >= 1 and warmup >= 0")
    devices = jax.devices()[:num_devices] if num_devices else jax.devices()
    n = len(devices)
    t = cfg.train
    run = Run(cfg, devices=devices)
    state = run.initial_state()
    rows = run.process_rows()
    if data is not None:
        loader = Loader(data, seed=t.seed, global_batch_size=t.global_batch_size, seq_length=t.seq_length,
                        rows=rows)
        next_batch = lambda i: run.global_batch(*loader.train_batch(i))  # noqa: E731
    else:
        rng = np.random.default_rng(t.seed)
        fixed = []
        for _ in range(2):
            tok = rng.integers(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_length + 1), dtype=np.int32)
            fixed.append(run.global_batch(tok[rows, :-1], tok[rows, 1:]))
        next_batch = lambda i: fixed[i % 2]  # noqa: E731

    batch = next_batch(0)
    t0 = time.perf_counter()
    compiled = run.train_step.lower(state, *batch).compile()
    compile_s = time.perf_counter() - t0
    memory = plan.memory_report(compiled)
    peak, peak_source = metrics.peak_flops_per_device(devices[0], cfg.model.dtype)

    times, loss = [], float("nan")
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, m = compiled(state, *batch)
        batch = next_batch(i + 1)  # prepared while the step runs, as in the training loop
        loss = float(m["loss"])  # the step's end: its metrics are back on the host
        if i >= warmup:
            times.append(time.perf_counter() - start)

    step_time = float(np.mean(times))
    out = metrics.throughput(step_time, cfg, num_devices=n, peak_flops=peak)
    stats = devices[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak_mem, mem_source = int(stats["peak_bytes_in_use"]), "memory_stats peak_bytes_in_use"
    else:
        peak_mem, mem_source = memory["total"], "compiled memory_analysis"
    return {
        "name": name,
        "date": datetime.date.today().isoformat(),
        "platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": n,
        "mesh": dict(run.mesh.shape),
        "num_params": model.num_params(state["params"]),
        "global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size,
        "microbatches": config.grad_accum_steps(cfg), "seq_length": t.seq_length,
        "tokens_per_step": t.global_batch_size * t.seq_length,
        "remat": cfg.model.remat, "attention_impl": cfg.model.attention_impl, "dtype": cfg.model.dtype,
        "data": "real" if data is not None else "synthetic",
        "warmup": warmup, "steps": steps, "compile_s": compile_s,
        **out,
        "step_time_median_s": float(np.median(times)), "step_time_min_s": float(np.min(times)),
        "step_time_max_s": float(np.max(times)),
        "hardware_tflops_per_device": out["hfu"] * peak / 1e12,
        "model_flops_per_step": metrics.flops_per_step(cfg, recompute=False),
        "hardware_flops_per_step": metrics.hardware_flops_per_step(cfg),
        "peak_flops_per_device": peak, "peak_flops_source": peak_source,
        "peak_memory_bytes": peak_mem, "peak_memory_source": mem_source,
        "compiled_memory_bytes": memory["total"], "compiled_temp_bytes": memory["temp"],
        "final_loss": loss, "step_times_s": times,
        "jax": jax.__version__,
        "config": cfg.to_dict(),
    }


# ---------------------------------------------------------------------------------------------
# Report and CLI
# ---------------------------------------------------------------------------------------------


def _mesh_text(mesh: dict) -> str:
    return " ".join(f"{k}{v}" for k, v in mesh.items() if v > 1) or "1 device"


def table(records: list[dict]) -> str:
    """Records side by side (Markdown); the ratio column is tokens/s against the first record."""
    head = ("| config | mesh | tokens/s | vs first | s/step (median) | TFLOP/s/dev | MFU | HFU | "
            "peak mem/dev GiB | compile s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base = records[0]["tokens_per_sec"]
    for r in records:
        lines.append(f"| {r['name'] or 'base'} | {_mesh_text(r['mesh'])} | {r['tokens_per_sec']:,.0f} | "
                     f"{r['tokens_per_sec'] / base:.2f}x | {r['step_time_s']:.4g} ({r['step_time_median_s']:.4g}) | "
                     f"{r['tflops_per_device']:.4g} | {100 * r['mfu']:.1f}% | {100 * r['hfu']:.1f}% | "
                     f"{r['peak_memory_bytes'] / 2**30:.3f} | {r['compile_s']:.1f} |")
    sources = sorted({r["peak_memory_source"] for r in records})
    lines.append(f"\npeak memory: {', '.join(sources)}; peak FLOP/s: {records[0]['peak_flops_source']} "
                 f"= {records[0]['peak_flops_per_device'] / 1e12:.3g} TFLOP/s/device")
    return "\n".join(lines)


def main(argv):
    from absl import flags  # noqa: PLC0415

    F = flags.FLAGS
    if len(argv) > 1:
        _usage_error(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        if F.steps < 1:
            raise ValueError(f"--steps={F.steps}: must be >= 1")
        if F.warmup < 0:
            raise ValueError(f"--warmup={F.warmup}: must be >= 0")
        if F.devices < 0 or F.devices > len(jax.devices()):
            raise ValueError(f"--devices={F.devices}: this machine has {len(jax.devices())} "
                             f"{jax.devices()[0].platform} device(s) (0: all)")
        if F.data not in DATA_MODES:
            raise ValueError(f"--data={F.data!r}: choose synthetic or real")
        variants = [("", [])] + [(spec.strip(), parse_overrides(spec)) for spec in F.compare.split(";") if spec.strip()]
        n = F.devices or len(jax.devices())
        configs = [(name, prepare(apply_overrides(F.config, ov), n, data=F.data, workdir=F.workdir))
                   for name, ov in variants]
    except config.ConfigError as e:
        _usage_error(str(e))
    except DataError as e:
        _usage_error(f"data error: {e}")
    except ValueError as e:
        _usage_error(f"error: {e}")
    records = []
    if F.output:
        os.makedirs(os.path.dirname(os.path.abspath(F.output)), exist_ok=True)
    for name, (cfg, data) in configs:
        r = benchmark(cfg, num_devices=n, steps=F.steps, warmup=F.warmup, data=data, name=name)
        records.append(r)
        print(f"{name or 'base'}: {r['tokens_per_sec']:,.0f} tokens/s, {r['step_time_s']:.4g} s/step, "
              f"{r['tflops_per_device']:.4g} TFLOP/s/device, MFU {100 * r['mfu']:.2f}% HFU {100 * r['hfu']:.2f}%, "
              f"peak {r['peak_memory_bytes'] / 2**30:.3f} GiB/device ({r['peak_memory_source']}), "
              f"compiled in {r['compile_s']:.1f} s", flush=True)
        if F.output:
            with open(F.output, "a", encoding="utf-8") as f:
                f.write(json.dumps(r) + "\n")
    print(table(records))
    if F.output:
        print(f"wrote {len(records)} JSON line(s) to {F.output}")


def _usage_error(message: str):
    print(message, file=sys.stderr)
    sys.exit(2)


def parse_flags_exit_2(argv):
    """absl flag parsing where a bad flag is one line on stderr and exit status 2.

    ``--some-flag`` is accepted for ``--some_flag`` (not for ``--config.*`` overrides)."""
    from absl import flags  # noqa: PLC0415

    fixed = [argv[0]]
    for arg in argv[1:]:
        if arg.startswith("--") and not arg.startswith("--config"):
            flag, eq, value = arg[2:].partition("=")
            arg = "--" + flag.replace("-", "_") + eq + value
        fixed.append(arg)
    try:
        return flags.FLAGS(fixed)
    except (flags.Error, ValueError, KeyError, AttributeError) as e:
        _usage_error(f"error: {e}")


def define_config_flag():
    from ml_collections import config_flags  # noqa: PLC0415

    config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "config.py"),
                                    "config file, e.g. configs/shakespeare_char.py or configs/gpt3.py:GPT125M")


if __name__ == "__main__":
    from absl import app, flags, logging

    logging.set_verbosity(logging.WARNING)
    define_config_flag()
    flags.DEFINE_integer("devices", 0, "devices to run on (CPU: fake devices); 0: all")
    flags.DEFINE_integer("steps", 10, "timed steps")
    flags.DEFINE_integer("warmup", 2, "untimed steps after compilation")
    flags.DEFINE_string("data", "synthetic", "synthetic (random tokens) or real (the config's data)")
    flags.DEFINE_string("workdir", "runs/bench", "where real data is tokenized (WORKDIR/data)")
    flags.DEFINE_string("output", "runs/bench/bench.jsonl", "JSONL file; one line per benchmarked config is appended")
    flags.DEFINE_string("compare", "", "more configs: ';'-separated lists of ','-separated SECTION.KEY=VALUE "
                        "overrides of --config, e.g. 'mesh.data=4,mesh.tensor=2;model.remat=full'")
    app.run(main, flags_parser=parse_flags_exit_2)
