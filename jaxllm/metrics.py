"""Training metrics: FLOP counts, peak FLOP/s per device, MFU, and the run's log.

* :func:`flops_per_token` / :func:`flops_per_step` count the matmul FLOPs of one
  training step of the GPT in :mod:`jaxllm.model` (forward + backward, optionally
  the recomputed forward of ``model.remat="full"``).
* :data:`PEAK_FLOPS` / :func:`peak_flops_per_device` give the dense peak FLOP/s of
  one device (vendor datasheet for known accelerators, a measured matmul otherwise).
* :func:`throughput` turns a step time into tokens/s, TFLOP/s per device, MFU and HFU.
* :class:`MetricsLogger` writes every logged step to ``WORKDIR/metrics.jsonl``,
  TensorBoard (``WORKDIR/tensorboard``) and one human line on stdout.

Units: FLOPs are floating-point operations (a multiply-add counts 2), FLOP/s are
FLOPs per second, throughput is tokens/s, times are seconds.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------------------------
# FLOP counts
# ---------------------------------------------------------------------------------------------


def flops_per_token(model_cfg, seq_length: int, *, recompute: bool = False) -> float:
    """Training FLOPs per token of one step: forward + backward (= 3x forward).

    Counts matmul FLOPs only (2 FLOPs per multiply-add; norms, softmax, activations,
    the optimizer and the embedding lookup are not counted). With ``h`` = hidden size,
    ``d`` = head dim, ``n`` = attention heads, ``k`` = kv heads, ``f`` = FFN size,
    ``V`` = vocabulary, ``s`` = sequence length, ``L`` = layers, the forward FLOPs per
    token are, per layer:

    * QKV projections: ``2*h*(n + 2*k)*d``
    * attention scores ``Q K^T`` and ``probs @ V``: ``2 * 2*s*n*d``, halved for the
      causal mask, i.e. ``2*s*n*d`` (each query attends to ~s/2 keys on average; this is
      the work a causal kernel does, and the convention of FlashAttention's benchmarks)
    * output projection: ``2*(n*d)*h`` (= ``2*h*h``)
    * MLP: ``2*h*f*2`` (gelu: up, down) or ``2*h*f*3`` (swiglu: gate, up, down)

    plus the output layer (logits) ``2*h*V``. Training is 3x the forward (the backward
    computes the gradients of both the activations and the weights, 2x). With
    ``recompute=True`` the transformer layers are counted 4x instead of 3x (the forward
    recomputed in the backward by ``model.remat="full"``); the logits are not rematerialised
    and stay at 3x. ``recompute=False`` gives *model* FLOPs (the basis of MFU),
    ``recompute=True`` *hardware* FLOPs for ``remat="full"`` (the basis of HFU).

    Relation to Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473, Appendix "Floating-point
    operations"): for ``f = 4h``, multi-head attention (``k = n``, ``n*d = h``), per
    iteration of ``B`` sequences they count ``72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h))``
    without recomputation and ``96*B*s*L*h^2*(1 + s/(6h) + V/(16*L*h))`` with it (eq. 3).
    Megatron does NOT halve the attention for the causal mask, so per token::

        flops_per_token(...)                 = 72*L*h^2*(1 + s/(6h) + V/(12Lh)) - 6*L*s*h
        flops_per_token(..., recompute=True) = 96*L*h^2*(1 + s/(6h) + V/(16Lh)) - 8*L*s*h

    (for GQA/SwiGLU the same holds against Megatron-LM's ``num_floating_point_operations``,
    with ``6*L*s*n*d`` in place of ``6*L*s*h``).

    Args:
      model_cfg: the ``model`` section of a config passed through
        :func:`jaxllm.config.resolved` (``num_kv_heads``, ``ffn_hidden_size`` and
        ``vocab_size`` must be filled in, not 0).
      seq_length: tokens per sequence ``s``.
      recompute: add one forward of the transformer layers (activation recomputation).
    Returns:
      FLOPs per token (a float).
    Raises:
      ValueError: the config still has derived (0) values, or an unknown activation.
    """
    m = model_cfg
    for key in ("num_kv_heads", "ffn_hidden_size", "vocab_size"):
        if not m[key]:
            raise ValueError(f"model.{key} is 0 (derived): pass config.resolved(cfg, vocab_size).model")
    if m.activation not in ("gelu", "swiglu"):
        raise ValueError(f"model.activation={m.activation!r}: flops_per_token knows gelu and swiglu")
    h, n, k, f, V, s = m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size, seq_length
    d = h // n
    qkv = 2 * h * (n + 2 * k) * d
    attention = 2 * 2 * s * n * d / 2  # QK^T and probs@V, halved: causal
    out_proj = 2 * (n * d) * h
    mlp = 2 * h * f * (3 if m.activation == "swiglu" else 2)
    layers = m.num_layers * (qkv + attention + out_proj + mlp)
    logits = 2 * h * V
    return float((4 if recompute else 3) * layers + 3 * logits)


def flops_per_step(cfg, *, recompute: bool | None = None) -> float:
    """Training FLOPs of one optimizer step, all devices together.

    ``train.global_batch_size * train.seq_length`` tokens x :func:`flops_per_token`.

    Args:
      cfg: a full config passed through :func:`jaxllm.config.resolved`.
      recompute: count the recomputed forward; None: ``cfg.model.remat == "full"``
        (``"save_dots"`` keeps every matmul output, so it recomputes no matmul FLOPs).
    Returns:
      FLOPs per step (a float).
    """
    if recompute is None:
        recompute = cfg.model.remat == "full"
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    return tokens * flops_per_token(cfg.model, cfg.train.seq_length, recompute=recompute)


def recompute_flops_per_token(model_cfg, seq_length: int, remat: str) -> float:
    """Matmul FLOPs per token that activation recomputation (``model.remat``) adds to a step.

    * ``"none"``: 0.
    * ``"full"`` (``nothing_saveable``): one more forward of the transformer layers, i.e.
      ``flops_per_token(recompute=True) - flops_per_token()``.
    * ``"save_dots"`` (``dots_with_no_batch_dims_saveable``): the projection and MLP matmuls
      (no dot batch dimensions) are saved; the attention score and value matmuls (batched over
      batch and heads) are recomputed, so one forward of them: ``L * 2*s*n*d`` per token
      (causal-halved as in :func:`flops_per_token`).  Approximation: norms, softmax, GELU
      and the other elementwise work that is also recomputed are not matmuls and are not
      counted, like everywhere in this module; a fused attention kernel (``pallas``,
      ``cudnn``, ``triton``) recomputes inside its own backward whatever the policy says,
      which no policy term counts either.

    Args:
      model_cfg: a resolved ``model`` section (see :func:`flops_per_token`).
      seq_length: tokens per sequence.
      remat: ``"none"``, ``"full"`` or ``"save_dots"``.
    Returns:
      FLOPs per token (a float).
    Raises:
      ValueError: unknown ``remat``, or the errors of :func:`flops_per_token`.
    """
    if remat == "none":
        return 0.0
    if remat == "full":
        return flops_per_token(model_cfg, seq_length, recompute=True) - flops_per_token(model_cfg, seq_length)
    if remat == "save_dots":
        flops_per_token(model_cfg, seq_length)  # the same checks
        m = model_cfg
        head_dim = m.hidden_size // m.num_attention_heads
        return float(m.num_layers * 2 * 2 * seq_length * m.num_attention_heads * head_dim / 2)
    raise ValueError(f"remat={remat!r}: choose none, full or save_dots")


def hardware_flops_per_step(cfg) -> float:
    """Matmul FLOPs one step actually executes, all devices: :func:`flops_per_step` without
    recomputation plus :func:`recompute_flops_per_token` of ``cfg.model.remat`` per token
    (the basis of HFU; MFU uses the model FLOPs alone).

    Args:
      cfg: a full config passed through :func:`jaxllm.config.resolved`.
    Returns:
      FLOPs per step (a float).
    """
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    return flops_per_step(cfg, recompute=False) + tokens * recompute_flops_per_token(
        cfg.model, cfg.train.seq_length, cfg.model.remat)


# ---------------------------------------------------------------------------------------------
# Peak FLOP/s per device
# ---------------------------------------------------------------------------------------------

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


def _entry(bf16: float, fp32: float) -> dict:
    return {"bfloat16": bf16, "float16": bf16, "float32": fp32}


PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": _entry(312e12, 19.5e12),
    "H100": _entry(989e12, 67e12),  # SXM ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": _entry(756e12, 51e12),
    "H100 NVL": _entry(835e12, 60e12),
    "H200": _entry(989e12, 67e12),  # SXM ("NVIDIA H200")
    "H200 NVL": _entry(835e12, 60e12),
    "GH200": _entry(989e12, 67e12),
    "V100": _entry(125e12, 15.7e12),  # SXM2 ("Tesla V100-SXM2-16GB")
    "V100-PCIE": _entry(112e12, 14e12),
    "MI250X": _entry(383e12 / 2, 95.7e12 / 2),  # per GCD
    "MI300X": _entry(1307.4e12, 163.4e12),
}

_MEASURED: dict[tuple[str, str, str], float] = {}  # (platform, device_kind, dtype) -> FLOP/s


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def lookup_peak_flops(device_kind: str, dtype="bfloat16") -> tuple[float, str] | None:
    """The :data:`PEAK_FLOPS` entry for a device kind string, or None.

    Args:
      device_kind: ``jax.Device.device_kind``, e.g. ``"NVIDIA A100-SXM4-80GB"``.
      dtype: the matmul dtype (name or dtype).
    Returns:
      ``(FLOP/s, the matching key)``, or None when no key matches or the entry lacks ``dtype``.
    """
    kind, dtype = device_kind.lower(), _dtype_name(dtype)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.lower() in kind:
            peak = PEAK_FLOPS[key].get(dtype)
            return None if peak is None else (peak, key)
    return None


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
    fastest of 5 jitted square matmuls in ``dtype`` (2048 on CPU, 8192 elsewhere),
    measured once per process and device kind and cached; on a shared CPU this is what
    the machine delivered at that moment, not a datasheet peak.

    Args:
      device: a ``jax.Device``; None: the first local device.
      dtype: the compute dtype (``model.dtype``).
    Returns:
      ``(FLOP/s, source)``, e.g. ``(312e12, "datasheet PEAK_FLOPS['A100'] bfloat16")`` or
      ``(1.8e11, "measured matmul on cpu (2048x2048 bfloat16)")``.
    """
    device = device if device is not None else jax.local_devices()[0]
    dtype = _dtype_name(dtype)
    found = lookup_peak_flops(device.device_kind, dtype)
    if found is not None:
        return found[0], f"datasheet PEAK_FLOPS[{found[1]!r}] {dtype}"
    n = 2048 if device.platform == "cpu" else 8192
    key = (device.platform, device.device_kind, dtype)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_matmul(device, dtype, n)
    where = "cpu" if device.platform == "cpu" else f"{device.device_kind!r} (not in PEAK_FLOPS)"
    return _MEASURED[key], f"measured matmul on {where} ({n}x{n} {dtype})"


def throughput(step_time_s: float, cfg, *, num_devices: int, peak_flops: float) -> dict[str, float]:
    """Throughput of one training step.

    Args:
      step_time_s: wall time of the step, seconds.
      cfg: the resolved config (global batch, sequence length, model, ``model.remat``).
      num_devices: devices the step ran on.
      peak_flops: peak FLOP/s of one device (:func:`peak_flops_per_device`).
    Returns:
      ``step_time_s``; ``tokens_per_sec`` (all devices) and ``tokens_per_sec_per_device``
      (tokens/s); ``tflops_per_device``: model TFLOP/s (1e12 FLOP/s) per device;
      ``mfu``: model FLOPs utilisation (model FLOP/s per device / peak, recomputation not
      counted); ``hfu``: hardware FLOPs utilisation (:func:`hardware_flops_per_step`: adds
      the matmuls ``model.remat`` recomputes; equals ``mfu`` for ``remat="none"``).
      Fractions, not percent.
    """
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    model_flops = flops_per_step(cfg, recompute=False) / step_time_s / num_devices
    hardware_flops = hardware_flops_per_step(cfg) / step_time_s / num_devices
    return {
        "step_time_s": float(step_time_s),
        "tokens_per_sec": tokens / step_time_s,
        "tokens_per_sec_per_device": tokens / step_time_s / num_devices,
        "tflops_per_device": model_flops / 1e12,
        "mfu": model_flops / peak_flops,
        "hfu": hardware_flops / peak_flops,
    }


# ---------------------------------------------------------------------------------------------
# The run's log
# ---------------------------------------------------------------------------------------------


def _to_python(key, value):
    """A JSON-able Python scalar from a Python/NumPy/JAX scalar."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    array = np.asarray(value)  # numpy scalar, 0-d numpy or jax array
    if array.ndim != 0 or array.dtype.kind not in "biuf":
        raise TypeError(f"metric {key!r} must be a real scalar, got {type(value).__name__} {array.shape}")
    return {"b": bool, "i": int, "u": int}.get(array.dtype.kind, float)(array)


def _si(x: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}"


def _number(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


# How the human line shows the usual keys, in this order: key -> formatter.
_TRAIN_FORMATS = {
    "loss": lambda v: f"loss {v:.4f}",
    "lr": lambda v: f"lr {v:.1e}",
    "grad_norm": lambda v: f"grad {v:.2f}",
    "tokens_per_sec": lambda v: f"{_si(v)} tok/s",
    "tflops_per_device": lambda v: f"{v:.3g} TFLOP/s/dev",
    "mfu": lambda v: f"MFU {100 * v:.1f}%",
    "step_time_s": lambda v: f"{v:.3g} s/step",
    "nonfinite_steps": lambda v: f"{v} non-finite steps skipped" if v else "",
}
_EVAL_FORMATS = {
    "eval_loss": lambda v: f"eval loss {v:.4f}",
    "eval_bpb": lambda v: f"bpb {v:.4f}",
    "eval_ppl": lambda v: f"ppl {v:.2f}",
}
_QUIET = {"tokens_per_sec_per_device", "hfu", "nonfinite_in_a_row"}  # logged to files, left off the human line


class MetricsLogger:
    """Writes each logged step to ``WORKDIR/metrics.jsonl``, TensorBoard and stdout.

    ``MetricsLogger(workdir, *, enabled=True, tensorboard=True, progress_bar=True, total_steps=None)``

    * ``metrics.jsonl``: one JSON object per :meth:`log` call, appended (a resumed run
      continues the file): ``{"step": int, "kind": "train"|"eval", **metrics}``; values are
      Python ints/floats/strings, non-finite floats (NaN, inf) are written as ``null`` so
      every line is strict JSON.
    * TensorBoard (tensorboardX ``SummaryWriter`` in ``WORKDIR/tensorboard``): every numeric
      metric as the scalar ``<kind>/<key>`` (``train/loss``, ``eval/eval_loss``).
    * stdout: one line per call, e.g.
      ``step   200 | loss 2.1034 | lr 9.8e-04 | grad 0.83 | 12.3k tok/s | 0.05 TFLOP/s/dev | MFU 12.1% | 0.061 s/step``.
      Known keys: ``loss``, ``lr``, ``grad_norm``, ``tokens_per_sec``,
      ``tflops_per_device``, ``mfu`` (fraction), ``step_time_s`` (seconds) for train;
      ``eval_loss``, ``eval_bpb``, ``eval_ppl`` for eval; other keys follow as ``key value``.
    * With ``progress_bar`` and stdout a terminal: a tqdm bar over ``total_steps``,
      moved by :meth:`advance`; the lines go through ``tqdm.write`` above it.

    ``enabled=False`` (processes other than 0) does nothing at all: no files, no output.
    :meth:`close` flushes and closes everything; the logger is also a context manager.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
                 progress_bar: bool = True, total_steps: int | None = None):
        self.enabled = enabled
        self.workdir = workdir
        self._file = self._writer = self._bar = None
        self._step_width = max(5, len(str(total_steps or "")))
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._file = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
        if progress_bar and sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, file=sys.stdout, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict, kind: str = "train") -> None:
        """Records ``metrics`` (scalars: Python, NumPy or JAX) at ``step``.

        Args:
          step: the optimizer step.
          metrics: name -> scalar; names ``step`` and ``kind`` are reserved.
          kind: ``"train"`` or ``"eval"``.
        Raises:
          ValueError: bad ``kind`` or a reserved name; TypeError: a non-scalar value.
        """
        if not self.enabled:
            return
        if kind not in ("train", "eval"):
            raise ValueError(f"kind={kind!r}: choose train or eval")
        if {"step", "kind"} & metrics.keys():
            raise ValueError("metric names 'step' and 'kind' are reserved")
        step = int(step)
        values = {k: _to_python(k, v) for k, v in metrics.items()}
        record = {"step": step, "kind": kind}
        record.update({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._writer.add_scalar(f"{kind}/{k}", v, step)
        line = self._human_line(step, values, kind)
        if self._bar is not None:
            if kind == "train" and isinstance(values.get("loss"), float):
                self._bar.set_postfix_str(f"loss {values['loss']:.4f}", refresh=False)
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def _human_line(self, step: int, values: dict, kind: str) -> str:
        formats = _TRAIN_FORMATS if kind == "train" else _EVAL_FORMATS
        parts = [f"step {step:>{self._step_width}}"]
        for key, fmt in formats.items():
            v = values.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and fmt(v):
                parts.append(fmt(v))
        for key, v in values.items():
            if key not in formats and key not in _QUIET:
                parts.append(f"{key} {_number(v)}")
        return " | ".join(parts)

    def advance(self, n: int = 1) -> None:
        """Moves the progress bar ``n`` steps (nothing without a bar)."""
        if self._bar is not None:
            self._bar.update(n)

    def flush(self) -> None:
        """Writes out everything buffered."""
        if self._file is not None:
            self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the files, the TensorBoard writer and the bar.

        Safe to call twice; :meth:`log` and :meth:`advance` do nothing afterwards.
        """
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self._bar is not None:
            self._bar.close()
        self._file = self._writer = self._bar = None
        self.enabled = False

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
