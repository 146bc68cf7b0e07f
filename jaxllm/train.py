"""Training CLI: ``python -m jaxllm.train --config=configs/FILE.py[:KEY] --config.SECTION.KEY=VALUE --workdir=DIR``.

With no flags it trains the default config (``jaxllm/config.py``) on the Python
standard library's sources.  Rerunning with the same ``--workdir`` resumes from
the latest checkpoint that can be restored (exactly: see :mod:`jaxllm.checkpoint`).

Exit codes: 0 done; 1 an unexpected error, or :class:`NonFiniteError` (the loss or
gradient norm was NaN/inf for ``train.max_nonfinite_steps`` steps in a row), or
:class:`jaxllm.checkpoint.CheckpointError` (checkpoints exist but none can be read);
2 bad config or data, one line naming the key, the value and the fix, before
anything is compiled; :data:`EXIT_PREEMPTED` (75) preempted: SIGTERM or SIGUSR1
made the run save a checkpoint at the next step boundary and stop; rerun the same
command to continue.
"""

from __future__ import annotations

import math
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from jaxllm import attention, checkpoint, config, distributed, gpu_env, metrics, model, optim, pipeline, sharding, step
from jaxllm.data import DataError, Loader, TokenData, ensure_prepared
from jaxllm.sampling import Sampler

# Exit status of a preempted run (after its checkpoint is saved): BSD's EX_TEMPFAIL, "try again later".
EXIT_PREEMPTED = 75


class Preempted(Exception):
    """The run saved a checkpoint at ``step`` on SIGTERM/SIGUSR1 and stopped; rerunning resumes it."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"preempted: saved a checkpoint at step {step}; rerun the same command to resume")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm was non-finite for ``train.max_nonfinite_steps`` steps in a row."""


def data_dir(cfg, workdir: str) -> str:
    """The prepared token directory of a run (prepared into ``WORKDIR/data`` if needed)."""
    return ensure_prepared(cfg.data, os.path.join(workdir, "data"))


def setup(cfg, workdir: str):
    """Checks config and data before anything compiles; returns ``(resolved cfg, TokenData)``.

    Raises:
      ConfigError, DataError: with the key or file, the value and the fix.
    """
    config.validate(cfg, num_devices=jax.device_count())
    attention.check_config(cfg)
    data = TokenData(data_dir(cfg, workdir))
    cfg = config.resolved(cfg, vocab_size=data.vocab_size, num_devices=jax.device_count())
    data.check_vocab(cfg.model.vocab_size)
    return cfg, data


class Run:
    """The compiled pieces of a run on a device mesh: shardings, state, train and eval steps.

    Args:
      cfg: a resolved config (see :func:`setup`).
      devices: the devices of the mesh (default: all).
    """

    def __init__(self, cfg, devices=None):
        self.cfg = cfg
        self.mesh = sharding.make_mesh(cfg, devices)
        self.table = sharding.rules(cfg)
        self.graphdef, _ = model.abstract(cfg)
        self.optimizer = optim.make_optimizer(cfg)
        logical = model.logical_axes(cfg)
        abstract_state = jax.eval_shape(lambda: step.init_state(cfg, self.optimizer, cfg.train.seed))
        self.state_sharding = sharding.state_shardings(cfg, abstract_state, logical, self.optimizer, self.mesh)
        self.abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                           abstract_state, self.state_sharding)
        spec = lambda *axes: jax.sharding.NamedSharding(self.mesh, sharding.logical_to_spec(axes, self.table))  # noqa: E731
        self.batch_sharding, self.eval_sharding = spec(None, "batch", "length"), spec("batch", "length")
        train_fn = step.make_train_step(cfg, self.graphdef, self.optimizer, optim.lr_schedule(cfg.train),
                                        sharding.grad_shardings(cfg, logical, self.mesh))
        self.train_step = jax.jit(self._in_mesh(train_fn), in_shardings=(self.state_sharding, self.batch_sharding, self.batch_sharding),
                                  out_shardings=(self.state_sharding, None), donate_argnums=0)
        self.eval_step = jax.jit(self._in_mesh(step.make_eval_step(cfg, self.graphdef, config.grad_accum_steps(cfg))),
                                 in_shardings=(self.state_sharding["params"], self.eval_sharding, self.eval_sharding))

    def _in_mesh(self, fn):
        """``fn`` traced with the activation constraints of this mesh and rules table."""

        def traced(*args):
            with sharding.activation_sharding(self.mesh, self.table):
                return fn(*args)

        return traced

    def initial_state(self, checkpointer=None):
        """The latest checkpoint's state, or a fresh one created directly in its sharding."""
        state = checkpointer.restore(self.abstract_state) if checkpointer else None
        if state is None:
            init = jax.jit(lambda: step.init_state(self.cfg, self.optimizer, self.cfg.train.seed),
                           out_shardings=self.state_sharding)
            state = init()
        return state

    def process_rows(self) -> slice:
        """The rows of the global batch this process feeds (its devices' part of the batch axis)."""
        t = self.cfg.train
        accum = config.grad_accum_steps(self.cfg)
        index = self.batch_sharding.addressable_devices_indices_map((accum, t.global_batch_size // accum, t.seq_length))
        rows = [i[1].indices(t.global_batch_size // accum)[:2] for i in index.values()]
        return slice(min(r[0] for r in rows) * accum, max(r[1] for r in rows) * accum)

    def global_batch(self, inputs, targets):
        """This process's rows ``[rows, seq]`` -> global arrays ``[microbatches, rows/microbatches, seq]``.

        Row ``r`` goes to micro batch ``r % microbatches``, so each process's contiguous
        rows stay contiguous within every micro batch."""
        accum = config.grad_accum_steps(self.cfg)
        out = []
        for x in (inputs, targets):
            x = x.reshape(-1, accum, x.shape[-1]).swapaxes(0, 1)
            out.append(jax.make_array_from_process_local_data(self.batch_sharding, np.ascontiguousarray(x)))
        return out

    def evaluate(self, params, loader) -> float:
        """Mean loss (nats/token) over the ``train.eval_iters`` fixed validation batches."""
        losses = []
        for i in range(self.cfg.train.eval_iters):
            x, y = (jax.make_array_from_process_local_data(self.eval_sharding, a) for a in loader.eval_batch(i))
            losses.append(self.eval_step(params, x, y))
        return float(np.mean(jax.device_get(losses)))

    def describe(self, params) -> str:
        """The mesh and a table of every parameter: shape, partition spec, bytes per device."""
        lines = [f"mesh {dict(self.mesh.shape)} over {self.mesh.devices.size} device(s)",
                 f"{'parameter':<28} {'shape':<22} {'partition spec':<44} {'bytes/device':>13}"]
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        for path, leaf in flat:
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            spec = str(tuple(leaf.sharding.spec))
            lines.append(f"{name:<28} {str(leaf.shape):<22} {spec:<44} {sharding.per_device_bytes(leaf):>13,}")
        lines.append(f"{'total':<96}{sharding.per_device_bytes(params):>13,}")
        return "\n".join(lines)


def pipeline_note(cfg) -> str:
    """``" through 4 pipeline stages (gpipe, bubble 27.3%)"``, or ``""`` without pipeline."""
    p, v = pipeline.num_stages(cfg), cfg.parallel.pipeline_virtual_stages
    if p == 1:
        return ""
    chunks = f" x {v} virtual" if v > 1 else ""
    return (f" through {p}{chunks} pipeline stages ({cfg.parallel.pipeline_schedule}, "
            f"bubble {pipeline.schedule_bubble(cfg):.1%})")


def train(cfg, workdir: str) -> dict:
    """Trains ``cfg`` (validated and resolved by :func:`setup`) in ``workdir``; returns the last
    train and eval metrics. Resumes from ``workdir``'s latest valid checkpoint if there is one.

    Raises:
      Preempted: SIGTERM/SIGUSR1 arrived; a checkpoint was saved at the next step boundary.
      NonFiniteError: ``train.max_nonfinite_steps`` skipped (non-finite) steps in a row.
      jaxllm.checkpoint.CheckpointError: checkpoints exist and none can be restored.
      ConfigError, DataError: see :func:`setup`.
    """
    cfg, data = setup(cfg, workdir)
    t = cfg.train
    run = Run(cfg)
    loader = Loader(data, seed=t.seed, global_batch_size=t.global_batch_size, seq_length=t.seq_length,
                    rows=run.process_rows())
    checkpointer = checkpoint.Checkpointer(workdir, cfg)
    state = run.initial_state(checkpointer)
    start = int(jax.device_get(state["step"]))
    n_params = model.num_params(state["params"])
    primary = jax.process_index() == 0
    unigram = data.unigram_entropy("val")  # logged with every evaluation: the best context-free model's loss
    if primary:
        print(f"jaxllm: {n_params / 1e6:.2f}M parameters, {jax.device_count()} {jax.devices()[0].platform} device(s), "
              f"{config.grad_accum_steps(cfg)} microbatch(es)/step{pipeline_note(cfg)}, "
              f"data {data.meta['train_tokens']:,} train / {data.meta['val_tokens']:,} val tokens "
              f"({data.meta['tokenizer']}, vocab {data.vocab_size} -> {cfg.model.vocab_size}; unigram entropy "
              f"{data.unigram_entropy('all'):.3f} nats/token, validation split {unigram:.3f})"
              + (f", resuming at step {start}" if start else ""))
        print(run.describe(state["params"]))

    t0 = time.perf_counter()
    train_step = run.train_step.lower(state, *run.global_batch(*loader.train_batch(start))).compile()
    compile_s = time.perf_counter() - t0
    flops_per_step = metrics.flops_per_step(cfg)
    peak, peak_source = metrics.peak_flops_per_device(jax.devices()[0], cfg.model.dtype)
    if primary:
        print(f"compiled the train step in {compile_s:.1f} s; {flops_per_step / 1e12:.4f} TFLOP/step; "
              f"peak {peak / 1e12:.2f} TFLOP/s/device ({peak_source})")

    bpb_scale = data.meta["num_tokens"] / max(1, sum(s["bytes"] for s in data.meta["sources"])) / math.log(2)
    logger = metrics.MetricsLogger(workdir, enabled=primary, tensorboard=cfg.log.tensorboard,
                                   progress_bar=cfg.log.progress_bar, total_steps=t.train_iters - start)
    last, last_eval = {}, {}
    bubble = pipeline.schedule_bubble(cfg)
    tick, steps_since = time.perf_counter(), 0
    batch = run.global_batch(*loader.train_batch(start))
    # Installed only now: a signal before the first step loses nothing since the checkpoint just restored.
    preemption = checkpoint.Preemption().install()
    try:
        for s in range(start, t.train_iters):
            state, m = train_step(state, *batch)
            done = s + 1
            if done < t.train_iters:  # prepared while the step runs
                batch = run.global_batch(*loader.train_batch(done))
            steps_since += 1
            logger.advance(1)
            # One scalar read per step (the batch above is already queued): stopping exactly after N needs it.
            diverged = int(m["nonfinite_in_a_row"]) >= t.max_nonfinite_steps
            if done % t.log_interval == 0 or done == t.train_iters or diverged:
                m = {k: np.asarray(v).item() for k, v in jax.device_get(m).items()}
                elapsed = time.perf_counter() - tick
                m.update(metrics.throughput(elapsed / steps_since, cfg, num_devices=jax.device_count(), peak_flops=peak))
                if bubble:  # the schedule's theoretical idle fraction, next to the MFU it costs
                    m["pipeline_bubble"] = bubble
                stats = jax.local_devices()[0].memory_stats() or {}
                if "peak_bytes_in_use" in stats:  # GPUs report it; the CPU backend does not
                    m["peak_memory_gib"] = stats["peak_bytes_in_use"] / 2**30
                logger.log(done, m)
                last, tick, steps_since = m, time.perf_counter(), 0
            if diverged:
                raise NonFiniteError(f"the loss or gradient norm was NaN/inf for {t.max_nonfinite_steps} steps in a "
                                     f"row (steps {done - t.max_nonfinite_steps + 1}-{done}, updates skipped); "
                                     "lower train.lr, raise train.warmup_iters or check the data, then resume")
            if t.eval_interval and (done % t.eval_interval == 0 or done == t.train_iters):
                t_eval = time.perf_counter()
                loss = run.evaluate(state["params"], loader)
                last_eval = {"eval_loss": loss, "eval_bpb": loss * bpb_scale, "unigram_entropy": unigram}
                logger.log(done, last_eval, kind="eval")
                tick += time.perf_counter() - t_eval  # throughput counts training steps only
            stop = preemption.reached(done)
            checkpointer.maybe_save(done, state, force=done == t.train_iters or stop)
            if stop:
                raise Preempted(done)
    finally:  # a pending asynchronous save completes before the process ends
        preemption.uninstall()
        checkpointer.close()
        logger.close()

    if primary and cfg.log.samples:
        print_samples(cfg, run.graphdef, state["params"], data.tokenizer, np.asarray(data.val[:8]), workdir)
    return {**last, **last_eval, "compile_s": compile_s}


def print_samples(cfg, graphdef, params, tokenizer, default_prompt, workdir):
    """Prints ``log.samples`` continuations of ``log.sample_prompt`` (default: ``default_prompt`` tokens)."""
    if jax.process_count() > 1:  # the parameters span other hosts' devices: device_get cannot fetch them
        print(f"samples skipped (multi-process run): python -m jaxllm.generate --workdir={workdir}")
        return
    log = cfg.log
    tokens = tokenizer.encode(log.sample_prompt) if log.sample_prompt else default_prompt
    sampler = Sampler(cfg, graphdef, jax.device_get(params))
    rows = sampler(np.tile(np.asarray(tokens)[None], (log.samples, 1)), log.sample_tokens,
                   temperature=log.temperature, top_k=log.top_k, seed=cfg.train.seed)
    for row in rows:
        print(f"--- sample ---\n{tokenizer.decode(list(tokens) + row.tolist())}\n--------------")


def main(argv):
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        gpu = gpu_env.apply()  # XLA flags and runtime variables for GPUs: before any backend starts
        distributed.initialize()  # joins a multi-process job before any backend starts; a LaunchError is a ConfigError
        gpu_env.report(gpu)  # process 0 prints them, and warns if GPUs are here but JAX runs on the CPU
        train(flags.FLAGS.config, flags.FLAGS.workdir)
    except config.ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        sys.exit(2)
    except Preempted as e:
        print(f"jaxllm: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except (NonFiniteError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "config.py"),
                                    "config file, e.g. configs/shakespeare_char.py or configs/gpt3.py:GPT125M")
    flags.DEFINE_string("workdir", "runs/default", "run directory: data cache, checkpoints, metrics.jsonl, tensorboard/")
    app.run(main)
