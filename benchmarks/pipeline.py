"""Pipeline schedules side by side: per-device memory and step time on fake CPU devices.

    python benchmarks/pipeline.py                       # p = 4 x data 2 on 8 CPU devices, m = 4, 8, 16, 32
    python benchmarks/pipeline.py --microbatches 4 --steps 1   # a quick look
    python benchmarks/pipeline.py --steps 0             # memory only (compiles, runs nothing)

For each microbatch count ``m`` and each schedule (gpipe, interleaved and interleaved_1f1b
with ``--virtual`` chunks per stage, 1f1b, zb_h1) it compiles the train step of a small GPT
(``--layers`` layers, float32, no remat) and prints one Markdown row: the schedule's bubble
and activations in flight per stage (:func:`jaxllm.parallel.schedules.stats`), XLA's per-device
temporaries (``Compiled.memory_analysis().temp_size_in_bytes``: activations kept for the
backward pass, gradients in flight, collective buffers) and their ratio to the same
schedule at the first ``m``, the whole executable's bytes, and the median step time of
``--steps`` steps after one warm-up step.  A first row per ``m`` runs the same batch
without pipeline (``data`` only, ``m`` accumulated micro batches) for reference.  The
load average is printed before and after: the step times mean little on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__":  # the device count must be fixed before jax is imported
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm import config, plan  # noqa: E402
from jaxllm.parallel import schedules  # noqa: E402
from jaxllm.resolve import resolve
from jaxllm.runtime.run import Run  # noqa: E402


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--data", type=int, default=2)
    p.add_argument("--virtual", type=int, default=2, help="chunks per stage of the interleaved schedules")
    p.add_argument("--microbatches", default="4,8,16,32")
    p.add_argument("--schedules", default="gpipe,interleaved,1f1b,interleaved_1f1b,zb_h1")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps (0: memory only)")
    return p.parse_args()


def measure(args, m, stages, schedule, virtual):
    """(temp bytes, total bytes, median step seconds or None) of one layout."""
    cfg = config.get_config()
    cfg.model.update(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, vocab_size=256,
                     dtype="float32")
    cfg.train.update(seq_length=args.seq, micro_batch_size=args.micro_batch,
                     global_batch_size=args.micro_batch * args.data * m, warmup_iters=1)
    cfg.mesh.update(pipeline=stages, data=args.data)
    cfg.parallel.update(pipeline_schedule=schedule, pipeline_virtual_stages=virtual)
    n = stages * args.data
    cfg = resolve(cfg, num_devices=n, data_files=False)
    run = Run(cfg, devices=jax.devices()[:n])
    tokens = np.random.default_rng(0).integers(0, 256, (cfg.train.global_batch_size, args.seq + 1), dtype=np.int32)
    batch = run.global_batch(tokens[:, :-1], tokens[:, 1:])
    state = run.initial_state()
    compiled = run.train_step.lower(state, *batch).compile()
    mem = plan.memory_report(compiled)
    times = []
    for _ in range(args.steps + 1 if args.steps else 0):
        t0 = time.perf_counter()
        state, metrics = compiled(state, *batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return mem["temp"], mem["total"], statistics.median(times[1:]) if times else None


def main():
    args = _parse()
    p, start = args.stages, time.perf_counter()
    print(f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro batch {args.micro_batch}, "
          f"float32; pipeline {p} x data {args.data} on {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"{os.cpu_count()} cores\n")
    print("| m | schedule | v | bubble | in flight per stage | temporaries MiB/device | x first m | "
          "executable MiB/device | step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    first = {}
    for m in map(int, args.microbatches.split(",")):
        rows = [("none (data only)", 1, 1)] + [
            (s, p, args.virtual if s.startswith("interleaved") else 1) for s in args.schedules.split(",")]
        for name, stages, v in rows:
            schedule = "gpipe" if stages == 1 else name
            temp, total, secs = measure(args, m, stages, schedule, v)
            st = schedules.stats(schedule, stages, v, m)
            bubble = f"{st.bubble:.1%}" if stages > 1 else "-"
            flight = "-" if stages == 1 else f"{st.in_flight}" + (f" + {st.deferred} awaiting W" if st.deferred else "")
            ratio = f"{temp / first.setdefault(name, temp):.2f}"
            step = "-" if secs is None else f"{secs:.2f}"
            print(f"| {m} | {name} | {v} | {bubble} | {flight} | {temp / 2**20:.1f} | {ratio} | {total / 2**20:.1f} "
                  f"| {step} |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    sys.exit(main())
