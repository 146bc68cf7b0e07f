"""The optimizer: AdamW (Loshchilov & Hutter 2019) with linear warmup, cosine decay and clipping."""

from __future__ import annotations

import optax


def lr_schedule(t) -> optax.Schedule:
    """Learning rate per step of the ``train`` section ``t``: 0 -> ``lr`` linearly over
    ``warmup_iters``, then cosine to ``min_lr`` at ``lr_decay_iters``, then ``min_lr`` (the
    Megatron-LM / nanoGPT schedule)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_iters,
        decay_steps=max(t.lr_decay_iters, t.warmup_iters + 1), end_value=t.min_lr)


def make_optimizer(t, decay_mask) -> optax.GradientTransformation:
    """Global-norm clipping at ``grad_clip`` (0: off), then AdamW, for the resolved ``train``
    section ``t``; weight decay only where ``decay_mask`` (:attr:`jaxllm.model.Spec.decay`) is True."""
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(lr_schedule(t), b1=t.beta1, b2=t.beta2, eps=t.adam_eps,
                    weight_decay=t.weight_decay, mask=decay_mask),
    )
