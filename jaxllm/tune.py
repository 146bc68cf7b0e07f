"""Parallel-strategy autotuner: ``python -m jaxllm.tune --config=... --devices=N [flags]``.

Search space (:mod:`jaxllm.analysis.layouts`): every ordered factorization of N devices over the
mesh axes in ``--axes`` x ``--micro_batch`` x ``--remat`` x ``--attention`` x pipeline schedule and
virtual stages (only with pipeline > 1: ``--pipeline_schedules`` x ``--virtual_stages``) x
``--sequence_impls`` (only with sequence > 1).

1. Constraints: :func:`constraint` puts each candidate through :func:`jaxllm.resolve.resolve` (heads,
   FFN and vocabulary divisible by tensor, hidden by fsdp, sequence by the sequence axis,
   global batch by micro batch x data-parallel size; pipeline: layers divisible by stages
   x virtual stages, microbatches a multiple of the stages; ulysses: heads divisible by tensor
   x sequence; ring: sequence divisible by 2 x sequence axis)
   and the attention impl available on this backend.  Rejected candidates
   are counted by the key that rejects them; nothing is compiled for them.
2. Memory: :func:`jaxllm.plan.plan` compiles the step ahead of time; a candidate whose
   per-device total exceeds the target memory (``--device_memory=4GiB``,
   ``--device=H100``; default on GPU the device's ``bytes_limit``, on CPU none) is pruned
   without running.
3. Measurement: :func:`jaxllm.bench.benchmark` with ``--steps`` timed steps after ``--warmup``
   (the CLI keeps XLA's persistent compilation cache in a temporary directory, so the plan's
   compilation of a candidate serves its measurement too).  The config as given (the baseline)
   is measured first.  When the budget (``--budget=N`` measured candidates or ``--budget=10m``
   minutes) covers the whole space the candidates are enumerated; otherwise Optuna's TPE sampler
   picks them (constrained: rejected and pruned trials are infeasible), after the baseline's layout
   under each other pipeline schedule.  The ``--confirm`` best
   and the baseline are measured once more at the end, interleaved, and ranked by the mean of
   their two measurements (the machine's load moves single measurements).

Without the GPU (``--device=H100``, ``H200``, ``A100-40GB`` or ``A100-80GB`` on a machine with no NVIDIA GPU):
step 2 compiles each candidate with XLA:GPU for that GPU (:func:`jaxllm.plan.plan` with ``gpu=``, JAX's CUDA
plugin, :mod:`jaxllm.platform.xla_gpu`) and step 3 is the step time :mod:`jaxllm.analysis.gpu_time` predicts for the
program (constants fitted to H100 traces): candidates are ranked by a prediction, not a measurement, and the report
says so.  ``--layer_loop=scan,unrolled`` adds the layers' loop to the space.

At a cluster's scale (``--cluster=frontier --mfu=0.4``): step 3 is the step-time model of the plan
(:mod:`jaxllm.analysis.step_time`: the FLOPs at the stated MFU, the compiled collectives over the cluster's
links, the pipeline bubble), not a measurement on this machine's devices; the memory limit is the
cluster's device's, the plans are for its backend, and nothing is re-measured.  Candidates are then
ranked by a model: its report says so.

Output (in ``--output_dir``): ``tune.md`` (summary and ranked table), ``tune.csv``,
``tune.png`` (tokens/s per measured candidate) and the chosen config as a ready
``--config.*`` line, also printed.

Exit codes: 0 done; 2 a bad flag or config (one line); 1 anything unexpected.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the CPU device count and the GPU settings must be fixed before jax starts a backend
    from jaxllm.cli import force_host_devices
    from jaxllm.platform import gpu_env, host_memory, xla_gpu

    force_host_devices(sys.argv)  # with --cluster, the devices above this process's on stand-in processes (main)
    if any(a.startswith("--cluster") for a in sys.argv):  # a cluster is planned (fake CPU devices), not measured
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if xla_gpu.deviceless_target(sys.argv):  # a GPU named that this machine lacks: XLA:GPU compiles for it here
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    gpu_env.apply()  # measure with training's GPU settings, or its host allocator on CPUs
    host_memory.keep_freed_memory()

import contextlib  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from jaxllm import bench, cli, config, plan  # noqa: E402
from jaxllm.analysis import layouts, step_time  # noqa: E402
from jaxllm.analysis.layouts import AXES, Candidate  # noqa: E402
from jaxllm.data.tokenizers import KNOWN_VOCAB_SIZES  # noqa: E402
from jaxllm.model import attention  # noqa: E402
from jaxllm.platform import xla_gpu  # noqa: E402
from jaxllm.platform.hardware import CLUSTERS, DEVICES, GiB, named_cluster, named_device  # noqa: E402
from jaxllm.resolve import mesh_shape, resolve  # noqa: E402


@dataclasses.dataclass
class Result:
    candidate: Candidate
    status: str  # measured | modeled (--cluster) | predicted (a GPU this machine lacks) | pruned (memory) | failed
    memory: float | None = None  # plan total, bytes per device
    tokens_per_sec: list = dataclasses.field(default_factory=list)  # tokens/s of each measurement
    record: dict | None = None  # the last bench record
    error: str = ""
    baseline: bool = False

    @property
    def throughput(self) -> float:
        return sum(self.tokens_per_sec) / len(self.tokens_per_sec) if self.tokens_per_sec else 0.0


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------


def constraint(cfg: config.Config, num_devices: int, backend: str | None = None) -> str | None:
    """None if ``cfg`` can run on ``num_devices`` of ``backend`` (None: this machine's), else the key that
    rejects it (:func:`jaxllm.resolve.resolve`'s: the mesh, divisibility, pipeline, sequence and attention
    checks)."""
    try:
        resolve(cfg, num_devices=num_devices, data_files=False, backend=backend)
    except config.ConfigError as e:
        return e.key
    return None


def baseline_candidate(base, num_devices: int, backend: str | None = None) -> Candidate:
    """The base config as a candidate (its -1 mesh axis filled) on ``backend`` (None: this machine's)."""
    return layouts.candidate_of(base, mesh_shape(base.mesh, num_devices), backend)


def _digits(x: float) -> float:
    """``x`` to 4 significant digits: a step of 0.8 ms keeps its precision in tune.csv as one of 8 s does."""
    return float(f"{x:.4g}")


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """``"20"`` -> (20 measured candidates, None); ``"10m"`` / ``"90s"`` -> (None, seconds).

    Raises:
      ValueError: anything else, or a budget <= 0.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(m|min|s)?\s*", text)
    if not m or float(m.group(1)) <= 0 or (m.group(2) is None and "." in m.group(1)):
        raise ValueError(f"--budget={text!r}: give a number of trials (20) or minutes (10m) / seconds (90s), > 0")
    if m.group(2) is None:
        return int(m.group(1)), None
    return None, float(m.group(1)) * (1 if m.group(2) == "s" else 60)


class Tuner:
    """Runs the search; see the module docstring.

    Args:
      base: the config to tune (validated as given: it is the baseline), with its
        ``model.vocab_size`` set (the planning and measuring read no data).
      num_devices: devices to lay out.
      memory_limit: bytes per device; None: no memory pruning.
      steps, warmup: of each measurement (:func:`jaxllm.bench.benchmark`).
      log: a function taking one line of progress (default: print it).
      cluster: ``(name, mfu)``: rank by the step-time model on :data:`jaxllm.platform.hardware.CLUSTERS` ``[name]``
        at that MFU instead of measuring (plans for the cluster's backend); None: measure.
      gpu: a GPU of :data:`jaxllm.platform.xla_gpu.SPECS`: rank by the step time
        :mod:`jaxllm.analysis.gpu_time` predicts for each candidate's program compiled for it here; None: measure.
    """

    def __init__(self, base, num_devices: int, *, memory_limit: float | None, steps: int = 3, warmup: int = 1,
                 log=None, cluster: tuple[str, float] | None = None, gpu: str | None = None):
        self.base, self.n, self.memory_limit = base, num_devices, memory_limit
        self.cluster, self.gpu = cluster, gpu
        self.backend = named_device(named_cluster(cluster[0]).device)[1] if cluster else "cuda" if gpu else None
        self.steps, self.warmup = steps, warmup
        self.log = log or (lambda line: print(line, flush=True))
        self.results: dict[Candidate, Result] = {}
        self.rejected: dict[str, int] = {}
        self.valid: list[Candidate] = []
        self.space_size = 0
        self.measured_count = 0
        self.baseline: Candidate | None = None

    def filter(self, candidates: list[Candidate]) -> None:
        """Applies the constraints to every candidate, counting rejections by key."""
        self.space_size = len(candidates)
        for c in candidates:
            why = constraint(layouts.candidate_config(self.base, c), self.n, self.backend)
            if why:
                self.rejected[why] = self.rejected.get(why, 0) + 1
            else:
                self.valid.append(c)

    def evaluate(self, c: Candidate, baseline: bool = False) -> Result:
        """Plans ``c`` and, if it fits, measures it (once; later calls return the result)."""
        if c in self.results:
            return self.results[c]
        cfg = layouts.candidate_config(self.base, c)
        try:
            p = plan.plan(cfg, self.n, backend=self.backend, collectives=self.cluster is not None, gpu=self.gpu)
        except Exception as e:  # noqa: BLE001  (a candidate XLA cannot compile is a result, not the end)
            r = self.results[c] = Result(c, "failed", error=f"plan: {type(e).__name__}: {str(e)[:200]}",
                                         baseline=baseline)
            self.log(f"  {c.mesh_text():<28} failed to plan: {r.error}")
            return r
        if self.memory_limit is not None and p["device"] > self.memory_limit:
            r = self.results[c] = Result(c, "pruned (memory)", memory=p["device"], baseline=baseline)
            self.log(f"  {c.mesh_text():<28} mb {c.micro_batch} {c.remat:<9} plan {p['total'] / GiB:.3f} GiB > "
                     f"{self.memory_limit / GiB:.3f} GiB: pruned")
            return r
        r = self.results[c] = Result(c, "modeled" if self.cluster else "predicted" if self.gpu else "measured",
                                     memory=p["device"], baseline=baseline)
        if self.cluster:
            self._model(r, p)
        elif self.gpu:
            self._predict(r, p)
        else:
            self._measure(r)
        self.measured_count += 1
        return r

    def _model(self, r: Result, p: dict) -> None:
        name, mfu = self.cluster
        est = step_time.estimate(p, named_cluster(name), mfu)
        r.tokens_per_sec.append(est["tokens_per_s"])
        r.record = {"tokens_per_step": p["seq_tokens"], "microbatches": p["pipeline"][2],
                    "mfu": est["tflops_per_device"] * 1e12 / est["peak"], "tflops_per_device": est["tflops_per_device"],
                    "step_time_s": est["step"]}
        c = r.candidate
        self.log(f"  {c.mesh_text():<28} mb {c.micro_batch} {c.remat:<9} plan {r.memory / GiB:.3f} GiB: modeled "
                 f"{est['tokens_per_s']:,.0f} tokens/s, {est['tflops_per_device']:.1f} TFLOP/s per device "
                 f"({est['step']:.3g} s/step)" + (" [baseline]" if r.baseline else ""))

    def _predict(self, r: Result, p: dict) -> None:
        record = plan.predicted_figures(p)
        step = record["predicted_step_time_s"]
        c = r.candidate
        if record["prediction_refused"]:
            r.status, r.error = "failed", record["prediction_refused"]
            self.log(f"  {c.mesh_text():<28} mb {c.micro_batch} {c.remat:<9} {record['prediction_refused']}")
            return
        r.tokens_per_sec.append(record["predicted_tokens_per_sec"])
        r.record = {"tokens_per_step": p["seq_tokens"], "microbatches": p["pipeline"][2],
                    "mfu": record["predicted_mfu"], "step_time_s": step}
        self.log(f"  {c.mesh_text():<28} mb {c.micro_batch} {c.remat:<9} {c.layer_loop:<8} plan {r.memory / GiB:.3f} "
                 f"GiB: predicted {record['predicted_tokens_per_sec']:,.0f} tokens/s ({step:.4g} s/step)"
                 + (" [baseline]" if r.baseline else ""))

    def _measure(self, r: Result) -> None:
        c = r.candidate
        try:
            cfg, _ = bench.prepare(layouts.candidate_config(self.base, c), self.n)
            rec = bench.benchmark(cfg, num_devices=self.n, steps=self.steps, warmup=self.warmup,
                                  name=c.mesh_text())
        except Exception as e:  # noqa: BLE001  (e.g. out of memory on a GPU)
            r.status, r.error = "failed", f"{type(e).__name__}: {str(e)[:200]}"
            self.log(f"  {c.mesh_text():<28} failed: {r.error}")
            return
        r.record = rec
        r.tokens_per_sec.append(rec["tokens_per_sec"])
        self.log(f"  {c.mesh_text():<28} mb {c.micro_batch} {c.remat:<9} {c.attention} "
                 f"plan {r.memory / GiB:.3f} GiB: {rec['tokens_per_sec']:,.0f} tokens/s "
                 f"({rec['step_time_s']:.3g} s/step)" + (" [baseline]" if r.baseline else ""))

    def run(self, *, trials: int | None, seconds: float | None, sampler: str = "auto", seed: int = 0,
            confirm: int = 2) -> None:
        """Measures the baseline, then searches the valid candidates within the budget.

        Args:
          trials: measured candidates at most (the baseline included); seconds: wall-time
            budget of the search (confirmation not included); one of them set.
          sampler: ``grid`` (in order), ``optuna`` (TPE) or ``auto`` (grid when the trial
            budget covers every valid candidate, else optuna).
          confirm: re-measure this many of the best and the baseline at the end.
        """
        start = time.perf_counter()
        base = baseline_candidate(self.base, self.n, self.backend)
        self.evaluate(base, baseline=True)
        self.baseline = base

        def budget_left():
            if trials is not None and self.measured_count >= trials:
                return False
            return seconds is None or time.perf_counter() - start < seconds

        if sampler == "auto":
            sampler = "grid" if trials is not None and trials >= len(set(self.valid) | {base}) else "optuna"
        self.sampler = sampler
        if sampler == "grid":
            for c in self.valid:
                if not budget_left():
                    break
                self.evaluate(c)
        else:
            self._optuna(budget_left, seed)
        if confirm and not self.cluster and not self.gpu:  # a model gives the same number again
            best = sorted((r for r in self.results.values() if r.status == "measured" and not r.baseline),
                          key=lambda r: -r.throughput)[:confirm]
            self.log(f"confirming: the baseline and the best {len(best)}, measured again")
            for r in [self.results[base], *best]:
                if r.status == "measured":
                    self._measure(r)

    def _optuna(self, budget_left, seed: int) -> None:
        import optuna  # noqa: PLC0415

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        valid = set(self.valid)
        dims = layouts.values(self.valid)
        dims["mesh"] = [",".join(map(str, m)) for m in dims["mesh"]]  # Optuna's categories: no tuples
        sampler = optuna.samplers.TPESampler(seed=seed)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        # first the baseline's layout under the other pipeline schedules: where gpipe's activations do not fit,
        # the same mesh may with 1f1b (the Frontier study's 1T layout), which the sampler need not draw
        for c in self.valid:
            if c != self.baseline and dataclasses.replace(c, schedule=self.baseline.schedule,
                                                          virtual_stages=self.baseline.virtual_stages) == self.baseline:
                study.enqueue_trial({**dataclasses.asdict(c), "mesh": ",".join(map(str, c.mesh))})
        seen: set[Candidate] = set()
        attempts = 0
        while budget_left() and len(seen) < len(valid) and attempts < 200 * max(1, len(valid)):
            attempts += 1
            trial = study.ask()
            picks = {k: trial.suggest_categorical(k, v) for k, v in dims.items()}  # in Candidate's field order
            c = Candidate(**{**picks, "mesh": tuple(int(x) for x in picks["mesh"].split(","))})
            if c not in valid:  # a combination the constraints reject: infeasible, costs nothing
                trial.set_constraint("infeasible", 1.0)
                study.tell(trial, 0.0)
                continue
            seen.add(c)
            r = self.evaluate(c)
            trial.set_constraint("infeasible", 0.0 if r.tokens_per_sec else 1.0)
            study.tell(trial, r.throughput)

    # -- report -----------------------------------------------------------------------------

    def ranked(self) -> list[Result]:
        order = {"measured": 0, "modeled": 0, "predicted": 0, "pruned (memory)": 1, "failed": 2}
        return sorted(self.results.values(), key=lambda r: (order[r.status], -r.throughput,
                                                             r.memory or 0))

    def best(self) -> Result | None:
        measured = [r for r in self.results.values() if r.tokens_per_sec]
        return max(measured, key=lambda r: r.throughput) if measured else None

    def summary(self) -> list[str]:
        rejected = sum(self.rejected.values())
        pruned = sum(r.status == "pruned (memory)" for r in self.results.values())
        failed = sum(r.status == "failed" for r in self.results.values())
        measured = sum(r.status in ("measured", "modeled", "predicted") for r in self.results.values())
        limit = f"{self.memory_limit / GiB:.3f} GiB/device" if self.memory_limit else "none"
        lines = [f"- search space: {self.space_size} candidates on {self.n} device(s); sampler {self.sampler}",
                 f"- rejected by the constraints (config.resolve + tune.constraint), never compiled: {rejected}"]
        lines += [f"  - {key}: {count}" for key, count in sorted(self.rejected.items(), key=lambda kv: -kv[1])]
        valid = set(self.valid)
        outside = self.baseline in self.results and self.baseline not in valid
        lines += [f"- planned (ahead-of-time memory plan): {sum(c in valid for c in self.results)} of {len(valid)} "
                  "valid" + (", and the baseline (the config as given: not a candidate)" if outside else ""),
                  f"- pruned by the memory plan (> {limit}), not run: {pruned}",
                  f"- {'modeled' if self.cluster else 'predicted' if self.gpu else 'measured'}: {measured}; "
                  f"failed: {failed}"]
        if self.cluster:
            lines.append(f"- ranked by the step-time MODEL on {self.cluster[0]} at MFU {self.cluster[1]:.0%} "
                         "(jaxllm/analysis/step_time.py), not by measurements")
        if self.gpu:
            lines.append(f"- ranked by the step time PREDICTED for each candidate's XLA:GPU program on {self.n} x "
                         f"{self.gpu} (jaxllm/analysis/gpu_time.py, constants fitted to H100 traces), not measured")
        return lines

    def rows(self) -> list[dict]:
        base = self.results[self.baseline].throughput or None
        out = []
        for rank, r in enumerate(self.ranked(), 1):
            c, rec = r.candidate, r.record or {}
            out.append({
                "rank": rank if r.tokens_per_sec else "",
                "status": r.status + (" [baseline]" if r.baseline else ""),
                **{a: n for a, n in zip(AXES, c.mesh)},
                "micro_batch": c.micro_batch, "microbatches": rec.get("microbatches", ""),
                "remat": c.remat, "attention": c.attention, "pipeline_schedule": c.schedule,
                "virtual_stages": c.virtual_stages,
                "sequence_impl": c.sequence_impl, "layer_loop": c.layer_loop,
                "plan_memory_gib": round(r.memory / GiB, 4) if r.memory is not None else "",
                "tokens_per_sec": round(r.throughput, 1) if r.tokens_per_sec else "",
                "measurements": len(r.tokens_per_sec),
                "step_time_s": _digits(rec["tokens_per_step"] / r.throughput) if r.tokens_per_sec else "",
                "mfu": _digits(rec["mfu"]) if rec else "",
                "vs_baseline": round(r.throughput / base, 3) if (base and r.tokens_per_sec) else "",
                "error": r.error,
            })
        return out

    def write(self, out_dir: str, command: str) -> dict:
        """Writes ``tune.md``, ``tune.csv``, ``tune.png`` into ``out_dir``; returns their paths."""
        os.makedirs(out_dir, exist_ok=True)
        rows = self.rows()
        paths = {k: os.path.join(out_dir, f"tune.{k}") for k in ("md", "csv", "png")}
        with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        cols = ["rank", "status", *AXES, "micro_batch", "microbatches", "remat", "attention", "pipeline_schedule",
                "virtual_stages", "sequence_impl", "layer_loop", "plan_memory_gib", "tokens_per_sec", "measurements",
                "mfu", "vs_baseline"]
        md = [f"```\n{command}\n```", "", *self.summary(), ""]
        best = self.best()
        if best:
            base = self.results[self.baseline]
            how = "modeled" if self.cluster else "predicted" if self.gpu else "measured"
            versus = (f"{best.throughput / base.throughput:.2f}x the baseline {how} in the same run"
                      if base.tokens_per_sec else f"the baseline was not measured: {base.status}")
            md += [f"chosen ({best.throughput:,.0f} tokens/s, {versus}):",
                   "", f"```\n{best.candidate.flags()}\n```", ""]
        md.append("| " + " | ".join(cols) + " |")
        md.append("|" + "---|" * len(cols))
        for row in rows:
            md.append("| " + " | ".join(str(row[k]) for k in cols) + " |")
        with open(paths["md"], "w", encoding="utf-8") as f:
            f.write("\n".join(md) + "\n")
        self.plot(paths["png"])
        return paths

    def plot(self, path: str) -> None:
        """Bar chart of tokens/s per measured candidate (baseline in orange, the chosen in green)."""
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        measured = [r for r in self.ranked() if r.tokens_per_sec]
        best = self.best()
        labels = [f"{r.candidate.mesh_text()} mb{r.candidate.micro_batch} {r.candidate.remat}"
                  + (f" {r.candidate.attention}" if len({m.candidate.attention for m in measured}) > 1 else "")
                  for r in measured]
        colors = ["tab:green" if r is best else "tab:orange" if r.baseline else "tab:blue" for r in measured]
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(measured) + 1.6))
        ax.barh(range(len(measured)), [r.throughput for r in measured], color=colors)
        ax.set_yticks(range(len(measured)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"tokens/s (step-time model on {self.cluster[0]})" if self.cluster else
                      f"tokens/s (predicted on {self.gpu})" if self.gpu else "tokens/s (mean of the measurements)")
        pruned = sum(r.status == "pruned (memory)" for r in self.results.values())
        where = (f"{self.cluster[0]} (modeled)" if self.cluster else f"{self.gpu} (predicted)" if self.gpu
                 else jax.devices()[0].platform)
        ax.set_title(f"jaxllm.tune: {self.n} {where} devices; {len(measured)} ranked, "
                     f"{pruned} pruned by the memory plan, {sum(self.rejected.values())} rejected\n"
                     "green: chosen, orange: baseline (the config as given)", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _target(F) -> tuple[float | None, tuple | None, str | None]:
    """``(memory limit in bytes or None, (cluster, mfu) or None, GPU predicted for or None)`` from the flags: a
    ``--device`` of :data:`jaxllm.platform.xla_gpu.SPECS` on a machine without it (JAX on its CPU) is predicted
    where XLA:GPU can compile for it here (else measured here, with a note, as ``jaxllm.plan`` plans).  JAX's
    persistent compilation cache is then off (:func:`jaxllm.plan.without_persistent_cache`)."""
    memory, cluster, gpu = None, None, None
    if F.cluster:
        memory = named_device(named_cluster(F.cluster).device)[0]  # an unknown name first
        step_time.check_mfu(F.cluster, F.mfu)
        cluster = (F.cluster, F.mfu)
    if F.device:
        memory = named_device(F.device)[0]
        gpu = F.device if F.device in xla_gpu.SPECS and not F.cluster and jax.default_backend() == "cpu" else None
    why = xla_gpu.unavailable(gpu) if gpu else None  # (it starts the CUDA plugin's compiler: once)
    if why:  # as jaxllm.plan --device does: this machine's compiler, with a note
        print(f"note: measured on this machine with {gpu}'s memory, not predicted for it: {why}", flush=True)
        gpu = None
    if F.device_memory:
        memory = plan.parse_bytes(F.device_memory)
    if gpu:
        plan.without_persistent_cache()
    return memory, cluster, gpu


@cli.stoppable("jaxllm.tune")
def _main(argv):
    from absl import flags, logging  # noqa: PLC0415

    logging.set_verbosity(logging.WARNING)
    F = flags.FLAGS
    if len(argv) > 1:
        cli.fail(f"error: unexpected arguments: {' '.join(argv[1:])}")
    base = F.config
    with cli.usage_errors({ValueError: "error: "}, now=True):
        trials, seconds = parse_budget(F.budget)
        cli.check_output("--output_dir", F.output_dir)  # before any candidate is compiled
        if F.sampler not in ("auto", "grid", "optuna"):
            raise ValueError(f"--sampler={F.sampler!r}: choose auto, grid or optuna")
        if F.steps < 1 or F.warmup < 0 or F.confirm < 0:
            raise ValueError("--steps must be >= 1, --warmup and --confirm >= 0")
        if any(getattr(base.mesh, f"dcn_{a}") != 1 for a in AXES):
            raise ValueError("tune lays out one node's devices: set every mesh.dcn_* to 1")
        memory, cluster, gpu = _target(F)
        if F.cluster and F.devices > cli.MAX_HOST_DEVICES:  # a cluster's scale is planned, not run
            cli.stand_in_processes(F.devices, cli.MAX_HOST_DEVICES)  # before the backend creates its devices
        axes = F.axes if F.axes != "auto" else ",".join(a for a in AXES if a != "expert" or base.model.num_experts)
        dims = layouts.dimensions(base, axes=axes, micro_batch=F.micro_batch, remat=F.remat, attention=F.attention,
                                  virtual_stages=F.virtual_stages, pipeline_schedules=F.pipeline_schedules,
                                  sequence_impls=F.sequence_impls, layer_loop=F.layer_loop)
        n = F.devices or (1 if gpu else len(jax.devices()))
        if n < 1 or (n > len(jax.devices()) and not gpu):
            raise ValueError(f"--devices={F.devices}: this machine has {len(jax.devices())} device(s)")
        if memory is None:
            memory = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        if n > 1 and all(getattr(base.mesh, a) == 1 for a in AXES):  # a one-device config: the baseline is data N
            base.mesh.data = -1
            print(f"jaxllm.tune: the config's mesh is one device; baseline: mesh.data={n}", flush=True)
        if not base.model.vocab_size:  # the candidates are planned and measured without reading data
            base.model.vocab_size = KNOWN_VOCAB_SIZES.get(base.data.tokenizer) or bench.prepare(
                base, n, workdir=F.workdir)[0].model.vocab_size  # the char vocabulary: read from the data
        resolve(base, num_devices=n, data_files=False, backend="cuda" if gpu else None)  # valid as given

    tuner = Tuner(base, n, memory_limit=memory, steps=F.steps, warmup=F.warmup, cluster=cluster, gpu=gpu)
    if tuner.backend and F.attention == "auto":  # the GPU's attention (memory linear in the sequence)
        dims["attentions"] = [attention.model_impl(base.model, tuner.backend, "auto")]
    tuner.filter(layouts.space(base, n, **dims))
    print(f"jaxllm.tune: {tuner.space_size} candidates, {len(tuner.valid)} pass the constraints; memory limit "
          f"{'%.3f GiB/device' % (memory / GiB) if memory else 'none'}; budget {F.budget}", flush=True)
    # The plan and the measurement of a candidate compile the same program: with XLA's persistent
    # cache (JAX_COMPILATION_CACHE_DIR's, else a directory removed at the end) the second compilation is a lookup.
    with contextlib.ExitStack() as stack:
        if not gpu:  # (a GPU's programs are compiled without it: they cannot be read back here)
            cache = jax.config.jax_compilation_cache_dir or stack.enter_context(
                tempfile.TemporaryDirectory(prefix="jaxllm-tune-xla-"))
            jax.config.update("jax_compilation_cache_dir", cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        tuner.run(trials=trials, seconds=seconds, sampler=F.sampler, seed=F.seed, confirm=F.confirm)
    command = "python -m jaxllm.tune " + " ".join(a for a in sys.argv[1:])
    paths = tuner.write(F.output_dir, command)
    print("\n".join(tuner.summary()))
    with open(paths["md"], encoding="utf-8") as f:
        print(f.read())
    best = tuner.best()
    print(f"wrote {paths['md']}, {paths['csv']}, {paths['png']}")
    if best:
        print(f"chosen: {best.candidate.flags()}")
    if F.cluster or gpu:
        cli.exit_now()  # XLA:CPU would join a thread per fake device


def define_flags(fv, argv) -> None:
    """``python -m jaxllm.tune``'s flags, in the ``FlagValues`` ``fv`` (``argv``: the command's arguments)."""
    from absl import flags  # noqa: PLC0415

    cli.define_config_flag(argv, fv)
    flags.DEFINE_integer("devices", 0, "devices to lay out (CPU: fake devices); 0: all", flag_values=fv)
    flags.DEFINE_string("budget", "20", "measured candidates (20) or wall time (10m, 90s)", flag_values=fv)
    flags.DEFINE_string("device", None, f"accelerator whose memory to prune against: {', '.join(DEVICES)}; on a "
                        f"machine without it, {', '.join(xla_gpu.SPECS)} are ranked by the predicted step time",
                        flag_values=fv)
    flags.DEFINE_string("device_memory", None, "memory per device to prune against, e.g. 4GiB (overrides --device)",
                        flag_values=fv)
    flags.DEFINE_string("axes", "auto", "mesh axes to factorize the devices over (auto: every axis, expert only "
                        "for a mixture of experts)", flag_values=fv)
    flags.DEFINE_string("micro_batch", "auto", "micro batch sizes (auto: every divisor of the global batch)",
                        flag_values=fv)
    flags.DEFINE_string("remat", "none,full,save_dots", "remat policies", flag_values=fv)
    flags.DEFINE_string("attention", "auto",
                        "attention impls (auto: those that run here; not Pallas's CPU interpreter)", flag_values=fv)
    flags.DEFINE_string("virtual_stages", "1,2", "pipeline virtual stages tried when mesh.pipeline > 1", flag_values=fv)
    flags.DEFINE_string("pipeline_schedules", ",".join(config.choices("parallel.pipeline_schedule")),
                        "pipeline schedules tried when mesh.pipeline > 1 (interleaved ones: virtual stages > 1)",
                        flag_values=fv)
    flags.DEFINE_string("sequence_impls", "allgather,ring,ulysses",
                        "sequence_impl values tried when mesh.sequence > 1 (usp: with the base config's "
                        "parallel.ulysses_degree; left out by default, as the tuned devices are one node's, "
                        "where its default is ulysses)", flag_values=fv)
    flags.DEFINE_string("layer_loop", "auto", "model.layer_loop values tried (auto: the config's), e.g. scan,unrolled",
                        flag_values=fv)
    flags.DEFINE_string("sampler", "auto", "auto, grid or optuna", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Optuna sampler seed", flag_values=fv)
    flags.DEFINE_integer("steps", 3, "timed steps per measurement", flag_values=fv)
    flags.DEFINE_integer("warmup", 1, "untimed steps per measurement", flag_values=fv)
    flags.DEFINE_integer("confirm", 2, "re-measure the baseline and this many of the best at the end", flag_values=fv)
    flags.DEFINE_string("workdir", "runs/tune", "where real data is tokenized when the vocabulary needs it",
                        flag_values=fv)
    flags.DEFINE_string("output_dir", "runs/tune", "where tune.md, tune.csv and tune.png go", flag_values=fv)
    flags.DEFINE_string("cluster", None, f"rank by the step-time model on a cluster instead of measuring: "
                        f"{', '.join(CLUSTERS)} (needs --mfu)", flag_values=fv)
    flags.DEFINE_float("mfu", None, "with --cluster: the model FLOPs utilization of the compute, e.g. 0.4",
                       flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxllm.tune ARGV``; with ``argv`` (a list) in this process, returning the exit status
    (:func:`jaxllm.cli.run_tool`)."""
    return cli.run_tool(_main, define_flags, argv)


if __name__ == "__main__":
    main()
