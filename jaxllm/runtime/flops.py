"""FLOP counts of a training step and the throughput figures built on them (tokens/s, TFLOP/s, MFU, HFU).

* :func:`flops_per_token` / :func:`flops_per_step` count the matmul FLOPs of one
  training step of the GPT in :mod:`jaxllm.model` (forward + backward, optionally
  the recomputed forward of ``model.remat="full"``).
* :func:`throughput` turns a step time into tokens/s, TFLOP/s per device, MFU and HFU
  against a device's peak (:func:`jaxllm.platform.hardware.peak_flops_per_device`).

Units: FLOPs are floating-point operations (a multiply-add counts 2), FLOP/s are
FLOPs per second, throughput is tokens/s, times are seconds.
"""

from __future__ import annotations

from jaxllm.model.groups import layer_kinds
from jaxllm.parallel import schedules


def flops_per_token(model_cfg, seq_length: int, *, recompute: bool = False) -> float:
    """Training FLOPs per token of one step: forward + backward (= 3x forward).

    Counts matmul FLOPs only (2 FLOPs per multiply-add; norms, softmax, activations,
    the optimizer and the embedding lookup are not counted). With ``h`` = hidden size,
    ``d`` = head dim, ``n`` = attention heads, ``k`` = kv heads, ``f`` = FFN size,
    ``V`` = vocabulary, ``s`` = sequence length, ``L`` = layers, the forward FLOPs per
    token are, per layer:

    * QKV projections: ``2*h*(n + 2*k)*d`` (multi-head latent attention's: :func:`_qkv_flops`; its scores
      and values then with the query/key and value widths ``dq``, ``dv`` in place of ``d``)
    * attention scores ``Q K^T`` and ``probs @ V``: ``2 * 2*s*n*d``, halved for the
      causal mask, i.e. ``2*s*n*d`` (each query attends to ~s/2 keys on average; this is
      the work a causal kernel does, and the convention of FlashAttention's benchmarks); in a layer with a window
      w < s (``model.sliding_window``, the layers ``model.window_attn_skip_freq`` gives it: each layer by its kind,
      :func:`jaxllm.model.groups.layer_kinds`), ``w - w^2/(2s)`` keys on average instead of ``s/2``
    * output projection: ``2*(n*d)*h`` (= ``2*h*h``)
    * MLP: ``2*h*f*2`` (gelu: up, down) or ``2*h*f*3`` (swiglu, geglu: gate, up, down); for a mixture of
      experts the active parameters, as Megatron-LM's ``num_floating_point_operations``: the
      ``moe_router_topk`` experts a token takes (``f`` = ``moe_ffn_hidden_size``), the shared expert, and
      the router's ``2*h*num_experts``; each layer's MLP by its kind (``model.moe_layer_freq``: dense and MoE
      layers mixed)

    plus the output layer (logits) ``2*h*V``; each of ``N`` = ``model.mtp_num_layers`` multi-token prediction
    depths adds a layer of the last layer's kind (counted with the layers), its projection ``eh_proj`` ``2*2h*h``
    and the output layer's ``2*h*V`` again (Megatron-LM's ``num_floating_point_operations`` counts the same).
    Training is 3x the forward (the backward
    computes the gradients of both the activations and the weights, 2x). With
    ``recompute=True`` the transformer layers are counted 4x instead of 3x (the forward
    recomputed in the backward by ``model.remat="full"``); the logits and the depths' projections are not
    rematerialised and stay at 3x. ``recompute=False`` gives *model* FLOPs (the basis of MFU),
    ``recompute=True`` *hardware* FLOPs for ``remat="full"`` (the basis of HFU).

    Relation to Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473, Appendix "Floating-point
    operations"): for ``f = 4h``, multi-head attention (``k = n``, ``n*d = h``), per
    iteration of ``B`` sequences they count ``72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h))``
    without recomputation and ``96*B*s*L*h^2*(1 + s/(6h) + V/(16*L*h))`` with it (eq. 3).
    Megatron does NOT halve the attention for the causal mask, so per token::

        flops_per_token(...)                 = 72*L*h^2*(1 + s/(6h) + V/(12Lh)) - 6*L*s*h
        flops_per_token(..., recompute=True) = 96*L*h^2*(1 + s/(6h) + V/(16Lh)) - 8*L*s*h

    (for GQA/SwiGLU the same holds against Megatron-LM's ``num_floating_point_operations``,
    with ``6*L*s*n*d`` in place of ``6*L*s*h``).

    ``V`` is the padded vocabulary (``model.padded_vocab_size``): the output layer computes
    every row of its table.

    Args:
      model_cfg: the ``model`` section of a resolved config (:func:`jaxllm.resolve.resolve`).
      seq_length: tokens per sequence ``s``.
      recompute: add one forward of the transformer layers (activation recomputation).
    Returns:
      FLOPs per token (a float).
    Raises:
      ValueError: the vocabulary is not known (resolved without the tokenizer's size).
    """
    m = model_cfg
    if not m.padded_vocab_size:
        raise ValueError("model.padded_vocab_size is 0: pass a config resolved with the tokenizer's vocabulary size")
    layers = sum(_stack_forward_flops(m, seq_length).values())
    h, n = m.hidden_size, m.mtp_num_layers
    outputs = (1 + n) * 2 * h * m.padded_vocab_size + n * 2 * 2 * h * h
    return float((4 if recompute else 3) * layers + 3 * outputs)


def flops_per_step(cfg, *, recompute: bool | None = None) -> float:
    """Training FLOPs of one optimizer step, all devices together.

    ``train.global_batch_size * train.seq_length`` tokens x :func:`flops_per_token`.

    Args:
      cfg: a resolved config.
      recompute: count the recomputed forward; None: ``cfg.model.remat`` ``"full"`` or ``"offload"``
        (``"save_dots"`` keeps every matmul output, so it recomputes no matmul FLOPs).
    Returns:
      FLOPs per step (a float).
    """
    if recompute is None:
        recompute = cfg.model.remat in ("full", "offload")
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    return tokens * flops_per_token(cfg.model, cfg.train.seq_length, recompute=recompute)


def _mlp_flops(m, moe: bool) -> tuple[float, float]:
    """Forward matmul FLOPs per token of one layer's MLP: ``(mlp_in, mlp_out)``; for a mixture of experts
    (``moe``) the ``moe_router_topk`` experts a token takes plus the shared expert, the router counted in
    ``mlp_in``."""
    gates = 1 if m.activation == "gelu" else 2  # swiglu, geglu: a gate matmul too
    mlp_in = lambda f: 2 * m.hidden_size * f * gates  # noqa: E731
    if not moe:
        return mlp_in(m.ffn_hidden_size), 2 * m.ffn_hidden_size * m.hidden_size
    shared, k, f = m.moe_shared_expert_intermediate_size, m.moe_router_topk, m.moe_ffn_hidden_size
    return (k * mlp_in(f) + mlp_in(shared) + 2 * m.hidden_size * m.num_experts,
            2 * (k * f + shared) * m.hidden_size)


def _qkv_flops(m) -> float:
    """Forward matmul FLOPs per token of one layer's query, key and value projections: ``2*h*(n + 2*k)*d``; for
    multi-head latent attention (``dq`` = ``qk_head_dim + qk_pos_emb_head_dim``, ``dn`` = ``qk_head_dim``, ``dr`` =
    ``qk_pos_emb_head_dim``, ``dv`` = ``v_head_dim``) the queries' ``2*h*n*dq`` or, through the rank ``rq``
    latent, ``2*rq*(h + n*dq)``, plus the keys' and values' latent ``2*h*(rkv + dr)`` and its decompression
    ``2*rkv*n*(dn + dv)`` (Megatron-LM's ``num_floating_point_operations`` counts the same matmuls)."""
    h, n = m.hidden_size, m.num_attention_heads
    if not m.multi_latent_attention:
        return 2 * h * (n + 2 * m.num_kv_heads) * m.head_dim
    dq, dv = m.attention_head_dims
    rq, rkv = m.q_lora_rank, m.kv_lora_rank
    q = 2 * rq * (h + n * dq) if rq else 2 * h * n * dq
    return q + 2 * h * (rkv + m.qk_pos_emb_head_dim) + 2 * rkv * n * (m.qk_head_dim + dv)


def _stack_forward_flops(m, s: int) -> dict[str, float]:
    """Forward matmul FLOPs per token of all the layers together, by named activation (as
    :func:`flops_per_token` counts them): ``qkv`` (:func:`_qkv_flops`), ``scores`` (``Q K^T``), ``values``
    (``probs @ V``; both causal-halved), ``out_proj``, ``mlp_in`` (up, and gate for swiglu), ``mlp_out`` (each
    layer's MLP by its kind, :attr:`jaxllm.config.Model.moe_layers`), the multi-token prediction depths' layers
    (``model.mtp_num_layers``, each of the last layer's kind) with them.  Attention's widths are
    :attr:`jaxllm.config.Model.attention_head_dims` (``dq`` for the scores, ``dv`` for the values and the output
    projection; both ``d`` but with multi-head latent attention)."""
    h, n, L = m.hidden_size, m.num_attention_heads, m.num_layers + m.mtp_num_layers
    dq, dv = m.attention_head_dims
    kinds = layer_kinds(m)
    kinds += kinds[-1:] * m.mtp_num_layers
    mlps = [_mlp_flops(m, kind.moe) for kind in kinds]
    # keys a query attends to, on average, summed over the layers: a windowed layer's w - w^2 / 2s, another's s / 2
    keys = sum(s / 2 if not w or w >= s else w - w * w / (2 * s) for w in (kind.window for kind in kinds))
    return {"qkv": L * _qkv_flops(m), "scores": 2 * keys * n * dq, "values": 2 * keys * n * dv,
            "out_proj": L * 2 * (n * dv) * h, "mlp_in": sum(x for x, _ in mlps), "mlp_out": sum(y for _, y in mlps)}


# What each ``model.remat`` policy recomputes in the backward pass (jaxllm.model.remat.POLICIES): the
# matmuls whose outputs it does not keep, plus those its backward needs the inputs of.  The attention
# scores are never kept (their softmax is what the backward of both attention matmuls needs), so every
# policy recomputes ``scores``; ``values`` too unless the attention output (``context``) is kept.
_RECOMPUTED = {
    "none": (),
    "full": ("qkv", "scores", "values", "out_proj", "mlp_in", "mlp_out"),
    "minimal": ("scores", "values"),
    "minimal_with_context": ("scores",),
    "save_dots": ("scores", "values"),
    "save_dots_except_mlp": ("scores", "values", "mlp_in", "mlp_out"),
    "save_qkv_proj": ("scores", "values", "out_proj", "mlp_in", "mlp_out"),
    "minimal_offloaded": ("scores", "values"),
    "qkv_proj_offloaded": ("scores", "values", "out_proj", "mlp_in", "mlp_out"),
    "offload": ("qkv", "scores", "values", "out_proj", "mlp_in", "mlp_out"),
}


def recompute_flops_per_token(model_cfg, seq_length: int, remat: str) -> float:
    """Matmul FLOPs per token that activation recomputation (``model.remat``) adds to a step: one
    more forward of the layer matmuls the policy does not keep (``_RECOMPUTED``).

    * ``"none"``: 0.
    * ``"full"`` (``nothing_saveable``): one more forward of the transformer layers, i.e.
      ``flops_per_token(recompute=True) - flops_per_token()``.
    * ``"save_dots"`` (``dots_with_no_batch_dims_saveable``) and ``"minimal"`` (every projection and
      MLP output kept by name): the attention score and value matmuls (batched over batch and heads),
      ``L * 2*s*n*d`` per token (causal-halved as in :func:`flops_per_token`); ``"minimal_with_context"``
      keeps the attention output, so only the scores; ``"save_dots_except_mlp"`` adds the MLP,
      ``"save_qkv_proj"`` the MLP and the output projection.  The offloaded policies recompute what
      their in-device counterparts do (``"offload"``: ``"full"``'s).  ``model.mlp_chunks`` > 1 adds
      one more forward of the MLP (each chunk is recomputed in its backward pass), whatever the policy.

    Approximation: norms, softmax, GELU and the other elementwise work that is also recomputed are
    not matmuls and are not counted, like everywhere in this module; a fused attention kernel
    (``pallas``, ``cudnn``, ``triton``) recomputes inside its own backward whatever the policy says,
    which no policy term counts either.

    Args:
      model_cfg: a resolved ``model`` section (see :func:`flops_per_token`).
      seq_length: tokens per sequence.
      remat: a ``model.remat`` policy.
    Returns:
      FLOPs per token (a float).
    Raises:
      ValueError: unknown ``remat``, or the errors of :func:`flops_per_token`.
    """
    if remat not in _RECOMPUTED:
        raise ValueError(f"remat={remat!r}: choose one of {', '.join(_RECOMPUTED)}")
    flops_per_token(model_cfg, seq_length)  # the same checks
    stack = _stack_forward_flops(model_cfg, seq_length)
    chunked = ("mlp_in", "mlp_out") if model_cfg.mlp_chunks > 1 else ()
    return float(sum(stack[k] for k in (*_RECOMPUTED[remat], *chunked)))


def hardware_flops_per_step(cfg) -> float:
    """Matmul FLOPs one step actually executes, all devices: :func:`flops_per_step` without
    recomputation plus :func:`recompute_flops_per_token` of ``cfg.model.remat`` per token,
    plus one more forward of the layers per pipeline recomputation
    (:func:`jaxllm.parallel.schedules.recomputed_forwards`: the 1F1B-family schedules) (the basis of HFU;
    MFU uses the model FLOPs alone).

    Args:
      cfg: a resolved config.
    Returns:
      FLOPs per step (a float).
    """
    tokens, seq = cfg.train.global_batch_size * cfg.train.seq_length, cfg.train.seq_length
    extra = (recompute_flops_per_token(cfg.model, seq, cfg.model.remat)
             + schedules.recomputed_forwards(cfg) * recompute_flops_per_token(cfg.model, seq, "full"))
    return flops_per_step(cfg, recompute=False) + tokens * extra


def megatron_flops_per_step(cfg) -> float:
    """:func:`flops_per_step` (model FLOPs, no recomputation) in Megatron-LM's convention, whose attention
    matmuls are not halved for the causal mask (``num_floating_point_operations`` in Megatron-LM's
    ``training.py``; Narayanan et al. 2021, eq. 3): ``6 * L * s * n * d`` more per token, ``n * d`` the
    query heads' width (``3 * L * s * n * (dq + dv)`` with multi-head latent attention's widths).  The basis of the
    Megatron-convention TFLOP/s and MFU in docs/performance.md."""
    m, seq = cfg.model, cfg.train.seq_length
    tokens = cfg.train.global_batch_size * seq
    layers = m.num_layers + m.mtp_num_layers
    return flops_per_step(cfg, recompute=False) + tokens * 3 * layers * seq * m.num_attention_heads * sum(
        m.attention_head_dims)


def hardware_flops_by_kind(cfg) -> dict[str, float]:
    """:func:`hardware_flops_per_step` split by the kernels that run them: ``attention`` (the score and value
    matmuls, forward, backward and recomputed), ``loss`` (the output layers' three matmuls, the
    multi-token prediction depths' too) and ``gemm``
    (every other layer matmul: projections and MLP, with their recomputation); FLOPs per step, all
    devices.  The basis of a profile's FLOP rates (:mod:`jaxllm.analysis.profile`)."""
    tokens, seq, m = cfg.train.global_batch_size * cfg.train.seq_length, cfg.train.seq_length, cfg.model
    stack = _stack_forward_flops(m, seq)
    attention_keys = ("scores", "values")
    forwards = schedules.recomputed_forwards(cfg)  # the 1F1B family's: one more forward of every matmul
    recomputed = [k for k in _RECOMPUTED[m.remat] if k in attention_keys]
    attention = ((3 + forwards) * sum(stack[k] for k in attention_keys) + sum(stack[k] for k in recomputed))
    loss = 3 * 2 * m.hidden_size * m.padded_vocab_size * (1 + m.mtp_num_layers)
    total = hardware_flops_per_step(cfg)
    return {"gemm": total - tokens * (attention + loss), "attention": tokens * attention, "loss": tokens * loss}


def throughput(step_time_s: float, cfg, *, num_devices: int, peak_flops: float) -> dict[str, float]:
    """Throughput of one training step.

    Args:
      step_time_s: wall time of the step, seconds.
      cfg: the resolved config (global batch, sequence length, model, ``model.remat``).
      num_devices: devices the step ran on.
      peak_flops: peak FLOP/s of one device (:func:`jaxllm.platform.hardware.peak_flops_per_device`).
    Returns:
      ``step_time_s``; ``tokens_per_sec`` (all devices) and ``tokens_per_sec_per_device``
      (tokens/s); ``tflops_per_device``: model TFLOP/s (1e12 FLOP/s) per device;
      ``mfu``: model FLOPs utilisation (model FLOP/s per device / peak, recomputation not
      counted); ``hfu``: hardware FLOPs utilisation (:func:`hardware_flops_per_step`: adds
      the matmuls ``model.remat`` recomputes; equals ``mfu`` for ``remat="none"``);
      ``megatron_tflops_per_device`` and ``megatron_mfu``: the same in Megatron-LM's FLOP convention
      (:func:`megatron_flops_per_step`). Fractions, not percent.
    """
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    model_flops = flops_per_step(cfg, recompute=False) / step_time_s / num_devices
    hardware_flops = hardware_flops_per_step(cfg) / step_time_s / num_devices
    megatron_flops = megatron_flops_per_step(cfg) / step_time_s / num_devices
    return {
        "step_time_s": float(step_time_s),
        "tokens_per_sec": tokens / step_time_s,
        "tokens_per_sec_per_device": tokens / step_time_s / num_devices,
        "tflops_per_device": model_flops / 1e12,
        "mfu": model_flops / peak_flops,
        "hfu": hardware_flops / peak_flops,
        "megatron_tflops_per_device": megatron_flops / 1e12,
        "megatron_mfu": megatron_flops / peak_flops,
    }


def step_figures(times, cfg, *, num_devices: int, peak_flops: float) -> dict[str, float]:
    """A benchmark record's figures of the timed steps ``times`` (seconds each) of ``cfg`` (``jaxllm.bench``
    and ``benchmarks/torch_reference.py`` write the same): :func:`throughput` of their mean, the median,
    fastest and slowest step (``step_time_median_s``, ``_min_s``, ``_max_s``), ``hardware_tflops_per_device``,
    ``model_flops_per_step`` and ``hardware_flops_per_step`` (FLOPs, all devices)."""
    out = throughput(sum(times) / len(times), cfg, num_devices=num_devices, peak_flops=peak_flops)
    ordered = sorted(times)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {**out, "step_time_median_s": float(median), "step_time_min_s": float(ordered[0]),
            "step_time_max_s": float(ordered[-1]), "hardware_tflops_per_device": out["hfu"] * peak_flops / 1e12,
            "model_flops_per_step": flops_per_step(cfg, recompute=False),
            "hardware_flops_per_step": hardware_flops_per_step(cfg)}
