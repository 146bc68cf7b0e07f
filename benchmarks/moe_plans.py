"""Plans of mixture-of-experts models at scale under each token dispatcher, and the step-time model's ranking.

    python benchmarks/moe_plans.py --output=benchmarks/results/DATE-plans/moe_plans.jsonl   # runs every plan
    python benchmarks/moe_plans.py --output=FILE --table                                    # the table of FILE
    python benchmarks/moe_plans.py --output=FILE --models=mixtral -- --config.model.num_layers=2  # a few, smaller

Each case is one ``python -m jaxllm.plan ... --output=FILE`` (compiled on this machine, the other devices on
stand-in processes; no GPU): Mixtral-8x7B (8 experts, top 2) on 64 GPUs, a 64-expert and a 128-expert top-8
model of Qwen3-30B-A3B's shape (hidden 2048, 48 layers) on 16 and 64 GPUs, each with ``allgather``,
``alltoall`` and ``ragged`` (its exchange compiled here as a stand-in of its buffers: an all-to-all of the
routed copies, ``jaxllm.parallel.experts._planned``), modelled on Frontier and Polaris (``--cluster``, an MFU of
35% assumed for the compute), and the 128-expert model's memory on 16 H100s.  The table: each plan's bytes sent
per device per step over the ``expert`` axis (the dispatch: the compiled step's all-gathers and reduce-scatters,
or all-to-alls, forward, recomputed and backward), its memory against the device, and the model's step time.
"""

import argparse
import json
import math
import os
import subprocess
import sys

QWEN3 = ["--config=configs/llama.py:Qwen3-30B-A3B", "--config.data.tokenizer=byte",
         "--config.model.vocab_size=151936", "--config.model.remat=full"]
# --models name: (the table's label, the plan's flags, [(GPUs, layout flags)]): the experts over 8 ranks, the
# other devices fsdp (Mixtral: tensor 8)
MODELS = {
    "mixtral": ("Mixtral-8x7B (8 experts, top 2)",
                ["--config=configs/moe.py:Mixtral-8x7B", "--config.data.tokenizer=byte"],
                [(64, ["--config.mesh.expert=8", "--config.mesh.tensor=8"])]),
    "experts64": ("64 experts, top 8 (Qwen3-30B-A3B's shape)", [*QWEN3, "--config.model.num_experts=64"], []),
    "qwen3": ("Qwen3-30B-A3B (128 experts, top 8)", QWEN3, []),
}
for _, _, layouts in list(MODELS.values())[1:]:
    layouts += [(n, ["--config.mesh.expert=8", f"--config.mesh.fsdp={n // 8}", f"--config.train.global_batch_size={n}"])
                for n in (16, 64)]
TARGETS = [["--cluster=frontier", "--mfu=0.35"], ["--cluster=polaris", "--mfu=0.35"]]
DISPATCHERS = ("allgather", "alltoall", "ragged")


def commands(models, extra):
    """Every plan's command line (after ``python -m jaxllm.plan``) of the named ``models``, ``extra`` flags last,
    without ``--output``."""
    out = []
    for name in models:
        _, flags, layouts = MODELS[name]
        for n, layout in layouts:
            targets = TARGETS + ([["--device=H100"]] if name == "qwen3" and n == 16 else [])
            for target in targets:
                out += [[*flags, f"--devices={n}", *layout, f"--config.model.moe_token_dispatcher_type={d}", *target,
                         *extra] for d in DISPATCHERS]
    return out


def model_of(record) -> str:
    """The table's label of the model a record was planned from, with any flags added after ``--``."""
    given = [a for a in record["command"].split() if a.startswith("--config")]
    label, flags, _ = next(m for m in MODELS.values() if all(f in given for f in m[1])
                           and ("--config.model.num_experts=64" in given) == ("--config.model.num_experts=64" in m[1]))
    layout = ("--config.mesh.", "--config.train.global_batch_size=", "--config.model.moe_token_dispatcher_type=")
    return " ".join([label, *(a for a in given if a not in flags and a.startswith("--config.")
                              and not a.startswith(layout))])


def table(records) -> str:
    """The markdown table of the records: one row per model, GPUs and dispatcher."""
    rows = {}
    for r in records:
        key = (model_of(r), math.prod(r["mesh"].values()), r["dispatcher"])
        rows.setdefault(key, {})[(r["step_time"] or {}).get("cluster") or r["device_name"]] = r
    lines = ["| model | GPUs (mesh) | dispatcher | expert axis: GB sent per device per step | GiB per device "
             "of the device's (over: does not fit) | step-time model, Frontier | Polaris |",
             "|---|---|---|---|---|---|---|"]
    for (model, n, d), by in rows.items():
        any_r = next(iter(by.values()))
        mesh = " x ".join(f"{a} {s}" for a, s in any_r["mesh"].items() if s > 1)
        sent = any_r["collectives"].get("expert", {}).get("wire_bytes", 0) / 1e9
        fits = "; ".join(f"{r['device_name']} {r['device'] / 2**30:.1f} of {r['device_memory_bytes'] / 2**30:.1f}"
                         + ("" if r["fits"] else " (over)") for r in by.values())
        step = [f"{by[c]['step_time']['step']:.2f} s ({by[c]['step_time']['tokens_per_s']:,.0f} tokens/s)"
                if c in by else "" for c in ("frontier", "polaris")]
        lines.append(f"| {model} | {n} ({mesh}) | {d} | {sent:.1f} | {fits} | "
                     f"{step[0]} | {step[1]} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="the JSON lines file the plans are appended to")
    p.add_argument("--table", action="store_true", help="print the table of --output's records; plan nothing")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("extra", nargs="*", help="after --: flags added to every plan, e.g. --config.model.num_layers=2")
    args = p.parse_args()
    if not args.table:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        for cmd in commands(args.models.split(","), args.extra):
            print("python -m jaxllm.plan " + " ".join(cmd), flush=True)
            subprocess.run([sys.executable, "-m", "jaxllm.plan", *cmd, f"--output={args.output}"], check=True)
    with open(args.output, encoding="utf-8") as f:
        print(table([json.loads(line) for line in f]))


if __name__ == "__main__":
    main()
