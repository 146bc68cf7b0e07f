"""What jaxllm knows of the hardware: peak FLOP/s and memory per device, the backend's kind.

* :data:`PEAK_FLOPS` / :func:`peak_flops_per_device`: the dense peak FLOP/s of one device
  (vendor datasheet for known accelerators, a measured matmul otherwise), the basis of MFU.
* :data:`DEVICES` / :func:`named_device`: memory per device and backend of the accelerators
  ``jaxllm.plan`` and ``jaxllm.tune`` check against.
* :data:`CLUSTERS` / :func:`named_cluster`: GPUs per node and the links between them, for
  ``jaxllm.plan --cluster`` (:mod:`jaxllm.analysis.step_time`).
* :func:`backend_kind`: ``cpu``, ``cuda``, ``rocm`` or ``tpu`` for a running JAX backend.
* :func:`host_threads`: the CPU cores this process may run on.
* :func:`fp8_unsupported`: whether a backend's devices have FP8 matmuls (``model.fp8``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.extend
import jax.numpy as jnp

GiB = 2**30
# The accelerators that `jaxllm.plan` and `jaxllm.tune` check against (``--device``): memory
# per device in bytes (vendor datasheets; MI250X: one of its two GCDs) and backend kind.
DEVICES = {
    "A100-40GB": (40e9, "cuda"), "A100-80GB": (80e9, "cuda"), "H100": (80e9, "cuda"), "H200": (141e9, "cuda"),
    "MI250X": (64 * GiB, "rocm"), "MI300X": (192 * GiB, "rocm"),
}
_KINDS = ("cpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A machine's nodes as the step-time model sees them (:mod:`jaxllm.analysis.step_time`).

    Attributes:
      device: its accelerator, a key of :data:`DEVICES` and :data:`PEAK_FLOPS` (one GCD for the MI250X).
      per_node: accelerators (JAX devices) per node.
      intra_bw: bytes/s one device sends to the next in a ring inside a node (one direction).
      inter_bw: bytes/s one device sends off its node (the node's injection bandwidth / ``per_node``).
      intra_latency, inter_latency: seconds per step of a ring inside / across nodes.
      nodes: nodes of the machine.
      sources: where the figures come from.
    """

    device: str
    per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency: float
    inter_latency: float
    nodes: int
    sources: str


# Latencies: no facility publishes a collective's per-step latency; 10 us inside a node and 20 us across
# (a few microseconds of network latency plus the collective library's per-step overhead) are assumed.
CLUSTERS = {
    # 4 MI250X (8 GCDs) per node; GCD-GCD Infinity Fabric 50-200 GB/s (50 GB/s the slowest link of a
    # ring over the node's 8 GCDs); 4 Slingshot-11 NICs of 25 GB/s (100 GB/s per node, 12.5 per GCD).
    "frontier": Cluster("MI250X", 8, 50e9, 12.5e9, 10e-6, 20e-6, 9408,
                        "OLCF Frontier User Guide (node diagram: Infinity Fabric 50-200 GB/s, 4 x 25 GB/s Slingshot "
                        "NICs); 9,408 nodes (TOP500)"),
    # 4 A100-40GB SXM4, each pair joined by 4 NVLink-3 links (NV4: 100 GB/s each way); 2 Slingshot-11 NICs.
    "polaris": Cluster("A100-40GB", 4, 100e9, 12.5e9, 10e-6, 20e-6, 560,
                       "ALCF Polaris machine overview (4 A100 over NVLink, NV4 between every pair, 2 Slingshot 11 "
                       "adapters, 560 nodes); 25 GB/s per Slingshot-11 NIC"),
    # 4 A100 (40GB; 256 nodes of 80GB) as Polaris's, 4 Slingshot-11 NICs per node.
    "perlmutter": Cluster("A100-40GB", 4, 100e9, 25e9, 10e-6, 20e-6, 1536,
                          "NERSC Perlmutter architecture (1,536 GPU nodes of 4 A100-40GB and 4 HPE Slingshot 11 NICs; "
                          "NVLink-3 between the GPUs); 25 GB/s per Slingshot-11 NIC"),
}


def named_cluster(name: str) -> Cluster:
    """The :data:`CLUSTERS` entry ``name`` (``--cluster``).

    Raises:
      ValueError: ``name`` is not in :data:`CLUSTERS`.
    """
    if name not in CLUSTERS:
        raise ValueError(f"--cluster={name!r}: choose one of {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


def named_device(name: str) -> tuple[float, str]:
    """Memory per device (bytes) and backend kind (``"cuda"``, ``"rocm"``) of an accelerator of
    :data:`DEVICES`, named as a ``--device`` flag names it.

    Raises:
      ValueError: ``name`` is not in :data:`DEVICES`.
    """
    if name not in DEVICES:
        raise ValueError(f"--device={name!r}: choose one of {', '.join(DEVICES)}")
    return DEVICES[name]


def host_threads() -> int:
    """The CPU cores this process may run on (its affinity mask): the threads XLA:CPU's
    intra-op pool has by default."""
    return len(os.sched_getaffinity(0))


def backend_kind(backend=None) -> str:
    """``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"`` (or another platform name) for a JAX backend.

    Args:
      backend: None (the default backend), a JAX backend name (``"gpu"``, ``"cpu"``, ...),
        or one of the kinds themselves, returned unchanged (to ask about another machine).
    """
    if backend in _KINDS:
        return backend
    client = jax.extend.backend.get_backend(backend)
    platform = client.platform
    if platform in ("gpu", "cuda", "rocm"):
        version = str(client.platform_version).lower()
        return "rocm" if ("rocm" in version or "hip" in version or platform == "rocm") else "cuda"
    return platform


_FP8_AMD = ("MI300", "MI325", "MI355")  # CDNA 3 and later: FP8 matrix cores


def fp8_unsupported(backend: str | None = None) -> str | None:
    """Why ``model.fp8`` cannot train on ``backend`` (a kind or a JAX backend name; None: the default),
    or None where it can: NVIDIA GPUs of compute capability 8.9 and later (Ada, Hopper: H100, H200;
    Blackwell), AMD MI300 and later.  A GPU kind named from a machine without that GPU (a plan for
    ``--device``) is taken on trust: there is no device to ask."""
    kind = backend_kind(backend)
    if kind not in ("cuda", "rocm"):
        return f"the {kind} backend has no FP8 matmuls (H100, H200 and MI300 GPUs have)"
    if backend in _KINDS and backend_kind() != kind:
        return None
    device = jax.local_devices()[0]
    capability = getattr(device, "compute_capability", None)
    if kind == "cuda" and capability:
        ok = tuple(int(p) for p in str(capability).split(".")[:2]) >= (8, 9)
    else:
        ok = any(name.lower() in device.device_kind.lower() for name in _FP8_AMD)
    return None if ok else (f"{device.device_kind} has no FP8 matmuls (NVIDIA compute capability 8.9 or later: "
                            "H100, H200; AMD MI300 or later)")


def host_offload_unsupported(backend: str | None = None) -> str | None:
    """Why activations cannot be kept in host memory (``model.remat=offload`` and the ``*_offloaded``
    policies) on ``backend`` (as :func:`fp8_unsupported`), or None where they can: its devices have a
    ``pinned_host`` memory (JAX's NVIDIA, AMD and TPU backends; the CPU's host memory is its device
    memory, so there the offload changes nothing).  A kind named from a machine without it (a plan
    for ``--device``) is taken on trust."""
    kind = backend_kind(backend)
    if backend in _KINDS and backend_kind() != kind:
        return None
    device = jax.local_devices()[0]
    kinds = [m.kind for m in device.addressable_memories()]
    return None if "pinned_host" in kinds else (
        f"{device.device_kind} ({kind}) has no pinned host memory to offload to (its memories: {', '.join(kinds)})")


# Dense (no 2:4 sparsity) peak FLOP/s of one device (one GCD for the MI250X) by device kind
# and dtype. "float32" is the best full-FP32 matmul rate: NVIDIA's non-tensor-core FP32
# (TF32 tensor-core rates are higher: XLA's default precision may use TF32 for float32 dots
# on Ampere and later, which can put float32 MFU above 100%); AMD's FP32 matrix-core rate.
# float16 = bfloat16 (V100 has no bfloat16 hardware: its "bfloat16" entry is the FP16
# tensor-core rate and is far above what bfloat16 actually reaches there).
# Sources (vendor datasheets; NVIDIA lists sparse tensor rates, dense = half):
#   A100:      NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 312 TF, FP32 19.5 TF (SXM and PCIe)
#   H100 SXM:  NVIDIA H100 Tensor Core GPU datasheet: BF16 1979 TF sparse -> 989, FP32 67 TF
#   H100 PCIe: same datasheet (first edition):        BF16 1513 TF sparse -> 756, FP32 51 TF
#   H100 NVL:  same datasheet:                        BF16 1671 TF sparse -> 835, FP32 60 TF
#   H200 SXM:  NVIDIA H200 Tensor Core GPU datasheet: BF16 1979 TF sparse -> 989, FP32 67 TF
#   H200 NVL:  same datasheet:                        BF16 1671 TF sparse -> 835, FP32 60 TF
#   GH200:     NVIDIA GH200 Grace Hopper datasheet (its GPU is an H100/H200 SXM): 989 / 67 TF
#   V100 SXM2: NVIDIA Tesla V100 datasheet: FP16 tensor 125 TF, FP32 15.7 TF
#   V100 PCIe: same datasheet:               FP16 tensor 112 TF, FP32 14 TF
#   MI250X:    AMD Instinct MI250X datasheet (2 GCDs; JAX sees each GCD as a device):
#              BF16/FP16 383 TF, FP32 matrix 95.7 TF -> per GCD 191.5 / 47.85 TF
#   MI300X:    AMD Instinct MI300X datasheet: BF16/FP16 1307.4 TF dense, FP32 matrix 163.4 TF
# Keys match ``jax.Device.device_kind`` by case-insensitive substring, the longest key
# first (so "NVIDIA H100 PCIe" -> "H100 PCIe", "NVIDIA H100 80GB HBM3" -> "H100").


def _entry(bf16: float, fp32: float, fp8: float | None = None) -> dict:
    return {"bfloat16": bf16, "float16": bf16, "float32": fp32, **({"float8": fp8} if fp8 else {})}


# "float8": the FP8 tensor-core rate (e4m3 and e5m2), dense, from the same datasheets (H100 SXM and H200 SXM 3,958
# TF sparse -> 1,979; H100 PCIe 3,026 -> 1,513; H100 NVL and H200 NVL 3,341 -> 1,671): model.fp8's GEMMs
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": _entry(312e12, 19.5e12),
    "H100": _entry(989e12, 67e12, 1979e12),  # SXM ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": _entry(756e12, 51e12, 1513e12),
    "H100 NVL": _entry(835e12, 60e12, 1671e12),
    "H200": _entry(989e12, 67e12, 1979e12),  # SXM ("NVIDIA H200")
    "H200 NVL": _entry(835e12, 60e12, 1671e12),
    "GH200": _entry(989e12, 67e12, 1979e12),
    "V100": _entry(125e12, 15.7e12),  # SXM2 ("Tesla V100-SXM2-16GB")
    "V100-PCIE": _entry(112e12, 14e12),
    "MI250X": _entry(383e12 / 2, 95.7e12 / 2),  # per GCD
    "MI300X": _entry(1307.4e12, 163.4e12),
}

_MEASURED: dict[tuple[str, str, str], float] = {}  # (platform, device_kind, dtype) -> FLOP/s

# Peak memory bandwidth, bytes/s, from the same datasheets (A100: the 80 GB SXM's HBM2e, 2,039 GB/s; the 40 GB
# card's 1,555; H100 SXM HBM3 3.35 TB/s, PCIe 2.0, NVL 3.9; H200 4.8 TB/s; MI250X 3.2 TB/s for two GCDs;
# MI300X 5.3 TB/s); matched as PEAK_FLOPS is, the 40 GB A100 by its name.  The basis of a profile's bandwidth
# fractions (:mod:`jaxllm.analysis.profile`).
MEMORY_BANDWIDTH: dict[str, float] = {
    "A100": 2.039e12, "A100-SXM4-40GB": 1.555e12, "A100-PCIE-40GB": 1.555e12,
    "H100": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H200": 4.8e12, "H200 NVL": 4.8e12,
    "GH200": 4.0e12, "V100": 0.9e12, "MI250X": 3.2e12 / 2, "MI300X": 5.3e12,
}


# The --device names of the NVIDIA GPUs that XLA:GPU compiles for here (jaxllm.platform.xla_gpu.SPECS), as
# jax.Device.device_kind names them: the keys PEAK_FLOPS and MEMORY_BANDWIDTH match (the SXM boards)
GPU_KINDS = {"A100-40GB": "NVIDIA A100-SXM4-40GB", "A100-80GB": "NVIDIA A100-SXM4-80GB",
             "H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}

# NVLink bytes/s one GPU sends (one direction) inside a node, from the same datasheets: A100 SXM NVLink 3, 600 GB/s
# both ways; H100 and H200 SXM NVLink 4, 900 GB/s both ways.  Off the node: NVIDIA's DGX A100 / DGX H100 give
# each GPU one 200 / 400 Gb/s InfiniBand NIC (25 / 50 GB/s), the second entry.
NVLINK_BANDWIDTH: dict[str, tuple[float, float]] = {"A100": (300e9, 25e9), "H100": (450e9, 50e9),
                                                     "H200": (450e9, 50e9)}


def memory_bandwidth(device_kind: str) -> float | None:
    """Peak memory bandwidth (bytes/s) of a device kind (``jax.Device.device_kind``; the longest
    :data:`MEMORY_BANDWIDTH` key it contains, case-insensitive), or None when none matches."""
    kind = device_kind.lower()
    for key in sorted(MEMORY_BANDWIDTH, key=len, reverse=True):
        if key.lower() in kind:
            return MEMORY_BANDWIDTH[key]
    return None


def _dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    return "float8" if name.startswith("float8") else name  # e4m3 and e5m2 run at one rate


def lookup_peak_flops(device_kind: str, dtype="bfloat16") -> tuple[float, str] | None:
    """The :data:`PEAK_FLOPS` entry for a device kind string, or None.

    Args:
      device_kind: ``jax.Device.device_kind``, e.g. ``"NVIDIA A100-SXM4-80GB"``.
      dtype: the matmul dtype (name or dtype; every float8 type is ``"float8"``'s entry).
    Returns:
      ``(FLOP/s, the matching key)``, or None when no key matches or the entry lacks ``dtype``.
    """
    kind, dtype = device_kind.lower(), _dtype_name(dtype)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.lower() in kind:
            peak = PEAK_FLOPS[key].get(dtype)
            return None if peak is None else (peak, key)
    return None


def measured_matmul_size(platform: str) -> int:
    """The side of the square matmul measured for a device without a datasheet peak: 1024 on CPUs, 8192 elsewhere
    (a GPU is not near its peak on smaller ones).  On the 2-core machine (2026-12-02, idle) 1024 measured 305-319
    GFLOP/s float32 against 2048's 310-334, and 1,481-1,551 bfloat16 against 1,110-1,184, in 0.07-0.24 s instead of
    0.44-0.58 s of every run's start (2-6 s when the machine is loaded)."""
    return 1024 if platform == "cpu" else 8192


def _measure_matmul(device, dtype: str, n: int, repeats: int = 5) -> float:
    """FLOP/s of the fastest of ``repeats`` jitted ``[n, n] @ [n, n]`` matmuls on ``device``."""
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), dtype), device)
    b = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), dtype), device)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops_per_device(device=None, dtype="bfloat16") -> tuple[float, str]:
    """Peak dense matmul FLOP/s of one device, and where the number came from.

    Known accelerators (:data:`PEAK_FLOPS`, matched on ``device.device_kind``): the
    datasheet number. Anything else (CPU, an unknown GPU, a dtype the table lacks): the
    fastest of 5 jitted square matmuls in ``dtype`` (:func:`measured_matmul_size`: 1024 on CPU, 8192 elsewhere),
    measured once per process and device kind and cached; on a shared CPU this is what
    the machine delivered at that moment, not a datasheet peak.

    Args:
      device: a ``jax.Device``; None: the first local device.
      dtype: the compute dtype (``model.dtype``).
    Returns:
      ``(FLOP/s, source)``, e.g. ``(312e12, "datasheet PEAK_FLOPS['A100'] bfloat16")`` or
      ``(1.8e11, "measured matmul on cpu (1024x1024 bfloat16)")``.
    """
    device = device if device is not None else jax.local_devices()[0]
    dtype = _dtype_name(dtype)
    found = lookup_peak_flops(device.device_kind, dtype)
    if found is not None:
        return found[0], f"datasheet PEAK_FLOPS[{found[1]!r}] {dtype}"
    n = measured_matmul_size(device.platform)
    key = (device.platform, device.device_kind, dtype)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_matmul(device, dtype, n)
    where = "cpu" if device.platform == "cpu" else f"{device.device_kind!r} (not in PEAK_FLOPS)"
    return _MEASURED[key], f"measured matmul on {where} ({n}x{n} {dtype})"
