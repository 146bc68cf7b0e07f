"""Lowering for a GPU this machine does not have, and the Triton kernels inside the result.

JAX lowers for any platform without its hardware: ``jax.export`` with
``platforms=["cuda"]`` or ``["rocm"]`` turns every Pallas call into a custom call
``__gpu$xla.gpu.triton`` whose backend config carries the kernel's Triton IR (TTIR,
as MLIR bytecode) and its launch parameters.  :func:`export_for` lowers a function
that way (with :func:`jaxllm.model.attention.lowering_target` the model's attention is
traced for that GPU), and :func:`triton_kernels` takes the kernels back out, so that
the tests can check what a GPU would be given and ``benchmarks/triton_offline.py``
can compile the IR to machine code with the Triton compiler.

With no GPU present, JAX's Pallas lowering assumes compute capability 9.0 for CUDA
(only float8 casts depend on it; none is used here), so the TTIR is the same for
every NVIDIA target; ROCm gets its own lowering (its math functions differ).  JAX 0.10 made
that assumption itself; JAX 0.11 and newer ask the device and refuse without a GPU, so
:func:`without_gpu` (entered by :func:`export_for` and by ``lowering_target``) answers as 0.10 did.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re

import jax
from jax import export

TRITON_CALL = "__gpu$xla.gpu.triton"
CUDNN_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
PLATFORMS = ("cuda", "rocm")


@contextlib.contextmanager
def without_gpu():
    """Pallas's Triton lowering where the GPU it lowers for is not here: JAX 0.11+ asks the default device (or the
    abstract mesh's) for its compute capability (``jax._src.pallas.triton.gpu_info.get_gpu_info``, a ValueError
    without a GPU, raised as "No supported GPU devices found"); inside the block that question is answered as JAX
    0.10's lowering answered it itself (``pallas_call_registration.py``: "the minimum CC supported by Triton"):
    an H100's, 9.0.  A GPU that is here answers as usual; under JAX 0.10 nothing changes."""
    try:
        from jax._src.pallas.triton import gpu_info  # noqa: PLC0415 - JAX 0.11 and newer
    except ImportError:
        yield
        return
    asked = gpu_info.get_gpu_info

    def answer():
        try:
            return asked()
        except ValueError:
            return gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)

    gpu_info.get_gpu_info = answer
    try:
        yield
    finally:
        gpu_info.get_gpu_info = asked


def export_for(fn, args, platform: str) -> export.Exported:
    """``jax.export`` of ``fn`` (jitted if it is not) at ``args`` for ``platform`` (``"cuda"``/``"rocm"``).

    Triton and cuDNN attention custom calls are allowed (JAX guarantees no serialization
    compatibility for them; these exports are checked, not stored).

    Args:
      fn: a function, or a ``jax.jit`` one (its shardings are kept).
      args: ``jax.ShapeDtypeStruct`` (optionally with ``sharding``) or arrays, positionally.
      platform: ``"cuda"`` or ``"rocm"``.
    Raises:
      ValueError: an unknown platform, or JAX's own error when something cannot be lowered.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}: choose one of {', '.join(PLATFORMS)}")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in (TRITON_CALL, *CUDNN_CALLS)]
    with without_gpu():
        return export.export(jitted, platforms=[platform], disabled_checks=checks)(*args)


def custom_call_targets(exported: export.Exported) -> collections.Counter:
    """``Counter`` of the custom-call targets in ``exported``'s StableHLO."""
    return collections.Counter(re.findall(r"stablehlo\.custom_call @([\w$.]+)", exported.mlir_module()))


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Triton kernel as a lowered Pallas call hands it to XLA.

    Attributes:
      name: the kernel (``pallas_call(name=...)``).
      ir: its Triton IR, MLIR bytecode.
      num_warps, num_stages: launch parameters.
      grid: ``(x, y, z)`` programs.
    """

    name: str
    ir: bytes
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]

    def ttir(self) -> str:
        """The IR as text (the ``.ttir`` form the Triton compiler reads)."""
        from jaxlib.mlir import ir  # noqa: PLC0415
        from jaxlib.triton import dialect  # noqa: PLC0415

        with ir.Context() as ctx:
            dialect.register_dialect(ctx)
            return ir.Module.parse(self.ir).operation.get_asm(enable_debug_info=False)


def triton_kernels(exported: export.Exported) -> list[TritonKernel]:
    """The Triton kernels of ``exported`` (from :func:`export_for`), in program order."""
    from jax._src.interpreters import mlir  # noqa: PLC0415 - the context with JAX's dialects registered
    from jax._src.lib.mlir import ir  # noqa: PLC0415

    out = []
    with mlir.make_ir_context():
        module = ir.Module.parse(exported.mlir_module())

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        child = child.operation
                        if (child.name == "stablehlo.custom_call"
                                and ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL):
                            cfg = ir.DictAttr(child.attributes["mhlo.backend_config"])
                            num = {k: ir.IntegerAttr(cfg[k]).value
                                   for k in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
                            out.append(TritonKernel(ir.StringAttr(cfg["name"]).value,
                                                    ir.StringAttr(cfg["ir"]).value_bytes,
                                                    num["num_warps"], num["num_stages"],
                                                    (num["grid_x"], num["grid_y"], num["grid_z"])))
                        walk(child)

        walk(module.operation)
    return out
