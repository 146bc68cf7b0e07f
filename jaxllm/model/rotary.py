"""Rotary scalings beyond Llama 3.1's (which is :func:`jaxllm.model.layers.rotary_frequencies`'s own): YaRN
(Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models", arXiv:2309.00071, section
3.4, ``model.rope_type="yarn"``), its scale of the rotary outputs and of the attention scores.

The formulas are Megatron-LM's ``YarnRotaryEmbedding`` (``megatron/core/models/common/embeddings/
yarn_rotary_pos_embedding.py``) and transformers' ``_compute_yarn_parameters`` (``modeling_rope_utils.py``), which
agree: with ``d`` rotary dimensions of base ``b``, dimension pair ``j`` of ``d / 2`` turns ``r(j) = L / (2 pi b^(2j /
d))`` times over the original context ``L``; the pairs turning more than ``beta_fast`` times keep their frequency,
those turning fewer than ``beta_slow`` times are divided by the factor, the ones between are interpolated linearly in
``j`` (the correction range rounded outward to whole pairs unless ``yarn_correction_range_round_to_int`` is off).
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def mscale(factor: float, m: float) -> float:
    """YaRN's attention temperature term ``0.1 m ln(factor) + 1`` (1 for ``factor`` <= 1), DeepSeek's
    ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn(inv_freq, cfg):
    """YaRN's inverse frequencies, float32 ``[d / 2]``, from the unscaled ``inv_freq`` ``[d / 2]`` (``rotary_base **
    (-2j / d)``) and the ``model`` section ``cfg``'s ``yarn_*`` keys (see the module docstring)."""
    half = inv_freq.shape[0]
    dim, base, factor = 2 * half, cfg.rotary_base, cfg.yarn_rotary_scaling_factor

    def pair(rotations):  # the (fractional) dimension pair that turns ``rotations`` times over the original context
        return dim * math.log(cfg.yarn_original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = pair(cfg.yarn_beta_fast), pair(cfg.yarn_beta_slow)
    if cfg.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / ((high - low) or 0.001), 0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def attention_factor(cfg) -> float:
    """What rotary's outputs are multiplied by (transformers' ``attention_scaling`` of cos and sin): YaRN's
    ``mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim)``; 1 without YaRN."""
    if cfg.rope_type != "yarn":
        return 1.0
    f = cfg.yarn_rotary_scaling_factor
    return mscale(f, cfg.yarn_mscale) / mscale(f, cfg.yarn_mscale_all_dim)


def score_factor(cfg) -> float:
    """What YaRN multiplies the attention scores by beyond their ``1 / sqrt(width)``: ``mscale(factor,
    yarn_mscale_all_dim)^2`` (DeepSeek-V3's softmax scale; Megatron-LM's MLA; 1 when ``yarn_mscale_all_dim`` is 0),
    1 without YaRN."""
    if cfg.rope_type != "yarn" or not cfg.yarn_mscale_all_dim:
        return 1.0
    return mscale(cfg.yarn_rotary_scaling_factor, cfg.yarn_mscale_all_dim) ** 2
