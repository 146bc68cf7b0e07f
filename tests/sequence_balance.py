"""Counts the attention work of each of 8 fake CPU devices and prints it as JSON.

Used by tests/test_sequence.py in a subprocess (the device count must be set before
jax is imported):  python tests/sequence_balance.py

Two counts per device, on a 64-token causal sequence over ``sequence`` = 8:

* useful (query, key) pairs, measured from the real implementation: with q = k = 0
  every visible score is 0, so ``exp(lse)`` of a query is the number of keys it was
  computed against that the causal mask lets through, and their sum over a device's
  queries is the causally needed work that device did;
* computed FLOPs: the ``dot_general`` FLOPs of the per-device program (the shard_map
  body's jaxpr, scan bodies counted once per iteration), the work actually issued.

For ring attention in zigzag order and, as the counter-example, the contiguous order
(all-gathered keys: each device's queries against the whole sequence).
"""

import json
import math
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxllm import config  # noqa: E402
from jaxllm.model import attention  # noqa: E402
from jaxllm.parallel import context_parallel, sharding  # noqa: E402

N, SEQ, HEADS, HEAD_DIM = 8, 64, 2, 8


def dot_flops(jaxpr) -> int:
    """FLOPs of every dot_general in ``jaxpr`` (2 x output size x contracted size), recursing into
    sub-jaxprs; a scan's body counts ``length`` times."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            contracted = math.prod(eqn.invars[0].aval.shape[i] for i in lhs_contract)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
            continue
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += times * dot_flops(sub)
    return total


def measure(body, positions):
    cfg = config.get_config()
    cfg.mesh.sequence = N
    mesh = sharding.make_mesh(cfg, jax.devices())
    spec = P(None, "sequence")
    q = jnp.zeros((1, SEQ, HEADS, HEAD_DIM), jnp.float32)
    v = jnp.ones((1, SEQ, HEADS, HEAD_DIM), jnp.float32)
    pos = jnp.asarray(positions, jnp.int32)[None]
    run = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=(P("sequence"), P("sequence")),
                        check_vma=False)
    pairs = np.asarray(jax.jit(run)(q, q, v, pos)[0])
    per_device = jax.make_jaxpr(run)(q, q, v, pos)  # the shard_map body holds per-device shapes
    return pairs.tolist(), dot_flops(per_device.jaxpr)


def ring(q, k, v, pos):
    _, lse = context_parallel._ring_forward(("sequence", N, 1, attention.Implementation()), q, k, v, pos)
    return jnp.exp(lse).sum()[None], jnp.zeros((1,))


def allgather(q, k, v, pos):
    gather = lambda x: jax.lax.all_gather(x, "sequence", axis=1, tiled=True)  # noqa: E731
    _, lse = context_parallel.local_attention(q, gather(k), gather(v), pos, gather(pos), attention.Implementation())
    return jnp.exp(lse).sum()[None], jnp.zeros((1,))


def main():
    zig = context_parallel.zigzag_order(SEQ, N)
    results = {}
    for name, body, order in (("ring_zigzag", ring, zig), ("allgather_contiguous", allgather, np.arange(SEQ))):
        pairs, flops = measure(body, order)
        results[name] = {"pairs": pairs, "flops": flops}
    results["needed_pairs"] = SEQ * (SEQ + 1) // 2 * HEADS
    results["flops_per_pair"] = 4 * HEAD_DIM  # q.k and p.v: 2 x head_dim each, per head
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
