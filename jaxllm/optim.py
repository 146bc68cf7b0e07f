"""The optimizer: AdamW (Loshchilov & Hutter 2019) with linear warmup, cosine decay and clipping."""

from __future__ import annotations

import optax

from jaxllm import model


def lr_schedule(t):
    """Learning rate per step: 0 -> ``train.lr`` linearly over ``warmup_iters``, then cosine
    to ``min_lr`` at ``lr_decay_iters``, then ``min_lr`` (the Megatron-LM / nanoGPT schedule)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_iters,
        decay_steps=max(t.lr_decay_iters, t.warmup_iters + 1), end_value=t.min_lr)


def make_optimizer(cfg) -> optax.GradientTransformation:
    """Global-norm clipping at ``train.grad_clip`` (0: off), then AdamW; no weight decay on
    norms and biases (see :func:`jaxllm.model.decay_mask`). ``cfg`` must be resolved."""
    t = cfg.train
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(lr_schedule(t), b1=t.beta1, b2=t.beta2, eps=t.adam_eps,
                    weight_decay=t.weight_decay, mask=model.decay_mask(cfg)),
    )
