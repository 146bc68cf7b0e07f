"""The run's log: :class:`MetricsLogger` writes every logged step to ``WORKDIR/metrics.jsonl``,
TensorBoard (``WORKDIR/tensorboard``), Weights & Biases (``log.wandb``: :func:`start_wandb`) and one
human line on stdout."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from jaxllm.errors import ConfigError


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
    "mtp_loss": lambda v: f"mtp {v:.4f}",  # multi-token prediction's depths (jaxllm.model.gpt.GPT.mtp_losses)
    "moe_aux_loss": lambda v: f"aux {v:.3f}",  # a mixture of experts' routing (jaxllm.model.moe)
    "moe_z_loss": lambda v: f"z {v:.3g}",
    "moe_max_load": lambda v: f"max load {v:.2f}",
    "moe_dropped": lambda v: f"dropped {100 * v:.1f}%" if v else "",
    "tokens_per_sec": lambda v: f"{_si(v)} tok/s",
    "tflops_per_device": lambda v: f"{v:.3g} TFLOP/s/dev",
    "mfu": lambda v: f"MFU {100 * v:.1f}%",
    "step_time_s": lambda v: f"{v:.3g} s/step",
    "step_time_spread": lambda v: f"spread {v:.2f}",  # multi-process runs: slowest / median (runtime/stragglers.py)
    "nonfinite_steps": lambda v: f"{v} non-finite steps skipped" if v else "",
}
_EVAL_FORMATS = {
    "eval_loss": lambda v: f"eval loss {v:.4f}",
    "eval_bpb": lambda v: f"bpb {v:.4f}",
    "eval_ppl": lambda v: f"ppl {v:.2f}",
}
# logged to files, left off the human line (Megatron-LM's FLOP convention: the same figures counted its way, in the
# record for comparisons with its published numbers; the line gives each figure once)
_QUIET = {"tokens_per_sec_per_device", "hfu", "nonfinite_in_a_row", "slowest_process", "megatron_tflops_per_device",
          "megatron_mfu"}
# the start-up times jaxllm.train adds to the first record after a start (printed on a line of their own)
_QUIET_PREFIXES = ("startup_", "compile_cache")


def import_wandb():
    """The ``wandb`` module, for ``log.wandb=True``.

    Raises:
      ConfigError: it cannot be imported (not installed).
    """
    try:
        import wandb
    except ImportError as e:
        raise ConfigError("log.wandb", True, f"the wandb package cannot be imported ({e}); pip install "
                          "'jaxllm[wandb]', or set --config.log.wandb=False") from None
    return wandb


def start_wandb(cfg, workdir: str):
    """Starts the W&B run of ``workdir`` for the resolved config ``cfg`` (recorded as the run's config),
    or resumes it: its id is kept in ``WORKDIR/wandb_run_id``, so a restart in the same directory logs to
    the same W&B run. W&B's files go to ``WORKDIR/wandb``; its environment variables apply
    (``WANDB_MODE=offline`` or ``disabled``, ``WANDB_API_KEY``, ...). Returns the ``wandb`` run, for
    :class:`MetricsLogger`.

    Raises:
      ConfigError: wandb cannot be imported, or W&B cannot start the run (not logged in, ...).
    """
    wandb = import_wandb()
    log = cfg.log
    id_file = os.path.join(workdir, "wandb_run_id")
    run_id = None  # the first start: W&B makes one
    if os.path.exists(id_file):
        with open(id_file, encoding="utf-8") as f:
            run_id = f.read().strip()
    try:
        run = wandb.init(id=run_id, resume="allow", dir=workdir, project=log.wandb_project or None,
                         name=log.wandb_name or os.path.basename(os.path.abspath(workdir)),
                         entity=log.wandb_entity or None, config=cfg.to_dict())
    except wandb.errors.Error as e:
        raise ConfigError("log.wandb", True, f"W&B cannot start the run: {e}; log in (wandb login, or set "
                          "WANDB_API_KEY), or set WANDB_MODE=offline (then wandb sync WORKDIR/wandb/offline-run-*)"
                          ) from None
    if run.id != run_id:
        with open(id_file + ".tmp", "w", encoding="utf-8") as f:
            f.write(run.id + "\n")
        os.replace(id_file + ".tmp", id_file)  # a crash leaves no half-written id
    return run


def _columns(stream) -> int:
    """The width of the terminal ``stream`` writes to (0: it does not say)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def supersede(path: str, step: int) -> int:
    """Drops the rows after ``step`` from the ``metrics.jsonl`` at ``path`` (a resume at ``step`` logs those steps
    again), replacing the file whole (a crash leaves the old one or the new one); returns the last step the file
    held before (0: none, or no file).  Lines that are not JSON records (a crash's half-written last line) go too."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    kept, last = [], 0
    for line in lines:
        try:
            row_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
        last = max(last, row_step)
        if row_step <= step:
            kept.append(line + "\n")
    if len(kept) < len(lines):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return last


def _summary_writer():
    """tensorboardX's ``SummaryWriter`` class, imported without PyTorch where nothing imported it yet.

    ``tensorboardX.writer`` imports torch only to accept torch tensors as values; jaxllm logs Python floats. Where
    torch is installed (the test extra, most clusters' environments) that import took 1.5 s of every run's start
    on the idle 2-core machine, 2.5 s loaded (0.09 s without it).  ``sys.modules["torch"] = None`` makes that
    ``import torch`` fail as if torch were absent, and is undone at once: a later ``import torch`` works.
    """
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsLogger:
    """Writes each logged step to ``WORKDIR/metrics.jsonl``, TensorBoard, Weights & Biases and stdout.

    ``MetricsLogger(workdir, *, enabled=True, tensorboard=True, progress_bar=True, total_steps=None,
    wandb=None, resumed_at=None)``

    * ``metrics.jsonl``: one JSON object per :meth:`log` call, appended (a resumed run
      continues the file): ``{"step": int, "kind": "train"|"eval", **metrics}``; values are
      Python ints/floats/strings, non-finite floats (NaN, inf) are written as ``null`` so
      every line is strict JSON.  A run that starts (or resumes) at step ``resumed_at`` first drops
      the rows after that step (those of the steps it runs again; the file is replaced whole,
      atomically: :func:`supersede`), so the file holds one row per step and kind.
    * TensorBoard (tensorboardX ``SummaryWriter`` in ``WORKDIR/tensorboard``): every numeric
      metric as the scalar ``<kind>/<key>`` (``train/loss``, ``eval/eval_loss``).  Each start
      writes a new event file that begins with a ``SessionLog.START`` event at step ``resumed_at + 1``
      (tensorboardX's ``purge_step``): TensorBoard drops the earlier files' events from that step on
      (its Python reader purges at a restart's START; its Rust data server drops a series' records whose
      step is not below a newer record's), so it shows each step once, as last run.
    * Weights & Biases, with ``wandb`` (the run :func:`start_wandb` started): each record of
      ``metrics.jsonl`` under the same names at W&B's step ``step`` (non-finite floats as they are).
      A resumed W&B run keeps the history it holds (W&B takes no step below its last one; only its beta
      ``resume_from`` rewinds a run): the steps a resume runs again up to the last one W&B has are not
      sent again, so W&B too holds each step once (the first run's values: the same losses, bit for bit,
      since a resume computes what the interrupted run did; its own timings).
    * stdout: one line per call, e.g.
      ``step   200 | loss 2.1034 | lr 9.8e-04 | grad 0.83 | 12.3k tok/s | 0.05 TFLOP/s/dev | MFU 12.1% | 0.061 s/step``.
      Known keys: ``loss``, ``lr``, ``grad_norm``, ``tokens_per_sec``,
      ``tflops_per_device``, ``mfu`` (fraction), ``step_time_s`` (seconds), ``step_time_spread`` for train;
      ``eval_loss``, ``eval_bpb``, ``eval_ppl`` for eval; other keys follow as ``key value``, but for
      ``startup_*`` and ``compile_cache`` (files only: jaxllm.train prints them on a line of their own).
    * With ``progress_bar`` and stdout a terminal: a tqdm bar over ``total_steps``,
      moved by :meth:`advance`; the lines go through ``tqdm.write`` above it.

    ``enabled=False`` (processes other than 0) does nothing at all: no files, no output.
    :meth:`close` flushes and closes everything and finishes the W&B run; the logger is also a
    context manager.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
                 progress_bar: bool = True, total_steps: int | None = None, wandb=None,
                 resumed_at: int | None = None):
        self.enabled = enabled
        self.workdir = workdir
        self._file = self._writer = self._bar = self._wandb = None
        self._step_width = max(5, len(str(total_steps or "")))
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "metrics.jsonl")
        # the steps a resumed W&B run holds already (None: a file appended to, nothing superseded)
        self._wandb_after = -1 if resumed_at is None else supersede(path, resumed_at)
        self._file = open(path, "a", encoding="utf-8")
        if tensorboard:
            self._writer = _summary_writer()(os.path.join(workdir, "tensorboard"),
                                         purge_step=None if resumed_at is None else resumed_at + 1)
        self._wandb = wandb
        if progress_bar and sys.stdout.isatty():
            from tqdm import tqdm

            # a terminal that says it is 0 x 0 (a pty nobody sized: script, some batch consoles) would get no bar at
            # all from tqdm (none wider than 0 columns, none below row 0): a fixed size instead
            sized = _columns(sys.stdout) > 0
            self._bar = tqdm(total=total_steps, file=sys.stdout, unit="step", dynamic_ncols=sized,
                             ncols=None if sized else 100, nrows=None if sized else 24)

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
        if self._wandb is not None and step > self._wandb_after:
            self._wandb.log(values, step=step)
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
            if key not in formats and key not in _QUIET and not key.startswith(_QUIET_PREFIXES):
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

    def close(self, exit_code: int = 0, preempted: bool = False) -> None:
        """Flushes and closes the files, the TensorBoard writer and the bar, and finishes the W&B run
        with ``exit_code`` (0: finished; else failed), first marked as preempted if ``preempted``.

        Safe to call twice; :meth:`log` and :meth:`advance` do nothing afterwards.
        """
        if self._wandb is not None:
            if preempted:
                self._wandb.mark_preempting()
            self._wandb.finish(exit_code=exit_code)
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self._bar is not None:
            self._bar.close()
        self._file = self._writer = self._bar = self._wandb = None
        self.enabled = False

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(exit_code=0 if kind is None else 1)
