"""Validate a GPU machine in one command; write one Markdown report for docs/performance.md.

    python benchmarks/gpu_check.py --output=gpu_check.md          # on a GPU machine: every step, > 10 minutes
    python benchmarks/gpu_check.py --part=speed --models=GPT125M,GPT1_5B --output=speed.md  # ~8 minutes
    python benchmarks/gpu_check.py --part=fp8_loss --output=fp8_loss.md  # GPT125M's 300 steps, twice
    python benchmarks/gpu_check.py --dry-run --output=report.md   # any machine: every step shortened, on the CPU

Steps, each a subprocess with its own time limit (the report keeps whatever finished):

1. versions (Python, jax, jaxlib and its GPU plugins, flax, optax, orbax, triton, jax_triton,
   ml_collections), the devices JAX sees, ``nvidia-smi``/``rocm-smi`` and the GPU settings of
   :mod:`jaxllm.platform.gpu_env`;
2. the GPU tests (not with ``--part=speed``): ``tests/test_kernels.py`` compiled Pallas, Triton (where
   ``jax_triton`` imports) and cuDNN attention against the XLA reference, forward and backward, cuDNN with
   Megatron's packed documents too (segment ids as cuDNN's lengths and offsets; Hopper and later), and
   ``tests/test_documents.py``'s five bfloat16 train steps with ``data.reset_attention_mask`` whose losses
   with ``attention_impl=cudnn`` must be the ``xla`` reference's (the tests that skip on a CPU);
3. ``benchmarks/attention.py --check`` (not with ``--part=speed``): every attention implementation,
   sequence 1k, 4k, 16k, bfloat16, 16 heads of 128, causal;
4. ``python -m jaxllm.bench`` (``--models``, default all three), bfloat16, sequence 2048, one device, 10 timed
   steps after 3 warm-up steps, each variant in a process of its own, synthetic batches (no data files):
   GPT125M (12 layers, micro batch 8 = global batch 8, no recomputation), its layers written out (the default on
   GPUs without remat) and scanned (``model.layer_loop=scan``); GPT1_5B (48 layers, micro
   batch 8 = global batch 8, ``model.remat=save_dots``: the fastest measured on an H200) scanned, with
   ``model.fp8``, and written out without recomputation, with and without ``model.fp8``; GPT2_7B (32 layers,
   micro batch 4 of 8, ``save_dots``) with and without ``model.fp8``; each model followed by
5. ``benchmarks/torch_reference.py``, the PyTorch reference of the same model on the same GPU
   (``torch.compile``, fused attention, fused AdamW, no recomputation; micro batch 8 for GPT125M, 4 for
   GPT1_5B and GPT2_7B).  The report ends its summary with each model's fastest jaxllm variant against the
   reference (tokens/s and their ratio); every benchmark's JSON record goes to ``--records`` (default: the
   report's name with ``.jsonl``), for ``benchmarks/results/``;
6. (``--part=all`` or ``fp8_loss``) FP8 in training: GPT125M trained 300 steps on Tiny Shakespeare (GPT-2's
   BPE, both shipped with jaxllm) from one seed, in bfloat16 and with ``model.fp8``; the report compares their
   losses (the mean of the last 50 steps; the bar: within 1 %), and each run's
   ``metrics.jsonl`` goes beside the report (``NAME-fp8_loss/bf16/``, ``NAME-fp8_loss/fp8/``).

``--dry-run`` runs the same steps on whatever backend JAX has (the CPU here) with tiny sizes, to
check the script and the report; its report says DRY RUN and its figures are not GPU figures.

On the lent GPU machines (their own Python 3.12 with jax, jaxlib, the CUDA plugin, flax, optax,
orbax, tensorstore, triton, pytest; no network): carry the missing pure-Python wheels,
``ml-collections`` (jaxllm.config), ``jax-triton`` (``attention_impl=triton``; without it the
Triton rows are skipped and say so) and ``tensorboardX`` (what ``jaxllm.train`` logs with), and the JAX
that compiles the GPU program here (:mod:`jaxllm.platform.xla_gpu`): jax, jaxlib, jax-cuda13-plugin and
jax-cuda13-pjrt 0.12.0.1 (the machine's CUDA 13 libraries; the same XLA as the cuda12 plugin) with flax
0.12.12, where the machine has 0.11.2.  Once, in the repository root of the checkout that travels::

    echo /.whl/ >> .git/info/exclude; echo '/.jax-*/' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \\
        -d .whl ml-collections==1.1.0 jax-triton==0.3.1 tensorboardX==2.6.5 jax==0.12.0.1 flax==0.12.12
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_27_x86_64 -d /tmp/jaxwhl jaxlib==0.12.0.1 jax-cuda13-plugin==0.12.0.1 \\
        jax-cuda13-pjrt==0.12.0.1
    tar -cf - -C /tmp/jaxwhl . | split -b 44M - /tmp/jaxpart-
    for p in /tmp/jaxpart-*; do mkdir -p .jax-${p##*-} && mv $p .jax-${p##*-}/; done

Those three wheels are 219 MiB, more than a call carries (64 MiB with the checkout): carry one ``.jax-*``
folder a call on one warm machine (it stays there), then ``.whl`` and run::

    mkdir -p /tmp/jaxwhl && cat .jax-*/jaxpart-* | tar -x -C /tmp/jaxwhl && python3 -m pip install -q \\
        --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \\
        /tmp/jaxwhl/*.whl && export PYTHONPATH=/tmp/site || exit
    python3 benchmarks/gpu_check.py --output=$OUT/gpu_check.md

(docs/performance.md, its section on this script).  The report's versions table says which JAX ran.

jaxllm itself need not be installed: the script puts the checkout (``jaxllm`` and ``jaxllm_kernels``) on
``PYTHONPATH`` for itself and its subprocesses.

Exit codes: 0 every step passed; 1 a step failed or timed out (the report says which); 2 no GPU
without ``--dry-run``, or bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm7-plugin", "flax", "optax",
            "orbax-checkpoint", "tensorstore", "triton", "jax-triton", "ml-collections", "numpy", "pytest")
GPT = [  # (name, config key, overrides, variants compared on a GPU, in the dry run, the PyTorch reference's overrides)
    # the base rows: the default layer loop (written out without remat on GPUs, a scan with it) at the fastest
    # settings measured on an H200 (2026-11-27); the variants: the other loop (the written-out layers' gradients
    # stacked since then, not measured yet) and FP8
    ("GPT125M", "GPT125M", ["--config.train.micro_batch_size=8", "--config.train.global_batch_size=8"],
     ("model.layer_loop=scan",), ("model.layer_loop=scan",),
     ["--config.train.micro_batch_size=8", "--config.train.global_batch_size=8"]),
    ("GPT1_5B", "GPT1_5B", ["--config.model.remat=save_dots", "--config.train.micro_batch_size=8",
                            "--config.train.global_batch_size=8"],
     ("model.layer_loop=unrolled,model.remat=none", "model.fp8=True",
      "model.fp8=True,model.layer_loop=unrolled,model.remat=none"), ("model.layer_loop=unrolled,model.remat=none",),
     ["--config.train.micro_batch_size=4", "--config.train.global_batch_size=8"]),
    ("GPT2_7B", "GPT2_7B", ["--config.model.remat=save_dots", "--config.train.micro_batch_size=4",
                            "--config.train.global_batch_size=8"],
     ("model.fp8=True",), (), ["--config.train.micro_batch_size=4", "--config.train.global_batch_size=8"]),
]
# step 6: FP8 against bfloat16 in training, on real data (the corpus and the tokenizer travel with the checkout)
FP8_LOSS_STEPS, FP8_LOSS_LAST = 300, 50
FP8_LOSS = ["--config=configs/gpt3.py:GPT125M", "--config.data.input=tests/data/tinyshakespeare.txt",
            "--config.train.micro_batch_size=8", "--config.train.global_batch_size=8", "--config.train.log_interval=1",
            "--config.train.eval_interval=0", "--config.log.samples=0", "--config.checkpoint.interval=0"]
# --dry-run: the same configs cut to seconds on a CPU (the vocabulary stays)
TINY = ["--config.model.num_layers=2", "--config.model.hidden_size=128", "--config.model.num_attention_heads=4",
        "--config.train.seq_length=64", "--config.model.dtype=float32", "--config.train.micro_batch_size=2",
        "--config.train.global_batch_size=2"]


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="gpu_check.md", help="the Markdown report")
    p.add_argument("--dry-run", action="store_true", help="shortened steps on any backend (checks the script)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per step at most")
    p.add_argument("--records", default="", help="the benchmarks' JSON records (default: --output's name, .jsonl)")
    p.add_argument("--part", choices=("all", "speed", "fp8_loss"), default="all",
                   help="speed: the throughput steps only (jaxllm against PyTorch), not the kernel tests; "
                        "fp8_loss: only GPT125M's training with and without model.fp8 (step 6)")
    p.add_argument("--models", default=",".join(g[0] for g in GPT),
                   help="the models benchmarked, comma-separated (each with its PyTorch reference)")
    a = p.parse_args(argv)
    a.records = a.records or os.path.splitext(a.output)[0] + ".jsonl"
    a.models = [m for m in a.models.split(",") if m]
    unknown = sorted(set(a.models) - {g[0] for g in GPT})
    if unknown:
        p.error(f"--models={','.join(unknown)}: not one of {', '.join(g[0] for g in GPT)}")
    return a


def _environment() -> dict[str, str]:
    """The environment of every step: the checkout importable (``jaxllm``, ``jaxllm_kernels``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_step(title, cmd, env, timeout) -> dict:
    """Runs ``cmd`` (argv) in the checkout; returns title, command, seconds, exit code, output."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + f"\n(killed after {timeout} s)"
    shown = ["python" if c == sys.executable else os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd]
    step = {"title": title, "command": shlex.join(shown), "seconds": time.perf_counter() - start, "rc": rc,
            "stdout": out, "stderr": err}
    print(f"gpu_check: {title}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {step['seconds']:.0f} s", file=sys.stderr,
          flush=True)
    if rc != 0:  # the cause on the console too: the report may never be read on the machine that ran it
        print((out[-1500:] + err[-1500:]).rstrip(), file=sys.stderr, flush=True)
    return step


_DEVICES = """
import json, jax
from jaxllm.model import attention
from jaxllm.platform import hardware
from jaxllm_kernels import pallas_attention, triton_attention
d = jax.devices()[0]
peak, source = hardware.peak_flops_per_device(d, "bfloat16") if d.platform != "cpu" else (None, "cpu")
print(json.dumps({"backend": jax.default_backend(), "kind": hardware.backend_kind(), "count": jax.device_count(),
                  "device_kind": d.device_kind, "platform_version": str(d.client.platform_version),
                  "compute_capability": str(getattr(d, "compute_capability", "")),
                  "family": pallas_attention.gpu_family(d), "impls": attention.available_impls(),
                  "triton": triton_attention.available()[1] or "available", "peak": peak, "peak_source": source}))
"""


def versions() -> list[tuple[str, str]]:
    out = [("python", platform.python_version())]
    for name in PACKAGES:
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            out.append((name, "not installed"))
    return out


def smi() -> str:
    for cmd in (["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
                ["rocm-smi", "--showproductname"]):
        if shutil.which(cmd[0]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            return f"$ {' '.join(cmd)}\n{r.stdout.strip()}"
    return "(no nvidia-smi or rocm-smi on the PATH)"


def steps(a, env) -> list[dict]:
    """Steps 2-4 (see the module doc)."""
    py = sys.executable
    out = []
    if a.part == "all":
        tests = [py, "-m", "pytest", "tests/test_kernels.py", "tests/test_documents.py", "-q", "-rA", "-p",
                 "no:cacheprovider", "-k", "gpu_matches or triton_matches or cudnn_matches or cudnn_packed"]
        out.append(run_step("GPU tests: compiled Pallas, Triton and cuDNN attention against the XLA reference, "
                            "cuDNN's packed documents in training", tests, env, a.timeout))
        attn = [py, "benchmarks/attention.py", "--check"]
        attn += (["--seqs", "128", "--heads", "2", "--iters", "1", "--warmup", "0", "--impls", "xla,pallas"]
                 if a.dry_run else ["--seqs", "1024,4096,16384"])
        out.append(run_step("attention benchmark", attn, env, a.timeout))
    if a.part == "fp8_loss":
        return fp8_loss_steps(a, env)
    for name, key, overrides, gpu_variants, dry_variants, torch_overrides in GPT:
        if name not in a.models:
            continue
        # auto: cuDNN on NVIDIA, Pallas on AMD; the others beside it (Pallas is interpret mode on a CPU: the dry
        # run skips it; xla may run out of memory at sequence 2048: the table then says so)
        cmd = [py, "-m", "jaxllm.bench", f"--config=configs/gpt3.py:{key}", *overrides,
               "--config.model.attention_impl=auto", "--steps=10", "--warmup=3", f"--output={a.records}", "--devices=1"]
        compare = dry_variants if a.dry_run else gpu_variants
        if compare:
            cmd.append("--compare=" + ";".join(compare))
        if a.dry_run:
            cmd += TINY + ["--steps=2", "--warmup=1"]
        out.append(run_step(f"jaxllm.bench {name}", cmd, env, a.timeout + (180 if key == "GPT1_5B" else 0)))
        # the PyTorch reference (benchmarks/torch_reference.py: torch.compile, cuDNN/flash attention, fused AdamW) on
        # the same GPU; without recomputation, at the micro batch measured fastest for it
        ref = [py, "benchmarks/torch_reference.py", f"--config=configs/gpt3.py:{key}", *torch_overrides,
               "--steps=10", "--warmup=3", f"--output={a.records}"]
        if a.dry_run:
            ref += TINY + ["--device=cpu", "--no-compile", "--steps=1", "--warmup=0"]
        out.append(run_step(f"torch reference {name}", ref, env, a.timeout))
    return out + (fp8_loss_steps(a, env) if a.part == "all" else [])


def _fp8_run(a, name: str) -> str:
    """The folder beside the report that keeps the ``metrics.jsonl`` of step 6's run ``name``."""
    return os.path.join(os.path.splitext(a.output)[0] + "-fp8_loss", name)


def fp8_loss_steps(a, env) -> list[dict]:
    """Step 6: GPT125M trained in bfloat16, then with ``model.fp8``, from the same seed; each run's
    ``metrics.jsonl`` copied beside the report (the workdir, with its 2 GB final checkpoint, is not). The dry
    run trains both without FP8 (the CPU has no FP8 matmuls: the config is refused there)."""
    steps, out = 20 if a.dry_run else FP8_LOSS_STEPS, []
    for name, fp8 in (("bf16", False), ("fp8", not a.dry_run)):
        shutil.rmtree(_fp8_run(a, name), ignore_errors=True)  # an earlier run's: a failed run must not show it
        with tempfile.TemporaryDirectory() as workdir:
            cmd = [sys.executable, "-m", "jaxllm.train", *FP8_LOSS, f"--config.train.train_iters={steps}",
                   f"--config.model.fp8={fp8}", f"--workdir={workdir}"]
            if a.dry_run:
                cmd += TINY + ["--config.train.warmup_iters=2"]
            out.append(run_step(f"GPT125M trained {steps} steps, model.fp8={fp8}", cmd, env, a.timeout))
            if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
                os.makedirs(_fp8_run(a, name))
                shutil.copy(os.path.join(workdir, "metrics.jsonl"), _fp8_run(a, name))
    return out


def fp8_losses(a) -> list[str]:
    """Markdown: both runs' training losses at six steps and the mean over the last :data:`FP8_LOSS_LAST` steps
    (half the steps in a dry run), with FP8's relative difference to bfloat16's."""
    from jaxllm.plot import PlotError, read_metrics  # noqa: PLC0415 - main puts the checkout on sys.path

    try:
        runs = [{s: r["loss"] for s, r in read_metrics(_fp8_run(a, name))["train"].items()} for name in ("bf16", "fp8")]
    except PlotError:  # a run failed: its step's output in the report says why
        return []
    steps = sorted(set(runs[0]) & set(runs[1]))
    last = steps[-min(FP8_LOSS_LAST, len(steps) // 2):]
    every = max(1, steps[-1] // 6)
    lines = ["| steps | bfloat16 loss | FP8 loss | FP8 / bfloat16 - 1 |", "|---|---|---|---|"]
    for label, chosen in [*((str(s), [s]) for s in steps if s % every == 0), (f"{last[0]}-{last[-1]} (mean)", last)]:
        bf16, fp8 = (sum(run[s] for s in chosen) / len(chosen) for run in runs)
        lines.append(f"| {label} | {bf16:.4f} | {fp8:.4f} | {fp8 / bf16 - 1:+.2%} |")
    return lines


def _fence(text: str) -> str:
    return "```text\n" + (text.strip() or "(no output)") + "\n```"


def _table_lines(stdout: str) -> str:
    """The Markdown table lines (and the lines right after them) of a step's output."""
    lines = stdout.splitlines()
    keep = [i for i, ln in enumerate(lines) if ln.startswith("|")]
    if not keep:
        return ""
    return "\n".join(lines[keep[0]:])


def versus_torch(records: list[dict]) -> list[str]:
    """Markdown: per config file, jaxllm's fastest record against the PyTorch reference's, tokens/s and ratio."""
    lines = ["| model | jaxllm (fastest variant) | tokens/s | PyTorch reference | tokens/s | jaxllm / PyTorch |",
             "|---|---|---|---|---|---|"]
    for key in dict.fromkeys(r["config_file"] for r in records):
        mine = [r for r in records if r["config_file"] == key and r.get("framework") != "torch"]
        theirs = [r for r in records if r["config_file"] == key and r.get("framework") == "torch"]
        if not mine or not theirs:
            continue
        best, ref = max(mine, key=lambda r: r["tokens_per_sec"]), max(theirs, key=lambda r: r["tokens_per_sec"])
        label = lambda r: f"micro {r['micro_batch_size']}, remat {r['remat']}, {r['attention_impl']}"  # noqa: E731
        lines.append(f"| {key} | {label(best)} | {best['tokens_per_sec']:,.0f} | {label(ref)} | "
                     f"{ref['tokens_per_sec']:,.0f} | {best['tokens_per_sec'] / ref['tokens_per_sec']:.2f}x |")
    return lines


def report(a, results, started, total_s, records=()) -> str:
    dev = {}
    if results and results[0]["rc"] == 0:
        dev = json.loads(results[0]["stdout"].strip().splitlines()[-1])
    head = "# GPU check" + (" -- DRY RUN (shortened, on the CPU: not GPU figures)" if a.dry_run else "")
    lines = [head, "",
             f"{started:%Y-%m-%d %H:%M} UTC on `{platform.node() or '?'}`, {total_s / 60:.1f} min; "
             f"command: `python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`", ""]
    if dev:
        lines += [f"Device: {dev['count']} x {dev['device_kind']} ({dev['kind']}, {dev['platform_version']}, "
                  f"compute capability {dev['compute_capability'] or '-'}), Pallas tiles `{dev['family']}`; "
                  f"attention impls here: {', '.join(dev['impls'])}; triton: {dev['triton']}; peak for MFU: "
                  + (f"{dev['peak'] / 1e12:.1f} TFLOP/s ({dev['peak_source']})" if dev["peak"] else "n/a"), ""]
    lines += ["| package | version |", "|---|---|"] + [f"| {n} | {v} |" for n, v in versions()] + [""]
    lines += [_fence(smi()), ""]
    from jaxllm.platform import gpu_env  # noqa: PLC0415

    vendor = dev.get("kind") if dev.get("kind") in ("cuda", "rocm") else None
    line = gpu_env.apply(dict(os.environ), vendor).line() if vendor else ""
    lines += [f"GPU settings of every jaxllm.train/jaxllm.bench run: {line or 'none (no GPU)'}", ""]
    lines += ["| step | seconds | result |", "|---|---|---|"]
    lines += [f"| {r['title']} | {r['seconds']:.0f} | {'ok' if r['rc'] == 0 else 'FAILED: ' + str(r['rc'])} |"
              for r in results]
    if records:
        lines += ["", "## jaxllm against the PyTorch reference, same GPU, same run", "", *versus_torch(records),
                  "", f"(records: `{a.records}`)"]
    fp8 = fp8_losses(a)
    if fp8:
        lines += ["", "## FP8 against bfloat16 in training, same seed, same data", "", *fp8, "",
                  f"(metrics: `{_fp8_run(a, 'bf16')}`, `{_fp8_run(a, 'fp8')}`)"]
    for r in results[1:]:
        lines += ["", f"## {r['title']}", "", f"`{r['command']}` ({r['seconds']:.0f} s, exit {r['rc']})", ""]
        if r["title"].startswith("GPU tests"):
            summary = [ln for ln in r["stdout"].splitlines() if ln.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))
                       or " passed" in ln or " failed" in ln or " skipped" in ln]
            lines.append(_fence("\n".join(summary[-60:])))
        else:
            table = _table_lines(r["stdout"])
            lines.append(table if table else _fence(r["stdout"][-3000:]))
            starts = ("#", "batch=", "FLOPs", "jaxllm.platform.gpu_env")
            heads = [ln for ln in r["stdout"].splitlines() if ln.startswith(starts)]
            if heads:
                lines += ["", _fence("\n".join(heads))]
        if r["rc"] != 0:
            lines += ["", "stderr (end):", "", _fence(r["stderr"][-3000:])]
    return "\n".join(lines) + "\n"


def _lines(path: str) -> list[str]:
    return open(path, encoding="utf-8").read().splitlines() if os.path.exists(path) else []


def main(argv=None) -> int:
    a = _parse(argv)
    env = _environment()
    sys.path[:0] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p not in sys.path]  # the report imports jaxllm
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.perf_counter()
    first = run_step("devices", [sys.executable, "-c", _DEVICES], env, a.timeout)
    if not a.dry_run and first["rc"] == 0 and '"backend": "cpu"' in first["stdout"]:
        print("error: JAX has no GPU backend here (it runs on the CPU); use --dry-run to check the script",
              file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    done = _lines(a.records)  # records of earlier runs in the same file stay out of this report
    results = [first, *steps(a, env)]
    records = [json.loads(x) for x in _lines(a.records)[len(done):]]
    text = report(a, results, started, time.perf_counter() - t0, records)
    tmp = a.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, a.output)  # whole or not at all
    print(f"gpu_check: wrote {a.output}", file=sys.stderr)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
