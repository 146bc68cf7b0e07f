"""The constants of the GPU step-time model (:data:`jaxllm.analysis.gpu_time.FITTED`), fitted to profiled steps.

Data: profiled steps of a GPU (``jaxllm.bench --profile``: a Perfetto trace of two steps) with the optimized HLO
of the program they ran (``*.step.hlo.txt.gz``) and the record's step time.  :func:`measured` matches every kernel
run of a trace to the instruction it ran: an XLA kernel by its name (:func:`jaxllm.analysis.profile.program`),
a library kernel by order (the ``i``-th cuBLAS kernel, ``nvjet_*``, of a step to the ``i``-th cuBLAS call of the
program in the order :func:`jaxllm.analysis.gpu_time.walk` runs it; cuDNN's forward kernel likewise, its
backward's three kernels, ``compute_dot_do_o``, the ``bprop`` kernel and ``convert_dq``, summed into one run);
the memory copies XLA runs for a slice or update of a stacked array (``memcpy128``, ``memcpy32_post``: not named
by the program) by their launch's bytes (CUPTI's grid x block x the bytes a thread copies, 16 or 4, read and
written).  XLA:GPU ran every kernel of these steps on one stream, so a step's time is its kernels' and the gaps
between them.

Fit: per kind (:data:`jaxllm.analysis.gpu_time.KINDS`), the non-negative least squares of
``t = overhead + a x FLOPs + b x bytes + o x ops`` over its runs, each squared error divided by the measured
time (the runs' relative errors weighted by the square root of their time: a 2-microsecond kernel counts, the
millisecond ones count more), on the columns :data:`COLUMNS` names; ``a``, ``b`` as efficiencies of the traced
device's datasheet peak and bandwidth.  The gap: the traced steps' time that no modelled kernel covers (idle
GPU, cuBLAS's workspace memsets), per launch.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import re

import numpy as np
from scipy.optimize import nnls

from jaxllm.analysis import gpu_time, profile
from jaxllm.platform.hardware import GPU_KINDS, memory_bandwidth

# the terms fitted per kind: GEMMs by FLOPs and bytes, attention by FLOPs, the rest by bytes (and the fusions'
# element-wise work); every kind with an overhead per run
COLUMNS = {"gemm": ("overhead", "flops", "bytes"), "attention_fwd": ("overhead", "flops"),
           "attention_bwd": ("overhead", "flops"), "loop": ("overhead", "bytes", "ops"),
           "reduction": ("overhead", "bytes", "ops"), "triton": ("overhead", "bytes", "ops"),
           "copy": ("overhead", "bytes"), "memcpy": ("overhead", "bytes")}
_GEMM = re.compile(r"^nvjet|gemm|xmma|cutlass", re.I)
_CUDNN_BWD = ("compute_dot_do_o", "bprop", "convert_dq")


def _library(kernels: list[gpu_time.Kernel], order: list[str], prog: dict) -> dict[str, list[str]]:
    """The library calls of a step in the order they run: cuBLAS GEMMs (custom calls), cuDNN forward and backward."""
    by_name = {k.name: k for k in kernels}
    calls = {"gemm": [], "attention_fwd": [], "attention_bwd": []}
    for name in order:
        k = by_name[name]
        if k.kind in calls and not (k.kind == "gemm" and prog[name].root != "custom-call"):
            calls[k.kind].append(name)
    return calls


def _memcpy_bytes(run: dict) -> float:
    """A ``memcpy128``/``memcpy32_post`` launch's bytes read and written, from its grid and block."""
    found = re.search(r"grid:(\d+),(\d+),(\d+) block:(\d+)", run["details"])
    threads = math.prod(int(g) for g in found.groups()) if found else 0
    return 2.0 * threads * (16 if "128" in run["name"] else 4)


def measured(hlo_text: str, trace: str) -> tuple[list[gpu_time.Kernel], list[tuple[gpu_time.Kernel, float]], int]:
    """The kernels of a traced program, its trace's runs matched to them (module docstring), and the steps traced.

    Args:
      hlo_text: the optimized HLO of the program the trace ran; trace: its ``*.perfetto_trace.json.gz``.
    Returns:
      ``(census, runs, steps)``: :func:`jaxllm.analysis.gpu_time.census`; ``[(Kernel, microseconds)]`` per run
      (a cuDNN backward's three kernels one run; a slice's memory copy a ``memcpy`` Kernel of its own with the
      launch's bytes); the number of steps (the cuBLAS kernels over the program's GEMM calls).
    Raises:
      ValueError: the trace's cuBLAS kernels are not a whole number of the program's steps (another program).
    """
    kernels = gpu_time.census(hlo_text)
    prog = profile.program(hlo_text)
    by_name = {k.name: k for k in kernels}
    calls = _library(kernels, [op.name for op, _, _ in gpu_time.walk(hlo_text)], prog)
    runs = profile.kernels(trace)
    gemms = sum(1 for r in runs if _GEMM.search(r["name"]) and profile.resolve(r["name"], prog) is None)
    steps = gemms // max(1, len(calls["gemm"]))
    if not calls["gemm"] or steps * len(calls["gemm"]) != gemms:
        raise ValueError(f"{trace}: {gemms} cuBLAS kernels are no whole number of the program's "
                         f"{len(calls['gemm'])} GEMM calls a step")
    seen = {"gemm": 0, "attention_fwd": 0, "attention_bwd": 0}
    out: list[tuple[gpu_time.Kernel, float]] = []
    for r in runs:
        name = r["name"]
        ins = profile.resolve(name, prog)
        if ins is not None and ins in by_name:
            out.append((by_name[ins], r["us"]))
            continue
        kind = ("gemm" if _GEMM.search(name) else "attention_fwd" if "fprop" in name else
                "attention_bwd" if any(p in name for p in _CUDNN_BWD) else None)
        if kind == "attention_bwd" and _CUDNN_BWD[0] not in name:  # the backward's 2nd and 3rd kernels
            k, us = out.pop(next(i for i in range(len(out) - 1, -1, -1) if out[i][0].kind == kind))
            out.append((k, us + r["us"]))
        elif kind is not None:
            out.append((by_name[calls[kind][seen[kind] % len(calls[kind])]], r["us"]))
            seen[kind] += 1
        elif name.startswith("memcpy"):
            out.append((gpu_time.Kernel(name, "memcpy", "copy", 1, bytes=_memcpy_bytes(r)), r["us"]))
    return kernels, out, steps


def _features(k: gpu_time.Kernel, peak: float, bandwidth: float) -> dict[str, float]:
    """A run's terms in the units of :data:`jaxllm.analysis.gpu_time.FITTED`: seconds at the peak / bandwidth."""
    return {"overhead": 1.0, "flops": k.flops / peak, "bytes": k.bytes / bandwidth, "ops": k.ops}


def fit(steps: list[tuple[str, str, float]], device: str = "H100") -> dict[str, dict[str, float]]:
    """:data:`jaxllm.analysis.gpu_time.FITTED` from profiled steps of one GPU model (module docstring).

    Args:
      steps: ``(optimized HLO text, trace path, measured step time in seconds)`` per profiled program.
      device: the GPU they ran on (a ``--device`` name): the peak and bandwidth the efficiencies are of.
    Returns:
      ``{kind: {"overhead_s", "flop_efficiency", "bandwidth_efficiency", "s_per_op"}}`` for every kind of
      :data:`COLUMNS` and ``"gap"`` (``overhead_s`` only), each to 3 significant digits.
    """
    dev = gpu_time.device(device)
    rows: dict[str, list] = {kind: [] for kind in COLUMNS}
    idle = launches = 0.0
    for hlo_text, trace, step_s in steps:
        kernels, runs, n = measured(hlo_text, trace)
        for k, us in runs:
            rows[k.kind].append((_features(k, dev.peaks["bf16"], dev.bandwidth), us * 1e-6))
        idle += n * step_s - sum(us for _, us in runs) * 1e-6
        launches += n * sum(k.runs for k in kernels)
    out = {kind: _fit_kind(rows[kind], COLUMNS[kind]) for kind in COLUMNS}
    out["gap"] = {"overhead_s": _round(idle / launches), "flop_efficiency": 0.0, "bandwidth_efficiency": 0.0,
                  "s_per_op": 0.0}
    return out


def bandwidth(steps: list[tuple[str, str, float]], device: str, skip: tuple[str, ...] = ()) -> float:
    """:data:`jaxllm.analysis.gpu_time.BANDWIDTH`'s factor of ``device`` from its profiled steps: with
    :data:`jaxllm.analysis.gpu_time.FITTED` held, the one factor on the datasheet bandwidth that every run's bytes
    term is divided by, least squares as :func:`fit` (each squared error over the measured time).

    Args:
      steps: ``(optimized HLO text, trace path, measured step time in seconds)`` per profiled program of ``device``
        (a ``--device`` name); skip: the profile's categories whose kernels are left out.
    Returns:
      the factor (dimensionless, 3 significant digits): the fraction of the datasheet bandwidth the device's kernels
      reach, as a share of the traced H100's (whose is in the efficiencies).
    """
    datasheet = dataclasses.replace(gpu_time.device(device), bandwidth=memory_bandwidth(GPU_KINDS[device]))
    num = den = 0.0
    for hlo_text, trace, _ in steps:
        for k, us in measured(hlo_text, trace)[1]:
            efficiency = gpu_time.FITTED[k.kind]["bandwidth_efficiency"]
            if k.category in skip or not efficiency:
                continue
            t, b = us * 1e-6, k.bytes / (datasheet.bandwidth * efficiency)
            num, den = num + b * b / t, den + b * (t - gpu_time.kernel_time(k, datasheet) + b) / t
    return _round(num / den)


def _round(x: float) -> float:
    return float(f"{x:.3g}")


def _fit_kind(rows: list, columns: tuple[str, ...]) -> dict[str, float]:
    """One kind's non-negative least squares, each row's squared error over its measured time."""
    x = np.array([[f[c] for c in columns] for f, _ in rows])
    y = np.array([t for _, t in rows])
    w = 1 / np.sqrt(y)
    scale = np.where(x.max(0) > 0, x.max(0), 1.0)
    coef = dict(zip(columns, nnls(x / scale * w[:, None], y * w)[0] / scale))
    inverse = lambda c: _round(1 / coef[c]) if coef.get(c) else 0.0  # noqa: E731
    return {"overhead_s": _round(coef["overhead"]), "flop_efficiency": inverse("flops"),
            "bandwidth_efficiency": inverse("bytes"), "s_per_op": _round(coef.get("ops", 0.0))}


def load(prefix: str) -> tuple[str, str]:
    """The optimized HLO text and the trace path of a profiled step committed as ``PREFIX.step.hlo.txt.gz`` and
    ``PREFIX.perfetto_trace.json.gz`` (``benchmarks/results/...``)."""
    with gzip.open(prefix + ".step.hlo.txt.gz", "rt", encoding="utf-8") as f:
        return f.read(), prefix + ".perfetto_trace.json.gz"

