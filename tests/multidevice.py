"""Runs training layouts on 8 fake CPU devices and prints their results as JSON.

Used by tests/test_sharding.py in a subprocess, because the device count must be
set before jax is imported:  python tests/multidevice.py '<json list of layouts>'

Each layout is ``{"mesh": {...}, "parallel": {...}, "model": {...}, "data": {...}}`` overrides
of :func:`base_config` (with Megatron's document options in ``data`` the batches hold about one
end-of-document token :data:`EOD` in five, and the steps take their ``docs`` arrays;
``"eval": True`` adds the validation loss of 200 batches after training, as
the training loop evaluates: one compiled program over the stacked batches, the case that deadlocked
XLA:CPU when each batch was its own execution); the result holds the three losses (and a mixture of
experts' logged routing statistics and multi-token prediction's ``mtp_loss``, ``moe``, per step), the parameters after
three steps (compared by the caller against the single-device run), whether
every parameter's sharding is the one the rules table declares, and the bytes
per device of parameters and optimizer state.  ``"hlo": True`` only compiles the train step and
gives the shapes of its per-device arrays that span the padded vocabulary, with the SPMD
partitioner's warnings (XLA logs them to stderr while compiling).
"""

import base64
import json
import os
import re
import sys
import tempfile
import traceback

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm import config  # noqa: E402
from jaxllm.data.loader import document_arrays  # noqa: E402
from jaxllm.data.loader import documents as document_batch  # noqa: E402
from jaxllm.parallel import sharding  # noqa: E402
from jaxllm.resolve import resolve
from jaxllm.runtime import checkpoint  # noqa: E402
from jaxllm.runtime.run import Run  # noqa: E402

STEPS = 3
EVAL_BATCHES = 200
EOD = 0  # the end-of-document token of the batches of layouts with document options


def with_eods(tokens, rng):
    """``tokens`` with about one in five replaced by :data:`EOD` (several documents per row)."""
    return np.where(rng.random(tokens.shape) < 0.2, EOD, tokens).astype(np.int32)


def documents(cfg, inputs) -> tuple:
    """``(docs,)``, the arrays the train step takes for ``inputs`` with ``cfg``'s document options, or ``()``."""
    docs = document_batch(inputs, EOD, cfg.data)
    return (docs,) if docs else ()


class ValidationBatches:
    """``eval_batch(i)``: this process's rows of validation batch ``i`` (random tokens, seeded by ``i``)."""

    def __init__(self, cfg, rows):
        self.shape, self.rows, self.cfg = (cfg.train.global_batch_size, cfg.train.seq_length + 1), rows, cfg

    def eval_batch(self, i):
        rng = np.random.default_rng([1, i])
        tokens = rng.integers(0, 128, self.shape).astype(np.int32)
        if document_arrays(self.cfg.data):
            tokens = with_eods(tokens, rng)
        tokens = tokens[self.rows]
        return tokens[:, :-1], tokens[:, 1:], *documents(self.cfg, tokens[:, :-1])


def packed(array) -> dict:
    """``array`` as JSON without loss and without a number per element (a list of floats made the
    parameters of two layouts 54 MB of text, seconds to write and read): float32 bytes in base64, its
    shape; :func:`tests.harness.unpacked` reads it. Every parameter dtype here is exact in float32."""
    a = np.ascontiguousarray(np.asarray(array, np.float32))
    return {"float32": base64.b64encode(a.tobytes()).decode("ascii"), "shape": list(a.shape)}


def base_config():
    c = config.get_config()
    # make_vocab_size_divisible_by 1: 128 rows on every tensor size, so each layout's tables are the single device's
    c.model.update(num_layers=2, hidden_size=128, num_attention_heads=8, vocab_size=128, make_vocab_size_divisible_by=1,
                   dtype="float32")
    c.train.update(seq_length=16, micro_batch_size=2, global_batch_size=16, warmup_iters=1, lr=1e-3, min_lr=1e-4,
                   train_iters=10, eval_iters=EVAL_BATCHES)
    return c


def compiled_vocab_shapes(run, batches):
    """The train step compiled: the shapes in its per-device program with a dimension of
    ``model.padded_vocab_size`` (``vocab_shapes``) or of one tensor shard of it (``shard_shapes``),
    and the partitioner's "Involuntary full rematerialization" lines."""
    x, y = batches[0]
    with tempfile.TemporaryFile("w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            hlo = run.train_step.lower(run.abstract_state, *run.global_batch(x, y)).compile().as_text()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        warnings = [line for line in log.read().splitlines() if "Involuntary full rematerialization" in line]
    shapes = {(s, *map(int, s[s.index("[") + 1:-1].split(","))) for s in re.findall(r"\b[a-z]+\d*\[[\d,]+\]", hlo)}
    vocab = run.cfg.model.padded_vocab_size
    spanning = lambda rows: sorted(s[0] for s in shapes if rows in s[1:])  # noqa: E731
    return {"vocab_shapes": spanning(vocab), "shard_shapes": spanning(vocab // run.layout.size("vocab")),
            "partitioner_warnings": warnings}


def run_layout(layout, batches, doc_batches):
    cfg = base_config()
    layout = dict(layout)
    evaluate = layout.pop("eval", False)  # also the validation loss of EVAL_BATCHES batches, after training
    hlo = layout.pop("hlo", False)
    restore_on = layout.pop("restore_on", None)  # a mesh: the trained state saved, then restored on it
    for section, values in layout.items():
        getattr(cfg, section).update(**values)
    sizes = list(cfg.mesh.devices().values())
    n = 8 if -1 in sizes else int(np.prod(sizes))
    cfg = resolve(cfg, num_devices=n)
    run = Run(cfg, devices=jax.devices()[:n])
    if run.documents:
        batches = doc_batches
    g = cfg.train.global_batch_size  # a smaller global batch than the base config's: its first rows
    batches = [(x[:g], y[:g]) for x, y in batches]
    if hlo:
        return compiled_vocab_shapes(run, batches)
    state = run.initial_state()
    rows = run.process_rows()
    losses, moe = [], []
    for x, y in batches:
        state, m = run.train_step(state, *run.global_batch(x[rows], y[rows], *documents(cfg, x[rows])))
        losses.append(float(m["loss"]))
        moe.append({k: float(v) for k, v in m.items() if k.startswith("moe_") or k == "mtp_loss"})
    declared = sharding.param_specs(run.spec.axes, sharding.zero_tables(cfg).params)
    mismatched = [
        jax.tree_util.keystr(path)
        for (path, leaf), spec in zip(
            jax.tree_util.tree_flatten_with_path(state["params"])[0],
            jax.tree.leaves(declared, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
        if not leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(run.mesh, spec), leaf.ndim)
    ]
    flat = {jax.tree_util.keystr(p): packed(v) for p, v in jax.tree_util.tree_flatten_with_path(run.params(state))[0]}
    eval_loss = None
    if evaluate:
        eval_loss = run.evaluate(state["params"], ValidationBatches(cfg, rows))
    result = {"losses": losses, "moe": moe, "params": flat, "sharding_mismatches": mismatched, "eval_loss": eval_loss,
              "param_bytes": sharding.per_device_bytes(state["params"]),
              "opt_bytes": sharding.per_device_bytes(state["opt_state"]),
              "stored_shapes": sorted({tuple(a.shape) for a in jax.tree.leaves(state)})}
    if restore_on is not None:
        result["restored"] = restored_elsewhere(cfg, run, state, restore_on)
    return result


def restored_elsewhere(cfg, run, state, mesh) -> dict:
    """``state`` saved by ``run``'s checkpointer and restored on ``mesh``: whether every array is bitwise
    the saved one (both unpadded), and the shapes stored there."""
    with tempfile.TemporaryDirectory() as workdir:
        ckpt = checkpoint.Checkpointer(workdir, cfg)
        ckpt.maybe_save(1, state, force=True)
        ckpt.close()
        spec = config.from_dict(cfg.to_dict())
        spec.mesh = config.Mesh(**mesh)
        other_cfg = resolve(spec, num_devices=int(np.prod(list(mesh.values()))))
        other = Run(other_cfg, devices=jax.devices()[:int(np.prod(list(other_cfg.mesh_shape.values())))])
        ckpt = checkpoint.Checkpointer(workdir, other_cfg)
        restored = ckpt.restore(other.abstract_state)
        ckpt.close()
    unpadded = lambda r, s: jax.tree.leaves(sharding.unpad(jax.device_get(s), r.logical_state))  # noqa: E731
    return {"equal": all(np.array_equal(a, b) for a, b in zip(unpadded(run, state), unpadded(other, restored))),
            "stored_shapes": sorted({tuple(a.shape) for a in jax.tree.leaves(restored)})}


def main():
    layouts = json.loads(sys.argv[1])
    cfg = base_config()
    rng = np.random.default_rng(0)
    batches, doc_batches = [], []
    for _ in range(STEPS):
        tokens = rng.integers(0, 128, (cfg.train.global_batch_size, cfg.train.seq_length + 1)).astype(np.int32)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    doc_rng = np.random.default_rng(1)
    for x, y in batches:
        tokens = with_eods(np.concatenate([x, y[:, -1:]], axis=1), doc_rng)
        doc_batches.append((tokens[:, :-1], tokens[:, 1:]))
    results = []
    for layout in layouts:
        try:
            results.append(run_layout(layout, batches, doc_batches))
        except config.ConfigError as e:
            results.append({"config_error": str(e), "key": e.key})
        except Exception:  # noqa: BLE001  (one failing layout must not hide the others' results)
            results.append({"error": traceback.format_exc()[-3000:]})
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
