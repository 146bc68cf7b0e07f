"""The longest power-of-two sequence whose compiled per-device memory fits a budget, per
sequence-parallel size and ``parallel.sequence_impl``, from ``jaxllm.plan``.

    python benchmarks/sequence_memory.py [--config=configs/gpt3.py:GPT125M] [--budget=4GiB]

Each point is one ``python -m jaxllm.plan --devices=N --config.mesh.sequence=N`` run
(fake CPU devices: the compiled program's memory, nothing allocated), batch 1.  Prints
a Markdown table: the longest length that fits and its compiled total per device.
"""

import argparse
import re
import subprocess
import sys

GiB = 2**30


def total_gib(config, n, impl, seq, extra):
    cmd = [sys.executable, "-m", "jaxllm.plan", f"--config={config}", f"--devices={n}", f"--config.mesh.sequence={n}",
           f"--config.parallel.sequence_impl={impl}", f"--config.train.seq_length={seq}",
           "--config.train.global_batch_size=1", "--config.train.micro_batch_size=1", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 2:
        return r.stderr.strip().splitlines()[-1]
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return float(re.search(r"total \(compiled\)\s+([0-9.]+) GiB", r.stdout).group(1))


def longest(config, n, impl, budget, start, extra):
    seq, best = start, None
    while True:
        t = total_gib(config, n, impl, seq, extra)
        if isinstance(t, str):
            return t
        print(f"  sequence {n} {impl} length {seq}: {t:.2f} GiB", file=sys.stderr, flush=True)
        if t > budget:
            if best is None and seq > 2 * n:
                seq //= 2
                continue
            return best
        best = (seq, t)
        seq *= 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gpt3.py:GPT125M")
    p.add_argument("--budget", type=float, default=4.0, help="GiB per device")
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--start", type=int, default=256, help="first length tried for sequence 1")
    p.add_argument("extra", nargs="*", help="more --config.* flags for every plan")
    a = p.parse_args()
    rows, base = [], None
    for n in map(int, a.sizes.split(",")):
        for impl in (("allgather",) if n == 1 else ("allgather", "ring", "ulysses")):
            start = a.start if base is None else base * n // 2
            got = longest(a.config, n, impl, a.budget, start, a.extra)
            if isinstance(got, tuple) and n == 1:
                base = got[0]
            rows.append((n, "- (plain attention)" if n == 1 else impl, got))
    print(f"| sequence | impl | longest length in {a.budget:g} GiB | compiled total per device | x sequence 1 |")
    print("|---|---|---|---|---|")
    for n, impl, got in rows:
        if isinstance(got, tuple):
            print(f"| {n} | {impl} | {got[0]} | {got[1]:.2f} GiB | {got[0] / base:g}x |")
        else:
            print(f"| {n} | {impl} | {got or 'none'} | | |")


if __name__ == "__main__":
    main()
