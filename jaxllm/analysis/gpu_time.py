"""The step time of a compiled GPU program, predicted kernel by kernel: ``jaxllm.plan --device=H100``.

A model, not a measurement.  :func:`census` reads the optimized HLO of a program XLA:GPU compiled
(``compiled.as_text()``; :mod:`jaxllm.platform.xla_gpu` compiles one without a GPU) in the order it runs,
the ``while`` loops' bodies times their known trip counts, and says what each kernel is and does: its kind
(:data:`KINDS`), its FLOPs (a GEMM's ``2 m n k``, cuDNN attention's four ``s x s x d`` products per head,
halved for a causal mask, 2.5 times that backward), the bytes it reads and writes (each array once, a
dynamic slice's slice only, an in-place update's update only: :func:`jaxllm.analysis.profile.program`), the
element-wise operations a fusion computes per byte, and a collective's message and group; and the profile's
category (:data:`jaxllm.analysis.profile.CATEGORIES`) the kernel's time falls in.  :func:`predict` prices
each kernel on a :class:`Device`:

    time = overhead[kind] + flops / (peak FLOP/s of its dtype x efficiency[kind])
                          + bytes / (memory bandwidth x efficiency[kind]) + ops / element rate

one linear cost per kind, whose coefficients :data:`FITTED` holds (fitted by
:func:`jaxllm.analysis.gpu_fit.fit` to the kernels of the H100 traces of 2026-11-26; each constant's value,
data and meaning are there; a GPU's bandwidth by :data:`BANDWIDTH` where its trace says: the H200's of
2026-11-27), plus a gap between consecutive kernels (the GPU idle while the next launches);
collectives by NCCL's ring algorithms over the link the group spans (:func:`collective_time`, constants
assumed from published nccl-tests figures: no multi-GPU trace exists to fit them).  The kernels run one after
another on one stream (true of the one-GPU traces: XLA:GPU ran every kernel on one stream); the collectives run on
a network stream beside it where XLA's latency-hiding scheduler put each one's start and done (:func:`timeline`),
and the step counts only what they leave exposed (predicted, never yet measured on several GPUs).  A program
compiled here (the installed jaxlib, no autotuning) is scaled by :data:`DEVICELESS`, fitted on the profiled steps.

What it ignores: clocks (a hot GPU's lower clock is inside the fitted efficiencies of the H100 of the fit),
the L2 cache (a kernel that rereads what the one before wrote is priced as a read from memory), cuBLAS's
choice of algorithm by shape beyond its fitted overhead, and the host (a step whose host work outlasts the
GPU's is not seen).  FP8 GEMMs are priced at the bfloat16 GEMMs' fitted efficiency of the FP8 peak (no FP8
kernel in the fit); other devices by their datasheet peaks at the H100's efficiencies (the H200's bandwidth by its
own trace, :data:`BANDWIDTH`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from jaxllm.analysis import collectives as comms
from jaxllm.analysis import profile
from jaxllm.analysis.step_time import crosses_nodes
from jaxllm.platform import hlo, xla_gpu
from jaxllm.platform.hardware import GPU_KINDS, NVLINK_BANDWIDTH, lookup_peak_flops, memory_bandwidth

KINDS = ("gemm", "attention_fwd", "attention_bwd", "loop", "reduction", "triton", "copy", "memcpy", "collective",
         "unpriced")  # unpriced: a custom call the model has no cost for (a Pallas attention kernel): see refusal
_NO_WORK = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "broadcast", "reshape", "slice",
            "dynamic-slice", "dynamic-update-slice", "concatenate", "transpose", "copy", "iota", "pad", "reverse"}
_TRANSCENDENTAL = {"exponential", "log", "tanh", "rsqrt", "sqrt", "power", "logistic", "erf", "exponential-minus-one",
                   "log-plus-one", "sine", "cosine", "cbrt", "atan2", "divide"}


@dataclasses.dataclass
class Kernel:
    """One kernel-launching instruction of a program and what one run of it does.

    Attributes:
      name: the HLO instruction (``loop_add_fusion.5``, ``custom-call.12``).
      kind: the model's kind (:data:`KINDS`).
      category: the profile's category (:data:`jaxllm.analysis.profile.CATEGORIES`).
      runs: runs per step (loop trip counts multiplied).
      flops: FLOPs of one run (GEMMs and attention; 0 for the others).
      bytes: bytes one run reads and writes.
      ops: element-wise operations of one run (a fusion's arithmetic: one per output element of each operation,
        :data:`_TRANSCENDENTAL` ones 4, a reduction's per input element).
      dtype: the operands' element type of a GEMM (``bf16``, ``f8e4m3fn``, ``f32``), else "".
      collective: a collective's :func:`jaxllm.analysis.collectives.message` (kind, mesh axes, group size,
        buffer bytes, bytes each device sends, latency terms); None for others and a group of one device.
    """

    name: str
    kind: str
    category: str
    runs: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    ops: float = 0.0
    dtype: str = ""
    collective: tuple | None = None


def walk(hlo_text: str, dones: bool = False):
    """The kernel-launching instructions of an optimized HLO module in the order one execution runs them:
    ``(op, its computation's body, every computation's body)`` per run; a ``while`` loop's body repeated its known
    trip count (1 when unknown; its condition, a scalar compare, left out), each branch of a conditional once (an
    upper bound), a call's and an ``async-start``'s callee in place; with ``dones``, an asynchronous operation's
    ``*-done`` too, where it is scheduled."""
    entry, bodies = hlo.parse(hlo_text)

    def visit(name: str, depth: int):
        if depth > 64 or name not in bodies:
            return
        for op in bodies[name]:
            if op.opcode == "while":
                body = re.search(r"body=%([\w.-]+)", op.rest)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', op.rest)
                for _ in range(int(trips.group(1)) if trips else 1):
                    yield from visit(body.group(1) if body else "", depth + 1)
            elif op.opcode in ("conditional", "call", "async-start"):
                for called, _ in xla_gpu.executed(op):
                    yield from visit(called, depth + 1)
            elif (dones and op.opcode.endswith("-done")) or xla_gpu.classify(op, bodies[name], bodies) is not None:
                yield op, bodies[name], bodies

    if entry is not None:
        yield from visit(entry, 0)


def _dims(type_text: str) -> list[int]:
    found = re.search(r"\[([\d,]*)\]", type_text)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def _operand_types(op: hlo.Op, body: list[hlo.Op]) -> list[str]:
    types = {o.name: o.type for o in body}
    return [types.get(n, "") for n in op.operands]


def _dot_flops(op: hlo.Op, body: list[hlo.Op]) -> float:
    """``2 x (output elements) x (contracted size)`` of a ``dot`` or a cuBLAS call (its first output, the
    product; its ``lhs_contracting_dims`` of the first operand)."""
    lhs = _dims(_operand_types(op, body)[0])
    found = re.search(r'lhs_contracting_dim(?:ension)?s"?\s*[:=]\s*[\[{]([^\]}]*)[\]}]', op.rest)
    contracted = [int(d) for d in re.findall(r"\d+", found.group(1))] if found else []
    k = math.prod(lhs[d] for d in contracted if d < len(lhs))
    return 2.0 * math.prod(_dims(op.type.lstrip("("))) * k


def _attention_flops(op: hlo.Op) -> float:
    """cuDNN attention's matmul FLOPs: ``4 b h s_q s_k d`` forward (``Q K^T`` and ``P V``), 2.5 times that
    backward (``Q K^T`` again, ``dV``, ``dP``, ``dQ``, ``dK``); for a causal mask the keys a query sees on average,
    ``s_k / 2`` (the kernel skips the masked tiles), with a sliding window ``w`` ``w - w^2 / (2 s_k)`` (as
    :func:`jaxllm.runtime.flops.flops_per_token`).  ``[b, h, s_q, s_k]`` from the call's
    ``intermediate_tensor_shape``, ``d`` the first output's last dimension."""
    scores = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', op.rest)
    b, h, sq, sk = ([int(d) for d in re.findall(r"\d+", scores.group(1))] if scores else [0, 0, 0, 0])[:4]
    d = _dims(op.type.lstrip("("))[-1]
    mask = re.search(r'"mask_type":\s*"(\w+)"', op.rest)
    window = re.search(r'"sliding_window_length":\s*(\d+)', op.rest)
    w = int(window.group(1)) if window else 0
    keys = (w - w * w / (2 * sk) if 0 < w < sk else sk / 2) if mask and "CAUSAL" in mask.group(1) else sk
    backward = "Backward" in op.rest.split("custom_call_target=")[-1][:60]
    return 4.0 * b * h * sq * keys * d * (2.5 if backward else 1.0)


def _ops(body: list[hlo.Op]) -> float:
    """Element-wise operations of a fused computation (:class:`Kernel`'s ``ops``)."""
    types = {o.name: o.type for o in body}
    total = 0.0
    for o in body:
        if o.opcode in _NO_WORK or o.opcode == "fusion":
            continue
        elements = math.prod(_dims(types[o.operands[0]] if o.opcode == "reduce" and o.operands else o.type))
        total += elements * (4 if o.opcode in _TRANSCENDENTAL else 1)
    return total


def _kind(group: str, label: str, root: str) -> str:
    """The model's kind of a kernel from :func:`jaxllm.platform.xla_gpu.classify`'s ``(group, label)`` and its
    fusion's root opcode."""
    if group == "GEMM" or root in ("dot", "scaled-dot"):
        return "gemm"
    if group == "attention":
        return "attention_bwd" if "backward" in label else "attention_fwd"
    if group == "collective":
        return "collective"
    if label.startswith("custom call"):  # not cuBLAS, cuDNN or a Pallas GEMM: work the model cannot see
        return "unpriced"
    if label in ("custom: dynamic_slice_fusion", "async slice or update") or root == "dynamic-slice":
        return "memcpy"  # a slice or an update of an array, run as a memory copy
    if group == "copy/transpose" or root in profile.MOVES:
        return "copy"
    if label.startswith("Triton"):
        return "triton"
    return "reduction" if label.startswith("input") else "loop"


def census(hlo_text: str, mesh_shape: dict | None = None) -> list[Kernel]:
    """The kernels of one execution of an XLA:GPU-compiled program, each instruction once with its runs.

    Args:
      hlo_text: ``compiled.as_text()`` of a program compiled for a GPU (``__cublas``/``__cudnn`` custom calls,
        Triton and XLA fusions).
      mesh_shape: ``{axis: size}`` of the mesh it runs on, for the axes a collective spans (None: one device).
    Returns:
      :class:`Kernel` per kernel-launching instruction, in first-run order.
    """
    prog = profile.program(hlo_text)
    found: dict[str, Kernel] = {}
    devices = math.prod((mesh_shape or {"": 1}).values())
    for op, body, bodies in walk(hlo_text):
        if op.name in found:
            found[op.name].runs += 1
            continue
        ins = prog[op.name]
        group, label = ins.kind  # profile.program's xla_gpu.classify of it
        fused = bodies.get(next(iter(re.findall(r"calls=%([\w.-]+)", op.rest)), ""), [])
        k = Kernel(op.name, _kind(group, label, ins.root), profile.categorize(ins), 1, bytes=float(ins.bytes))
        if k.kind == "gemm":
            dot = next((o for o in fused if o.opcode in ("dot", "scaled-dot")), None)
            k.flops = _dot_flops(dot, fused) if dot is not None else _dot_flops(op, body)
            k.dtype = label.split(" ", 1)[1].split(" x ")[0] if " " in label else "bf16"
        elif k.kind.startswith("attention"):
            k.flops = _attention_flops(op)
        elif k.kind == "collective":
            k.collective = comms.message(op, devices, mesh_shape or {"": 1})
        elif fused:
            k.ops = _ops(fused)
        found[op.name] = k
    return list(found.values())


# Per kind, the linear cost of one run: (overhead s, s per FLOP at the dtype's peak, s per byte at the memory
# bandwidth, s per element-wise operation), as fractions of the device: FLOP efficiency e_f = 1 / (a x peak),
# bandwidth efficiency e_b = 1 / (b x bandwidth).  Fitted by jaxllm.analysis.gpu_fit.fit (its docstring: the data,
# the weights) to the 4 H100 traces of benchmarks/results/2026-11-26-h100 (GPT1_5B, micro batches 4 and 8, remat
# full and save_dots: 65,788 kernel runs, two steps each); tests/test_gpu_time.py fits again and compares.  What
# each says:
FITTED: dict[str, dict[str, float]] = {
    # cuBLAS GEMMs (and XLA's Triton GEMM fusions): no overhead beyond the gap; the FLOP and byte terms together give
    # a 16384 x 1536 x 6144 bfloat16 GEMM 81 % of the peak (measured 80 %), one of K = 1536 76 % (measured 73 %), the
    # loss head's float32 products less (their bytes); efficiencies above 1 are a linear fit's terms, not rates
    "gemm": {"overhead_s": 0.0, "flop_efficiency": 0.935, "bandwidth_efficiency": 1.62, "s_per_op": 0.0},
    # cuDNN flash attention (sequence 2048, head size 64, causal; only that shape was traced): 35 % of the peak
    # forward, 28 % backward (its three kernels)
    "attention_fwd": {"overhead_s": 4.22e-06, "flop_efficiency": 0.352, "bandwidth_efficiency": 0.0, "s_per_op": 0.0},
    "attention_bwd": {"overhead_s": 4.77e-06, "flop_efficiency": 0.277, "bandwidth_efficiency": 0.0, "s_per_op": 0.0},
    # XLA's loop (element-wise) fusions, input (reduction) fusions and Triton normalization / softmax fusions: a
    # launch's microseconds, the bytes at about the bandwidth (the L2 cache serves some rereads: above 1), and the
    # fused arithmetic at 23, 34 and 14 T operations/s
    "loop": {"overhead_s": 1.34e-06, "flop_efficiency": 0.0, "bandwidth_efficiency": 1.16, "s_per_op": 4.44e-14},
    "reduction": {"overhead_s": 2.28e-06, "flop_efficiency": 0.0, "bandwidth_efficiency": 0.877, "s_per_op": 2.94e-14},
    "triton": {"overhead_s": 1.14e-06, "flop_efficiency": 0.0, "bandwidth_efficiency": 0.851, "s_per_op": 7.34e-14},
    # copies and transposes (XLA fusions), and the memory copies of a stacked array's slices and updates
    "copy": {"overhead_s": 9.15e-07, "flop_efficiency": 0.0, "bandwidth_efficiency": 1.06, "s_per_op": 0.0},
    "memcpy": {"overhead_s": 1.84e-06, "flop_efficiency": 0.0, "bandwidth_efficiency": 0.947, "s_per_op": 0.0},
    # the GPU idle before each launch (within and between XLA's CUDA graphs; cuBLAS's workspace memsets included)
    "gap": {"overhead_s": 8.78e-07, "flop_efficiency": 0.0, "bandwidth_efficiency": 0.0, "s_per_op": 0.0},
}


# A program compiled here is the installed jaxlib's XLA:GPU without autotuning (0.12.0.1 on 2026-12-02); the GPUs of the
# traces ran jaxlib 0.11.2's, with it.  The same configs at the same commits compiled here predict less than the
# programs the GPU ran: the 5 profiled steps' own HLO over their compile here, 1.025-1.049, the mean this factor
# (fitted and checked by benchmarks/step_time_check.py's check_fit; with jaxlib 0.10.2's compile it was 1.03, over the
# 4 H100 steps).  :func:`predict` applies it to every category of a program compiled here (``deviceless``).
DEVICELESS = 1.04

# Per GPU, the factor on its datasheet memory bandwidth that its kernels' bytes are priced at, where a trace of it
# says (FITTED's bandwidth efficiencies are the H100's): fitted by jaxllm.analysis.gpu_fit.bandwidth to the kernels of
# the H200's profiled step of 2026-11-27 outside its optimizer (its padded gradients' fusions, 231 ms for a modelled
# 14: left out), 5,550 kernel runs of two steps.  The H200's kernels reached 1.43 x 0.87 = 1.25x the H100's bandwidth,
# not the datasheets' 1.43x (4.8 against 3.35 TB/s); the H200's bfloat16 records were predicted 6-10 % low without it.
BANDWIDTH: dict[str, float] = {"H200": 0.87}


@dataclasses.dataclass(frozen=True)
class Device:
    """What the model knows of a GPU: ``name`` (a ``--device`` key of :data:`jaxllm.platform.hardware.GPU_KINDS`),
    ``peaks`` (dense FLOP/s by operand type: ``bf16``, ``f16``, ``f8``, ``f32``), ``bandwidth`` (memory bytes/s),
    ``links`` (bytes/s one GPU sends inside its node and off it, :data:`jaxllm.platform.hardware.NVLINK_BANDWIDTH`),
    ``per_node`` (GPUs a node holds)."""

    name: str
    peaks: dict
    bandwidth: float
    links: tuple[float, float]
    per_node: int = 8


def device(name: str, per_node: int = 8) -> Device:
    """The :class:`Device` of a ``--device`` name, from the datasheet tables of :mod:`jaxllm.platform.hardware`:
    float32 GEMMs at the TF32 tensor-core rate (XLA's default precision on these GPUs), half the bfloat16 one; the
    memory bandwidth the datasheet's times :data:`BANDWIDTH`'s factor where one was fitted.

    Raises:
      ValueError: ``name`` is not one of :data:`jaxllm.platform.hardware.GPU_KINDS`.
    """
    if name not in GPU_KINDS:
        raise ValueError(f"--device={name!r}: the step-time model knows {', '.join(GPU_KINDS)}")
    kind = GPU_KINDS[name]
    bf16 = lookup_peak_flops(kind, "bfloat16")
    fp8 = lookup_peak_flops(kind, "float8_e4m3fn")
    peaks = {"bf16": bf16[0], "f16": bf16[0], "f32": bf16[0] / 2, "f8": fp8[0] if fp8 else bf16[0]}
    return Device(name, peaks, memory_bandwidth(kind) * BANDWIDTH.get(name, 1.0), NVLINK_BANDWIDTH[bf16[1].split()[0]],
                  per_node)


# NCCL's ring collectives (assumed, not fitted: no multi-GPU trace exists).  A ring step's latency: NCCL's LL
# protocol's few microseconds per hop inside a node, more across; the fraction of the link's bandwidth a ring's bus
# bandwidth reaches on large messages, and the message size at which it reaches half of that.  nccl-tests'
# all_reduce_perf bus bandwidth at large sizes as a third party reports it ("NCCL-tests in practice",
# docs.alayanew.com, 2026-05-06): 8 x A100 SXM 230-250 GB/s, 0.8 of NVLink 3's 300; 8 x H100 SXM 460-480, NVSwitch's
# in-network reduction above NVLink 4's 450: 0.8 assumed for both (rings, no NVLink SHARP).
NCCL = {"latency_intra_s": 5e-6, "latency_inter_s": 10e-6, "efficiency": 0.8, "half_bytes": 4 * 2**20}


def collective_time(c: tuple, dev: Device, mesh_shape: dict | None) -> float:
    """Seconds of one collective (:func:`jaxllm.analysis.collectives.message`'s tuple) on ``dev``: NCCL's ring,
    each device sending ``wire`` bytes over the slowest link its group spans (off the node when the group does,
    the mesh's devices numbered node by node, :func:`jaxllm.analysis.step_time.crosses_nodes`) at
    ``efficiency x size / (size + half_bytes)`` of it, plus a latency per ring step."""
    _, axes, _, size, wire, hops = c
    off = bool(mesh_shape) and crosses_nodes(axes, mesh_shape, dev.per_node)
    link = dev.links[1] if off else dev.links[0]
    latency = NCCL["latency_inter_s"] if off else NCCL["latency_intra_s"]
    rate = link * NCCL["efficiency"] * size / (size + NCCL["half_bytes"])
    return hops * latency + wire / rate


def kernel_time(k: Kernel, dev: Device, mesh_shape: dict | None = None) -> float:
    """Seconds of one run of ``k`` on ``dev`` by :data:`FITTED` (collectives by :func:`collective_time`)."""
    if k.kind == "collective":
        return collective_time(k.collective, dev, mesh_shape) if k.collective else 0.0
    if k.kind == "unpriced":
        return 0.0  # counted in predict's "unpriced"; refusal() withholds the step
    c = FITTED[k.kind]
    peak = dev.peaks["f8" if k.dtype.startswith("f8") else k.dtype if k.dtype in dev.peaks else "bf16"]
    per = lambda work, rate, efficiency: work / (rate * efficiency) if efficiency else 0.0  # noqa: E731
    return (c["overhead_s"] + per(k.flops, peak, c["flop_efficiency"])
            + per(k.bytes, dev.bandwidth, c["bandwidth_efficiency"]) + k.ops * c["s_per_op"])


@dataclasses.dataclass
class Transfer:
    """One collective instruction of a program as :func:`timeline` schedules it, over a step (all its runs).

    Attributes:
      name: the HLO instruction (``all-gather-start.3``, ``reduce-scatter.1`` inside an ``async-start``, or a
        synchronous ``all-reduce.2``).
      kind: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``collective-permute``, ``all-to-all``,
        ``ragged-all-to-all``.
      axes: the mesh axes its group spans; ``bytes``: its buffer's bytes, one run
        (:func:`jaxllm.analysis.collectives.message`).
      runs: runs per step; ``asynchronous``: started and awaited apart (an ``*-start`` / ``*-done`` pair that
        XLA did not mark ``is_sync``), else it holds the kernels' stream for its whole time.
      time_s: seconds on the network, every run (:func:`collective_time`).
      overlapped_s: seconds of the kernels the schedule runs between its start and its done, every run.
      kernels_between: kernel launches between its start and its done, every run.
      exposed_s: seconds the kernels' stream waits for it, every run (at most ``time_s`` plus its wait for the
        collective before it).
    """

    name: str
    kind: str
    axes: tuple
    bytes: float
    runs: int = 0
    asynchronous: bool = False
    time_s: float = 0.0
    overlapped_s: float = 0.0
    kernels_between: int = 0
    exposed_s: float = 0.0

    @property
    def hidden_s(self) -> float:
        """Seconds of it that kernels cover."""
        return max(0.0, self.time_s - self.exposed_s)


def _owners(bodies: dict) -> dict[str, str]:
    """``{instruction: the async-start that launches it}`` (a reduce-scatter or all-to-all in an async
    computation: its ``async-done`` names the start)."""
    return {inner.name: op.name for body in bodies.values() for op in body if op.opcode == "async-start"
            for called, _ in xla_gpu.executed(op) for inner in bodies.get(called, [])}


def timeline(hlo_text: str, kernels: list[Kernel], dev: Device, mesh_shape: dict | None = None,
             scale: float = 1.0) -> dict:
    """One execution of the scheduled program replayed on two streams: its kernels one after another (each after
    a launch gap, :data:`FITTED` ``["gap"]``), its collectives on one network stream in the order they start.

    An asynchronous collective (XLA:GPU's latency-hiding scheduler places each ``*-start`` and ``*-done`` among the
    kernels) starts at its place in the kernels' stream once the collective before it is done, and the kernels'
    stream waits at its ``*-done`` for what is left of it; a synchronous one (``is_sync``, or no ``*-start``) holds
    the kernels' stream from its start to its end.  A ``*-done`` whose start is not in flight under its name (a
    loop that carries the start to the next iteration) awaits the oldest collective in flight.  What it
    ignores: a collective slowing the kernels it overlaps (NCCL's kernels take some of the SMs), and several
    network streams (XLA:GPU can run collectives of different kinds side by side; here they queue).

    Args:
      hlo_text: the optimized HLO of :func:`census`; kernels: its :func:`census`; dev, mesh_shape: as for
        :func:`kernel_time`; scale: a factor on the kernels' times and gaps (:data:`DEVICELESS`), not the
        collectives'.
    Returns:
      ``step_s`` (seconds the kernels' stream takes, waits included), ``transfers`` (a :class:`Transfer` per
      collective instruction, in first-start order).
    """
    by_name = {k.name: k for k in kernels}
    owners = _owners(hlo.parse(hlo_text)[1])
    gap = FITTED["gap"]["overhead_s"] * scale
    t = network = 0.0
    pending: dict[str, tuple[Transfer, float, float, int]] = {}  # start -> (transfer, end, t at start, launches)
    transfers: dict[str, Transfer] = {}
    synchronous: set[str] = set()  # the starts XLA marked is_sync (their dones pass)
    launches = 0
    for op, _, _ in walk(hlo_text, dones=True):
        if op.opcode.endswith("-done"):
            key = next(iter(op.operands), "")
            if key in synchronous:
                continue  # its start held the kernels' stream already
            key = key if key in pending else next(iter(pending), None)
            if key is None:
                continue
            tr, end, began, launched = pending.pop(key)
            tr.overlapped_s += t - began
            tr.kernels_between += launches - launched
            tr.exposed_s += max(0.0, end - t)
            t = max(t, end)
            continue
        k = by_name.get(op.name)
        if k is None:
            continue
        t += gap
        launches += 1
        if k.kind != "collective" or k.collective is None:
            t += kernel_time(k, dev, mesh_shape) * scale
            continue
        tr = transfers.setdefault(op.name, Transfer(op.name, k.collective[0], k.collective[1], k.collective[3]))
        duration = kernel_time(k, dev, mesh_shape)
        network = max(t, network) + duration
        tr.runs += 1
        tr.time_s += duration
        key = op.name if op.opcode.endswith("-start") else owners.get(op.name)
        if key and '"is_sync":true' not in op.rest:
            tr.asynchronous = True
            pending[key] = (tr, network, t, launches)
        else:
            if key:
                synchronous.add(key)
            tr.exposed_s += network - t
            t = network
    return {"step_s": t, "transfers": list(transfers.values())}


def communication(transfers: list[Transfer]) -> dict[str, dict[str, float]]:
    """Per mesh axis (several joined by `` x ``): ``{axes: {"time_s", "hidden_s", "exposed_s"}}`` a step, from
    :func:`timeline`'s transfers."""
    out: dict[str, dict[str, float]] = {}
    for tr in transfers:
        row = out.setdefault(" x ".join(tr.axes) or "-", {"time_s": 0.0, "hidden_s": 0.0, "exposed_s": 0.0})
        row["time_s"] += tr.time_s
        row["hidden_s"] += tr.hidden_s
        row["exposed_s"] += tr.exposed_s
    return out


def predict(kernels: list[Kernel], dev: Device, mesh_shape: dict | None = None, deviceless: bool = False,
            hlo_text: str | None = None) -> dict:
    """The step time of a :func:`census` on ``dev`` (``deviceless``: of a program compiled here, every category
    times :data:`DEVICELESS`).  With the program's ``hlo_text``, its collectives are scheduled as it schedules them
    (:func:`timeline`): only what no kernel covers counts; without it every collective counts whole (a program
    of one GPU has none).  Collectives are priced by :func:`collective_time`, not scaled by :data:`DEVICELESS`.

    Returns:
      ``step_s`` (seconds: every kernel's runs, one after another, a gap of :data:`FITTED` ``["gap"]`` before
      each launch, and the collectives' exposed time), ``categories`` ``{category: seconds}`` (the profile's,
      ``idle`` the gaps, ``collective`` the exposed time), ``launches`` (kernels per step), ``category_launches``
      ``{category: kernels per step}``, ``transfers`` (:func:`timeline`'s, ``[]`` without ``hlo_text``),
      ``communication_s`` and ``exposed_communication_s`` (seconds a step), ``communication``
      (:func:`communication`).
    """
    scale = DEVICELESS if deviceless else 1.0
    categories: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    total = 0.0  # the collectives' seconds, whole
    for k in kernels:
        seconds = k.runs * kernel_time(k, dev, mesh_shape)
        if k.kind == "collective":
            total += seconds
        else:
            categories[k.category] += seconds * scale
        counts["collective" if k.kind == "collective" else k.category] += k.runs
    launches = sum(k.runs for k in kernels)
    categories["idle"] = launches * FITTED["gap"]["overhead_s"] * scale
    transfers = timeline(hlo_text, kernels, dev, mesh_shape, scale)["transfers"] if hlo_text is not None else []
    exposed = sum(tr.exposed_s for tr in transfers) if hlo_text is not None else total
    if total:
        categories["collective"] = exposed
    unpriced = collections.Counter({k.name: k.runs for k in kernels if k.kind == "unpriced"})
    return {"step_s": sum(categories.values()), "categories": dict(categories), "launches": launches,
            "category_launches": dict(counts), "transfers": transfers, "communication_s": total,
            "exposed_communication_s": exposed, "communication": communication(transfers),
            "unpriced": dict(unpriced)}


def refusal(predicted: dict, model_flops: float, devices: int, device_name: str) -> str | None:
    """Why :func:`predict`'s step must not be printed, or None: a kernel it cannot price (its time would be
    missing from the step), or a step faster than ``model_flops`` (per step, all ``devices``) at the GPU's
    bfloat16 peak allows (an MFU above 100 %: work the model did not see)."""
    if predicted["unpriced"]:
        names = ", ".join(f"{name} x{runs}" for name, runs in sorted(predicted["unpriced"].items())[:3])
        return (f"no step predicted: {sum(predicted['unpriced'].values())} kernel runs a step the model cannot price "
                f"(custom calls: {names}{', ...' if len(predicted['unpriced']) > 3 else ''})")
    mfu = model_flops / predicted["step_s"] / devices / device(device_name).peaks["bf16"]
    if mfu > 1:
        return (f"no step predicted: the model's {predicted['step_s']:.4g} s would be an MFU of {mfu:.0%}, "
                "above the peak")
    return None


def report(predicted: dict, device_name: str, tokens: int, model_flops: float, devices: int = 1) -> str:
    """The prediction as text: the step, tokens/s and MFU (``model_flops`` per step over the step and the devices'
    bfloat16 peak), or :func:`refusal`'s reason in their place (and no share of the step it withholds), and tables
    by the profile's categories and of the collectives, saying it is a model."""
    step = predicted["step_s"]
    peak = device(device_name).peaks["bf16"]
    refused = refusal(predicted, model_flops, devices, device_name)
    lines = [f"step-time MODEL of this XLA:GPU program on {devices} x {device_name} (predicted, not measured: "
             "jaxllm/analysis/gpu_time.py, constants fitted to the H100 traces of 2026-11-26 and the H200's of "
             "2026-11-27):",
             f"  {refused} ({predicted['launches']} kernels a step)" if refused else
             f"  step {step:.4f} s, {tokens / step:,.0f} tokens/s, MFU {model_flops / step / devices / peak:.1%} "
             f"({predicted['launches']} kernels a step)",
             f"  {'category':<30} {'ms/step':>9} {'share':>6} {'kernels':>8}"]
    for category, t in sorted(predicted["categories"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {profile.LABELS[category]:<30} {1e3 * t:9.2f} {'-' if refused else f'{t / step:.1%}':>6} "
                     f"{predicted['category_launches'].get(category, 0):>8}")
    if predicted["transfers"]:
        lines += [f"  collectives as XLA's schedule places them ({1e3 * predicted['communication_s']:.2f} ms a step, "
                  f"{1e3 * predicted['exposed_communication_s']:.2f} exposed"
                  + ("):" if refused else f", {predicted['exposed_communication_s'] / step:.1%} of the step):"),
                  f"  {'mesh axes':<30} {'ms/step':>9} {'hidden':>9} {'exposed':>9}"]
        lines += [f"  {axes:<30} {1e3 * r['time_s']:9.2f} {1e3 * r['hidden_s']:9.2f} {1e3 * r['exposed_s']:9.2f}"
                  for axes, r in predicted["communication"].items()]
        lines.append(f"  {'collective':<30} {'kind':<18} {'axes':<16} {'MiB':>8} {'runs':>5} {'ms/step':>9} "
                     f"{'under it':>9} {'exposed':>9}")
        lines += [f"  {tr.name[:30]:<30} {tr.kind + ('' if tr.asynchronous else ' (sync)'):<18} "
                  f"{' x '.join(tr.axes)[:16]:<16} {tr.bytes / 2**20:8.2f} {tr.runs:>5} {1e3 * tr.time_s:9.3f} "
                  f"{1e3 * tr.overlapped_s:9.3f} {1e3 * tr.exposed_s:9.3f}" for tr in predicted["transfers"]]
    return "\n".join(lines)
