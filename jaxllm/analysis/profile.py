"""Where a training step's device time goes: a JAX profiler trace of a few steps, and its table by category.

:func:`capture` runs steps under :func:`jax.profiler.trace` (TensorBoard/XProf's XSpace and a Perfetto
trace, ``DIR/plugins/profile/<run>/``); :func:`kernels` reads the device's kernels from the Perfetto trace
(its own JSON format: one event per kernel, with its name and duration); :func:`program` reads the optimized
HLO of the step; :func:`summary` puts each kernel in one of :data:`CATEGORIES` and adds them up per step, with
the idle time (the step's wall time that no kernel covers) and each category's FLOP/s and bytes/s against
the device's peaks.

Why not xprof's per-operation tables: XLA:GPU runs the step's loops as CUDA graphs (command buffers), and
the profiler then attributes every kernel to its graph (``hlo_op: command_buffer_N``), not to an HLO
operation.  The kernels keep their names, though: an XLA fusion's kernel is the fusion's name (``%fusion.12``
-> ``fusion_12``), so it is found in the program, with its operands, results and JAX op name (the named
scopes); library kernels (cuBLAS ``nvjet_*``/``*gemm*``, cuDNN's ``*sdpa*``/``*fmha*``) are known by name;
and a graph whose every mapped kernel lies in one scope (the loss's chunk loop) gives that scope to its
library kernels too.

The categories follow the program's structure first: the output layer and cross entropy (the
``output_loss`` scope, :meth:`jaxllm.model.gpt.GPT.output_loss`) and the optimizer (the ``optimizer`` scope,
:func:`jaxllm.runtime.step.make_train_step`: gradient norm, clipping, update, the non-finite guard), whatever
kernels they run; then by kernel: GEMMs (the layer matmuls), attention, copies (copy, transpose, concatenate,
dynamic-update-slice, memcpy, memset: data moved, not computed), collectives, and the remaining fusions
(norms, activations, bias and residual adds, gradient reductions and accumulation).

FLOP rates come from the model's count (:func:`jaxllm.runtime.flops.hardware_flops_by_kind`: the GEMMs',
attention's and output layer's matmul FLOPs over their kernels' time); byte rates from the program: each
XLA kernel's operands and results once (a lower bound of its memory traffic).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
from collections import Counter, defaultdict

import jax

from jaxllm.platform import hlo, xla_gpu

CATEGORIES = ("gemm", "attention", "elementwise", "loss", "optimizer", "copy", "collective", "idle")
LABELS = {"gemm": "GEMMs (layer matmuls)", "attention": "attention", "elementwise": "norm / element-wise fusions",
          "loss": "output layer + loss", "optimizer": "optimizer update", "copy": "copies / transposes",
          "collective": "collectives", "idle": "idle (no kernel running)"}
SCOPES = {"loss": "output_loss", "optimizer": "optimizer"}  # jax.named_scope names in the model and the step
COMPUTE = ("gemm", "attention")  # matmul-bound: their rate is FLOP/s (the others' bytes/s)

# library kernels that are not in the program (inside a custom call, or the runtime's), by their names
_BY_NAME = (("attention", re.compile(r"sdpa|fmha|flash|attention", re.I)),
            ("gemm", re.compile(r"^nvjet|gemm|xmma|cutlass|matmul", re.I)),
            ("copy", re.compile(r"memcpy|memset", re.I)),
            ("collective", re.compile(r"nccl|rccl", re.I)))
_GROUPS = {"GEMM": "gemm", "attention": "attention", "collective": "collective", "copy/transpose": "copy"}
MOVES = ("concatenate", "dynamic-update-slice", "dynamic-slice", "slice", "pad")  # a fusion that moves data


def capture(step, steps: int, logdir: str) -> str:
    """Runs ``step()`` ``steps`` times under the JAX profiler (each call must end with the step's results
    on the host, so that the trace holds whole steps); returns the folder of this trace (its
    ``*.xplane.pb`` and ``perfetto_trace.json.gz``) under ``logdir``.  Raises RuntimeError when the
    profiler wrote none."""
    os.makedirs(logdir, exist_ok=True)
    pattern = os.path.join(logdir, "plugins", "profile", "*", "*perfetto_trace.json.gz")
    before = set(glob.glob(pattern))
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(steps):
            step()
    new = sorted(set(glob.glob(pattern)) - before)
    if not new:
        raise RuntimeError(f"the JAX profiler wrote no Perfetto trace under {logdir}")
    return os.path.dirname(new[-1])


def kernels(trace: str) -> list[dict]:
    """The device kernels (and memory copies) of a Perfetto trace ``*.json.gz`` written by
    :func:`capture`: one dict per run, ``name``, ``us`` (duration, microseconds), ``graph`` (the CUDA
    graph / HLO op the profiler gives, e.g. ``command_buffer_185``), ``details`` (CUPTI's launch: ``"regs:16 ...
    grid:4608,1,1 block:256,1,1 ..."``, empty for a memset or copy); the events of processes named
    ``/device:...`` (GPUs), in time order.  Empty for a CPU's trace (XLA:CPU's operations are not traced)."""
    with gzip.open(trace, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    runs = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in devices), key=lambda e: e["ts"])
    return [{"name": e["name"], "us": float(e.get("dur", 0.0)), "graph": e.get("args", {}).get("hlo_op", ""),
             "details": e.get("args", {}).get("kernel_details", "")} for e in runs]


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction of the optimized program: its kind (:func:`jaxllm.platform.xla_gpu.classify`'s
    ``(group, kind)``, None where it launches nothing), a fusion's root opcode, JAX's op name (with the named
    scopes) and the bytes it reads and writes (each array once)."""

    kind: tuple[str, str] | None
    root: str
    op_name: str
    bytes: int


def _fusion_bytes(body: list[hlo.Op]) -> int:
    """Bytes a fused computation reads and writes, each array once: a parameter read only through
    ``dynamic-slice`` (directly or through bitcasts) counts its slices (a scanned layer's weights), the buffer a
    ``dynamic-update-slice`` writes in place counts only its update."""
    ops = {o.name: o for o in body}
    origin = {}  # a bitcast (of a bitcast ...) of a parameter -> that parameter
    for o in body:
        if o.opcode == "bitcast" and o.operands and (o.operands[0] in origin or ops.get(o.operands[0], o).opcode
                                                     == "parameter"):
            origin[o.name] = origin.get(o.operands[0], o.operands[0])
    uses = defaultdict(list)  # parameter -> (user, operand index), through its bitcasts
    for o in body:
        if o.opcode == "bitcast" and o.name in origin:
            continue
        for i, name in enumerate(o.operands):
            uses[origin.get(name, name)].append((o, i))
    total = 0
    for o in body:
        if o.opcode != "parameter" or (uses[o.name] and all((u.opcode, i) == ("dynamic-update-slice", 0)
                                                           for u, i in uses[o.name])):
            continue  # a buffer written in place: its update is counted as the result
        slices = [u.type for u, i in uses[o.name] if u.opcode == "dynamic-slice" and i == 0]
        whole = not slices or len(slices) != len(uses[o.name])
        total += hlo.type_bytes(o.type) if whole else sum(map(hlo.type_bytes, slices))
    root = body[-1] if body else None
    if root is not None and root.opcode == "dynamic-update-slice":
        return total + hlo.type_bytes(ops[root.operands[1]].type)
    return total + (hlo.type_bytes(root.type) if root is not None else 0)


def program(hlo_text: str) -> dict[str, Instruction]:
    """The instructions of an optimized HLO module (``compiled.as_text()``) by name."""
    _, bodies = hlo.parse(hlo_text)
    types = {o.name: o.type for body in bodies.values() for o in body}
    out = {}
    for body in bodies.values():
        for o in body:
            called = re.search(r"calls=%([\w.-]+)", o.rest)
            fused = bodies.get(called.group(1), []) if o.opcode in ("fusion", "fusion-start") and called else []
            size = (_fusion_bytes(fused) if fused else
                    hlo.type_bytes(o.type) + sum(hlo.type_bytes(types.get(n, "")) for n in o.operands))
            found = re.search(r'op_name="([^"]+)"', o.rest)
            out[o.name] = Instruction(xla_gpu.classify(o, body, bodies), fused[-1].opcode if fused else o.opcode,
                                      found.group(1) if found else "", size)
    return out


def _in_scope(op_name: str, scope: str) -> bool:
    """Whether JAX's op name ``a/b(c)/d`` passes through the named scope ``scope`` (also inside the
    ``jvp(...)``/``transpose(...)`` wrappers that differentiation adds)."""
    return re.search(rf"(^|[/(]){re.escape(scope)}($|[/)])", op_name or "") is not None


def _scope(op_name: str) -> str | None:
    return next((c for c, scope in SCOPES.items() if _in_scope(op_name, scope)), None)


def categorize(instruction: Instruction | None, kernel: str = "") -> str:
    """The category (:data:`CATEGORIES`, not ``idle``) of a kernel: by its instruction's named scope, then
    its kind (a fusion whose root only moves data, a concatenation or a slice, is a copy); a kernel the
    program does not name (a library's, the runtime's memcpy) by its name ``kernel``."""
    if instruction is None:
        return next((c for c, pattern in _BY_NAME if pattern.search(kernel)), "elementwise")
    scope = _scope(instruction.op_name)
    if scope:
        return scope
    group = instruction.kind[0] if instruction.kind else "other"
    if instruction.root in ("dot", "scaled-dot", "convolution"):  # a matmul XLA left to its own emitter
        return "gemm"
    if group == "fusion" and instruction.root in MOVES:
        return "copy"
    return _GROUPS.get(group, "elementwise")


def resolve(kernel: str, prog: dict[str, Instruction]) -> str | None:
    """The name of the HLO instruction of ``prog`` an XLA kernel runs (``loop_add_fusion_5`` ->
    ``loop_add_fusion.5``), or None (a library's kernel)."""
    for name in (kernel, re.sub(r"_(\d+)$", r".\1", kernel), re.sub(r"_(\d+)(_|$)", r".\1\2", kernel).replace(
            "_double_buffer_clone", ".double_buffer_clone")):
        if name in prog:
            return name
    return None


def _instruction(kernel: str, prog: dict[str, Instruction]) -> Instruction | None:
    name = resolve(kernel, prog)
    return None if name is None else prog[name]


def _graph_scope(scopes: Counter) -> str | None:
    """The scope (a key of :data:`SCOPES`) of a CUDA graph whose mapped kernels are at least 3/4 in it (the
    loss's chunk loop also runs its loop counter and slicing), else None."""
    scope, n = scopes.most_common(1)[0] if scopes else (None, 0)
    return scope if scope is not None and n >= 0.75 * sum(scopes.values()) else None


def summary(runs: list[dict], prog: dict[str, Instruction], steps: int, step_time_s: float,
            flops: dict[str, float] | None = None, peak_flops: float | None = None,
            peak_bandwidth: float | None = None) -> list[dict]:
    """Per category, the device time of one step and its rates.

    Args:
      runs: :func:`kernels` of a trace of ``steps`` steps; prog: :func:`program` of the step.
      step_time_s: the wall time of one step (seconds), for the idle time and the shares.
      flops: matmul FLOPs per step by category (:func:`jaxllm.runtime.flops.hardware_flops_by_kind`).
      peak_flops, peak_bandwidth: the device's peak FLOP/s and memory bytes/s (None: not shown).
    Returns:
      One dict per category present: ``category``, ``label``, ``ms_per_step``, ``share`` (of the step
      time), ``kernels`` (runs per step), ``tflops`` (TFLOP/s while it runs), ``tbps`` (TB/s, the XLA
      kernels' operands and results; not for :data:`COMPUTE`), ``flops_fraction``, ``bandwidth_fraction`` of
      the peaks (None where unknown); ordered by time, ``idle`` included.  Empty when ``runs`` is (a CPU's trace).
    """
    if not runs:
        return []
    found = [(r, _instruction(r["name"], prog)) for r in runs]
    graphs = defaultdict(Counter)  # the scopes of each CUDA graph's mapped kernels
    for r, ins in found:
        if ins is not None:
            graphs[r["graph"]][_scope(ins.op_name)] += 1
    totals = defaultdict(lambda: {"us": 0.0, "bytes": 0.0, "runs": 0})
    for r, ins in found:
        category = categorize(ins, r["name"])
        if ins is None:
            category = _graph_scope(graphs.get(r["graph"], Counter())) or category
        t = totals[category]
        t["us"] += r["us"]
        t["bytes"] += ins.bytes if ins is not None else 0
        t["runs"] += 1
    busy = sum(t["us"] for t in totals.values())
    totals["idle"] = {"us": max(0.0, step_time_s * 1e6 * steps - busy), "bytes": 0.0, "runs": 0}
    out = []
    for category, t in sorted(totals.items(), key=lambda kv: -kv[1]["us"]):
        seconds = t["us"] * 1e-6 / steps
        tflops = (flops or {}).get(category, 0.0) / seconds / 1e12 if seconds else 0.0
        tbps = t["bytes"] / steps / seconds / 1e12 if seconds and category not in COMPUTE else 0.0
        out.append({"category": category, "label": LABELS[category], "ms_per_step": 1e3 * seconds,
                    "share": seconds / step_time_s, "kernels": t["runs"] // steps, "tflops": tflops or None,
                    "tbps": tbps or None,
                    "flops_fraction": tflops * 1e12 / peak_flops if tflops and peak_flops else None,
                    "bandwidth_fraction": tbps * 1e12 / peak_bandwidth if tbps and peak_bandwidth else None})
    return out


def markdown(table: list[dict]) -> str:
    """:func:`summary`'s rows as a Markdown table."""
    pct = lambda x: "-" if x is None else f"{100 * x:.0f} %"  # noqa: E731
    num = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
    lines = ["| category | ms/step | share | kernels/step | TFLOP/s | of peak | TB/s | of peak |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['ms_per_step']:.2f} | {pct(r['share'])} | {r['kernels']} | {num(r['tflops'])} | "
              f"{pct(r['flops_fraction'])} | {num(r['tbps'])} | {pct(r['bandwidth_fraction'])} |" for r in table]
    return "\n".join(lines)
