"""Compile the attention kernels to GPU machine code on a machine without a GPU; report their resources.

    python benchmarks/triton_offline.py                     # Markdown table: every kernel x target
    python benchmarks/triton_offline.py --targets sm_90 --head-dims 128 --impls pallas
    python benchmarks/triton_offline.py --sweep --targets gfx90a,gfx942 --head-dims 128   # candidate tiles

Needs the ``triton`` package (``pip install "triton>=3.9"``, a ~290 MB wheel, ~1 GB installed: it
bundles ``ptxas``/``cuobjdump`` for NVIDIA and links AMD GPU code with its own LLD), no GPU.

* ``pallas``: the Pallas flash-attention forward, dK/dV and dQ kernels are lowered with
  ``jax.export`` for ``cuda`` / ``rocm`` (:mod:`jaxllm_kernels.lowering`), each with its GPU
  family's tiles from ``DEFAULT_BLOCK_SIZES`` (sm_80: ``ampere``, sm_90: ``hopper``, gfx90a:
  ``cdna``); the Triton IR inside each custom call is compiled by the Triton compiler, as XLA
  would compile it on the GPU (XLA bundles its own Triton; versions differ, so the figures are
  those of this Triton, close to but not necessarily XLA's).
* ``triton``: the Triton-language kernels of :mod:`jaxllm_kernels.triton_attention` compiled
  from their Python source (``triton.compile`` of an ``ASTSource``) with the constants, pointer
  alignment (16 bytes) and launch parameters ``jax_triton`` would give them.

Targets: ``sm_80`` (A100), ``sm_90`` (H100/H200; Triton compiles for ``sm_90a``), ``gfx90a``
(MI250X), ``gfx942`` (MI300X).  Resources per kernel: registers per thread (NVIDIA, from
``ptxas -v``) or VGPRs + AGPRs per lane and SGPRs (AMD, from the assembly's metadata), shared
memory / LDS per block as Triton allocates it, against the architecture's per-block limit,
spills (NVIDIA: spill stores + loads bytes; AMD: VGPR/SGPR spill counts and scratch bytes), and
the matrix instructions in the code (:data:`MATRIX`: Hopper's ``wgmma`` on sm_90, ``mma.sync`` on sm_80,
``v_mfma`` on CDNA; counted in the PTX or the AMD GPU assembly, each instruction once however often
it runs). A kernel that exceeds the shared-memory limit would fail to launch on that GPU; one without
its target's matrix instructions would do its products on the ordinary cores, several times slower.

``--sweep``: instead of the family's tiles, every candidate of :data:`SWEEP` for each Pallas kernel
(9 tile shapes x ``--warps`` x ``--stages``), one row each: how the CDNA tables of
``DEFAULT_BLOCK_SIZES`` were chosen without an AMD GPU (the kernels' spills and occupancy, not
their speed, which only a GPU can measure: ``benchmarks/attention.py``).

Exit codes: 0 every kernel compiled within the limits; 1 a kernel failed to compile, exceeds the
shared-memory limit, spills, or has none of its target's matrix instructions (:func:`problem`; its
row says which); 2 bad arguments or no ``triton``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

from jaxllm.model import attention
from jaxllm_kernels import lowering
from jaxllm_kernels import pallas_attention as pa

# target: (Triton backend, arch, warp size, block-size family, lowering platform, shared memory per block in bytes)
# Limits: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": 163 KB (8.0) and
# 227 KB (9.0) of shared memory per block (opt-in); AMD CDNA2/CDNA3 ISA guides: 64 KiB of LDS per workgroup.
TARGETS = {
    "sm_80": ("cuda", 80, 32, "ampere", "cuda", 163 * 1024),
    "sm_90": ("cuda", 90, 32, "hopper", "cuda", 227 * 1024),
    "gfx90a": ("hip", "gfx90a", 64, "cdna", "rocm", 64 * 1024),
    "gfx942": ("hip", "gfx942", 64, "cdna", "rocm", 64 * 1024),
}
KERNELS = ("fwd", "dkdv", "dq")
# the matrix instruction each target's kernels must use; the patterns count them in the PTX / AMD GPU assembly
MATRIX = {"sm_80": "mma.sync", "sm_90": "wgmma", "gfx90a": "v_mfma", "gfx942": "v_mfma"}
_MATRIX_PATTERNS = {"wgmma": r"\bwgmma\.mma_async", "mma.sync": r"\bmma\.sync", "v_mfma": r"\bv_mfma"}
# --sweep: each kernel's (query tile, key tile) candidates; the i-th of each kernel's list is lowered together
SWEEP = {"fwd": [(q, k) for q in (64, 128, 256) for k in (32, 64, 128)],
         "dkdv": [(q, k) for q in (16, 32, 64) for k in (32, 64, 128)],
         "dq": [(q, k) for q in (32, 64, 128) for k in (16, 32, 64)]}
_PALLAS_NAMES = {"jaxllm_flash_fwd": "fwd", "jaxllm_flash_bwd_dkdv": "dkdv", "jaxllm_flash_bwd_dq": "dq"}


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="sm_80,sm_90,gfx90a,gfx942", help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--impls", default="pallas,triton", help="pallas and/or triton")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="0: = heads")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--sweep", action="store_true", help="every candidate tile of the Pallas kernels (see SWEEP)")
    p.add_argument("--warps", default="4,8", help="--sweep: warps per program")
    p.add_argument("--stages", default="1,2", help="--sweep: software-pipelining stages")
    return p.parse_args(argv)


def tiles(family: str, head_dim: int) -> pa.BlockSizes:
    """The resolved tile sizes and launch parameters of ``family`` at ``head_dim`` (as the kernels use them)."""
    return pa._resolve_blocks(None, None, None, 1 << 30, 1 << 30, head_dim, family)


def _tile_text(bs: pa.BlockSizes, kernel: str) -> str:
    q, k = {"fwd": (bs.block_q, bs.block_k), "dkdv": (bs.block_q_dkv, bs.block_k_dkv),
            "dq": (bs.block_q_dq, bs.block_k_dq)}[kernel]
    warps, stages = (bs.num_warps, bs.num_stages) if kernel == "fwd" else (bs.num_warps_bwd, bs.num_stages_bwd)
    return f"{q}x{k}, {warps}w, {stages}s"


def pallas_ttir(platform_: str, family: str, a, head_dim: int,
                block_sizes: pa.BlockSizes | None = None) -> dict[str, lowering.TritonKernel]:
    """Forward + backward of the Pallas kernel lowered for ``platform_`` with ``family``'s tiles (as the
    model's attention calls it), or with ``block_sizes``: ``{kernel: TritonKernel}``."""
    dtype = jnp.dtype(a.dtype)
    kvh = a.kv_heads or a.heads

    def grads(q, k, v):
        def loss(q, k, v):
            if block_sizes is None:
                out = attention.attention(q, k, v, impl="pallas", causal=a.causal)
            else:
                out = pa.flash_attention(q, k, v, causal=a.causal, interpret=False, block_sizes=block_sizes)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct((1, a.seq, h, head_dim), dtype) for h in (a.heads, kvh, kvh)]
    with attention.lowering_target(platform_, family):
        exported = lowering.export_for(grads, args, platform_)
    return {_PALLAS_NAMES[k.name]: k for k in lowering.triton_kernels(exported)}


def sweep_rows(a) -> list[dict]:
    """Every :data:`SWEEP` candidate of the three Pallas kernels compiled for every target (``--sweep``)."""
    out = []
    targets = [t for t in a.targets.split(",") if t]
    for d in (int(x) for x in a.head_dims.split(",") if x):
        for warps, stages in ((int(w), int(s)) for w in a.warps.split(",") for s in a.stages.split(",")):
            for i in range(len(SWEEP["fwd"])):
                bs = pa.BlockSizes(*SWEEP["fwd"][i], *SWEEP["dkdv"][i], *SWEEP["dq"][i], num_warps=warps,
                                   num_stages=stages, num_warps_bwd=warps, num_stages_bwd=stages)
                lowered = {}
                for target in targets:
                    family, plat = TARGETS[target][3], TARGETS[target][4]
                    for kernel in KERNELS:
                        row = dict(impl="pallas", head_dim=d, kernel=kernel, target=target,
                                   tiles=_tile_text(bs, kernel))
                        try:
                            if plat not in lowered:
                                lowered[plat] = pallas_ttir(plat, family, a, d, bs)
                            row.update(compile_pallas(lowered[plat][kernel], target))
                        except Exception as e:  # noqa: BLE001 - reported in the table
                            row["error"] = _error_text(e)
                        out.append(row)
                print(f"  d{d} {warps}w {stages}s tiles {i + 1}/{len(SWEEP['fwd'])}", file=sys.stderr, flush=True)
    return out


def _triton_source(kernel: str, a, head_dim: int, bs: pa.BlockSizes):
    """``(ASTSource, num_warps, num_stages)`` of a Triton-language kernel as jax_triton would compile it."""
    import triton  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from jaxllm_kernels import triton_attention as ta  # noqa: PLC0415

    fn = ta._load()[kernel]
    ty = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[a.dtype]
    kvh = a.kv_heads or a.heads
    cfg = ta._Cfg(sm_scale=head_dim ** -0.5, causal=a.causal, window=0, group=a.heads // kvh, has_seg=False,
                  has_pos=False, exact=a.dtype == "float32", blocks=bs)
    q = jax.ShapeDtypeStruct((1, a.seq, a.heads, head_dim), jnp.dtype(a.dtype))
    k = jax.ShapeDtypeStruct((1, a.seq, kvh, head_dim), jnp.dtype(a.dtype))
    block = {"fwd": (bs.block_q, bs.block_k), "dkdv": (bs.block_q_dkv, bs.block_k_dkv),
             "dq": (bs.block_q_dq, bs.block_k_dq)}[kernel]
    meta = ta._meta(cfg, q, k, *block)
    pointers = {"fwd": ["Q", "K", "V", "QSEG", "KSEG", "QPOS", "KPOS", "O", "LSE"],
                "dkdv": ["Q", "K", "V", "DO", "LSE2", "DELTA", "QSEG", "KSEG", "QPOS", "KPOS", "DK", "DV"],
                "dq": ["Q", "K", "V", "DO", "LSE2", "DELTA", "QSEG", "KSEG", "QPOS", "KPOS", "DQ"]}[kernel]
    types = {"QSEG": "*i32", "KSEG": "*i32", "QPOS": "*i32", "KPOS": "*i32", "LSE": "*fp32", "LSE2": "*fp32",
             "DELTA": "*fp32"}
    signature = {name: types.get(name, f"*{ty}") for name in pointers}
    signature.update({name: "constexpr" for name in meta})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}  # jax_triton assumes 16-byte alignment
    warps, stages = (bs.num_warps, bs.num_stages) if kernel == "fwd" else (bs.num_warps_bwd, bs.num_stages_bwd)
    assert triton  # imported for its side effect of making ta._load() work
    return ASTSource(fn, signature, constexprs=meta, attrs=attrs), warps, stages


def compile_source(src, target: str, num_warps: int, num_stages: int) -> dict:
    """Compiles ``src`` (a ``.ttir`` path or an ``ASTSource``) for ``target``; returns its resources.

    Returns:
      dict with ``regs`` (NVIDIA registers per thread, AMD VGPRs + AGPRs per lane), ``sgprs`` (AMD),
      ``smem`` (bytes of shared memory / LDS per block), ``smem_limit``, ``spill`` (NVIDIA: spill
      store + load bytes; AMD: VGPR + SGPR spill count), ``scratch`` (AMD scratch bytes per lane),
      ``occupancy`` (AMD waves per SIMD, from the compiler), ``matrix`` (``{instruction: count}`` of
      :data:`MATRIX`'s instructions present in the code).
    Raises:
      Exception: Triton's own error when the kernel cannot be compiled for ``target``.
    """
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    backend, arch, warp, _, _, limit = TARGETS[target]
    opts = dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)  # Triton's and jax_triton's default
    log = io.StringIO()
    knobs = triton.knobs
    with contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = backend == "cuda"  # ptxas -v: registers and spills
        knobs.compilation.always_compile = True  # a cached kernel would skip ptxas and its log
        try:
            compiled = triton.compile(src, target=GPUTarget(backend, arch, warp), options=opts)
        finally:
            knobs.nvidia.dump_ptxas_log = False
            knobs.compilation.always_compile = False
    res = {"smem": int(compiled.metadata.shared), "smem_limit": limit, "sgprs": None, "scratch": None,
           "occupancy": None}
    if backend == "cuda":
        text = log.getvalue()
        regs = re.findall(r"Used (\d+) registers", text)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        if not regs or not spills:
            raise RuntimeError(f"no ptxas resource line in: {text[-500:]!r}")
        res.update(regs=int(regs[-1]), spill=sum(map(int, spills[-1])), matrix=matrix_instructions(compiled.asm["ptx"]))
    else:
        asm = compiled.asm["amdgcn"]

        def num(pattern):
            m = re.search(pattern, asm)
            if not m:
                raise RuntimeError(f"{pattern!r} not in the AMD GPU assembly")
            return int(m.group(1))

        res.update(regs=num(r"; TotalNumVgprs: (\d+)") if "TotalNumVgprs" in asm else num(r"; NumVgprs: (\d+)"),
                   sgprs=num(r"; TotalNumSgprs: (\d+)") if "TotalNumSgprs" in asm else num(r"; NumSgprs: (\d+)"),
                   spill=num(r"\.vgpr_spill_count:\s+(\d+)") + num(r"\.sgpr_spill_count:\s+(\d+)"),
                   scratch=num(r"; ScratchSize: (\d+)"), occupancy=num(r"; Occupancy: (\d+)"),
                   matrix=matrix_instructions(asm))
    return res


def matrix_instructions(code: str) -> dict[str, int]:
    """``{instruction: count}`` of the matrix instructions (:data:`MATRIX`'s) in PTX or AMD GPU assembly."""
    counts = {name: len(re.findall(pattern, code)) for name, pattern in _MATRIX_PATTERNS.items()}
    return {name: n for name, n in counts.items() if n}


def compile_pallas(kernel: lowering.TritonKernel, target: str) -> dict:
    """Compiles one lowered Pallas kernel (its Triton IR) for ``target``; see :func:`compile_source`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(path, "w", encoding="utf-8") as f:
            f.write(kernel.ttir())
        return compile_source(path, target, kernel.num_warps, kernel.num_stages)


def rows(a) -> list[dict]:
    """Every (impl, head_dim, kernel, target) compiled; a row has ``error`` where it failed."""
    out = []
    targets = [t for t in a.targets.split(",") if t]
    impls = [i for i in a.impls.split(",") if i]
    for impl in impls:
        for d in (int(x) for x in a.head_dims.split(",") if x):
            lowered = {}
            for target in targets:
                family, plat = TARGETS[target][3], TARGETS[target][4]
                bs = tiles(family, d)
                for kernel in KERNELS:
                    row = dict(impl=impl, head_dim=d, kernel=kernel, target=target, tiles=_tile_text(bs, kernel))
                    try:
                        if impl == "pallas":
                            if (plat, family) not in lowered:
                                lowered[plat, family] = pallas_ttir(plat, family, a, d)
                            k = lowered[plat, family][kernel]
                            if (k.num_warps, k.num_stages) != _launch(bs, kernel):  # the table is what was lowered
                                raise RuntimeError(f"lowered with {k.num_warps} warps, {k.num_stages} stages")
                            row.update(compile_pallas(k, target))
                        else:
                            row.update(compile_source(*_triton_source(kernel, a, d, bs)[:1], target,
                                                      *_launch(bs, kernel)))
                    except Exception as e:  # noqa: BLE001 - reported in the table, exit status 1
                        row["error"] = _error_text(e)
                    out.append(row)
                    print(f"  {impl} d{d} {kernel} {target}: {row.get('error') or 'ok'}", file=sys.stderr, flush=True)
    return out


def _error_text(e: Exception) -> str:
    """The first line of an exception, for a table cell."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e) else ''}"


def _launch(bs: pa.BlockSizes, kernel: str) -> tuple[int, int]:
    return (bs.num_warps, bs.num_stages) if kernel == "fwd" else (bs.num_warps_bwd, bs.num_stages_bwd)


def problem(row: dict) -> str | None:
    """Why a compiled row fails the checks (over the shared memory, spilling, without its target's matrix
    instructions), or None; rows with an ``error`` are not checked."""
    if "error" in row:
        return None
    if row["smem"] > row["smem_limit"]:
        return "OVER shared memory"
    if row["spill"] or row["scratch"]:
        return "SPILLS"
    if MATRIX[row["target"]] not in row["matrix"]:
        return f"no {MATRIX[row['target']]}"
    return None


def table(results: list[dict]) -> str:
    head = ["impl", "head_dim", "kernel", "tiles (q x k, warps, stages)", "target", "registers", "shared KiB (limit)",
            "spills", "matrix instructions", "AMD: SGPRs / scratch B / occupancy", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        base = [r["impl"], str(r["head_dim"]), r["kernel"], r["tiles"], r["target"]]
        if "error" in r:
            lines.append("| " + " | ".join(base + [f"error: {r['error']}", "", "", "", "", "error"]) + " |")
            continue
        smem = f"{r['smem'] / 1024:.1f} ({r['smem_limit'] // 1024})"
        amd = "" if r["sgprs"] is None else f"{r['sgprs']} / {r['scratch']} / {r['occupancy']}"
        spill = f"{r['spill']} B" if r["sgprs"] is None else str(r["spill"])
        matrix = ", ".join(f"{n} {name}" for name, n in r["matrix"].items()) or "none"
        lines.append("| " + " | ".join(base + [str(r["regs"]), smem, spill, matrix, amd, problem(r) or "ok"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _parse(argv)
    bad = [t for t in a.targets.split(",") if t and t not in TARGETS]
    if bad or not set(a.impls.split(",")) <= {"pallas", "triton"}:
        print(f"error: --targets {','.join(bad)}: choose from {', '.join(TARGETS)}; --impls from pallas, triton",
              file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print('error: the triton package is not installed: pip install "triton>=3.9"', file=sys.stderr)
        return 2
    results = sweep_rows(a) if a.sweep else rows(a)
    kvh = a.kv_heads or a.heads
    print(f"# Attention kernels compiled offline ({datetime.date.today().isoformat()}, {platform.node() or '?'}, "
          f"no GPU): triton {triton.__version__}, jax {jax.__version__}")
    print(f"batch 1, seq {a.seq}, heads {a.heads}, kv_heads {kvh}, {a.dtype}, causal={a.causal}; "
          f"command: python benchmarks/triton_offline.py {' '.join(sys.argv[1:] if argv is None else argv)}\n")
    print(table(results))
    failed = [r for r in results if "error" in r or problem(r)]
    return 1 if failed and not a.sweep else 0


if __name__ == "__main__":
    sys.exit(main())
