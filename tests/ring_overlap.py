"""Whether ring attention's transfers can overlap its compute, read from the per-device program.

Used by tests/test_sequence.py in a subprocess (the device count must be set before jax is
imported):  python tests/ring_overlap.py

Ring attention over ``sequence`` = 4 fake CPU devices, forward and backward (``jax.grad``), traced
to a jaxpr. In every loop body that sends blocks (a ``scan`` holding ``ppermute``), a ``dot_general``
that reads a value received in the same iteration must wait for the transfer; none that does means
the transfer and the attention of an iteration are independent, which is what XLA's latency-hiding
scheduler needs to run them at the same time on GPUs. Prints JSON: per loop body, the number of
collective permutes and of dot_generals that read their results (directly or through other ops).
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxllm import config  # noqa: E402
from jaxllm.model import attention  # noqa: E402
from jaxllm.parallel import context_parallel, sharding  # noqa: E402

N, SEQ, HEADS, HEAD_DIM = 4, 32, 2, 8


def dots_in(jaxpr) -> int:
    """dot_generals in ``jaxpr`` and its sub-jaxprs."""
    return sum(1 if e.primitive.name == "dot_general" else sum(dots_in(s) for s in jax.extend.core.jaxprs_in_params(
        e.params)) for e in jaxpr.eqns)


def waiting_dots(body) -> tuple[int, int]:
    """``(ppermutes, dots)`` of a loop body: its collective permutes, and the dot_generals whose inputs
    depend on a permute's output within the body (an op with sub-jaxprs that reads such a value counts
    all the dots inside it)."""
    received, permutes, waiting = set(), 0, 0
    for eqn in body.eqns:
        reads = any(not isinstance(v, jax.extend.core.Literal) and v in received for v in eqn.invars)
        if eqn.primitive.name == "ppermute":
            permutes += 1
            received.update(eqn.outvars)
        elif reads:
            received.update(eqn.outvars)
            waiting += 1 if eqn.primitive.name == "dot_general" else sum(
                dots_in(s) for s in jax.extend.core.jaxprs_in_params(eqn.params))
    return permutes, waiting


def loop_bodies(jaxpr):
    """Every scan body in ``jaxpr`` (recursively) that holds a collective permute."""
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if eqn.primitive.name == "scan" and any(e.primitive.name == "ppermute" for e in sub.eqns):
                yield sub
            yield from loop_bodies(sub)


def main():
    cfg = config.get_config()
    cfg.mesh.sequence = N
    mesh = sharding.make_mesh(cfg, jax.devices())
    spec = P(None, "sequence")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, SEQ, HEADS, HEAD_DIM)), jnp.float32) for _ in range(3))
    pos = jnp.asarray(context_parallel.zigzag_order(SEQ, N), jnp.int32)[None]
    static = ("sequence", N, 1, attention.Implementation())  # the xla reference
    ring = jax.shard_map(lambda q, k, v, pos: context_parallel._ring(static, q, k, v, pos, None),
                         mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False)
    loss = lambda q, k, v: ring(q, k, v, pos).sum()  # noqa: E731
    out = {}
    for name, fn in (("forward", loss), ("backward", jax.grad(loss, argnums=(0, 1, 2)))):
        out[name] = [waiting_dots(b) for b in loop_bodies(jax.make_jaxpr(fn)(q, k, v).jaxpr)]
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
