"""Attention benchmark: forward and forward+backward TFLOP/s and memory of every implementation.

    python benchmarks/attention.py                      # seq 1k..32k, every impl available here
    python benchmarks/attention.py --seqs 256 --impls xla --heads 2   # a CPU smoke run
    python benchmarks/attention.py --tune --seqs 16384 --output=tune.jsonl  # the Pallas kernel's tiles (GPU)

FLOPs are counted, not measured: forward = 4 * batch * seq^2 * heads * head_dim (two
matmuls of 2 * seq^2 * head_dim each), halved when causal; backward = 2.5 x forward
(five matmuls instead of two), so forward+backward = 3.5 x forward.  Times are the median
of ``--iters`` calls after ``--warmup`` calls, each ending in ``block_until_ready``.

Memory: "compiled" is XLA's own accounting of the forward+backward executable
(arguments + outputs + temporaries, ``Compiled.memory_analysis()``); "device peak" is the
allocator's ``peak_bytes_in_use`` from ``device.memory_stats()`` where the backend has it
(GPUs; not CPU).  That peak only grows within a process, so with ``--isolate`` (the
default on GPUs) every (seq, impl) case runs in its own subprocess.

Prints one Markdown table; a case that fails (out of memory, unsupported) shows the error
in its row instead of numbers.  ``--output=FILE.jsonl`` also appends one JSON record per case
(``date``, ``device``, versions, the shape, ``impl``, ``seq``, ``fwd_tflops``,
``fwd_bwd_tflops``, times, memory, ``command``): the records docs/performance.md's tables
come from (committed under ``benchmarks/results/``).  ``bwd_tflops`` is the backward alone:
2.5 x forward FLOPs over (forward+backward time - forward time).

``--tune`` sweeps the Pallas kernel's tiles and launch parameters (``jaxllm_kernels.pallas_flash.BlockSizes``)
at each ``--seqs`` for ``--head-dim``: first the forward's (:data:`FWD_GRID`, timed forward only), then, with
the best forward, the backward's (:data:`BWD_GRID`, timed forward+backward); a candidate that does not
compile (too much shared memory) is recorded with its error.  One record per candidate (``block_sizes``,
``tune``: ``"fwd"`` or ``"bwd"``), and the best as the ``BlockSizes(...)`` of ``DEFAULT_BLOCK_SIZES``'s entry for
this GPU family (``jaxllm_kernels/pallas_attention.py``) printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.extend
import jax.numpy as jnp

# --tune's candidates: forward (block_q, block_k, num_warps, num_stages); backward (the dK/dV kernel's
# block_q_dkv, block_k_dkv, the dQ kernel's tiles the same two transposed, num_warps_bwd, num_stages_bwd)
FWD_GRID = [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
            for bq in (64, 128) for bk in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
BWD_GRID = [dict(block_q_dkv=bq, block_k_dkv=bk, block_q_dq=bk, block_k_dq=bq, num_warps_bwd=w, num_stages_bwd=st)
            for bq in (32, 64) for bk in (64, 128) for w in (4, 8) for st in (2, 3)]


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="0: = heads (multi-head attention)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--impls", default="", help="comma-separated; default: every impl available on this backend")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="full instead of causal attention")
    p.add_argument("--window", type=int, default=0, help="sliding window (0: none); FLOPs are still counted dense")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check", action="store_true", help="add max |out - xla float32 reference| per case")
    p.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                   help="one subprocess per case for a clean device peak (auto: yes on GPUs)")
    p.add_argument("--output", default="", help="JSONL file: one record per case is appended")
    p.add_argument("--tune", action="store_true", help="sweep the Pallas kernel's tiles (FWD_GRID, then BWD_GRID)")
    p.add_argument("--_case", default="", help=argparse.SUPPRESS)  # "impl,seq": child mode, prints JSON
    return p.parse_args()


def flops(batch, seq, heads, head_dim, causal):
    """(forward, forward+backward) counted FLOPs."""
    fwd = 4 * batch * seq * seq * heads * head_dim
    if causal:
        fwd //= 2
    return fwd, fwd * 3.5


def _time(fn, args, iters, warmup):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _peak_bytes():
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without allocator stats
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def run_case(impl, seq, a, block_sizes=None, fwd_only=False):
    """Measure one (impl, seq) case; returns a dict of results (or ``error``).  ``block_sizes``: the Pallas
    kernel's (``impl`` must be ``"pallas"``); ``fwd_only``: no forward+backward timing."""
    from jaxllm.model.attention import attention

    if block_sizes is not None:
        from jaxllm_kernels import pallas_attention

        def attention(q, k, v, impl, **kw):  # noqa: F811 - the same call with the tiles given
            return pallas_attention.flash_attention(q, k, v, block_sizes=block_sizes, **kw)

    kvh = a.kv_heads or a.heads
    dtype = jnp.dtype(a.dtype)
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (a.batch, seq, a.heads, a.head_dim), dtype)
    k = jax.random.normal(kk, (a.batch, seq, kvh, a.head_dim), dtype)
    v = jax.random.normal(kv, (a.batch, seq, kvh, a.head_dim), dtype)
    do = jax.random.normal(kd, q.shape, dtype)
    kw = dict(impl=impl, causal=a.causal, window=a.window or None)
    fwd = jax.jit(lambda q, k, v: attention(q, k, v, **kw))

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, **kw).astype(jnp.float32) * do.astype(jnp.float32))

    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    res = {"impl": impl, "seq": seq}
    try:
        res["fwd_s"] = _time(fwd, (q, k, v), a.iters, a.warmup)
        if fwd_only:
            return res
        res["fwd_bwd_s"] = _time(fwd_bwd, (q, k, v), a.iters, a.warmup)
        try:
            ma = fwd_bwd.lower(q, k, v).compile().memory_analysis()
            res["compiled_bytes"] = (ma.argument_size_in_bytes + ma.output_size_in_bytes
                                     + ma.temp_size_in_bytes - ma.alias_size_in_bytes)
        except Exception:  # noqa: BLE001 - memory_analysis is best effort
            res["compiled_bytes"] = None
        res["peak_bytes"] = _peak_bytes()
        if a.check:
            res["max_err"] = _max_error(fwd(q, k, v), q, k, v, a)
    except Exception as e:  # noqa: BLE001 - OOM, unsupported configuration: reported in the table
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return res


def _max_error(out, q, k, v, a, block=2048):
    """max |out - float32 XLA reference|, the reference computed ``block`` queries at a time (its
    float32 scores ``[batch, heads, block, seq]`` stay at 2 GiB for 16 heads at sequence 16k)."""
    from jaxllm_kernels import reference

    b, seq = q.shape[:2]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    kv_pos = jnp.broadcast_to(jnp.arange(seq), (b, seq))
    err = 0.0
    for start in range(0, seq, block):
        stop = min(start + block, seq)
        ref = reference.attention(f32(q[:, start:stop]), f32(k), f32(v), causal=a.causal, window=a.window or None,
                                  q_positions=kv_pos[:, start:stop], kv_positions=kv_pos)
        err = max(err, float(jnp.max(jnp.abs(f32(out[:, start:stop]) - ref))))
    return err


def _run_isolated(impl, seq, argv):
    cmd = [sys.executable, __file__, *argv, "--isolate", "no", "--_case", f"{impl},{seq}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"impl": impl, "seq": seq, "error": f"subprocess rc={proc.returncode}: {tail[:120]}"}


def record(r, a) -> dict:
    """The JSON record of one case ``r`` (as :func:`run_case` returns it) run with arguments ``a``."""
    import datetime
    import shlex

    import jaxlib

    dev = jax.devices()[0]
    out = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
           "platform_version": jax.extend.backend.get_backend().platform_version,
           "jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads or a.heads, "head_dim": a.head_dim,
           "dtype": a.dtype, "causal": a.causal, "window": a.window or None, **r,
           "command": shlex.join(["python", "benchmarks/attention.py", *sys.argv[1:]])}
    if "error" not in r:
        f_fwd, f_all = flops(a.batch, r["seq"], a.heads, a.head_dim, a.causal)
        out["fwd_tflops"] = f_fwd / r["fwd_s"] / 1e12
        if "fwd_bwd_s" in r:
            out["fwd_bwd_tflops"] = f_all / r["fwd_bwd_s"] / 1e12
            out["bwd_tflops"] = (f_all - f_fwd) / (r["fwd_bwd_s"] - r["fwd_s"]) / 1e12
    return out


def _gib(x):
    return "n/a" if x is None else f"{x / 2**30:.2f}"


def table(results, a):
    cols = ["seq", "impl", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s", "compiled GiB", "device peak GiB"]
    if a.check:
        cols.append("max err")
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in results:
        if "error" in r:
            row = [str(r["seq"]), r["impl"], f"error: {r['error']}"] + [""] * (len(cols) - 3)
        else:
            f_fwd, f_all = flops(a.batch, r["seq"], a.heads, a.head_dim, a.causal)
            row = [str(r["seq"]), r["impl"], f"{r['fwd_s'] * 1e3:.3f}", f"{f_fwd / r['fwd_s'] / 1e12:.2f}",
                   f"{r['fwd_bwd_s'] * 1e3:.3f}", f"{f_all / r['fwd_bwd_s'] / 1e12:.2f}",
                   _gib(r.get("compiled_bytes")), _gib(r.get("peak_bytes"))]
            if a.check:
                row.append(f"{r['max_err']:.2e}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _sweep(a, seq, grid, start, stage, records):
    """Time ``start`` changed by each of ``grid`` (``stage``: ``"fwd"`` forward only, ``"bwd"`` forward+backward),
    append each candidate's record to ``records``; the fastest BlockSizes."""
    import dataclasses

    timed = []
    key = "fwd_s" if stage == "fwd" else "fwd_bwd_s"
    for change in grid:
        bs = dataclasses.replace(start, **change)
        r = run_case("pallas", seq, a, block_sizes=bs, fwd_only=stage == "fwd")
        records.append(record({**r, "tune": stage, "block_sizes": dataclasses.asdict(bs)}, a))
        if "error" not in r:
            timed.append((r[key], bs))
        print(f"  {stage} seq={seq} {change}: {r.get('error') or r[key]}", file=sys.stderr, flush=True)
    if not timed:
        sys.exit(f"error: no {stage} candidate ran at seq={seq}: {records[-1].get('error')}")
    return min(timed, key=lambda t: t[0])[1]


def tune(a) -> list:
    """``--tune`` (module docstring): the records of every candidate at every ``--seqs``; prints the best."""
    import dataclasses

    from jaxllm_kernels import pallas_attention

    family = pallas_attention.gpu_family()
    base = pallas_attention.default_block_sizes(family, a.head_dim)
    records = []
    for seq in [int(s) for s in a.seqs.split(",") if s]:
        best = _sweep(a, seq, BWD_GRID, _sweep(a, seq, FWD_GRID, base, "fwd", records), "bwd", records)
        fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(best).items())
        print(f"{family} head_dim={a.head_dim} seq={seq}: BlockSizes({fields})  (default: {base})")
    return records


def main():
    a = _parse()
    if a.tune:
        records = tune(a)
        if a.output:
            with open(a.output, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        return
    if a._case:
        impl, seq = a._case.split(",")
        print(json.dumps(run_case(impl, int(seq), a)))
        return
    from jaxllm.model.attention import available_impls, resolve_impl

    impls = [s for s in a.impls.split(",") if s] or available_impls()
    for impl in impls:
        try:
            resolve_impl(impl)  # fail early, with the reason, for an impl this backend lacks
        except ValueError as e:
            sys.exit(f"error: {e}")
    seqs = [int(s) for s in a.seqs.split(",") if s]
    isolate = a.isolate == "yes" or (a.isolate == "auto" and jax.default_backend() == "gpu")
    argv = sys.argv[1:]
    dev = jax.devices()[0]
    print(f"# attention benchmark on {dev.platform} ({getattr(dev, 'device_kind', '?')}), jax {jax.__version__}")
    print(f"batch={a.batch} heads={a.heads} kv_heads={a.kv_heads or a.heads} head_dim={a.head_dim} dtype={a.dtype} "
          f"causal={a.causal} window={a.window or None} iters={a.iters} (median) warmup={a.warmup}")
    print("FLOPs counted: forward = 4*b*s^2*h*d" + (" / 2 (causal)" if a.causal else "")
          + "; backward = 2.5 x forward; fwd+bwd = 3.5 x forward.\n")
    results = []
    for seq in seqs:
        for impl in impls:
            results.append(_run_isolated(impl, seq, argv) if isolate else run_case(impl, seq, a))
            print(f"  done seq={seq} impl={impl}", file=sys.stderr, flush=True)
    print(table(results, a))
    if a.output:
        with open(a.output, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(record(r, a)) + "\n" for r in results)
        print(f"appended {len(results)} record(s) to {a.output}")


if __name__ == "__main__":
    main()
