"""Resolution: every check of a config and its derived sizes, once, above the library.

:func:`resolve` turns the :class:`~jaxllm.config.Config` that files and flags wrote into the
read-only :class:`~jaxllm.config.Resolved` one.  It is the one place that asks the model (its
logical axes), the rules table, the pipeline schedules, sequence parallelism, attention and the
backend what a config needs, so that :mod:`jaxllm.config` itself imports nothing of the library.
"""

import dataclasses
import math
import os

from jaxllm import config
from jaxllm.config import MESH_AXES, TYPE_NAMES, Config, Data, Mesh, Model, Resolved
from jaxllm.errors import ConfigError
from jaxllm.model import attention, gpt
from jaxllm.parallel import context_parallel, experts, pipeline, schedules, sharding
from jaxllm.platform import hardware

__all__ = ["layer_loop", "mesh_shape", "padded_vocab", "resolve", "resolve_dtype", "resolve_model"]

def _check_types_and_ranges(cfg: Config) -> None:
    for name, section in cfg.sections().items():
        for field in dataclasses.fields(section):
            if field.metadata.get("derived"):
                continue
            key, value = f"{name}.{field.name}", getattr(section, field.name)
            kind = field.type
            ok = (isinstance(value, kind) and not (kind is int and isinstance(value, bool))) or (
                kind is float and isinstance(value, int) and not isinstance(value, bool))
            if not ok:
                raise ConfigError(key, value, f"must be {TYPE_NAMES[kind]}")
            if kind is float:
                object.__setattr__(section, field.name, float(value))
            choices, check = field.metadata.get("choices"), field.metadata.get("check")
            if choices and value not in choices:
                raise ConfigError(key, value, f"choose one of {', '.join(map(str, choices))}")
            if check == ">0" and not value > 0:
                raise ConfigError(key, value, "must be > 0")
            if check == ">=0" and value < 0:
                raise ConfigError(key, value, "must be >= 0")


def _check_values(cfg: Config) -> None:
    """The checks that need no device count: types, choices, ranges, relations between keys."""
    _check_types_and_ranges(cfg)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    interleaved = p.pipeline_schedule.startswith("interleaved")
    if interleaved != (p.pipeline_virtual_stages > 1):
        raise ConfigError("parallel.pipeline_virtual_stages", p.pipeline_virtual_stages,
                          f"parallel.pipeline_schedule={p.pipeline_schedule} needs "
                          + (">= 2 virtual stages" if interleaved else "exactly 1")
                          + "; the interleaved schedules (interleaved, interleaved_1f1b) take >= 2, gpipe, 1f1b "
                          "and zb_h1 exactly 1")
    if m.multi_latent_attention:
        _check_mla(m)
    elif not m.kv_channels and m.hidden_size % m.num_attention_heads:
        raise ConfigError("model.hidden_size", m.hidden_size,
                          f"must be divisible by model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % (m.num_kv_heads or m.num_attention_heads):
        raise ConfigError("model.num_kv_heads", m.num_kv_heads,
                          f"must divide model.num_attention_heads={m.num_attention_heads}")
    if m.position_embedding == "rotary" and not m.multi_latent_attention and m.head_dim % 2:
        raise ConfigError("model.position_embedding", "rotary",
                          f"rotary needs an even head dim; model.kv_channels (0: hidden_size/num_attention_heads) "
                          f"gives {m.head_dim}")
    _check_attention_kinds(m)
    if m.rope_type == "yarn" and (m.position_embedding != "rotary" or m.use_rope_scaling):
        raise ConfigError("model.rope_type", "yarn", "YaRN scales rotary frequencies: it needs "
                          "model.position_embedding=rotary and not model.use_rope_scaling (another scaling)")
    if m.use_rope_scaling and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise ConfigError("model.rope_high_freq_factor", m.rope_high_freq_factor,
                          f"must exceed model.rope_low_freq_factor={m.rope_low_freq_factor} (Llama 3.1: 4 and 1)")
    if m.use_rope_scaling and m.position_embedding != "rotary":
        raise ConfigError("model.use_rope_scaling", True, "scales rotary frequencies: set "
                          "model.position_embedding=rotary, or model.use_rope_scaling=False")
    if m.position_embedding == "learned" and m.max_position_embeddings and m.max_position_embeddings < t.seq_length:
        raise ConfigError("model.max_position_embeddings", m.max_position_embeddings,
                          f"the learned position table must cover train.seq_length={t.seq_length}")
    if not m.dropout < 1.0:
        raise ConfigError("model.dropout", m.dropout, "must be in [0, 1)")
    if m.num_experts and m.moe_router_topk > m.num_experts:
        raise ConfigError("model.moe_router_topk", m.moe_router_topk,
                          f"must be <= model.num_experts={m.num_experts} (each token takes that many distinct experts)")
    _check_router(m)
    if m.num_experts and not any(m.moe_layers):  # moe_layers: the pattern's own errors
        raise ConfigError("model.moe_layer_freq", m.moe_layer_freq,
                          "names no mixture-of-experts layer: name at least one, or set model.num_experts=0")
    if not m.num_experts and m.moe_layer_freq != "1":
        raise ConfigError("model.moe_layer_freq", m.moe_layer_freq,
                          "places mixture-of-experts layers, but model.num_experts=0: set model.num_experts")
    if not m.num_experts and cfg.mesh.expert * cfg.mesh.dcn_expert > 1:
        raise ConfigError("mesh.expert", cfg.mesh.expert * cfg.mesh.dcn_expert,
                          "splits the experts' weights: set model.num_experts > 0, or mesh.expert=1")
    if cfg.log.samples and not cfg.log.sample_tokens:
        raise ConfigError("log.sample_tokens", 0, f"each of the log.samples={cfg.log.samples} end-of-run samples "
                          "needs at least 1 token; for no samples set log.samples=0")
    for key in ("beta1", "beta2", "sgd_momentum"):
        if not getattr(t, key) < 1.0:
            raise ConfigError(f"train.{key}", getattr(t, key), "must be in [0, 1)")
    if t.min_lr > t.lr:
        raise ConfigError("train.min_lr", t.min_lr, f"must be <= train.lr={t.lr}")
    _check_schedule(t)
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError("train.global_batch_size", t.global_batch_size,
                          f"must be divisible by train.micro_batch_size={t.micro_batch_size}")
    for key in [*MESH_AXES, *(f"dcn_{a}" for a in MESH_AXES)]:
        size = getattr(cfg.mesh, key)
        if not (size >= 1 or (size == -1 and key in MESH_AXES)):
            raise ConfigError(f"mesh.{key}", size, "must be an integer >= 1 (or -1 on one ICI axis: fill)")
    fill = [a for a in MESH_AXES if getattr(cfg.mesh, a) == -1]
    if len(fill) > 1:
        raise ConfigError(f"mesh.{fill[1]}", -1, f"only one mesh axis may be -1 (mesh.{fill[0]} is too)")


def _check_schedule(t) -> None:
    """The learning-rate schedule's keys agree (Megatron-LM's checks of its OptimizerParamScheduler)."""
    decay = t.lr_decay_iters or t.train_iters
    if t.lr_warmup_fraction:
        if t.warmup_iters:
            raise ConfigError("train.lr_warmup_fraction", t.lr_warmup_fraction,
                              f"train.warmup_iters={t.warmup_iters} sets the warmup too; set "
                              "--config.train.warmup_iters=0 to warm up over lr_warmup_fraction x lr_decay_iters "
                              "steps, or lr_warmup_fraction=0 (Megatron: one of --lr-warmup-fraction, "
                              "--lr-warmup-iters)")
        if not t.lr_warmup_fraction < 1.0:
            raise ConfigError("train.lr_warmup_fraction", t.lr_warmup_fraction,
                              "must be in [0, 1): the warmup is that fraction of train.lr_decay_iters")
    elif t.warmup_iters >= decay:
        raise ConfigError("train.warmup_iters", t.warmup_iters,
                          f"must be < train.lr_decay_iters (resolved: {decay}): the decay follows the warmup")
    if t.lr_decay_style == "WSD" and not 0 < t.lr_wsd_decay_iters <= decay:
        raise ConfigError("train.lr_wsd_decay_iters", t.lr_wsd_decay_iters,
                          f"train.lr_decay_style=WSD anneals over this many steps at the end of "
                          f"train.lr_decay_iters (resolved: {decay}): set it in [1, {decay}]")


def _check_data_files(d: Data) -> None:
    if not (d.input.strip() or d.file_list):
        raise ConfigError("data.input", d.input, "name text files or directories (comma-separated), or "
                          "indexed datasets as Megatron's --data-path: W1 PREFIX1 W2 PREFIX2 ...")
    if d.tokenizer not in ("char", "byte", "gpt2") and not os.path.exists(d.tokenizer):
        if os.sep in d.tokenizer or d.tokenizer.endswith((".json", ".model")):  # a path: the file is missing
            raise ConfigError("data.tokenizer", d.tokenizer, f"not found: no such file or directory "
                              f"{os.path.abspath(d.tokenizer)}; give the path of an existing Hugging Face "
                              f"tokenizer.json, SentencePiece tokenizer.model (or of a directory holding one)")
        megatron = {"gpt2bpetokenizer": "Megatron's GPT2BPETokenizer is gpt2 here; ",
                    "huggingfacetokenizer": "Megatron's HuggingFaceTokenizer is the tokenizer.json's path here; ",
                    "llama2tokenizer": "Megatron's Llama2Tokenizer is the tokenizer.model's path here; "}
        raise ConfigError("data.tokenizer", d.tokenizer, f"neither a tokenizer jaxllm knows nor an existing path; "
                          f"{megatron.get(d.tokenizer.lower(), '')}choose char, byte, gpt2, or the path of a Hugging "
                          f"Face tokenizer.json, a SentencePiece tokenizer.model (or of a local directory holding one)")
    if d.tokenizer == "gpt2" and d.gpt2_dir:  # empty: the files shipped with jaxllm
        for name in ("encoder.json", "vocab.bpe"):
            if not os.path.isfile(os.path.join(d.gpt2_dir, name)):
                raise ConfigError("data.gpt2_dir", d.gpt2_dir,
                                  f"must be a directory holding GPT-2's encoder.json and vocab.bpe ({name} missing), "
                                  f"or empty for the files shipped with jaxllm")


def mesh_shape(mesh: Mesh, num_devices: int) -> dict[str, int]:
    """Devices along each mesh axis (ICI x DCN), a -1 axis filled from ``num_devices``."""
    dcn = math.prod(getattr(mesh, f"dcn_{a}") for a in MESH_AXES)
    known = math.prod(getattr(mesh, a) for a in MESH_AXES if getattr(mesh, a) != -1)
    fill = max(1, num_devices // (dcn * known))
    return {a: (fill if getattr(mesh, a) == -1 else getattr(mesh, a)) * getattr(mesh, f"dcn_{a}") for a in MESH_AXES}


def _mesh_error(mesh: Mesh, num_devices: int, shape: dict[str, int]) -> ConfigError:
    """Why the mesh does not cover ``num_devices`` and what to set: the axis to change when it is one."""
    fill = [a for a in MESH_AXES if getattr(mesh, a) == -1]
    fixed = {k: v for k, v in mesh.devices().items() if v not in (1, -1)}
    product = math.prod(fixed.values())
    named = " x ".join(f"mesh.{k}={v}" for k, v in fixed.items())
    divisors = [n for n in range(1, num_devices + 1) if num_devices % n == 0]
    if fill:
        if len(fixed) == 1:
            (k, v), = fixed.items()
            near = max(n for n in divisors if n <= v)
            return ConfigError(f"mesh.{k}", v, f"does not divide the {num_devices} devices, so mesh.{fill[0]}=-1 "
                               f"cannot take the rest; give mesh.{k} a divisor of {num_devices} (e.g. mesh.{k}={near})")
        why = (f"{named} = {product} does not divide the {num_devices} devices, so mesh.{fill[0]}=-1 cannot take "
               f"the rest; make that product a divisor of {num_devices} ({', '.join(map(str, divisors))})")
    else:
        why = (f"the mesh covers {math.prod(shape.values())} devices but there are {num_devices}; make the product "
               f"of mesh.* x mesh.dcn_* equal {num_devices}, or set one axis to -1 to take what the others leave")
    return ConfigError("mesh", {a: getattr(mesh, a) for a in MESH_AXES}, why)


def padded_vocab(vocab_size: int, divisible_by: int, tensor: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by x tensor`` (the tensor-parallel size), as
    Megatron-LM pads (``_vocab_size_with_padding``): GPT-2's 50257 -> 50304 on one tensor device (128),
    50432 on 2 (256); with ``divisible_by`` 1, 65 characters -> 66 rows on 2.  The padded rows are zeros
    whose logits are masked, so the padding does not change the model (export writes the real rows only).
    """
    k = divisible_by * tensor
    return k * math.ceil(vocab_size / k)


def _ffn_size(m: Model) -> int:
    if m.ffn_hidden_size:
        return m.ffn_hidden_size
    return 64 * math.ceil(8 * m.hidden_size / 3 / 64) if m.activation != "gelu" else 4 * m.hidden_size


def layer_loop(backend: str, remat: str) -> str:
    """``model.layer_loop="auto"`` for ``backend`` (a :func:`jaxllm.platform.hardware.backend_kind`):
    ``"unrolled"`` on CPUs and NVIDIA GPUs without remat (XLA zero-fills a scan's stacked activations and copies
    them every step: on an H200 GPT125M's step ran 1.22x faster written out, measured on 2026-11-27; GPT1_5B's is
    predicted 0.30 s against 0.38 s scanned, in 11 GiB less, docs/performance.md), else ``"scan"`` (with remat a
    scan's loop bounds what is live, and XLA:CPU would keep every unrolled layer's recomputed activations; a scan
    compiles in a time independent of depth)."""
    return "unrolled" if backend in ("cpu", "cuda") and remat == "none" else "scan"


def resolve_dtype(dtype: str, backend: str | None = None) -> str:
    """``model.dtype`` as the backend runs it: ``"auto"`` is float32 on CPUs, bfloat16 elsewhere.

    Args:
      backend: the JAX backend or its kind (:func:`jaxllm.platform.hardware.backend_kind`); None: the default.
    """
    if dtype != "auto":
        return dtype
    return "float32" if hardware.backend_kind(backend) == "cpu" else "bfloat16"


def resolve_model(m: Model, *, seq_length: int, vocab_size: int | None = None, tensor: int = 1,
                  backend: str | None = None) -> Model:
    """A copy of the ``model`` section with its derived sizes filled in (what tools that only need
    the model use, e.g. to sample from or export a checkpoint; :func:`resolve` calls it too).

    Args:
      m: the section; seq_length: ``train.seq_length`` (the learned position table's default size).
      vocab_size: the tokenizer's vocabulary (needed when ``m.vocab_size`` is 0; None: not known yet).
      tensor: devices along the tensor axis (the tables are padded to a multiple of it).
      backend: where the model runs, for ``dtype="auto"`` (:func:`resolve_dtype`), ``layer_loop="auto"`` and
        ``attention_impl="auto"`` (:func:`jaxllm.model.attention.resolve_impl`); None: the default backend.
    Raises:
      ConfigError: ``m.vocab_size`` is smaller than the tokenizer's vocabulary; ``m.pad_token_id`` is no token of
        the vocabulary, nor -1.
    """
    m = dataclasses.replace(m)  # a copy that may be written, also of a resolved (read-only) section
    m.num_kv_heads = m.num_kv_heads or m.num_attention_heads
    m.ffn_hidden_size = _ffn_size(m)
    m.moe_ffn_hidden_size = m.moe_ffn_hidden_size or m.ffn_hidden_size
    m.dtype = resolve_dtype(m.dtype, backend)
    if m.layer_loop == "auto":
        m.layer_loop = layer_loop(hardware.backend_kind(backend), m.remat)
    if m.attention_impl == "auto":  # decided here once: the model binds the concrete one (attention.implementation)
        m.attention_impl = attention.model_impl(m, backend)
    m.max_position_embeddings = m.max_position_embeddings or seq_length
    if vocab_size is not None and m.vocab_size and m.vocab_size < vocab_size:
        raise ConfigError("model.vocab_size", m.vocab_size,
                          f"the tokenizer has {vocab_size} tokens; set it to >= {vocab_size} or to 0 (the tokenizer's)")
    m.vocab_size = m.vocab_size or vocab_size or 0
    if m.pad_token_id < -1 or (m.vocab_size and m.pad_token_id >= m.vocab_size):
        raise ConfigError("model.pad_token_id", m.pad_token_id, "must be a token id, 0 to model.vocab_size - 1"
                          + (f" = {m.vocab_size - 1}" if m.vocab_size else "") + ", or -1 (no padding row)")
    m.padded_vocab_size = padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, tensor)
    m._freeze()
    return m


def _check_documents(cfg: Resolved) -> None:
    """Megatron's document options run on every mesh axis but ``pipeline`` (its schedules take one
    set of positions for all microbatches, and no segment ids or loss mask yet).  ``data.max_documents_per_sample``
    is at most ``train.seq_length``.

    Raises:
      ConfigError: one of the options with ``mesh.pipeline`` (ICI x DCN) > 1; ``data.max_documents_per_sample``
        above ``train.seq_length``.
    """
    bound, seq = cfg.data.max_documents_per_sample, cfg.train.seq_length
    if bound > seq:
        raise ConfigError("data.max_documents_per_sample", bound, f"a sample of train.seq_length={seq} tokens holds "
                          f"at most {seq} documents; set it to <= {seq} (0: no bound)")
    on = [key for key in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(cfg.data, key)]
    if on and cfg.stages > 1:
        raise ConfigError(f"data.{on[0]}", True, f"not supported with pipeline parallelism yet (mesh.pipeline over "
                          f"{cfg.stages} devices); set mesh.pipeline=1 (use the data, fsdp, tensor and sequence "
                          f"axes) or turn data.{on[0]} off")


def _check_fp8(cfg: Resolved, backend: str | None) -> None:
    """``model.fp8`` needs FP8 matmuls on the backend, and a schedule whose weight gradients go through them.

    Raises:
      ConfigError: the backend's devices have no FP8 matmuls; ``parallel.pipeline_schedule=zb_h1``
        (its split backward computes the weight gradients with plain matmuls).
    """
    if not cfg.model.fp8:
        return
    why = hardware.fp8_unsupported(backend)
    if why:
        raise ConfigError("model.fp8", True, f"{why}; set model.fp8=False")
    if cfg.stages > 1 and cfg.parallel.pipeline_schedule == "zb_h1":
        raise ConfigError("model.fp8", True, "zb_h1 computes the weight gradients outside the FP8 matmuls; use "
                          "parallel.pipeline_schedule=1f1b (or interleaved_1f1b), or model.fp8=False")


def _check_mtp(cfg: Resolved) -> None:
    """Multi-token prediction runs with the gpipe and interleaved pipeline schedules (after the forward loop, as the
    output loss: :func:`jaxllm.parallel.pipeline.loss`), of dense layers there (the forward loop detaches a router's
    loss from the layer), and without ring attention (whose reordered sequence the depths' roll to the next token
    does not follow).

    Raises:
      ConfigError: ``model.mtp_num_layers`` > 0 with ``mesh.pipeline`` (ICI x DCN) > 1 and a 1F1B-family schedule or
        mixture-of-experts last layers, or with ``parallel.sequence_impl`` ring or usp over more than one ring device.
    """
    m, p = cfg.model, cfg.parallel
    if not m.mtp_num_layers:
        return
    if cfg.stages > 1 and (p.pipeline_schedule in schedules.FUSED or m.moe_layers[-1]):
        why = (f"parallel.pipeline_schedule={p.pipeline_schedule}: its loop computes no multi-token prediction yet; "
               f"use gpipe or interleaved" if p.pipeline_schedule in schedules.FUSED else
               "its layers would be mixtures of experts, whose router loss the pipeline's forward loop detaches")
        raise ConfigError("model.mtp_num_layers", m.mtp_num_layers, f"not supported with pipeline parallelism (mesh."
                          f"pipeline over {cfg.stages} devices) and {why}, or set mesh.pipeline=1 or "
                          f"model.mtp_num_layers=0")
    length = math.prod(cfg.mesh_shape[a] for a in sharding.rules(cfg)["length"])
    if context_parallel.groups(p.sequence_impl, length, p.ulysses_degree)[1] > 1:
        raise ConfigError("model.mtp_num_layers", m.mtp_num_layers, f"not supported with ring attention "
                          f"(parallel.sequence_impl={p.sequence_impl} over {length} sequence devices) yet: its "
                          f"reordered sequence breaks the roll to the next token; use parallel.sequence_impl="
                          f"ulysses or allgather, or model.mtp_num_layers=0")


def _check_offload(cfg: Resolved, backend: str | None) -> None:
    remat = cfg.model.remat
    why = (remat == "offload" or remat.endswith("_offloaded")) and hardware.host_offload_unsupported(backend)
    if why:
        raise ConfigError("model.remat", remat, f"{why}; use model.remat=full (or a policy without offloading)")


def _check_mlp_chunks(cfg) -> None:
    """``model.mlp_chunks`` must divide each device's share of the sequence (chunks are local)."""
    chunks, n = cfg.model.mlp_chunks, math.prod(cfg.mesh_shape[a] for a in sharding.rules(cfg)["length"])
    if (cfg.train.seq_length // n) % chunks:
        raise ConfigError("model.mlp_chunks", chunks,
                          f"must divide the tokens of each sequence device, train.seq_length / mesh.sequence = "
                          f"{cfg.train.seq_length} / {n} = {cfg.train.seq_length // n}")


def _check_attention_kinds(m: Model) -> None:
    """The keys of layers' own attention (Gemma 3's local and global layers) and of the scalings.

    Raises:
      ConfigError: ``model.window_attn_skip_freq`` or ``model.local_rotary_base`` without a window (or a pattern that
        names no layers); a linear scaling (``model.rotary_seq_len_interpolation_factor``) with another; ``geglu``
        with experts (their gate is SiLU's); quick GeGLU's offset or clamp with another activation.
    """
    for key, value in (("window_attn_skip_freq", m.window_attn_skip_freq), ("local_rotary_base", m.local_rotary_base)):
        if value and not m.sliding_window:
            raise ConfigError(f"model.{key}", value, "applies to the layers with a window: set model.sliding_window")
    m.window_layers  # noqa: B018  (raises ConfigError for a pattern that names no layers)
    if m.rotary_seq_len_interpolation_factor != 1 and (m.use_rope_scaling or m.rope_type == "yarn"):
        raise ConfigError("model.rotary_seq_len_interpolation_factor", m.rotary_seq_len_interpolation_factor,
                          "is a scaling of its own: set 1, or model.use_rope_scaling=False and model.rope_type=rope")
    if m.activation == "geglu" and m.num_experts:
        raise ConfigError("model.activation", "geglu", "the experts' gated activation is SiLU's: set swiglu, or "
                          "model.num_experts=0")
    for key in ("glu_linear_offset", "activation_func_clamp_value"):
        if getattr(m, key) and m.activation != "quick_geglu":
            raise ConfigError(f"model.{key}", getattr(m, key), "applies to model.activation=quick_geglu only")


def _check_mla(m: Model) -> None:
    """Multi-head latent attention's keys agree with the rest of the model (what ``layers.LatentAttention`` builds).

    Raises:
      ConfigError: positions other than rotary (its decoupled key is rotary), an odd ``qk_pos_emb_head_dim``,
        ``num_kv_heads`` other than the query heads (its keys and values are per head), or the options of the
        ordinary projections (``qk_layernorm``, ``add_qkv_bias``, ``use_bias``), which MLA has not.
    """
    if m.position_embedding != "rotary":
        raise ConfigError("model.multi_latent_attention", True, "its decoupled query/key part is rotary: set "
                          "model.position_embedding=rotary")
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError("model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim, "rotary needs an even width")
    if m.num_kv_heads not in (0, m.num_attention_heads):
        raise ConfigError("model.num_kv_heads", m.num_kv_heads, "multi-head latent attention decompresses keys and "
                          "values for every query head: set 0 (= model.num_attention_heads)")
    for key in ("qk_layernorm", "add_qkv_bias", "use_bias"):
        if getattr(m, key):
            raise ConfigError(f"model.{key}", True, f"multi-head latent attention (DeepSeek's, Megatron-LM's) has no "
                              f"{key}: set model.{key}=False, or model.multi_latent_attention=False")


def _check_router(m: Model) -> None:
    """The router's options agree with each other (Megatron-LM's ``validate_args``)."""
    groups, group_topk, k = m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk
    if bool(groups) != bool(group_topk):
        key, value = ("model.moe_router_group_topk", group_topk) if groups else ("model.moe_router_num_groups", groups)
        raise ConfigError(key, value, "group-limited routing needs both model.moe_router_num_groups and "
                          "model.moe_router_group_topk > 0 (or both 0: no groups)")
    if groups and (m.num_experts % groups or group_topk > groups or k % group_topk or k > group_topk * (
            m.num_experts // groups)):
        raise ConfigError("model.moe_router_group_topk", group_topk,
                          f"needs model.num_experts={m.num_experts} divisible by model.moe_router_num_groups={groups}, "
                          f"moe_router_group_topk <= the groups, and model.moe_router_topk={k} divisible by it and "
                          f"no more than the experts of the chosen groups")
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        raise ConfigError("model.moe_router_pre_softmax", True, "applies to model.moe_router_score_function=softmax")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError("model.moe_router_enable_expert_bias", True, "biases sigmoid scores (as Megatron-LM's): "
                          "set model.moe_router_score_function=sigmoid")


def _check_moe(cfg) -> None:
    """What the rules table's sizes do not cover for a mixture of experts: the shared expert's hidden size
    splits over the MLP's axes, and ``model.mlp_chunks`` chunks only the dense MLP."""
    m = cfg.model
    if not m.num_experts:
        return
    n = math.prod(cfg.mesh_shape[a] for a in sharding.rules(cfg)["mlp"])
    if m.moe_shared_expert_intermediate_size % n:
        raise ConfigError("model.moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size,
                          f"must be divisible by mesh.tensor = {n} (the shared expert is a tensor-parallel MLP)")
    if m.mlp_chunks > 1:
        raise ConfigError("model.mlp_chunks", m.mlp_chunks, "chunks the dense MLP only; with model.num_experts > 0 "
                          "set it to 1")


def resolve(spec: Config, *, num_devices: int | None, vocab_size: int | None = None,
            backend: str | None = None, data_files: bool = True) -> Resolved:
    """Checks every value of ``spec`` and returns the read-only :class:`Resolved` config.

    Args:
      spec: the config as files and flags wrote it (not changed).
      num_devices: devices the mesh must cover (``jax.device_count()``); None: the mesh as written
        (a -1 axis counted as 1), for tools that need no devices.
      vocab_size: the tokenizer's vocabulary; needed when ``model.vocab_size`` is 0. None when not
        known yet (a check before the data is read): ``model.padded_vocab_size`` is then 0.
      backend: the JAX backend (kind) the run is for: the attention implementation must run on it, and
        ``model.dtype``, ``model.layer_loop`` and ``model.attention_impl`` ``"auto"`` resolve for it; None: the
        default.
      data_files: check that the data section names input and tokenizer files that exist; False for
        tools that read no data (planning, benchmarks on synthetic batches).
    Raises:
      ConfigError: the first bad value: its key, the value and the fix.
    """
    cfg = config.from_dict(spec.to_dict())  # a copy that may be written, also of a resolved config
    _check_values(cfg)
    if data_files:
        _check_data_files(cfg.data)
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    if num_devices is None:
        num_devices = math.prod(abs(n) for n in mesh.devices().values())
    shape = mesh_shape(mesh, num_devices)
    if math.prod(shape.values()) != num_devices:
        raise _mesh_error(mesh, num_devices, shape)
    for a in MESH_AXES:
        if getattr(mesh, a) == -1:
            setattr(mesh, a, shape[a] // getattr(mesh, f"dcn_{a}"))
    if cfg.parallel.sequence_impl == "usp" and not cfg.parallel.ulysses_degree:
        cfg.parallel.ulysses_degree = mesh.sequence  # the all-to-all inside a node, the ring across nodes
    if mesh.expert_tensor not in (0, 1, shape["tensor"]):
        raise ConfigError("mesh.expert_tensor", mesh.expert_tensor,
                          f"the experts split over all {shape['tensor']} tensor devices (0 or {shape['tensor']}) or "
                          "none (1), not a part of them (that would split the tensor mesh axis in two): set 0 or 1")
    if m.num_experts:  # "auto" decided once, for the mesh and the micro batch (experts.choose)
        table = sharding.rules(cfg)
        split = lambda names: math.prod(shape[a] for a in table[names])  # noqa: E731
        micro_tokens = t.micro_batch_size * split("batch") * t.seq_length
        m.moe_token_dispatcher_type = experts.choose(
            m.moe_token_dispatcher_type, tokens=micro_tokens // (split("batch") * split("expert_length")),
            micro_tokens=micro_tokens, experts=m.num_experts, expert_size=split("experts"), topk=m.moe_router_topk,
            capacity_factor=m.moe_capacity_factor)
    cfg.model = m = resolve_model(m, seq_length=t.seq_length, vocab_size=vocab_size, tensor=shape["tensor"],
                                  backend=backend)
    t.lr_decay_iters = t.lr_decay_iters or t.train_iters
    t.optimizer = config.OPTIMIZER_ALIASES.get(t.optimizer, t.optimizer)
    batch_axes = sharding.RULES["batch"]  # the data-parallel axes: those the rules table splits the batch over
    data_parallel = math.prod(shape[a] for a in batch_axes)
    if t.global_batch_size % (t.micro_batch_size * data_parallel):
        raise ConfigError(
            "train.global_batch_size", t.global_batch_size,
            f"must be divisible by train.micro_batch_size x data-parallel size (mesh {' x '.join(batch_axes)}) "
            f"= {t.micro_batch_size} x {data_parallel} = {t.micro_batch_size * data_parallel}")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)}
    microbatches = t.global_batch_size // (t.micro_batch_size * data_parallel)
    out = Resolved(**fields, backend=hardware.backend_kind(backend), num_devices=num_devices, mesh_shape=shape,
                   data_parallel=data_parallel,
                   microbatches=microbatches, stages=shape["pipeline"],
                   batch_shape=(microbatches, t.micro_batch_size * data_parallel, t.seq_length))
    _check_documents(out)
    pipeline.check(out)  # the layers before the microbatches, as the one check of both was
    schedules.check(out)
    sharding.check(out, gpt.logical_sizes(out.model, t.seq_length))
    context_parallel.check(out)
    _check_mlp_chunks(out)
    _check_moe(out)
    attention.check_config(out, backend)
    _check_fp8(out, backend)
    _check_offload(out, backend)
    _check_mtp(out)
    for section in out.sections().values():
        section._freeze()
    out._freeze()
    return out
