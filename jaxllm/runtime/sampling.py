"""Sampling from a GPT with a KV cache: temperature and top-k (Fan et al. 2018).

The cache holds ``train.seq_length`` positions; when it is full, the last half
of the text is re-encoded and decoding goes on, so the model never sees
positions it was not trained on.  A context is written into the cache in chunks of
power-of-two lengths (its binary digits: 37 tokens as 32, 4 and 1), so prompts of any length
compile at most ``log2(seq_length) + 1`` prefill shapes, not one per length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model import gpt


class Sampler:
    """Compiled prefill and decode functions for one model.

    Args:
      model_cfg: the resolved ``model`` section; ``graphdef``/``params``: the model (see
        :mod:`jaxllm.model`); max_length: the longest context, in tokens (``train.seq_length``).
    """

    def __init__(self, model_cfg, graphdef, params, max_length: int):
        self.model_cfg, self.params, self.max_length = model_cfg, params, max_length

        def run(params, tokens, positions, cache):
            logits, cache = gpt.forward(graphdef, params, tokens, positions=positions, cache=cache)
            return logits[:, -1], cache

        self._run = jax.jit(run)

        def pick(logits, key, temperature, top_k):
            logits = logits / temperature
            if top_k:
                kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            return jax.random.categorical(key, logits)

        self._pick = jax.jit(pick, static_argnums=(3,))

    def _prefill(self, context: np.ndarray, cache):
        """Writes ``context`` (int32 ``[batch, n]``) into an empty ``cache`` at positions ``0..n-1``, in
        chunks of decreasing powers of two; returns the logits after its last token and the cache."""
        start, n = 0, context.shape[1]
        for bit in reversed(range(n.bit_length())):
            if n >> bit & 1:
                chunk = context[:, start:start + (1 << bit)]
                positions = np.broadcast_to(np.arange(start, start + chunk.shape[1], dtype=np.int32), chunk.shape)
                logits, cache = self._run(self.params, chunk, positions, cache)
                start += chunk.shape[1]
        return logits, cache

    def __call__(self, prompt: np.ndarray, num_tokens: int, *, temperature=0.8, top_k=200, seed=0) -> np.ndarray:
        """Continues each row of ``prompt`` (int ``[batch, len]``, len >= 1) by ``num_tokens`` tokens.

        Returns int32 ``[batch, num_tokens]``.  ``top_k`` 0 samples from the whole vocabulary.
        """
        tokens = np.asarray(prompt, np.int32)
        batch, key, out = tokens.shape[0], jax.random.key(seed), []
        top_k = min(int(top_k), self.model_cfg.padded_vocab_size)
        logits, cache, pos = None, None, 0
        for _ in range(num_tokens):
            if cache is None or pos == self.max_length:
                keep = max(1, self.max_length // 2) if cache is not None else self.max_length
                context = tokens[:, -keep:]
                cache = gpt.init_cache(self.model_cfg, batch, self.max_length)
                logits, cache = self._prefill(context, cache)
                pos = context.shape[1]
            key, sub = jax.random.split(key)
            nxt = np.asarray(self._pick(logits, sub, temperature, top_k), np.int32)[:, None]
            tokens = np.concatenate([tokens, nxt], axis=1)
            out.append(nxt)
            if pos < self.max_length:
                logits, cache = self._run(self.params, nxt, np.full((batch, 1), pos, np.int32), cache)
                pos += 1
        return np.concatenate(out, axis=1)
