"""Validation loss as few compiled programs: the eval step mapped over a stack of batches.

One execution per validation batch (the obvious loop) costs a dispatch and two host
transfers per batch, and, left un-awaited, it deadlocks XLA:CPU when a process has
fewer cores than twice its devices (jaxlib 0.10.2, ``xla/pjrt/cpu/cpu_client.cc``):
the client runs both the launch of an execution (which takes a per-device in-flight
slot, blocking once 32 are taken) and the execution itself (a collective needs one
thread per device at once, in the rendezvous) on one pool of ``max(cores, devices)``
threads.  With more than 32 executions queued, launches blocked on a slot occupy
threads the oldest execution needs to finish and free its slot; XLA aborts after
``--xla_cpu_collective_call_terminate_timeout_seconds`` (40 s) with "Expected 8 threads
to join the rendezvous, but only 6 of them arrived".  Here every program covers a chunk
of batches and at most two are in flight.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# Host bytes of the stacked (inputs, targets[, docs]) of one program: chunks are cut to stay under it.
MAX_CHUNK_BYTES = 64 << 20
# Programs in flight: the next chunk is dispatched before the previous one's losses are read.
IN_FLIGHT = 2


def batched(eval_step):
    """``eval_step(params, [batch, seq], [batch, seq][, docs]) -> scalar`` mapped over a leading axis:
    ``(params, inputs [chunk, batch, seq], targets [chunk, batch, seq][, docs]) -> (float32 [chunk], counts)``,
    one loss (nats/token) per batch, computed one batch after another (``lax.map``), and the tokens
    each counts: float32 ``[chunk]``, the sums of ``docs["loss_mask"]``, or None without one."""

    def losses(params, *batch):
        docs = batch[2] if len(batch) > 2 else {}
        counts = jnp.sum(docs["loss_mask"], axis=(1, 2)) if "loss_mask" in docs else None
        return jax.lax.map(lambda b: eval_step(params, *b), batch), counts

    return losses


def chunks(num_batches: int, batch_bytes: int, max_bytes: int = MAX_CHUNK_BYTES) -> tuple[int, int]:
    """``(number of programs, batches per program)`` for ``num_batches`` batches of
    ``batch_bytes`` host bytes (inputs and targets): the fewest programs whose stacks stay
    under ``max_bytes`` (at least one batch each), with batches spread evenly so that
    the last, padded program wastes fewer batches than there are programs."""
    n = min(num_batches, max(1, math.ceil(num_batches * batch_bytes / max_bytes)))
    return n, math.ceil(num_batches / n)


def mean_loss(program, params, eval_batch, num_batches: int, sharding, max_bytes: int = MAX_CHUNK_BYTES,
              progress=None) -> float:
    """Mean of the per-batch losses of validation batches ``0 .. num_batches - 1``.

    Args:
      program: :func:`batched` eval step, jitted with ``sharding`` for its inputs and a
        replicated output.
      params: the parameters, as ``program`` expects them.
      eval_batch: ``i -> (inputs, targets[, docs])``, this process's rows of batch ``i``, int32 ``[rows, seq]``
        (``docs``: a dict of such arrays, :meth:`jaxllm.data.loader.Batches.eval_batch`).
      num_batches: ``train.eval_iters``.
      sharding: of a stack ``[chunk, batch, seq]`` (chunk unsplit).
      progress: called after each program's losses are read (e.g. :meth:`jaxllm.runtime.watchdog.Watchdog.alive`).
    Returns:
      the mean token loss over the batches, nats/token: the mean of the per-batch means (float32 mean as
      ``np.mean``), all batches holding equally many tokens; with a loss mask (``data.eod_mask_loss``)
      the per-batch means weighted by their counts, ``sum(loss x mask) / sum(mask)`` over every batch
      (Megatron-LM's per-token evaluation).
    """
    first = eval_batch(0)
    count, size = chunks(num_batches, sum(x.nbytes for x in jax.tree.leaves(first)), max_bytes)
    losses, weights, pending = [], [], []
    for c in range(count):
        ids = range(c * size, min((c + 1) * size, num_batches))
        # The last program is padded with repeats of its last batch (one shape, one compile); their losses are dropped.
        batches = [first if i == 0 else eval_batch(i) for i in ids] + [None] * (size - len(ids))
        batches = [b if b is not None else batches[len(ids) - 1] for b in batches]
        stacked = jax.tree.map(lambda *xs: jax.make_array_from_process_local_data(sharding, np.stack(xs)), *batches)
        pending.append((program(params, *stacked), len(ids)))
        while len(pending) >= IN_FLIGHT or (pending and c == count - 1):
            (out, counts), valid = pending.pop(0)
            losses.extend(np.asarray(jax.device_get(out))[:valid])
            if counts is not None:
                weights.extend(np.asarray(jax.device_get(counts), np.float64)[:valid])
            if progress is not None:
                progress()
    if weights:
        return float(np.dot(np.asarray(losses, np.float64), weights) / max(sum(weights), 1.0))
    return float(np.mean(np.asarray(losses, np.float32)))
