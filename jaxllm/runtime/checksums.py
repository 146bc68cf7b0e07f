"""What a checkpoint records to be checked at restore: a checksum of every array (Orbax and TensorStore
0.12.8 do not detect a changed byte in an array's chunk) and the tokenizer's fingerprint; the comparisons
are :class:`jaxllm.runtime.checkpoint.Checkpointer`'s.
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

# Odd multipliers of the index along each dimension in an array's checksum (dimensions beyond cycle).
_PRIMES = (2654435761, 2246822519, 3266489917, 668265263, 374761393, 1181783497)


def _checksum(x: jax.Array) -> jax.Array:
    """uint32: the sum, modulo 2**32, of each element's bits times an odd weight made of its index along
    each dimension.  A change of any one element changes it; zero elements add nothing, so the zero
    padding a restore cuts or adds (another tensor or data-parallel size) leaves it as it is, and integer
    sums do not depend on the order in which the devices add them."""
    bits = x.astype(jnp.uint32) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(
        x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    weight = jnp.zeros(x.shape, jnp.uint32)
    for d in range(x.ndim):
        weight = weight + (jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) + 1) * jnp.uint32(_PRIMES[d % 6])
    return jnp.sum(bits * (weight * 2 + 1), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def checksums(state) -> dict[str, int]:
    """``{path: checksum}`` of every array of ``state`` (:func:`_checksum`), computed where the arrays are
    (one pass over them, a few scalars to the host; collective: every process calls it)."""
    sums = _checksums(state)
    return {jax.tree_util.keystr(path, simple=True, separator="/"): int(np.asarray(s.addressable_data(0)))
            for path, s in jax.tree_util.tree_flatten_with_path(sums)[0]}


def tokenizer_fingerprint(tokenizer) -> dict:
    """``{"name", "vocab_size", "sha256"}`` of a tokenizer (:mod:`jaxllm.data.tokenizers`): the hash of what
    decides its ids (a char tokenizer's characters, the tokenizer files' contents), not of where its files are."""
    fields = {k: v for k, v in tokenizer.meta_fields().items() if not k.endswith(("_path", "_dir"))}
    text = json.dumps({"name": tokenizer.name, **fields}, sort_keys=True)
    return {"name": tokenizer.name, "vocab_size": int(tokenizer.vocab_size),
            "sha256": hashlib.sha256(text.encode()).hexdigest()}
