"""XLA flags and runtime variables for GPUs: the one place jaxllm sets them.

:func:`apply` runs before JAX starts a backend (``python -m jaxllm.train``, ``bench``
and ``tune`` call it first).  It decides the vendor from the
environment and the device files, as :func:`jaxllm.platform.distributed.gpu_vendor` does
(``JAX_PLATFORMS``, else ``/dev/kfd`` for AMD, ``/dev/nvidiactl`` for NVIDIA), and
on a GPU machine adds :data:`SETTINGS` for that vendor: XLA flags to ``XLA_FLAGS``,
the others as environment variables.  The user's own values win: a flag already in
``XLA_FLAGS`` (any value) or a variable already set is left as it is.  On a machine
without GPUs nothing changes.  :func:`report` prints what was set, once (process 0),
and one warning line when NVIDIA or AMD GPUs are on the machine but JAX runs on the CPU.

None of these settings has been measured with jaxllm (no GPU was available when they
were chosen: every :class:`Setting` has ``measured=False``); each is taken from the
source it names, for the reason given.  Measure before and after on your system
(``python -m jaxllm.bench``, and the same with ``XLA_FLAGS=--FLAG=<other value>``)
and record the result in docs/performance.md.  XLA aborts the process on a flag it
does not know, so every flag here is checked against the installed jaxlib by
``tests/test_gpu_env.py``.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, MutableMapping

from jaxllm.platform.distributed import gpu_vendor

JAX_TOOLBOX = "https://github.com/NVIDIA/JAX-Toolbox/blob/main/rosetta/docs/GPU_performance.md"
JAX_TIPS = "https://docs.jax.dev/en/latest/gpu_performance_tips.html"
AMD_AXLEARN = "https://github.com/AMD-AGI/axlearn/blob/main/launch_70B_multi_nodes.sh"
AMD_CVS = "https://rocm.docs.amd.com/projects/cvs/en/latest/reference/configuration-files/jax.html"
AMD_MI300X = "https://rocm.docs.amd.com/en/latest/how-to/rocm-for-ai/inference-optimization/workload.html"
MARIN_RAGGED = "https://github.com/marin-community/marin/issues/8077"
XLA_FLAGS_SOURCE = "https://github.com/openxla/xla/blob/main/xla/debug_options_flags.cc"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One GPU setting.

    Attributes:
      name: an XLA flag (``--xla_...``, added to ``XLA_FLAGS``) or an environment variable.
      value: its value, as text.
      vendors: ``"cuda"`` and/or ``"rocm"``: where it is applied.
      why: what it does and why jaxllm sets it.
      source: where the value comes from (URL).
      measured: True once a jaxllm measurement (docs/performance.md) supports it.
      retired: the jaxlib release ``(major, minor)`` whose XLA no longer has the flag (its parser takes it in
        ``XLA_FLAGS`` and ignores it; a compile option of that name is refused): not applied from then on.
      since: the first jaxlib release whose XLA has the flag (an older XLA aborts on it): not applied before.
    """

    name: str
    value: str
    vendors: tuple[str, ...]
    why: str
    source: str
    measured: bool = False
    retired: tuple[int, int] | None = None
    since: tuple[int, int] | None = None

    @property
    def is_flag(self) -> bool:
        return self.name.startswith("--")

    def text(self) -> str:
        return f"{self.name}={self.value}"


_8GIB = str(8 * 2**30)
BOTH = ("cuda", "rocm")

SETTINGS: tuple[Setting, ...] = (
    Setting("--xla_gpu_enable_latency_hiding_scheduler", "true", BOTH,
            "schedules collectives asynchronously around independent compute so that data, FSDP and tensor "
            "parallel communication overlaps the matmuls; NVIDIA bakes it into its JAX container, AMD's JAX "
            "training scripts set it too",
            f"{JAX_TIPS}; https://docs.nvidia.com/jax-toolbox/environment-variables; {AMD_AXLEARN}"),
    Setting("--xla_gpu_enable_pipelined_all_gather", "true", ("cuda",),
            "the layers are a scan: pipelines each iteration's FSDP parameter all-gather with the previous "
            "iteration's compute", JAX_TOOLBOX, retired=(0, 12)),
    Setting("--xla_gpu_enable_pipelined_reduce_scatter", "true", ("cuda",),
            "the same for the gradient reduce-scatter of the backward scan (ZeRO-2/3, FSDP)", JAX_TOOLBOX,
            retired=(0, 12)),
    Setting("--xla_gpu_enable_pipelined_all_reduce", "true", ("cuda",),
            "the same for gradient all-reduces inside the layer scan (data parallelism)", JAX_TOOLBOX, retired=(0, 12)),
    *(Setting(f"--xla_gpu_pipeline_{c}", "on", ("cuda",),
              f"JAX 0.12's XLA's successor of --xla_gpu_enable_pipelined_{c}, which it maps to default (\"follows "
              f"optimization effort\", its help says), which left the layers' FSDP collectives exposed "
              f"(docs/performance.md, Collectives under the kernels); on: \"considers all structurally eligible\" "
              f"{c.replace('_', '-')}s", XLA_FLAGS_SOURCE, since=(0, 12))
      for c in ("all_gather", "reduce_scatter", "all_reduce")),
    Setting("--xla_gpu_all_reduce_combine_threshold_bytes", _8GIB, BOTH,
            "combines the many per-parameter gradient all-reduces into few large ones (NCCL/RCCL reach their "
            "bandwidth only on large messages); 8 GiB as JAX-Toolbox lists it for FSDP, the same in AMD's "
            "axlearn script", f"{JAX_TOOLBOX}; {AMD_AXLEARN}"),
    Setting("--xla_gpu_reduce_scatter_combine_threshold_bytes", _8GIB, BOTH,
            "the same for reduce-scatters (ZeRO-2/3, FSDP gradients)", f"{JAX_TOOLBOX}; {AMD_AXLEARN}"),
    Setting("--xla_gpu_all_gather_combine_threshold_bytes", _8GIB, BOTH,
            "the same for FSDP parameter all-gathers (AMD's script uses 128 GiB here); combining costs memory: "
            "lower it if a run is short of memory", f"{JAX_TOOLBOX}; {AMD_AXLEARN}"),
    Setting("--xla_gpu_enable_all_gather_combine_by_dim", "false", BOTH,
            "lets XLA combine all-gathers along different dimensions too, so the threshold above applies to all "
            "of them", f"{JAX_TOOLBOX}; {AMD_AXLEARN}"),
    Setting("--xla_gpu_enable_reduce_scatter_combine_by_dim", "false", BOTH,
            "the same for reduce-scatters", f"{JAX_TOOLBOX}; {AMD_AXLEARN}"),
    Setting("--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel", "false", ("cuda",),
            "the ragged token dispatcher's jax.lax.ragged_all_to_all through NCCL: XLA's one-shot kernel, which it "
            "picks for groups of at most 8 GPUs of one node, corrupted gradients at expert 8 (Marin's EP8 runs, "
            "2026); XLA's other workaround, --xla_gpu_unsupported_enable_ragged_all_to_all_decomposer, pads every "
            "rank's slice to the whole send buffer (its source: ragged_all_to_all_decomposer.cc), which sends more "
            "than the alltoall dispatcher", MARIN_RAGGED),
    Setting("--xla_gpu_enable_cublaslt", "true", ("rocm",),
            "matmuls through hipBLASLt (cuBLASLt's ROCm counterpart) as AMD's JAX training scripts select",
            AMD_AXLEARN),
    Setting("--xla_gpu_enable_command_buffer", "", ("rocm",),
            "no GPU graphs (command buffers): AMD's scripts pass --xla_gpu_graph_level=0, which this XLA no "
            "longer accepts (it aborts on it); an empty command-buffer list is that flag's successor",
            AMD_AXLEARN),
    Setting("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9", ("cuda",),
            "JAX preallocates 75% of GPU memory by default; NVIDIA's guide sets 0.9 (the rest stays for "
            "cuDNN/cuBLAS/NCCL workspaces), so larger micro batches fit", JAX_TOOLBOX),
    Setting("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.975", ("rocm",),
            "the same on AMD GPUs, with AMD's JAX training value", f"{AMD_CVS}; {AMD_AXLEARN}"),
    Setting("HSA_FORCE_FINE_GRAIN_PCIE", "1", ("rocm",),
            "fine-grained PCIe memory for RCCL's GPU-direct RDMA (with the launch script's libfabric settings); "
            "set by AMD's multi-node JAX script", AMD_AXLEARN),
    Setting("GPU_MAX_HW_QUEUES", "2", ("rocm",),
            "the hardware queues HIP opens per device, the value of AMD's JAX training configurations",
            f"{AMD_CVS}; {AMD_AXLEARN}"),
    Setting("HIP_FORCE_DEV_KERNARG", "1", ("rocm",),
            "kernel arguments in device memory, which AMD's tuning guide says cuts kernel launch latency",
            f"{AMD_MI300X}; {AMD_AXLEARN}"),
)


def jaxlib_release(version: str | None = None) -> tuple[int, int]:
    """``"0.12.0.1"`` -> ``(0, 12)``; default the installed jaxlib's version (read without importing it)."""
    major, minor = re.findall(r"\d+", version or importlib.metadata.version("jaxlib"))[:2]
    return int(major), int(minor)


def _retired(s: Setting, jaxlib: str | None) -> bool:
    return s.retired is not None and jaxlib_release(jaxlib) >= s.retired


def _before(s: Setting, jaxlib: str | None) -> bool:
    return s.since is not None and jaxlib_release(jaxlib) < s.since


def settings_for(vendor: str, jaxlib: str | None = None) -> list[Setting]:
    """The :data:`SETTINGS` applied for ``vendor`` (``"cuda"`` or ``"rocm"``) under ``jaxlib`` (a version, default
    the installed one), in order: those its XLA still has."""
    return [s for s in SETTINGS if vendor in s.vendors and not _retired(s, jaxlib) and not _before(s, jaxlib)]


def retired(vendor: str, jaxlib: str | None = None) -> list[Setting]:
    """The :data:`SETTINGS` of ``vendor`` that ``jaxlib``'s XLA no longer has (:attr:`Setting.retired`): not applied."""
    return [s for s in SETTINGS if vendor in s.vendors and _retired(s, jaxlib)]


def flag_names(xla_flags: str) -> set[str]:
    """``"--a=1 --b --c=x"`` -> ``{"--a", "--b", "--c"}``: the flags an ``XLA_FLAGS`` value sets."""
    return {word.split("=", 1)[0] for word in xla_flags.split() if word.startswith("--")}


@dataclasses.dataclass(frozen=True)
class Applied:
    """What :func:`apply` did.

    Attributes:
      vendor: ``"cuda"``, ``"rocm"`` or None (no GPU: nothing applied).
      set: the settings jaxllm set.
      kept: the settings the user had already given (their value kept), as ``name=value`` of the user's.
    """

    vendor: str | None
    set: tuple[Setting, ...] = ()
    kept: tuple[str, ...] = ()

    def line(self) -> str:
        """The start-up line (empty when nothing was applied)."""
        if self.vendor is None:
            return ""
        ours = " ".join(s.text() for s in self.set) or "nothing"
        kept = f"; yours kept: {' '.join(self.kept)}" if self.kept else ""
        return (f"jaxllm.platform.gpu_env: {self.vendor} settings (jaxllm/platform/gpu_env.py, from sources, "
                f"not measured): {ours}{kept}")


def apply(environ: MutableMapping[str, str] | None = None, vendor: str | None = None) -> Applied:
    """Adds the GPU settings of this machine's vendor to ``environ``; must run before JAX starts a backend.

    Args:
      environ: the environment to update (default ``os.environ``).
      vendor: ``"cuda"``, ``"rocm"``, or None to detect it (:func:`jaxllm.platform.distributed.gpu_vendor`).
    Returns:
      :class:`Applied`: what was set and which of the user's values were kept.
    """
    environ = os.environ if environ is None else environ
    vendor = vendor or gpu_vendor(environ)
    if vendor is None:
        return Applied(None)
    user_flags = environ.get("XLA_FLAGS", "")
    given = flag_names(user_flags)
    words = {w.split("=", 1)[0]: w for w in user_flags.split()}
    done, kept, ours = [], [], []
    for s in settings_for(vendor):
        if s.is_flag:
            if s.name in given:
                kept.append(words[s.name])
                continue
            ours.append(s.text())
        else:
            if environ.get(s.name) not in (None, ""):
                kept.append(f"{s.name}={environ[s.name]}")
                continue
            environ[s.name] = s.value
        done.append(s)
    if ours:  # ours first: for a flag given twice XLA keeps the last, so the user's would win in any case
        environ["XLA_FLAGS"] = " ".join([*ours, user_flags]).strip()
    return Applied(vendor, tuple(done), tuple(kept))


def gpus_on_machine(dev: str = "/dev") -> str | None:
    """``"NVIDIA"`` or ``"AMD"`` if this machine has such GPUs, else None; starts no JAX backend.

    Looks for the device files (``DEV/nvidia0``..., ``DEV/kfd``), then asks ``nvidia-smi -L`` and
    ``rocm-smi --showproductname`` where they are on the ``PATH`` (5 s each at most).
    """
    if glob.glob(os.path.join(dev, "nvidia[0-9]*")):
        return "NVIDIA"
    if os.path.exists(os.path.join(dev, "kfd")):
        return "AMD"
    for vendor, cmd, marker in (("NVIDIA", ["nvidia-smi", "-L"], "GPU "),
                                ("AMD", ["rocm-smi", "--showproductname"], "GPU[")):
        if shutil.which(cmd[0]):
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            if any(line.lstrip().startswith(marker) for line in out.splitlines()):
                return vendor
    return None


def cpu_warning(platform: str, environ: Mapping[str, str], dev: str = "/dev") -> str:
    """One warning line when JAX runs on the CPU (``platform``) of a machine with GPUs, else ``""``.

    Silent when ``JAX_PLATFORMS`` asks for the CPU explicitly.
    """
    if platform != "cpu" or environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return ""
    vendor = gpus_on_machine(dev)
    if vendor is None:
        return ""
    fix = 'pip install -e ".[cuda]"' if vendor == "NVIDIA" else "install JAX's ROCm packages (docs/rocm.md)"
    return (f"jaxllm: warning: this machine has {vendor} GPUs but JAX runs on the CPU (no GPU backend in this "
            f"JAX installation, or it failed to start): {fix}")


def report(applied: Applied) -> None:
    """Prints the start-up lines on process 0: the settings :func:`apply` made, and :func:`cpu_warning`.

    Call it after :func:`jaxllm.platform.distributed.initialize` (it starts the JAX backend)."""
    import jax  # noqa: PLC0415 - apply() must stay importable and runnable before jax starts

    if jax.process_index() != 0:
        return
    if applied.line():
        print(applied.line(), flush=True)
    warning = cpu_warning(jax.default_backend(), os.environ)
    if warning:
        print(warning, file=sys.stderr, flush=True)
