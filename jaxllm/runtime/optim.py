"""The optimizer and the learning-rate schedule: optax's own transformations, chosen by ``train.optimizer``
and ``train.lr_decay_style``.

Optimizers (``train.optimizer``; every one after global-norm clipping at ``train.grad_clip``, weight decay
only where the model's decay mask is True: matrices and embeddings, not biases and norms):

========== =====================================================================================
adamw      ``optax.adamw``: decoupled weight decay (Loshchilov & Hutter 2019); Megatron-LM's default
           ``--optimizer adam``, ALCF's ``adamw`` and ``apex.adam``
adam       ``optax.adam`` after ``optax.add_decayed_weights``: L2 weight decay added to the gradient,
           as ``torch.optim.Adam`` (ALCF's ``adam``; Megatron-LM's ``--no-decoupled-weight-decay``)
sgd        ``optax.sgd`` with momentum ``train.sgd_momentum`` (0: none) after L2 weight decay, as
           ``torch.optim.SGD`` (Megatron's ``--optimizer sgd``, ALCF's ``apex.sgd``)
lion       ``optax.lion`` (Chen et al. 2023): betas ``beta1, beta2``, decoupled weight decay
lamb       ``optax.lamb`` (You et al. 2020), per layer: the trust ratio of each layer's own matrix
           (ALCF's ``ds.fusedlamb``, ``ipex.lamb``, ``ipex.fusedlamb``)
adafactor  ``optax.adafactor`` (Shazeer & Stern 2018) as ALCF configures it: no parameter scaling, the
           external learning rate, momentum ``beta1`` (0: none), factored second moments of matrices
           with two dimensions >= 128, per layer; weight decay multiplied by the learning rate
muon       ``optax.contrib.muon`` (Jordan 2024) for the layers' matrices, its updates scaled to
           AdamW's RMS (``consistent_rms=0.2``, Liu et al. 2025, so one ``train.lr`` serves both);
           ``optax.adamw`` for embeddings, position and output tables, norms and biases
========== =====================================================================================

``beta1``, ``beta2`` and ``adam_eps`` are the Adam-family hyperparameters (adafactor and lion use
what applies to them; muon's momentum is 0.95, Keller Jordan's); ``weight_decay`` the decay of every
optimizer.  The layers' parameters are stacked along a leading ``layers`` axis
(:func:`jaxllm.model.gpt.describe`); lamb and adafactor, whose updates depend on a whole matrix (trust
ratio, factored moments, block-RMS clipping), are applied to each layer's slice of the stack
(``jax.vmap`` over that axis), as Megatron applies them to each layer's tensor; muon treats the axis
as a batch of matrices; the element-wise optimizers need nothing.

The learning rate (:func:`lr_schedule`) is Megatron-LM's ``OptimizerParamScheduler`` step for step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxllm import config

__all__ = ["STATE_SWITCHES", "lr_schedule", "make_optimizer", "muon_dimensions", "warmup_steps"]

# Hyperparameters whose being 0 or not changes which arrays an optimizer keeps (a checkpoint's
# state fits only a run that agrees; see jaxllm.runtime.checkpoint).
STATE_SWITCHES = {"sgd": ("sgd_momentum",), "adafactor": ("beta1",)}

MUON_MOMENTUM = 0.95  # Keller Jordan's (optax's default)
MUON_CONSISTENT_RMS = 0.2  # Muon's update RMS matched to AdamW's (Liu et al. 2025, "Muon is Scalable")


def warmup_steps(t) -> float:
    """Steps of the linear warmup of the ``train`` section ``t``: ``lr_warmup_fraction x lr_decay_iters``
    (Megatron's ``--lr-warmup-fraction``; a fraction of a step is kept, as Megatron keeps it in samples),
    else ``warmup_iters``."""
    decay = t.lr_decay_iters or t.train_iters
    return t.lr_warmup_fraction * decay if t.lr_warmup_fraction else t.warmup_iters


def lr_schedule(t) -> optax.Schedule:
    """The learning rate of the ``train`` section ``t`` as a function of the number of updates applied.

    Megatron-LM's ``OptimizerParamScheduler.get_lr`` step for step (``tests/test_optim.py`` compares
    them): with ``W`` = :func:`warmup_steps` and ``D`` = ``lr_decay_iters``, steps ``n <= W`` warm up
    linearly from 0 to ``lr``; then ``lr_decay_style``:

    * ``constant``: ``lr``;
    * ``linear``, ``cosine``: from ``lr`` to ``min_lr`` over steps ``W`` to ``D``;
    * ``inverse-square-root``: ``lr x sqrt(W / n)``, at least ``min_lr`` (without warmup
      ``lr / sqrt(n x global_batch_size)``: Megatron counts this one in samples);
    * ``WSD`` (warmup, stable, decay): ``lr`` until ``D - lr_wsd_decay_iters``, then to ``min_lr`` at
      ``D`` by ``lr_wsd_decay_style``: ``linear``, ``cosine``, ``exponential`` (``2 x 0.5^r - 1`` of the
      way, ``r`` the fraction of the decay done) or ``minus_sqrt`` (``1 - sqrt(r)``);

    and ``min_lr`` after ``D`` (but ``constant``).

    The step convention: Megatron-LM's scheduler starts at ``num_steps = 0`` and advances by the
    global batch after each successful update, its ``lr_warmup_steps``, ``lr_decay_steps`` and
    ``wsd_decay_steps`` being the iteration counts times the global batch; so iteration ``i`` (0-based)
    updates with ``get_lr`` at ``num_steps = i x global batch``, which is this schedule at ``i``.
    jaxllm's train step ``i`` (``state["step"] = i``) updates with the schedule at optax's count, the
    number of updates applied before it: ``i`` minus the steps skipped for a non-finite loss or
    gradient norm, which Megatron does not count either.
    """
    decay = t.lr_decay_iters or t.train_iters
    warmup = warmup_steps(t)
    after = _after_warmup(t, t.lr_decay_style, float(decay), float(warmup))
    if warmup == 0:
        return after
    warm = optax.linear_schedule(0.0, t.lr, warmup)
    # the warmup's last step included (optax.join_schedules switches at the boundary itself): Megatron's
    # n <= W, which differs from the next piece's start where a WSD anneal began during the warmup
    return lambda n: jnp.where(n <= warmup, warm(n), after(n - warmup))


def _after_warmup(t, style: str, decay: float, warmup: float) -> optax.Schedule:
    """The schedule from the end of the warmup on, as a function of the steps since then."""
    lr, low = t.lr, t.min_lr
    if style == "constant":
        return optax.constant_schedule(lr)
    if style == "linear":
        return optax.linear_schedule(lr, low, decay - warmup)
    if style == "cosine":
        return optax.cosine_decay_schedule(lr, decay - warmup, alpha=low / lr)
    if style == "inverse-square-root":
        batch = t.global_batch_size  # Megatron counts samples here, and clamps them (not steps) at 1

        def inverse_square_root(s):
            n = s + warmup
            value = lr * max(warmup * batch, 1.0) ** 0.5 / jnp.sqrt(jnp.maximum(n * batch, 1.0))
            return jnp.where(n > decay, low, jnp.maximum(low, value))
        return inverse_square_root
    if style == "WSD":
        steps = float(t.lr_wsd_decay_iters)
        # stable at lr until the anneal starts at D - lr_wsd_decay_iters (before the warmup ends, if
        # the two overlap: Megatron then starts the anneal part way, as this does)
        return optax.join_schedules([optax.constant_schedule(lr), _anneal(t, steps)], [decay - steps - warmup])
    raise ValueError(f"train.lr_decay_style={style!r}")


def _anneal(t, steps: float) -> optax.Schedule:
    """WSD's final decay from ``lr`` to ``min_lr`` over ``steps`` by ``lr_wsd_decay_style``."""
    lr, low, style = t.lr, t.min_lr, t.lr_wsd_decay_style
    if style == "linear":
        return optax.linear_schedule(lr, low, steps)
    if style == "cosine":
        return optax.cosine_decay_schedule(lr, steps, alpha=low / lr)
    coeff = {"exponential": lambda r: 2.0 * 0.5 ** r - 1.0, "minus_sqrt": lambda r: 1.0 - jnp.sqrt(r)}[style]
    return lambda u: low + (lr - low) * coeff(jnp.clip(u / steps, 0.0, 1.0))


def _like(values, is_leaf=None):
    """``tree -> the tree of values[path]`` for every leaf of ``tree`` (a mask or label function that also
    fits the partial trees optax hands the transformations inside ``optax.partition``)."""
    table = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(values, is_leaf=is_leaf)[0]}
    return lambda tree: jax.tree_util.tree_map_with_path(lambda p, _: table[jax.tree_util.keystr(p)], tree)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def muon_dimensions(axes):
    """Muon's matrix view of each parameter from its logical axes (:attr:`jaxllm.model.gpt.Spec.axes`): an
    ``optax.contrib.MuonDimensionNumbers`` for the layers' weight matrices (``layers`` is a batch axis;
    a matrix maps its ``embed`` dimension to the others, or the others to ``embed``), None for what
    AdamW updates (embedding, position and output tables, norms, biases)."""
    def dims(names):
        inner = [i for i, n in enumerate(names) if n != "layers"]
        if len(inner) < 2 or "embed" not in names or any(names[i] in (None, "vocab") for i in inner):
            return None
        embed = names.index("embed")
        others = tuple(i for i in inner if i != embed)
        if embed == inner[0]:  # x @ W: embed -> heads/mlp
            return optax.contrib.MuonDimensionNumbers(reduction_axis=(embed,), output_axis=others)
        return optax.contrib.MuonDimensionNumbers(reduction_axis=others, output_axis=(embed,))
    return jax.tree.map(dims, axes, is_leaf=_is_axes)


def _per_layer(tx: optax.GradientTransformation, axes) -> optax.GradientTransformation:
    """``tx`` applied to each layer's slice of the stacked ``[layers, ...]`` parameters (vmapped over
    the leading axis) and as it is to the other parameters."""
    labels = jax.tree.map(lambda names: "layers" if names[:1] == ("layers",) else "other", axes, is_leaf=_is_axes)
    if "layers" not in jax.tree.leaves(labels):
        return tx
    stacked = optax.GradientTransformation(jax.vmap(tx.init), jax.vmap(tx.update))
    return optax.partition({"layers": stacked, "other": tx}, _like(labels))


def make_optimizer(t, decay_mask, axes=None) -> optax.GradientTransformation:
    """The optimizer of the ``train`` section ``t`` (see the module docstring), after global-norm
    clipping at ``grad_clip`` (0: off).

    Args:
      t: the ``train`` section (an alias of ``train.optimizer`` is taken as its optimizer).
      decay_mask: True where weight decay applies (:attr:`jaxllm.model.gpt.Spec.decay`).
      axes: the parameters' logical axes (:attr:`jaxllm.model.gpt.Spec.axes`); lamb, adafactor and muon need them.
    Raises:
      ValueError: lamb, adafactor or muon without ``axes``.
    """
    name = config.OPTIMIZER_ALIASES.get(t.optimizer, t.optimizer)
    if name in ("lamb", "adafactor", "muon") and axes is None:
        raise ValueError(f"make_optimizer: train.optimizer={name} needs the parameters' logical axes")
    lr, wd, mask = lr_schedule(t), t.weight_decay, _like(decay_mask)
    if name == "adamw":
        opt = optax.adamw(lr, b1=t.beta1, b2=t.beta2, eps=t.adam_eps, weight_decay=wd, mask=decay_mask)
    elif name == "adam":
        opt = optax.chain(optax.add_decayed_weights(wd, decay_mask), optax.adam(lr, b1=t.beta1, b2=t.beta2,
                                                                                eps=t.adam_eps))
    elif name == "sgd":
        opt = optax.chain(optax.add_decayed_weights(wd, decay_mask), optax.sgd(lr, momentum=t.sgd_momentum or None))
    elif name == "lion":
        opt = optax.lion(lr, b1=t.beta1, b2=t.beta2, weight_decay=wd, mask=decay_mask)
    elif name == "lamb":
        opt = _per_layer(optax.lamb(lr, b1=t.beta1, b2=t.beta2, eps=t.adam_eps, weight_decay=wd, mask=mask), axes)
    elif name == "adafactor":
        opt = _per_layer(optax.adafactor(lr, multiply_by_parameter_scale=False, momentum=t.beta1 or None,
                                         weight_decay_rate=lambda count: wd * lr(count), weight_decay_mask=mask),
                         axes)
    elif name == "muon":
        dims = muon_dimensions(axes)
        labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims,
                              is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))
        opt = optax.partition({
            "muon": optax.contrib.muon(lr, beta=MUON_MOMENTUM, weight_decay=wd, weight_decay_mask=mask,
                                       consistent_rms=MUON_CONSISTENT_RMS, adam_b1=t.beta1, adam_b2=t.beta2,
                                       muon_weight_dimension_numbers=_like(
                                           dims, is_leaf=lambda x: isinstance(x, optax.contrib.MuonDimensionNumbers))),
            "adamw": optax.adamw(lr, b1=t.beta1, b2=t.beta2, eps=t.adam_eps, weight_decay=wd, mask=mask),
        }, _like(labels))
    else:
        raise ValueError(f"train.optimizer={t.optimizer!r}: choose one of {', '.join(config.OPTIMIZERS)}")
    return optax.chain(optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(), opt)
