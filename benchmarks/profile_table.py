"""A recorded GPU step's device time by category, from its committed trace.

    python benchmarks/profile_table.py benchmarks/results/2026-11-26-h100/call2.jsonl:0 \\
        benchmarks/results/2026-11-26-h100/call2-GPT1_5B-full-micro4 [--steps=2]

The first argument is a ``jaxllm.bench`` record (a JSONL file and the line's index, from 0); the second the
trace that ``jaxllm.bench --profile`` wrote for it, as committed: ``PREFIX.perfetto_trace.json.gz`` (the
Perfetto trace) and ``PREFIX.step.hlo.txt.gz`` (the optimized program).  Prints
:func:`jaxllm.analysis.profile.summary` as Markdown, with the record's step time, device peak and the FLOPs its
config counts (:func:`jaxllm.runtime.flops.hardware_flops_by_kind`): the tables of docs/performance.md.
"""

from __future__ import annotations

import argparse
import gzip
import json

from jaxllm import config
from jaxllm.analysis import profile
from jaxllm.platform import hardware
from jaxllm.resolve import resolve
from jaxllm.runtime import flops


def table(record: dict, prefix: str, steps: int = 2) -> list[dict]:
    """:func:`jaxllm.analysis.profile.summary` of the trace ``prefix`` of ``record``'s run."""
    # resolved for the machine that ran it: the record's attention_impl (cudnn) is refused on this one
    version = record["platform_version"].lower()
    backend = "rocm" if "rocm" in version else "cuda" if "cuda" in version else record["platform"]
    cfg = resolve(config.from_dict(record["config"]), num_devices=record["devices"],
                  vocab_size=record["config"]["model"]["vocab_size"], data_files=False, backend=backend)
    with gzip.open(prefix + ".step.hlo.txt.gz", "rt", encoding="utf-8") as f:
        program = profile.program(f.read())
    runs = profile.kernels(prefix + ".perfetto_trace.json.gz")
    return profile.summary(runs, program, steps, record["step_time_median_s"], flops.hardware_flops_by_kind(cfg),
                           record["peak_flops_per_device"], hardware.memory_bandwidth(record["device_kind"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("record", help="FILE.jsonl:INDEX")
    p.add_argument("trace", help="the trace's prefix (PREFIX.perfetto_trace.json.gz, PREFIX.step.hlo.txt.gz)")
    p.add_argument("--steps", type=int, default=2, help="steps the trace holds (jaxllm.bench --profile_steps)")
    a = p.parse_args(argv)
    path, _, index = a.record.rpartition(":")
    with open(path, encoding="utf-8") as f:
        record = json.loads(f.read().splitlines()[int(index)])
    print(f"{record['device_kind']}, {record['date']}: {record['command']}")
    print(profile.markdown(table(record, a.trace, a.steps)))


if __name__ == "__main__":
    main()
