"""Training CLI: ``python -m jaxllm.train --config=configs/FILE.py[:KEY] --config.SECTION.KEY=VALUE --workdir=DIR``.

With no flags it trains the default config (:mod:`jaxllm.config`) on the Python
standard library's sources.  Rerunning with the same ``--workdir`` resumes from
the latest checkpoint that can be restored (exactly: see :mod:`jaxllm.runtime.checkpoint`).

Exit codes: 0 done; 1 an unexpected error, or :class:`NonFiniteError` (the loss or
gradient norm was NaN/inf for ``train.max_nonfinite_steps`` steps in a row), or
:class:`jaxllm.runtime.checkpoint.CheckpointError` (checkpoints exist but none can be read);
2 bad config or data, one line naming the key, the value and the fix, before
anything is compiled, or the workdir is in use by another run
(:mod:`jaxllm.runtime.workdir_lock`); :data:`~jaxllm.runtime.checkpoint.EXIT_SAVE_FAILED` (74) a checkpoint was not
saved (a full disk or quota): one line naming the newest complete step, which a rerun resumes
from; :data:`EXIT_PREEMPTED` (75) preempted: SIGTERM or SIGUSR1
made the run save a checkpoint at the next step boundary and stop; rerun the same
command to continue; 130 Ctrl-C (143 SIGTERM) before the first step (:func:`jaxllm.cli.stoppable`): nothing to save,
data being tokenized is not kept.

``JAXLLM_DEBUG_SLOW_PROCESS=INDEX:SECONDS`` makes process INDEX sleep SECONDS in every step: a
straggler for the tests (:mod:`jaxllm.runtime.stragglers`), never set by jaxllm.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging as python_logging
import math
import os
import sys
import tempfile
import time

import jax
import numpy as np
from absl import flags, logging

from jaxllm import cli, config
from jaxllm.data import samples
from jaxllm.data.loader import Batches, Data, unigram_entropy
from jaxllm.data.tokenizers import KNOWN_VOCAB_SIZES
from jaxllm.model import gpt
from jaxllm.parallel import schedules
from jaxllm.platform import console, distributed, gpu_env, hardware, host_memory
from jaxllm.resolve import resolve
from jaxllm.runtime import checkpoint, compile_cache, flops, metrics, stragglers, workdir_lock
from jaxllm.runtime.checkpoint import EXIT_SAVE_FAILED
from jaxllm.runtime.preemption import Preemption
from jaxllm.runtime.run import Run
from jaxllm.runtime.sampling import Sampler
from jaxllm.runtime.watchdog import Watchdog

# Exit status of a preempted run (after its checkpoint is saved): BSD's EX_TEMPFAIL, "try again later".
EXIT_PREEMPTED = 75


class Preempted(Exception):
    """The run saved a checkpoint at ``step`` on SIGTERM/SIGUSR1 and stopped; rerunning resumes it."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"preempted: saved a checkpoint at step {step}; rerun the same command to resume")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm was non-finite for ``train.max_nonfinite_steps`` steps in a row."""


class NonFiniteStop:
    """Decides the stop after ``limit`` non-finite steps in a row without making the host wait.

    The loop calls :meth:`add` after dispatching each step, with its metrics (device arrays
    not yet computed).  It reads the counter ``nonfinite_in_a_row`` only of the step ``lag``
    steps back, which the device has finished or nearly so: the host stays ``lag`` steps
    ahead of the device instead of waiting for every step.  With ``settle=True`` (before
    anything that reads the state anyway: logging, evaluation, a checkpoint, the end) it
    reads every pending step.  Steps are read in order, so the step it reports is the first
    whose counter reaches ``limit``, the step a read after every step would report; and since
    the loop settles before saving, no checkpoint is written after it.

    Args:
      limit: ``train.max_nonfinite_steps``.
      lag: steps the host may run ahead.
    """

    def __init__(self, limit: int, lag: int = 2):
        self.limit, self.lag = limit, lag
        self.pending: collections.deque = collections.deque()

    def add(self, step: int, metrics: dict, *, settle: bool = False) -> tuple[int, dict] | None:
        """Records ``step``'s metrics; returns ``(step, metrics)`` of the first step read whose
        ``nonfinite_in_a_row`` reached the limit, or None."""
        self.pending.append((step, metrics))
        while self.pending and (settle or len(self.pending) > self.lag):
            done, m = self.pending.popleft()
            if int(m["nonfinite_in_a_row"]) >= self.limit:
                self.pending.clear()
                return done, m
        return None


def check_workdir(workdir: str) -> None:
    """A run directory must be a directory this process can write (it is created if missing).

    Raises:
      ConfigError: ``--workdir`` is a file, or cannot be created or written.
    """
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise config.ConfigError("--workdir", workdir, "is a file; give a directory (created if missing)")
    try:
        os.makedirs(workdir, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass
    except OSError as e:
        raise config.ConfigError("--workdir", workdir, f"cannot be written ({e.strerror}); give a directory you can "
                                 "write, or copy the run there to resume it") from None


def setup(spec: config.Config, workdir: str) -> tuple[config.Resolved, Data]:
    """Checks config and data before anything compiles; returns ``(resolved config, Data)``.

    Raises:
      ConfigError, DataError: with the key or file, the value and the fix (``log.wandb`` without wandb
        installed included).
    """
    resolve(spec, num_devices=jax.device_count())  # every config error before the data is read
    if spec.log.wandb:  # every process checks, so that all stop alike
        metrics.import_wandb()
    if spec.train.eval_interval and samples.split_matrix(spec.data.split)[1] is None:
        # Megatron-LM builds no validation dataset for a zero weight and skips evaluation; so does jaxllm
        spec = config.from_dict(spec.to_dict())
        spec.train.eval_interval = 0
        if jax.process_index() == 0:
            print(f"jaxllm: note: data.split={spec.data.split!r} leaves no validation split, so the run does not "
                  f"evaluate (as Megatron-LM); give validation a weight (e.g. data.split=969,30,1) to evaluate",
                  flush=True)
    resume = functools.partial(checkpoint.check_resume_tokenizer, workdir, spec.data.tokenizer)  # before tokenizing
    data = Data(spec, workdir, splits=("train", "valid") if spec.train.eval_interval else ("train",),
                quiet=jax.process_index() != 0, accept_tokenizer=resume)  # process 0 says a text is reused, once
    return resolve(spec, num_devices=jax.device_count(), vocab_size=data.vocab_size), data


def check(spec: config.Config, num_devices: int) -> str:
    """Resolves ``spec`` for ``num_devices`` devices as the job would, without starting a backend
    or reading data (a launcher's dry run, on a login node); returns a one-line summary.

    The attention implementation is checked against the backend ``JAX_PLATFORMS`` or the
    machine names (CPU if none).  The data and tokenizer files are not looked for: they are the
    cluster's (this may run elsewhere), and the job reads them when it starts.
    Raises:
      ConfigError: as :func:`jaxllm.resolve.resolve`.
    """
    backend = distributed.gpu_vendor(os.environ) or "cpu"
    cfg = resolve(spec, num_devices=num_devices, vocab_size=KNOWN_VOCAB_SIZES.get(spec.data.tokenizer),
                  backend=backend, data_files=False)
    mesh = " x ".join(f"{a} {n}" for a, n in cfg.mesh_shape.items() if n > 1) or "one device"
    return (f"config ok for {num_devices} {backend} devices: {mesh}, "
            f"{cfg.microbatches} microbatch(es)/step{pipeline_note(cfg)}")


def pipeline_note(cfg) -> str:
    """``" through 4 pipeline stages (1f1b, bubble 27.3%, 7 microbatches in flight per stage)"``, or ``""``
    without pipeline."""
    p, v = cfg.stages, cfg.parallel.pipeline_virtual_stages
    if p == 1:
        return ""
    chunks = f" x {v} virtual" if v > 1 else ""
    return f" through {p}{chunks} pipeline stages ({schedules.summary(cfg)})"


def train(cfg, workdir: str, started: float | None = None) -> dict:
    """Trains ``cfg`` (validated and resolved by :func:`setup`) in ``workdir``; returns the last
    train and eval metrics and the start-up times (:func:`startup_line`). Resumes from ``workdir``'s
    latest valid checkpoint if there is one. Compiled programs go to and come from JAX's persistent
    compilation cache in ``train.compile_cache_dir``.

    Args:
      started: ``time.perf_counter()`` when the process started its work (default: now), for the
        time to the first step.
    Raises:
      Preempted: SIGTERM/SIGUSR1 arrived; a checkpoint was saved at the next step boundary.
      NonFiniteError: ``train.max_nonfinite_steps`` skipped (non-finite) steps in a row.
      jaxllm.runtime.checkpoint.CheckpointError: checkpoints exist and none can be restored.
      ConfigError, DataError: see :func:`setup`; an unwritable ``train.compile_cache_dir``; ``log.wandb``
        and W&B cannot start the run (:func:`jaxllm.runtime.metrics.start_wandb`).
    """
    started = time.perf_counter() if started is None else started
    check_workdir(workdir)
    path = compile_cache.directory(cfg.train.compile_cache_dir, workdir)
    with contextlib.ExitStack() as stack:
        stack.enter_context(workdir_lock.held(workdir))  # one run per workdir (main holds it already)
        try:
            stack.enter_context(compile_cache.use(path, cfg.train.compile_cache_min_compile_s))
        except OSError as e:
            raise config.ConfigError("train.compile_cache_dir", cfg.train.compile_cache_dir,
                                     f"cannot create {path} ({e.strerror or e}); give a directory you can write, "
                                     f"or \"\" to turn the compilation cache off") from None
        return _train(cfg, workdir, started)


def startup_line(times: dict, cache_dir: str | None) -> str:
    """``"first step 9.1 s after start: data 0.4 s (sample indices 0.1 s, read from the cache), restore
    0.8 s (step 40), compile 3.2 s (compilation cache hit: DIR), first step 0.3 s, other 4.4 s"``."""
    state = ("restore", times["startup_restore_s"]) if "startup_restore_s" in times else (
        "init", times["startup_init_s"])
    cache = {"hit": f"compilation cache hit: {cache_dir}", "miss": f"compilation cache miss: {cache_dir}",
             "off": "no compilation cache" if cache_dir is None else
             f"compilation cache {cache_dir} unused: this backend cannot serialize programs"}[times["compile_cache"]]
    built = times["startup_index_built"]
    index = ("uniform sampling: no sample indices" if built is None else
             f"sample indices {times['startup_index_s']:.1f} s, {'built' if built else 'read from the cache'}")
    resumed = f" (step {times['resumed_at']})" if "startup_restore_s" in times else ""
    other = times["startup_s"] - sum(times[k] for k in ("startup_data_s", "startup_compile_s", "startup_first_step_s"))
    return (f"first step {times['startup_s']:.1f} s after start: data {times['startup_data_s']:.1f} s ({index}), "
            f"{state[0]} {state[1]:.1f} s{resumed}, compile {times['startup_compile_s']:.1f} s ({cache}), "
            f"first step {times['startup_first_step_s']:.1f} s, other {other - state[1]:.1f} s")


def _train(cfg, workdir: str, started: float) -> dict:
    cfg, data, run, checkpointer, state, start, startup = _restore(cfg, workdir)
    if start >= cfg.train.train_iters:  # nothing is compiled for a finished run
        checkpointer.close()
        if jax.process_index() == 0:
            print(f"jaxllm: the run in {workdir} is finished: its checkpoint is at step {start} of "
                  f"train.train_iters={cfg.train.train_iters}; to train on, raise --config.train.train_iters")
        return {}
    return _Loop(cfg, workdir, data, run, checkpointer, state, start, startup, started).train()


def _restore(cfg, workdir: str):
    """Checks config and data (:func:`setup`), then restores the newest checkpoint or initializes; returns
    ``(resolved config, Data, Run, Checkpointer, state, completed steps, startup times in seconds)``."""
    tick = time.perf_counter()
    cfg, data = setup(cfg, workdir)
    startup = {"startup_data_s": time.perf_counter() - tick, "startup_index_s": data.index_seconds,
               "startup_index_built": None if data.sampling == "uniform" else bool(data.index_built)}
    checkpointer = checkpoint.Checkpointer(workdir, cfg, tokenizer=data.tokenizer)
    run = Run(cfg)
    tick = time.perf_counter()
    state = run.initial_state(checkpointer)
    start = int(jax.device_get(state["step"]))
    startup["startup_restore_s" if start else "startup_init_s"] = time.perf_counter() - tick
    if start:
        startup["resumed_at"] = start
    return cfg, data, run, checkpointer, state, start, startup


def _announce(cfg, run, data, state, start: int, unigram: float) -> None:
    """Process 0's first lines: parameters, devices, batch, data, vocabulary, evaluation; the layout."""
    n_params = gpt.num_params(run.logical_state["params"])
    active = gpt.active_params(cfg.model, run.logical_state["params"])
    print(f"jaxllm: {n_params / 1e6:.2f}M parameters"
          + (f" ({active / 1e6:.2f}M active per token)" if active != n_params else "")
          + f", {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"{cfg.microbatches} microbatch(es)/step{pipeline_note(cfg)}, {data.describe()}, model vocabulary "
          f"{cfg.model.vocab_size} (tables padded to {cfg.model.padded_vocab_size}); "
          + (f"unigram entropy of the validation batches {unigram:.3f} nats/token" if cfg.train.eval_interval else
             "no evaluation (train.eval_interval=0)")
          + (f", resuming at step {start}" if start else ""))
    print(run.describe(state["params"]))


class _Loop:
    """The training loop of a restored run: compiles the train step, then runs the steps from ``start`` to
    ``train.train_iters`` with logging, evaluation and checkpoints (:meth:`train`)."""

    def __init__(self, cfg, workdir: str, data, run, checkpointer, state, start: int, startup: dict, started: float):
        self.cfg, self.t, self.workdir, self.data, self.run = cfg, cfg.train, workdir, data, run
        self.checkpointer, self.state, self.start, self.startup, self.started = (checkpointer, state, start, startup,
                                                                                 started)
        self.loader = Batches(data, rows=run.process_rows())
        self.primary = jax.process_index() == 0
        t = self.t
        # logged with every evaluation: the loss of the best context-free model of the validation batches
        self.unigram = (unigram_entropy(np.stack([Batches(data).eval_batch(i)[1] for i in range(t.eval_iters)]),
                                        data.vocab_size) if t.eval_interval else float("nan"))
        if self.primary:
            _announce(cfg, run, data, state, start, self.unigram)
        # the W&B run starts (or resumes) before the compilation: a login problem stops the run at once
        wandb_run = metrics.start_wandb(cfg, workdir) if self.primary and cfg.log.wandb else None
        self._compile()
        self.bpb_scale = 1 / data.bytes_per_token / math.log(2) if data.bytes_per_token else None
        self.logger = metrics.MetricsLogger(workdir, enabled=self.primary, tensorboard=cfg.log.tensorboard,
                                            progress_bar=cfg.log.progress_bar, total_steps=t.train_iters - start,
                                            wandb=wandb_run, resumed_at=start)
        self.exit_code = 1  # what the W&B run records: 1 unless the loop ends or is preempted
        self.last, self.last_eval = {}, {}
        self.bubble = schedules.schedule_bubble(cfg)
        self.tick, self.steps_since = time.perf_counter(), 0
        self.batch = run.global_batch(*self.loader.train_batch(start))
        self.pending_startup = {}
        self.nonfinite = NonFiniteStop(t.max_nonfinite_steps)
        self.watchdog = Watchdog(t.stall_timeout_s)
        self.step_times = stragglers.StepTimes(t.straggler_threshold)
        self.slow_down = debug_slow_down(os.environ.get("JAXLLM_DEBUG_SLOW_PROCESS", ""))

    def _compile(self) -> None:
        t0 = time.perf_counter()
        with compile_cache.Hits() as self.hits:
            self.train_step = self.run.train_step.lower(
                self.state, *self.run.global_batch(*self.loader.train_batch(self.start))).compile()
        self.compile_s = time.perf_counter() - t0
        self.startup.update(startup_compile_s=self.compile_s, compile_cache=self.hits.state)
        flops_per_step = flops.flops_per_step(self.cfg)
        self.peak, peak_source = hardware.peak_flops_per_device(jax.devices()[0], self.cfg.model.dtype)
        if self.primary:
            print(f"compiled the train step in {self.compile_s:.1f} s (compilation cache {self.hits.state}); "
                  f"{flops_per_step / 1e12:.4f} TFLOP/step; "
                  f"peak {self.peak / 1e12:.2f} TFLOP/s/device ({peak_source})")

    def train(self) -> dict:
        """Runs the steps; returns the last train and eval metrics, the compile time and the startup times.

        Raises:
          Preempted: after the checkpoint of the step at which a preemption signal was seen.
          NonFiniteError: ``train.max_nonfinite_steps`` skipped (non-finite) steps in a row.
        """
        # Installed only now: a signal before the first step loses nothing since the checkpoint just restored.
        preemption = Preemption().install()
        try:
            for s in range(self.start, self.t.train_iters):
                self._step(s, preemption)
            self.exit_code = 0
        except checkpoint.SaveError:
            self.exit_code = EXIT_SAVE_FAILED
            raise
        finally:  # a pending asynchronous save completes before the process ends (a second Ctrl-C still ends it)
            try:
                with self.watchdog.waiting("the last checkpoint's save"):
                    self.checkpointer.close()
            except checkpoint.SaveError:
                self.exit_code = EXIT_SAVE_FAILED
                raise
            finally:
                preemption.uninstall()
                self.logger.close(self.exit_code, preempted=self.exit_code == EXIT_PREEMPTED)

        if self.primary and self.cfg.log.samples:
            split = "valid" if self.t.eval_interval else "train"
            print_samples(self.run, self.state, self.data.tokenizer, Batches(self.data).batch(split, 0)[0, :8],
                          self.workdir)
        return {**self.last, **self.last_eval, "compile_s": self.compile_s, **self.startup}

    def _step(self, s: int, preemption: Preemption) -> None:
        """Step ``s + 1``, then what is due after it: the log line, evaluation, a checkpoint, the stops."""
        t, watchdog, step_times, done = self.t, self.watchdog, self.step_times, s + 1
        with watchdog.waiting(f"train step {done}"):
            with step_times.waiting():
                self.state, m = self.train_step(self.state, *self.batch)
            if done < t.train_iters:  # prepared while the step runs
                self.batch = self.run.global_batch(*self.loader.train_batch(done))
            if s == self.start:  # the time to the first step: waits for it once
                with step_times.waiting():
                    jax.block_until_ready(m)
                now = time.perf_counter()
                self.startup.update(startup_first_step_s=now - self.tick, startup_s=now - self.started)
                if self.primary:
                    print(f"jaxllm: {startup_line(self.startup, self.hits.directory)}", flush=True)
                self.pending_startup = {k: v for k, v in self.startup.items()
                                        if k.startswith(("startup_", "compile_"))}
        if self.slow_down:
            time.sleep(self.slow_down)
        self.steps_since += 1
        self.logger.advance(1)
        log = done % t.log_interval == 0 or done == t.train_iters
        evaluate = t.eval_interval and (done % t.eval_interval == 0 or done == t.train_iters)
        with watchdog.waiting(f"the checkpoint at step {done}"):
            stop = preemption.reached(done)
        save = stop or done == t.train_iters or self.checkpointer.due(done)
        # The host reads the device only where it must: the non-finite stop from steps a few back
        # (all pending ones before logging, evaluation and saving), the metrics at log steps.
        settle = log or evaluate or save
        with watchdog.waiting(f"train step {done if settle else max(done - self.nonfinite.lag, self.start + 1)}"):
            with step_times.waiting():
                diverged = self.nonfinite.add(done, m, settle=settle)
        if log or diverged:
            self._log(*(diverged or (done, m)))
        if diverged:
            step = diverged[0]
            raise NonFiniteError(f"the loss or gradient norm was NaN/inf for {t.max_nonfinite_steps} steps in a "
                                 f"row (steps {step - t.max_nonfinite_steps + 1}-{step}, updates skipped); "
                                 "lower train.lr, raise train.warmup_iters or check the data, then resume")
        if evaluate:
            self._evaluate(done)
        with watchdog.waiting(f"the checkpoint at step {done}"), step_times.waiting():
            self.checkpointer.poll()  # a save that failed in the background stops the run now, not at the next
            self.checkpointer.maybe_save(done, self.state, force=done == t.train_iters or stop)
        if stop:
            self.exit_code = EXIT_PREEMPTED
            raise Preempted(done)

    def _log(self, step: int, m: dict) -> None:
        """The metrics line of ``step`` (``m``: its metrics, device arrays) with throughput, MFU, the processes'
        spread, the bubble, peak memory and, first after a start, the startup times."""
        with self.step_times.waiting():
            m = {k: np.asarray(v).item() for k, v in jax.device_get(m).items()}
        now = time.perf_counter()
        elapsed, self.tick = now - self.tick, now  # the next interval holds the wait for the others just below
        m.update(flops.throughput(elapsed / self.steps_since, self.cfg, num_devices=jax.device_count(),
                                  peak_flops=self.peak))
        spread, straggler = self.step_times.report(elapsed, self.steps_since)  # every process: a collective
        m.update(spread)
        if straggler and self.primary:
            print(straggler, flush=True)
        if self.bubble:  # the schedule's theoretical idle fraction, next to the MFU it costs
            m["pipeline_bubble"] = self.bubble
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:  # GPUs report it; the CPU backend does not
            m["peak_memory_gib"] = stats["peak_bytes_in_use"] / 2**30
        if self.pending_startup:  # the first record after a start says where the time to it went
            m.update(self.pending_startup)
            self.pending_startup = {}
        self.logger.log(step, m)
        self.last, self.steps_since = m, 0

    def _evaluate(self, done: int) -> None:
        """The validation loss after ``done`` steps, logged (not counted in the training throughput)."""
        t_eval = time.perf_counter()
        with self.watchdog.waiting(f"the evaluation at step {done}"):
            loss = self.run.evaluate(self.state["params"], self.loader, progress=self.watchdog.alive)
        self.last_eval = {"eval_loss": loss, "unigram_entropy": self.unigram}
        if self.bpb_scale:
            self.last_eval["eval_bpb"] = loss * self.bpb_scale
        self.logger.log(done, self.last_eval, kind="eval")
        self.tick += time.perf_counter() - t_eval  # throughput counts training steps only


def debug_slow_down(value: str) -> float:
    """Seconds this process sleeps per step for ``JAXLLM_DEBUG_SLOW_PROCESS=INDEX:SECONDS`` (0 for another
    process, or when unset).

    Raises:
      ConfigError: not ``INDEX:SECONDS``.
    """
    if not value:
        return 0.0
    index, _, seconds = value.partition(":")
    try:
        return float(seconds) if int(index) == jax.process_index() else 0.0
    except ValueError:
        raise config.ConfigError("JAXLLM_DEBUG_SLOW_PROCESS", value, "give INDEX:SECONDS (a test's straggler), "
                                 "or unset it") from None


def print_samples(run, state, tokenizer, default_prompt, workdir):
    """Prints ``log.samples`` continuations of ``log.sample_prompt`` (default: ``default_prompt`` tokens),
    on this host with the model's local operations (the run's are bound to its mesh)."""
    if jax.process_count() > 1:  # the parameters span other hosts' devices: device_get cannot fetch them
        print(f"samples skipped (multi-process run): python -m jaxllm.generate --workdir={workdir}")
        return
    cfg, log = run.cfg, run.cfg.log
    tokens = tokenizer.encode(log.sample_prompt) if log.sample_prompt else default_prompt
    sampler = Sampler(cfg.model, gpt.describe(cfg.model).graphdef, run.params(state), cfg.train.seq_length)
    rows = sampler(np.tile(np.asarray(tokens)[None], (log.samples, 1)), log.sample_tokens,
                   temperature=log.temperature, top_k=log.top_k, seed=cfg.train.seed)
    for row in rows:
        print(f"--- sample ---\n{tokenizer.decode(list(tokens) + row.tolist())}\n--------------")


def fail_once(message: str, code: int, process: int):
    """Exits with ``code`` after one line on stderr from process 0: every process of a multi-process run
    meets the same config error, data error or preemption, and the others (``process`` > 0) write theirs to
    their log file (``WORKDIR/logs/process_N.log``, once it is open) instead of repeating it on the job's console."""
    if process == 0:
        cli.fail(message, code)
    library = python_logging.getLogger("jaxllm.library")
    if library.handlers:
        library.error("%s", message)
    sys.exit(code)


def _refused(workdir: str, before: frozenset[str] | None, held: bool) -> None:
    """After bad input: what this run wrote into ``workdir`` since ``before`` (:func:`workdir_lock.snapshot`) is
    removed, the workdir too if the run made it, unless the run saved a checkpoint; only by the lock's holder, and
    only in a run of one process (another process may still be writing its log there, which says why it stopped)."""
    saved = os.path.join(workdir, "checkpoints")
    if held and jax.process_count() == 1 and (before is None or "checkpoints" not in before) and not (
            os.path.isdir(saved) and any(n.isdigit() for n in os.listdir(saved))):
        workdir_lock.remove_new(workdir, before)


@cli.stoppable("jaxllm.train", "nothing to save before the first training step")
def _main(argv):
    started = time.perf_counter()
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    if len(argv) > 1:
        cli.fail(f"error: unexpected arguments: {' '.join(argv[1:])}")
    process, held = 0, False  # this process's index once it joined a multi-process job; the workdir locked
    workdir = flags.FLAGS.workdir
    before = workdir_lock.snapshot(workdir)

    def refuse(line: str):
        _refused(workdir, before, held)
        fail_once(line, cli.EXIT_USAGE, process)

    try:
        with contextlib.ExitStack() as stack, cli.usage_errors(report=refuse):  # refuse() while the lock is held
            if flags.FLAGS.check_devices:
                print(check(flags.FLAGS.config, flags.FLAGS.check_devices))
                return
            gpu = gpu_env.apply()  # XLA flags and runtime variables for GPUs: before any backend starts
            host_memory.keep_freed_memory()  # CPU runs: XLA's buffers come from malloc; before XLA's threads start
            topology = distributed.initialize()  # joins a multi-process job before any backend starts; a
            process = topology.process_id if topology else 0  # LaunchError is a ConfigError of its process
            check_workdir(workdir)
            stack.enter_context(workdir_lock.held(workdir))  # before anything is written there
            held = True
            console.configure(workdir, process=jax.process_index(), verbose=flags.FLAGS.config.log.verbose,
                              processes=jax.process_count())
            gpu_env.report(gpu)  # process 0 prints them, and warns if GPUs are here but JAX runs on the CPU
            train(flags.FLAGS.config, workdir, started=started)
    except KeyboardInterrupt:
        cli.fail("jaxllm: interrupted before the first training step; nothing to save", code=cli.EXIT_INTERRUPTED)
    except Preempted as e:
        fail_once(f"jaxllm: {e}", EXIT_PREEMPTED, process)
    except checkpoint.SaveError as e:
        fail_once(f"error: {e}", EXIT_SAVE_FAILED, process)
    except (NonFiniteError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def define_flags(fv, argv) -> None:
    """jaxllm.train's flags, in the ``FlagValues`` ``fv``: ``--config`` (:func:`jaxllm.cli.define_config_flag`),
    ``--workdir`` and ``--check_devices``; ``argv``: the command's arguments, whose ``--config.*`` are checked."""
    cli.define_config_flag(argv, fv)
    flags.DEFINE_string("workdir", "runs/default", "run directory: data cache, checkpoints, metrics.jsonl, "
                        "tensorboard/", flag_values=fv)
    flags.DEFINE_integer("check_devices", 0, "only check the config for this many devices (a launcher's dry run): "
                         "nothing is started, read or written", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxllm.train ARGV``; with ``argv`` (a list) in this process, returning the exit status
    (:func:`jaxllm.cli.run_tool`: a run that trains keeps this process's console as the process would)."""
    return cli.run_tool(_main, define_flags, argv)


if __name__ == "__main__":
    main()
