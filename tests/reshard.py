"""Restores one checkpoint onto other meshes and prints, as JSON, whether every value and sharding matches.

Used by tests/test_checkpoint.py in a subprocess (8 fake CPU devices must be set before
jax is imported):  python tests/reshard.py WORKDIR '<json {name: mesh overrides}>'

WORKDIR's latest checkpoint is first restored in the layout it was saved with (its
stored config); each named layout then restores the same step, and the result says
whether each leaf is bitwise equal and laid out as that layout's ``Run.state_sharding``.
"""

import copy
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm import config  # noqa: E402
from jaxllm.resolve import resolve
from jaxllm.runtime import checkpoint  # noqa: E402
from jaxllm.runtime.run import Run  # noqa: E402


def restore(saved_cfg, workdir, mesh):
    spec = copy.deepcopy(saved_cfg)
    spec.mesh = config.Mesh(**mesh)
    spec.train.update(micro_batch_size=1, global_batch_size=8)  # divisible on every layout below
    n = int(np.prod(list(mesh.values())))
    cfg = resolve(spec, num_devices=n)
    run = Run(cfg, devices=jax.devices()[:n])
    ckpt = checkpoint.Checkpointer(workdir, cfg)
    state = ckpt.restore(run.abstract_state)
    ckpt.close()
    shardings_ok = all(leaf.sharding.is_equivalent_to(s, leaf.ndim)
                       for leaf, s in zip(jax.tree.leaves(state), jax.tree.leaves(run.state_sharding)))
    return state, shardings_ok, n


def same(a, b) -> bool:
    """Equal, where tables of another vocabulary padding (tensor size) count as equal when their
    common rows are and the rest is zeros."""
    if np.shape(a) == np.shape(b):
        return np.array_equal(a, b)
    shape = [max(m, n) for m, n in zip(np.shape(a), np.shape(b))]
    pad = lambda x: np.pad(x, [(0, n - m) for n, m in zip(shape, np.shape(x))])  # noqa: E731
    return np.array_equal(pad(a), pad(b))


def main():
    workdir, layouts = sys.argv[1], json.loads(sys.argv[2])
    saved_cfg = checkpoint.load_config(workdir)
    saved_mesh = {a: n for a, n in saved_cfg.mesh.devices().items() if n != 1}
    reference, _, _ = restore(saved_cfg, workdir, saved_mesh)
    reference = jax.device_get(reference)
    results = {"saved_mesh": saved_mesh, "step": int(reference["step"])}
    for name, mesh in layouts.items():
        state, shardings_ok, n = restore(saved_cfg, workdir, mesh)
        leaves = zip(jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0], jax.tree.leaves(reference))
        different = [jax.tree_util.keystr(p) for (p, a), b in leaves if not same(a, b)]
        results[name] = {"devices": n, "different": different, "shardings_ok": shardings_ok,
                         "leaves": len(jax.tree.leaves(state))}
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
