"""The longest sequence whose compiled per-device memory fits a budget, per sequence-parallel size and
``parallel.sequence_impl``, from ``jaxllm.plan``.

    python benchmarks/sequence_memory.py [--config=configs/gpt3.py:GPT125M] [--budget=4] [-- --config.X=Y ...]
    python benchmarks/sequence_memory.py --config=configs/long_context.py:DS4Science --sizes=32 \\
        --impls=ulysses,ring --device=A100-40GB --start=65536 --step=65536

Each point is one ``python -m jaxllm.plan --devices=N --config.mesh.sequence=N`` run (fake CPU
devices: the compiled program's memory, nothing allocated), batch 1.  Lengths double from
``--start`` (or grow by ``--step`` tokens) until the compiled total per device exceeds the budget:
``--budget`` GiB (default 4, or with ``--device=NAME`` that GPU's memory); ``--device`` plans for
that GPU (bfloat16, the flash attention's memory).  Prints a Markdown table: the longest length
that fits and its compiled total.
"""

import argparse
import re
import subprocess
import sys

GiB = 2**30


def total_gib(config, n, impl, seq, extra):
    """The compiled total per device (GiB) of one plan, or the config error's line."""
    cmd = [sys.executable, "-m", "jaxllm.plan", f"--config={config}", f"--devices={n}", f"--config.mesh.sequence={n}",
           f"--config.parallel.sequence_impl={impl}", f"--config.train.seq_length={seq}",
           "--config.train.global_batch_size=1", "--config.train.micro_batch_size=1", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 2:
        return r.stderr.strip().splitlines()[-1]
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return float(re.search(r"total \(compiled\)\s+([0-9.]+) GiB", r.stdout).group(1))


def longest(config, n, impl, budget, start, step, extra):
    """(longest length, its GiB) within ``budget`` GiB, None if not even the first, or a config error."""
    seq, best = start, None
    while True:
        t = total_gib(config, n, impl, seq, extra)
        if isinstance(t, str):
            return t
        print(f"  sequence {n} {impl} length {seq}: {t:.2f} GiB", file=sys.stderr, flush=True)
        if t > budget:
            if best is None and not step and seq > 2 * n:
                seq //= 2
                continue
            return best
        best = (seq, t)
        seq = seq + step if step else 2 * seq


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gpt3.py:GPT125M")
    p.add_argument("--budget", type=float, default=None, help="GiB per device (default: --device's memory, else 4)")
    p.add_argument("--device", default=None, help="plan for this GPU (jaxllm.plan --device)")
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--impls", default="allgather,ring,ulysses", help="sequence_impl values for sizes > 1")
    p.add_argument("--start", type=int, default=256, help="first length tried for the first size")
    p.add_argument("--step", type=int, default=0, help="tokens added per try (0: double)")
    p.add_argument("extra", nargs="*", help="more --config.* flags for every plan")
    a = p.parse_args()
    from jaxllm.platform.hardware import named_device  # noqa: PLC0415

    extra = [*a.extra, *([f"--device={a.device}"] if a.device else [])]
    budget = a.budget or (named_device(a.device)[0] / GiB if a.device else 4.0)
    rows, base = [], None
    for n in map(int, a.sizes.split(",")):
        for impl in (("allgather",) if n == 1 else a.impls.split(",")):
            start = a.start if base is None or a.step else base * n // 2
            got = longest(a.config, n, impl, budget, start, a.step, extra)
            if isinstance(got, tuple) and n == 1:
                base = got[0]
            rows.append((n, "- (plain attention)" if n == 1 else impl, got))
    print(f"| sequence | impl | longest length in {budget:.2f} GiB | compiled total per device | x sequence 1 |")
    print("|---|---|---|---|---|")
    for n, impl, got in rows:
        if isinstance(got, tuple):
            print(f"| {n} | {impl} | {got[0]} | {got[1]:.2f} GiB | {f'{got[0] / base:g}x' if base else '-'} |")
        else:
            print(f"| {n} | {impl} | {got or 'none'} | | |")


if __name__ == "__main__":
    main()
