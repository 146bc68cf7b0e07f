"""XLA:GPU without a GPU: a program compiled here for a named NVIDIA GPU, and its kernels by kind.

With JAX's CUDA plugin installed (``pip install -e ".[cuda]"``, or the test extra) and JAX started on
the CPU (``JAX_PLATFORMS=cpu``, which lets the plugin register without a driver), XLA's GPU compiler
runs on a machine with no GPU: :func:`devices` are the abstract devices of the GPU that XLA's own
target spec describes (``gpu_specs/``: openxla/xla's ``xla/backends/gpu/target_config/specs``), and
``jax.jit(f).lower(arguments sharded over them).compile()`` is the optimized program that GPU runs:
its cuBLAS / cuBLASLt and Triton GEMMs, cuDNN attention, fusions, copies and collectives
(:func:`kernels`), and its ``memory_analysis()``.  ``python -m jaxllm.plan --device=H100`` uses it.

What it cannot know without the GPU: no autotuning (cuBLAS picks its algorithm at run time; a Triton
GEMM keeps XLA's default tiles, and on a GPU the autotuner may swap a Triton GEMM for a cuBLAS call),
and cuDNN's workspace, which XLA sizes when it builds the cuDNN graph on a device (estimated by
:func:`cudnn_workspace`).  AMD GPUs: JAX's ROCm plugin loads the ROCm libraries (HIP, rocBLAS, MIOpen,
...) to start, which no PyPI wheel ships, so there is no ROCm counterpart here.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import importlib.resources
import importlib.util
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from jaxllm.platform import gpu_env
from jaxllm.platform.hlo import Op, parse


class Target(NamedTuple):
    """A GPU XLA:GPU compiles for here: ``spec``, its XLA target spec (a file of ``gpu_specs/``, whose README.md
    says where each comes from); ``arch``, its architecture as the Pallas kernel's tiles name it
    (:data:`jaxllm_kernels.pallas_attention.DEFAULT_BLOCK_SIZES`)."""

    spec: str
    arch: str


# the keys of jaxllm.platform.hardware.DEVICES that XLA:GPU compiles for without the GPU
SPECS = {"A100-40GB": Target("a100_sxm_40.txtpb", "ampere"), "A100-80GB": Target("a100_sxm_80.txtpb", "ampere"),
         "H100": Target("h100_sxm.txtpb", "hopper"), "H200": Target("h200.txtpb", "hopper")}
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def unavailable(name: str) -> str | None:
    """Why this process cannot compile for the GPU ``name`` (a key of
    :data:`jaxllm.platform.hardware.DEVICES`) with XLA:GPU, or None where it can."""
    if name not in SPECS:
        return (f"no XLA:GPU target spec for {name} here (NVIDIA targets: {', '.join(SPECS)}; JAX's ROCm plugin "
                "needs the ROCm libraries to start)")
    if importlib.util.find_spec("jax_plugins") is None or not any(
            importlib.util.find_spec(m) for m in CUDA_PLUGINS):
        return 'JAX\'s CUDA plugin is not installed (pip install -e ".[cuda]")'
    try:
        devices(name, 1)
    except NotImplementedError:
        return ("JAX's CUDA plugin did not start (on a machine without a GPU it starts only with "
                "JAX_PLATFORMS=cpu set before JAX starts)")
    return None


def deviceless_target(argv: list[str]) -> str | None:
    """The GPU of :data:`SPECS` that ``argv``'s ``--device=NAME`` names when this machine has no NVIDIA GPU (no
    ``/dev/nvidia0``...), or None: a tool that compiles for it must start JAX with ``JAX_PLATFORMS=cpu``.  Read
    before JAX starts."""
    named = next((a.split("=", 1)[1] for a in argv if a.startswith("--device=")), None)
    return named if named in SPECS and not glob.glob("/dev/nvidia[0-9]*") else None


def spec_text(name: str) -> str:
    """The text of ``name``'s XLA target spec (a ``GpuTargetConfigProto``). Raises KeyError: no spec."""
    return importlib.resources.files("jaxllm.platform.gpu_specs").joinpath(SPECS[name].spec).read_text()


def devices(name: str, count: int) -> list:
    """``count`` abstract devices of the GPU ``name`` (one host's: topology ``1x1xcount``), for ``jax.jit``'s
    shardings; ``compile()`` on them runs XLA:GPU.  Raises NotImplementedError: :func:`unavailable`."""
    from jax.experimental import topologies  # noqa: PLC0415

    return list(topologies.get_topology_desc(platform="cuda", target_config=spec_text(name),
                                             topology=f"1x1x{count}").devices)


# XLA:GPU sorts 32,768 keys or more with CUB, whose scratch size it asks the GPU for (jaxlib 0.10.2 has no
# deviceless data for it: cudaErrorInvalidDevice, e.g. the experts' sort of a micro batch's token copies); without
# a GPU, XLA's own sort
DEVICELESS = {"xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED"}
# What XLA:GPU's C++ prints only because no GPU is here (the sort it falls back to is what DEVICELESS asks for)
DEVICELESS_NOTES = re.compile(rb"W\d{4} [^\n]*sort_rewriter\.cc:\d+\] Using fallback sort algorithm")


@contextlib.contextmanager
def deviceless_notes_dropped() -> Iterator[None]:
    """Inside (a compile for GPUs that are not here): what is written to file descriptor 2 is held back, then
    written there without the lines of :data:`DEVICELESS_NOTES`."""
    sys.stderr.flush()
    console = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(console, 2)
            os.close(console)
            held.seek(0)
            os.write(2, b"".join(line for line in held if not DEVICELESS_NOTES.match(line)))


def compiler_options(environ: Mapping[str, str] | None = None) -> dict[str, bool | int | str]:
    """The XLA flags a CUDA run of ``python -m jaxllm.train`` gets from :mod:`jaxllm.platform.gpu_env` and
    :data:`DEVICELESS`, as ``compile(compiler_options=...)`` takes them: ``{flag without --: bool, int or text}``,
    less those the user's ``XLA_FLAGS`` (in ``environ``, default ``os.environ``) sets, whose values XLA reads
    (:func:`jaxllm.platform.gpu_env.settings_for` leaves out those this jaxlib's XLA no longer has)."""
    given = gpu_env.flag_names((os.environ if environ is None else environ).get("XLA_FLAGS", ""))
    typed = lambda v: {"true": True, "false": False}.get(v, int(v) if v.isdigit() else v)  # noqa: E731
    options = {**DEVICELESS, **{s.name[2:]: typed(s.value) for s in gpu_env.settings_for("cuda") if s.is_flag}}
    for name in [n for n in options if n.startswith("xla_gpu_pipeline_")]:  # an enum: a compile option takes its name
        options[name] = f"COLLECTIVE_PIPELINING_MODE_{options[name].upper()}"  # ("on" in XLA_FLAGS)
    return {k: v for k, v in options.items() if f"--{k}" not in given}


class Count(NamedTuple):
    """How often a kind of kernel occurs: ``program``, in the compiled program's text (a loop body once);
    ``step``, launched per execution (loop bodies times XLA's known trip counts; each branch of a
    conditional counted, an upper bound)."""

    program: int
    step: int


GROUPS = ("GEMM", "attention", "fusion", "copy/transpose", "collective", "other")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
                "send", "recv")
# (an async-start launches what its computation holds, :func:`executed`: jaxlib 0.12 runs a slice of a stacked array
# as a fusion in one, where 0.11 had a fusion-start)
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                "async-start", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency"}
_GEMM_CALLS = {"__cublas$gemm": "cuBLAS", "__cublas$lt$matmul": "cuBLASLt", "__cublas$lt$matmul$f8": "cuBLASLt"}
# Pallas kernels (Triton custom calls) that are GEMMs, by the kernel name's start (jaxllm_kernels.grouped_matmul)
_PALLAS_GEMMS = {"jaxllm_grouped_matmul": "Pallas grouped"}
_GEMM_FUSIONS = {"__triton_gemm": "Triton", "__triton_nested_gemm_fusion": "Triton", "__cudnn$fusion": "cuDNN"}
def _operand_dtypes(op: Op, body: list[Op], count: int = 2) -> str:
    """The distinct dtypes of ``op``'s first ``count`` operands (named in ``body``), sorted and joined: ``"bf16"``,
    ``"f8e4m3fn x f8e5m2"``."""
    types = {o.name: o.dtype for o in body}
    names = re.findall(r"%([\w.-]+)", op.rest.split("),", 1)[0])[:count]
    found = [types.get(n, "?") for n in names]
    return " x ".join(sorted(set(found)))


def _dot_dtypes(computation: str, bodies: dict[str, list[Op]]) -> str:
    """The operand dtypes of the ``dot`` inside a GEMM fusion's computation (``"?"`` if none is found)."""
    body = bodies.get(computation, [])
    dot = next((o for o in body if o.opcode in ("dot", "scaled-dot")), None)
    return "?" if dot is None else _operand_dtypes(dot, body)


def _fusion_kind(op: Op, bodies: dict[str, list[Op]]) -> tuple[str, str]:
    called = re.search(r"calls=%([\w.-]+)", op.rest)
    called = called.group(1) if called else ""
    backend = re.search(r'"kind":"([^"]+)"', op.rest)
    backend = backend.group(1) if backend else ""
    if backend in _GEMM_FUSIONS:
        return "GEMM", f"{_GEMM_FUSIONS[backend]} {_dot_dtypes(called, bodies)}"
    inner = {o.opcode for o in bodies.get(called, [])}
    if "transpose" in inner:
        return "copy/transpose", "transpose (fused)"
    root = bodies.get(called, [])[-1:]  # XLA prints the ROOT last
    if root and root[0].opcode == "copy":
        return "copy/transpose", "copy (fused)"
    if backend == "__triton":
        return "fusion", "Triton (normalization, softmax)"
    if backend == "__custom_fusion":
        config = re.search(r'"custom_fusion_config":\{"name":"(\w+)"', op.rest)
        return "fusion", f"custom: {config.group(1) if config else '?'}"
    kind = re.search(r"kind=k(\w+)", op.rest)
    label = {"Loop": "loop (elementwise)", "Input": "input (reduction)", "Output": "output"}
    return "fusion", label.get(kind.group(1), kind.group(1)) if kind else "?"


def classify(op: Op, body: list[Op], bodies: dict[str, list[Op]]) -> tuple[str, str] | None:
    """``(group, kind)`` of one instruction ``op`` of the computation ``body`` (:func:`parse`'s ``bodies``), or
    None where it launches nothing (the groups and kinds of :func:`kernels`)."""
    code = op.opcode
    if code in _NOT_KERNELS or code.endswith("-done"):
        return None
    if code == "fusion":
        return _fusion_kind(op, bodies)
    if code == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', op.rest)
        target = target.group(1) if target else "?"
        if target in _GEMM_CALLS:
            return "GEMM", f"{_GEMM_CALLS[target]} {_operand_dtypes(op, body)}"
        name = re.search(r'name = "(\w+)"', op.rest)
        gemm = name and next((v for k, v in _PALLAS_GEMMS.items() if name.group(1).startswith(k)), None)
        if target == "__gpu$xla.gpu.triton" and gemm:  # its float operands (the integer ones: the tile layout)
            floats = [t for t in _operand_dtypes(op, body, 3).split(" x ") if not re.fullmatch(r"[su]\d+", t)]
            return "GEMM", f"{gemm} {' x '.join(floats)}"
        if target.startswith("__cudnn$fmha"):
            return "attention", "cuDNN " + ("backward" if "Backward" in target else "forward") + f" ({target})"
        return "other", f"custom call {target}"
    base = code.removesuffix("-start")
    if base in _COLLECTIVES:
        return "collective", base
    if code == "fusion-start":  # an async slice or update of an array: a scan's stacked layer inputs, in host
        return "copy/transpose", "async slice or update"  # memory under model.remat=offload
    if code in ("copy", "transpose"):
        return "copy/transpose", code
    return "other", code


def kernels(hlo: str) -> dict[tuple[str, str], Count]:
    """The kernels of an XLA:GPU-compiled program by kind: ``{(group, kind): Count}``.

    Args:
      hlo: ``compiled.as_text()`` of a program compiled for a GPU (:func:`devices`).
    Returns:
      groups (:data:`GROUPS`) and kinds: ``GEMM``: ``"<library> <operand dtypes>"``, the library cuBLAS,
      cuBLASLt (``__cublas$lt$matmul$f8`` included: its operands say FP8), Triton or cuDNN (GEMM fusions),
      e.g. ``"cuBLASLt f8e4m3fn x f8e5m2"``, ``"Triton bf16"``; ``attention``: cuDNN's fused attention
      forward and backward; ``fusion``: XLA's loop, input (reduction) and Triton normalization fusions;
      ``copy/transpose``: copies and transposes, alone or as a fusion's work, and transfers to and from host
      memory; ``collective``: all-reduce,
      all-gather, ... (async pairs once); ``other``: every other launch, by opcode or custom-call target.
      Each with its :class:`Count` in the program and per step.
    """
    entry, bodies = parse(hlo)
    runs: collections.Counter[str] = collections.Counter()  # executed computation -> runs per step

    def visit(name: str, times: int, depth: int) -> None:
        if depth > 64 or name not in bodies:
            return
        runs[name] += times
        for op in bodies[name]:
            for called, n in executed(op):
                visit(called, times * n, depth + 1)

    if entry is not None:
        visit(entry, 1, 0)
    counts: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for name, times in runs.items():
        for op in bodies[name]:
            kind = classify(op, bodies[name], bodies)
            if kind is not None:
                counts[kind][0] += 1
                counts[kind][1] += times
    return {k: Count(*v) for k, v in sorted(counts.items(), key=lambda kv: (GROUPS.index(kv[0][0]), kv[0][1]))}


def gemm_loops(hlo: str) -> int:
    """Loops of the XLA:GPU-compiled program ``hlo`` that launch a GEMM and whose trip count XLA does not know (a
    loop over data-dependent tiles): :func:`kernels` counts their GEMMs once per run, a lower bound."""
    _, bodies = parse(hlo)

    def launches_gemm(name: str, depth: int = 0) -> bool:
        for op in bodies.get(name, []):
            kind = classify(op, bodies[name], bodies)
            if (kind is not None and kind[0] == "GEMM") or (
                    depth < 64 and any(launches_gemm(c, depth + 1) for c, _ in executed(op))):
                return True
        return False

    loops = [op for ops in bodies.values() for op in ops if op.opcode == "while" and "known_trip_count" not in op.rest]
    return sum(launches_gemm(re.search(r"body=%([\w.-]+)", op.rest).group(1)) for op in loops)


def executed(op: Op) -> list[tuple[str, int]]:
    """The computations ``op`` runs as sequences of kernels, each with its runs per run of ``op``: a loop's body
    (its known trip count, else 1) and condition (one more), a conditional's branches (each once: an upper
    bound), a call's callee, an ``async-start``'s computation; not a fusion's or a reduction's computation."""
    if op.opcode == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', op.rest)
        n = int(trips.group(1)) if trips else 1
        body, cond = re.search(r"body=%([\w.-]+)", op.rest), re.search(r"condition=%([\w.-]+)", op.rest)
        return [(body.group(1), n)] * bool(body) + [(cond.group(1), n + 1)] * bool(cond)
    if op.opcode == "conditional":
        named = re.findall(r"(?:true|false)_computation=%([\w.-]+)", op.rest)
        branches = re.search(r"branch_computations=\{([^}]*)\}", op.rest)
        return [(c, 1) for c in named + (re.findall(r"%([\w.-]+)", branches.group(1)) if branches else [])]
    if op.opcode == "call":
        return [(c, 1) for c in re.findall(r"to_apply=%([\w.-]+)", op.rest)]
    if op.opcode == "async-start":
        return [(c, 1) for c in re.findall(r"calls=%([\w.-]+)", op.rest)]
    return []


def gemm_workspace(hlo: str) -> int:
    """Bytes of the largest cuBLAS / cuBLASLt workspace in the program: XLA gives each GEMM call an ``s8[N]``
    buffer as its second output, so the workspaces are in ``memory_analysis()``'s temporaries already."""
    sizes = [int(n) for n in re.findall(r"\(\S+, s8\[(\d+)\]\{0\}\) custom-call\(.*custom_call_target=\"__cublas",
                                       hlo)]
    return max(sizes, default=0)


def cudnn_workspace(hlo: str) -> int:
    """An estimate of the largest cuDNN attention workspace in the program, in bytes, which XLA sizes only
    on a device (``u8[0]`` here) and ``memory_analysis()`` leaves out.

    The backward pass's, from cuDNN frontend's SDPA backward node (NVIDIA/cudnn-frontend,
    ``scaled_dot_product_flash_attention.h``, ``SDPABackwardNode``) on Hopper: the ``dP`` workspace,
    ``batch x heads x q_len x kv_len x 2`` bytes (lengths rounded up to 64) where that is at most 256 MiB,
    else a float32 ``dQ`` accumulator, ``batch x heads x q_len x head_dim x 4``; and the float32 softmax
    sum, ``batch x heads x q_len x 4``.  Read off the backward call's ``dQ`` output ``[batch, heads, q_len,
    head_dim]`` with ``kv_len = q_len`` (self-attention)."""
    best = 0
    for shape in re.findall(r"= \((?:bf16|f16)\[([\d,]+)\]\{[^}]*\}, .*custom_call_target=\"__cudnn\$fmha\w*Backward",
                            hlo):
        b, h, s, d = (int(n) for n in shape.split(","))
        padded = 64 * math.ceil(s / 64)
        dp = b * h * padded * padded * 2
        best = max(best, (dp if dp <= 256 * 2**20 else b * h * s * d * 4) + b * h * s * 4)
    return best


def table(counts: Mapping[tuple[str, str], Count]) -> str:
    """:func:`kernels`' counts as text: one line per kind, grouped, with both counts."""
    lines = [f"  {'kernel':<58} {'in program':>10} {'per step':>10}"]
    group = None
    for (g, kind), c in counts.items():
        if g != group:
            group = g
            total = [sum(v[i] for (gg, _), v in counts.items() if gg == g) for i in (0, 1)]
            lines.append(f"  {g:<58} {total[0]:>10} {total[1]:>10}")
        lines.append(f"    {kind:<56} {c.program:>10} {c.step:>10}")
    return "\n".join(lines)
