"""The longest sequence whose compiled per-device memory fits a budget, per sequence-parallel size and
``parallel.sequence_impl``, from ``jaxllm.plan``.

    python benchmarks/sequence_memory.py [--config=configs/gpt3.py:GPT125M] [--budget=4] [-- --config.X=Y ...]
    python benchmarks/sequence_memory.py --config=configs/long_context.py:DS4Science --sizes=32 \\
        --impls=ulysses,ring,usp --ulysses-degree=4 --device=H100 --budget=A100-40GB,MI250X,H100 \\
        --start=65536 --step=65536

Each point is one ``python -m jaxllm.plan --devices=N --config.mesh.sequence=N`` run (fake CPU
devices: the compiled program's memory, nothing allocated), batch 1.  ``--budget``: GiB per device
or GPU names (their memory), comma-separated (default 4, or with ``--device=NAME`` that GPU's
memory); ``--device`` plans for that GPU (bfloat16, the flash attention's memory).  Without
``--step`` lengths double from ``--start`` until the total per device exceeds the largest budget;
with it the longest ``start + k x step`` within each budget is found by doubling k and then
bisecting, every length planned once (the total grows with the length).  Prints a Markdown table:
for each budget the longest length that fits and its total.
"""

import argparse
import functools
import re
import subprocess
import sys

GiB = 2**30


@functools.cache
def total_gib(config, n, impl, seq, extra):
    """The total per device (GiB) of one plan (on the device, with host offload), or the config error's line."""
    cmd = [sys.executable, "-m", "jaxllm.plan", f"--config={config}", f"--devices={n}", f"--config.mesh.sequence={n}",
           f"--config.parallel.sequence_impl={impl}", f"--config.train.seq_length={seq}",
           "--config.train.global_batch_size=1", "--config.train.micro_batch_size=1", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 2:
        return r.stderr.strip().splitlines()[-1]
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    # with model.remat=offload the plan also prints what stays on the device (what its verdict checks)
    got = float(re.search(r"total (?:on the device|\(compiled\))\s+([0-9.]+) GiB(?![\s\S]*total on the device)",
                          r.stdout).group(1))
    print(f"  sequence {n} {impl} length {seq}: {got:.2f} GiB", file=sys.stderr, flush=True)
    return got


def longest(total, budget, start, step, shortest):
    """(longest length, its GiB) within ``budget`` GiB, None if not even the first, or a config error's line.
    ``total(seq)``: the plan's GiB or an error line; ``step`` 0: powers of two times ``start`` (halving while
    the first does not fit, down to ``shortest``), else ``start + k x step``."""
    if not step:
        seq, best = start, None
        while True:
            t = total(seq)
            if isinstance(t, str) or t > budget:
                if isinstance(t, float) and best is None and seq > shortest:
                    seq //= 2
                    continue
                return t if isinstance(t, str) else best
            best, seq = (seq, t), 2 * seq
    fits = lambda k: (lambda t: t if isinstance(t, str) else t <= budget)(total(start + k * step))  # noqa: E731
    first = fits(0)
    if first is not True:
        return first or None
    lo, hi = 0, 1
    while (got := fits(hi)) is True:  # doubling: lo fits, hi does not
        lo, hi = hi, 2 * hi
    if isinstance(got, str):
        return got
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) is True else (lo, mid)
    return start + lo * step, total(start + lo * step)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gpt3.py:GPT125M")
    p.add_argument("--budget", default=None,
                   help="GiB per device or GPU names, comma-separated (default: --device's memory, else 4)")
    p.add_argument("--device", default=None, help="plan for this GPU (jaxllm.plan --device)")
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--impls", default="allgather,ring,ulysses", help="sequence_impl values for sizes > 1")
    p.add_argument("--ulysses-degree", type=int, default=0, help="usp's all-to-all group (parallel.ulysses_degree)")
    p.add_argument("--start", type=int, default=256, help="first length tried for the first size")
    p.add_argument("--step", type=int, default=0, help="lengths are start + k x step (0: start x 2^k)")
    p.add_argument("extra", nargs="*", help="more --config.* flags for every plan")
    a = p.parse_args()
    from jaxllm.platform.hardware import named_device  # noqa: PLC0415

    extra = (*a.extra, *([f"--device={a.device}"] if a.device else []))
    gib = lambda b: float(b) if re.fullmatch(r"[0-9.]+", b) else named_device(b)[0] / GiB  # noqa: E731
    names = a.budget.split(",") if a.budget else [a.device] if a.device else ["4"]
    budgets = [gib(b) for b in names]
    rows, base = [], None
    for n in map(int, a.sizes.split(",")):
        for impl in (("allgather",) if n == 1 else a.impls.split(",")):
            start = a.start if base is None or a.step else base * n // 2
            usp = impl == "usp" and a.ulysses_degree
            group = (f"--config.parallel.ulysses_degree={a.ulysses_degree}",) if usp else ()
            total = functools.partial(total_gib, a.config, n, impl, extra=(*extra, *group))
            got = [longest(total, b, start, a.step, 2 * n) for b in budgets]
            if isinstance(got[0], tuple) and n == 1:
                base = got[0][0]
            name = f"usp (groups of {a.ulysses_degree})" if usp else impl
            rows.append((n, "- (plain attention)" if n == 1 else name, got))
    cell = lambda g: f"{g[0]} ({g[1]:.2f} GiB)" if isinstance(g, tuple) else (g or "none")  # noqa: E731
    label = lambda name, b: f"{name} ({b:.2f} GiB)" if not re.fullmatch(r"[0-9.]+", name) else f"{b:.2f} GiB"  # noqa: E731
    print("| sequence | impl | " + " | ".join(f"longest in {label(nm, b)}" for nm, b in zip(names, budgets))
          + " | x sequence 1 |")
    print("|---|---|" + "---|" * len(budgets) + "---|")
    for n, impl, got in rows:
        ratio = f"{got[0][0] / base:g}x" if base and isinstance(got[0], tuple) else "-"
        print(f"| {n} | {impl} | " + " | ".join(cell(g) for g in got) + f" | {ratio} |")


if __name__ == "__main__":
    main()
