"""The configuration schema: every key, its default and its check, in one place.

A config file (``configs/*.py``) starts from :func:`get_config` and changes what
it needs; ``--config.SECTION.KEY=VALUE`` flags change the rest.  This file is
itself a valid config file: it is what ``python -m jaxllm.train`` runs with no
``--config`` (a small byte-level GPT on the Python standard library's sources).

Sections: ``model``, ``train``, ``data``, ``mesh``, ``parallel``,
``checkpoint``, ``log``.  A value of 0 for a size means "derived" (see the
comment beside it); :func:`validate` resolves nothing, it only checks, and
:func:`resolved` fills the derived values.
"""

from __future__ import annotations

import math
import os
import sysconfig

import ml_collections

MESH_AXES = ("data", "fsdp", "pipeline", "tensor", "sequence")

CHOICES = {
    "model.position_embedding": ("learned", "rotary"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.remat": ("none", "full", "save_dots"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attention_impl": ("auto", "xla", "cudnn", "pallas", "triton"),
    "data.sampling": ("megatron", "uniform"),
    "parallel.zero_stage": (0, 1, 2, 3),
    "parallel.pipeline_schedule": ("gpipe", "interleaved"),
    "parallel.sequence_impl": ("allgather", "ring", "ulysses"),
}


def default_corpus() -> str:
    """The running interpreter's standard library directory (its ``.py`` files are the default corpus)."""
    return sysconfig.get_paths()["stdlib"]


def get_config() -> ml_collections.ConfigDict:
    """Every default of jaxllm. Returns a ConfigDict with the seven sections."""
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict(
        dict(
            num_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            num_kv_heads=0,  # 0: = num_attention_heads (multi-head attention)
            ffn_hidden_size=0,  # 0: 4 * hidden_size (gelu) or 8/3 * hidden_size rounded to 64 (swiglu)
            vocab_size=0,  # 0: the tokenizer's vocabulary, padded to make_vocab_size_divisible_by
            make_vocab_size_divisible_by=128,  # Megatron-LM's padding, so that vocab shards evenly
            position_embedding="learned",
            rotary_base=10000.0,
            norm="layernorm",
            norm_eps=1e-5,
            activation="gelu",
            use_bias=True,
            tie_embeddings=True,
            dropout=0.0,
            init_std=0.02,
            remat="none",
            dtype="bfloat16",  # compute dtype; parameters are always float32
            attention_impl="xla",
        )
    )
    c.train = ml_collections.ConfigDict(
        dict(
            seq_length=128,
            micro_batch_size=16,
            global_batch_size=16,
            train_iters=400,
            lr=2e-3,
            min_lr=2e-4,
            warmup_iters=40,
            lr_decay_iters=0,  # 0: = train_iters
            weight_decay=0.1,
            beta1=0.9,
            beta2=0.95,
            adam_eps=1e-8,
            grad_clip=1.0,
            seed=1234,
            eval_interval=100,
            eval_iters=10,
            log_interval=20,
            # consecutive steps with a non-finite loss or gradient norm (each skipped: no update)
            # after which the run stops with an error; a diverged run rarely recovers
            max_nonfinite_steps=10,
        )
    )
    # docs/data.md: the inputs, the Megatron-LM option each key stands for
    c.data = ml_collections.ConfigDict(
        dict(
            # text files/directories (comma-separated; prepared into WORKDIR/data), or Megatron's
            # --data-path: "W1 PREFIX1 W2 PREFIX2 ..." or "PREFIX" (indexed datasets PREFIX.bin/.idx)
            input=default_corpus(),
            file_list="",  # an ALCF data-file list ("weight prefix corpus" lines); when set, replaces input
            tokenizer="byte",  # char, byte, gpt2, or a Hugging Face tokenizer.json (or a directory holding one)
            gpt2_dir="",  # directory with GPT-2's encoder.json and vocab.bpe (tokenizer=gpt2)
            json_key="text",  # text inputs: the text's key in JSON Lines records / column in Parquet files
            document_marker="",  # text inputs: a line starting with this begins a new document ("": one per file)
            split="969,30,1",  # Megatron's --split: train, validation, test weights
            sampling="megatron",  # megatron: GPTDataset/BlendedDataset order; uniform: nanoGPT's random windows
            cache_dir="",  # sample indices (Megatron's --data-cache-path); "": index-cache/ beside the data
            reset_position_ids=False,  # positions restart after each end-of-document token
            reset_attention_mask=False,  # attention stays within documents (segment ids)
            eod_mask_loss=False,  # no loss where the input is the end-of-document token
        )
    )
    # mesh.AXIS: devices along AXIS within a node (-1 on one axis: fill with what is left);
    # mesh.dcn_AXIS: nodes along AXIS (the slow network); the axis spans AXIS x dcn_AXIS devices.
    c.mesh = ml_collections.ConfigDict({**{a: 1 for a in MESH_AXES}, **{f"dcn_{a}": 1 for a in MESH_AXES}})
    c.parallel = ml_collections.ConfigDict(
        dict(
            zero_stage=0,
            megatron_sp=False,
            # with mesh.pipeline > 1 the step's microbatches (global batch / (micro batch x
            # data-parallel size)) flow through the stages; interleaved: the circular schedule
            # with pipeline_virtual_stages chunks of layers per device
            pipeline_schedule="gpipe",
            pipeline_virtual_stages=1,
            # attention with mesh.sequence > 1: allgather (keys/values gathered), ring (context
            # parallelism, load-balanced), ulysses (all-to-all to heads)
            sequence_impl="allgather",
        )
    )
    c.checkpoint = ml_collections.ConfigDict(
        dict(
            interval=0,  # steps between saves; 0: only at the end
            keep=2,  # most recent checkpoints kept
            keep_period=0,  # also keep every checkpoint whose step is a multiple of this; 0: off
        )
    )
    c.log = ml_collections.ConfigDict(
        dict(
            tensorboard=True,
            progress_bar=True,  # only drawn when stdout is a terminal
            samples=1,  # text samples printed at the end of training
            sample_tokens=256,
            sample_prompt="",  # "": the first tokens of the validation split
            temperature=0.8,
            top_k=200,
        )
    )
    return c


class ConfigError(ValueError):
    """A config value that cannot work: names the key, the value and the fix."""

    def __init__(self, key: str, value, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"config error: {key}={value!r}: {fix}")


def _get(cfg, key):
    section, name = key.split(".")
    return cfg[section][name]


def _resolve_heads(m) -> int:
    return m.num_kv_heads or m.num_attention_heads


def _resolve_ffn(m) -> int:
    if m.ffn_hidden_size:
        return m.ffn_hidden_size
    return 64 * math.ceil(8 * m.hidden_size / 3 / 64) if m.activation == "swiglu" else 4 * m.hidden_size


def resolved(cfg: ml_collections.ConfigDict, vocab_size: int | None = None,
             num_devices: int | None = None) -> ml_collections.ConfigDict:
    """A copy of ``cfg`` with every derived (0) value filled in.

    Args:
      cfg: a config that passed :func:`validate`.
      vocab_size: the tokenizer's vocabulary size; needed when ``model.vocab_size`` is 0.
      num_devices: fills a -1 mesh axis (default: ``jax.device_count()`` when one is -1).
    Raises:
      ConfigError: ``model.vocab_size`` is smaller than the tokenizer's vocabulary.
    """
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    m, t = cfg.model, cfg.train
    if any(cfg.mesh[a] == -1 for a in MESH_AXES):
        if num_devices is None:
            import jax  # noqa: PLC0415  (only needed to fill a -1 axis)

            num_devices = jax.device_count()
        sizes = mesh_shape(cfg, num_devices)
        for a in MESH_AXES:
            if cfg.mesh[a] == -1:
                cfg.mesh[a] = sizes[a] // cfg.mesh[f"dcn_{a}"]
    m.num_kv_heads = _resolve_heads(m)
    m.ffn_hidden_size = _resolve_ffn(m)
    if vocab_size is not None:
        if not m.vocab_size:
            k = m.make_vocab_size_divisible_by * cfg.mesh.tensor * cfg.mesh.dcn_tensor
            m.vocab_size = k * math.ceil(vocab_size / k)
        elif m.vocab_size < vocab_size:
            raise ConfigError(
                "model.vocab_size",
                m.vocab_size,
                f"the tokenizer has {vocab_size} tokens; set it to >= {vocab_size} or to 0 (derive it)",
            )
    t.lr_decay_iters = t.lr_decay_iters or t.train_iters
    return cfg


def mesh_shape(cfg, num_devices: int) -> dict[str, int]:
    """Devices along each mesh axis (ICI x DCN), with a -1 axis filled from ``num_devices``."""
    dcn = math.prod(cfg.mesh[f"dcn_{a}"] for a in MESH_AXES)
    known = math.prod(cfg.mesh[a] for a in MESH_AXES if cfg.mesh[a] != -1)
    fill = max(1, num_devices // (dcn * known))
    return {a: (fill if cfg.mesh[a] == -1 else cfg.mesh[a]) * cfg.mesh[f"dcn_{a}"] for a in MESH_AXES}


def data_parallel_size(cfg) -> int:
    """Number of model replicas the global batch is split over: the ``data`` x ``fsdp`` axes
    (of a resolved config, where no axis is -1)."""
    return cfg.mesh.data * cfg.mesh.dcn_data * cfg.mesh.fsdp * cfg.mesh.dcn_fsdp


def _check_divisibility(cfg, sizes):
    """Every mesh axis must divide the dimensions it shards (see ``jaxllm.sharding.rules``)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    kv = _resolve_heads(m)
    tensor, fsdp, dp = sizes["tensor"], sizes["fsdp"], sizes["data"] * sizes["fsdp"]
    needs = [
        ("model.num_attention_heads", m.num_attention_heads, tensor, "mesh.tensor"),
        ("model.num_kv_heads", kv, tensor, "mesh.tensor"),
        ("model.ffn_hidden_size", _resolve_ffn(m), tensor, "mesh.tensor"),
        ("model.vocab_size", m.vocab_size, tensor, "mesh.tensor"),
        ("model.hidden_size", m.hidden_size, fsdp * (sizes["data"] if p.zero_stage >= 1 else 1),
         "mesh.fsdp x mesh.data (ZeRO shards the embed dimension over both)" if p.zero_stage >= 1 else "mesh.fsdp"),
        ("train.seq_length", t.seq_length, sizes["sequence"] * (tensor if p.megatron_sp else 1),
         "mesh.sequence x mesh.tensor (megatron_sp)" if p.megatron_sp else "mesh.sequence"),
    ]
    seq = sizes["sequence"]
    if seq > 1 and p.sequence_impl == "ring":  # zigzag order: 2 chunks per sequence device
        needs.append(("train.seq_length", t.seq_length, 2 * seq,
                      "2 x mesh.sequence (parallel.sequence_impl=ring cuts the sequence into 2 chunks per device)"))
    if seq > 1 and p.sequence_impl == "ulysses":  # the all-to-all splits each tensor shard's heads over sequence
        why = "mesh.tensor x mesh.sequence (parallel.sequence_impl=ulysses splits each tensor shard's heads over sequence)"
        needs += [("model.num_attention_heads", m.num_attention_heads, tensor * seq, why),
                  ("model.num_kv_heads", kv, tensor * seq, why)]
    for key, value, size, axis in needs:
        if value and value % size:
            raise ConfigError(key, value, f"must be divisible by {axis} = {size}")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            "train.global_batch_size", t.global_batch_size,
            f"must be divisible by train.micro_batch_size x data-parallel size (mesh data x fsdp) "
            f"= {t.micro_batch_size} x {dp} = {t.micro_batch_size * dp}")
    stages, virtual = sizes["pipeline"], p.pipeline_virtual_stages
    if m.num_layers % (stages * virtual):
        raise ConfigError("model.num_layers", m.num_layers,
                          f"must be divisible by pipeline stages x virtual stages (mesh.pipeline x "
                          f"parallel.pipeline_virtual_stages) = {stages} x {virtual} = {stages * virtual}")
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    if stages > 1 and microbatches % stages:
        raise ConfigError(
            "train.global_batch_size", t.global_batch_size,
            f"gives {microbatches} microbatches (global batch / (micro batch {t.micro_batch_size} x data-parallel "
            f"size {dp})), which must be a multiple of the {stages} pipeline stages; use a global batch that is a "
            f"multiple of {t.micro_batch_size * dp * stages}, or a smaller train.micro_batch_size")


def grad_accum_steps(cfg) -> int:
    """Micro batches per step on each replica: global batch / (micro batch x data-parallel size)."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_parallel_size(cfg))


def validate(cfg: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Checks the whole config before anything is built or compiled.

    Args:
      cfg: the config.
      num_devices: devices the mesh must cover (``jax.device_count()``); None skips that check.
    Raises:
      ConfigError: the first bad value, with its key and the fix.
    """
    for key, options in CHOICES.items():
        if _get(cfg, key) not in options:
            raise ConfigError(key, _get(cfg, key), f"choose one of {', '.join(map(str, options))}")

    def positive(key):
        if not (isinstance(_get(cfg, key), (int, float)) and _get(cfg, key) > 0):
            raise ConfigError(key, _get(cfg, key), "must be > 0")

    def non_negative(key):
        if _get(cfg, key) < 0:
            raise ConfigError(key, _get(cfg, key), "must be >= 0")

    m, t = cfg.model, cfg.train
    for key in ("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.init_std",
                "model.norm_eps", "train.seq_length", "train.micro_batch_size", "train.global_batch_size",
                "train.train_iters", "train.lr", "train.eval_iters", "train.log_interval", "train.adam_eps",
                "train.max_nonfinite_steps"):
        positive(key)
    for key in ("model.num_kv_heads", "model.ffn_hidden_size", "model.vocab_size", "train.min_lr",
                "train.warmup_iters", "train.lr_decay_iters", "train.weight_decay", "train.grad_clip",
                "train.eval_interval", "checkpoint.interval", "checkpoint.keep_period", "log.samples", "log.sample_tokens", "log.top_k"):
        non_negative(key)
    positive("model.make_vocab_size_divisible_by")
    positive("parallel.pipeline_virtual_stages")
    interleaved = cfg.parallel.pipeline_schedule == "interleaved"
    if interleaved != (cfg.parallel.pipeline_virtual_stages > 1):
        raise ConfigError("parallel.pipeline_virtual_stages", cfg.parallel.pipeline_virtual_stages,
                          "the interleaved schedule needs >= 2 virtual stages, gpipe exactly 1: set "
                          "parallel.pipeline_schedule=interleaved with pipeline_virtual_stages >= 2, or gpipe with 1")
    positive("checkpoint.keep")

    if m.hidden_size % m.num_attention_heads:
        raise ConfigError("model.hidden_size", m.hidden_size,
                          f"must be divisible by model.num_attention_heads={m.num_attention_heads}")
    kv = _resolve_heads(m)
    if m.num_attention_heads % kv:
        raise ConfigError("model.num_kv_heads", m.num_kv_heads,
                          f"must divide model.num_attention_heads={m.num_attention_heads}")
    head_dim = m.hidden_size // m.num_attention_heads
    if m.position_embedding == "rotary" and head_dim % 2:
        raise ConfigError("model.position_embedding", "rotary",
                          f"rotary needs an even head dim; hidden_size/num_attention_heads is {head_dim}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout", m.dropout, "must be in [0, 1)")
    if not 0.0 <= t.beta1 < 1.0 or not 0.0 <= t.beta2 < 1.0:
        raise ConfigError("train.beta1" if not 0 <= t.beta1 < 1 else "train.beta2",
                          t.beta1 if not 0 <= t.beta1 < 1 else t.beta2, "must be in [0, 1)")
    if t.min_lr > t.lr:
        raise ConfigError("train.min_lr", t.min_lr, f"must be <= train.lr={t.lr}")
    decay = t.lr_decay_iters or t.train_iters
    if t.warmup_iters > decay:
        raise ConfigError("train.warmup_iters", t.warmup_iters,
                          f"must be <= train.lr_decay_iters (resolved: {decay})")

    for key in [*MESH_AXES, *(f"dcn_{a}" for a in MESH_AXES)]:
        size = cfg.mesh[key]
        if not isinstance(size, int) or not (size >= 1 or (size == -1 and key in MESH_AXES)):
            raise ConfigError(f"mesh.{key}", size, "must be an integer >= 1 (or -1 on one ICI axis: fill)")
    fill = [a for a in MESH_AXES if cfg.mesh[a] == -1]
    if len(fill) > 1:
        raise ConfigError(f"mesh.{fill[1]}", -1, f"only one mesh axis may be -1 (mesh.{fill[0]} is too)")
    if num_devices is not None:
        sizes = mesh_shape(cfg, num_devices)
        if math.prod(sizes.values()) != num_devices:
            raise ConfigError("mesh", {a: cfg.mesh[a] for a in MESH_AXES},
                              f"the mesh covers {math.prod(sizes.values())} devices but there are {num_devices}; "
                              f"make the product of mesh.* x mesh.dcn_* equal {num_devices}, or set one axis to -1")
        _check_divisibility(cfg, sizes)

    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError("train.global_batch_size", t.global_batch_size,
                          f"must be divisible by train.micro_batch_size={t.micro_batch_size}")

    if not (cfg.data.input.strip() or cfg.data.file_list):
        raise ConfigError("data.input", cfg.data.input, "name text files or directories (comma-separated), or "
                          "indexed datasets as Megatron's --data-path: W1 PREFIX1 W2 PREFIX2 ...")
    if cfg.data.tokenizer not in ("char", "byte", "gpt2") and not os.path.exists(cfg.data.tokenizer):
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, "choose char, byte, gpt2, or the path of a Hugging "
                          "Face tokenizer.json (or of a local directory holding one)")
    if cfg.data.tokenizer == "gpt2":
        for name in ("encoder.json", "vocab.bpe"):
            if not os.path.isfile(os.path.join(cfg.data.gpt2_dir, name)):
                raise ConfigError("data.gpt2_dir", cfg.data.gpt2_dir,
                                  f"must be a directory holding GPT-2's encoder.json and vocab.bpe ({name} missing)")
    if not 0.0 < cfg.log.temperature:
        raise ConfigError("log.temperature", cfg.log.temperature, "must be > 0")
