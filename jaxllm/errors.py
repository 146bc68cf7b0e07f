"""The errors a user's input can cause: each names what is wrong and the fix, in one line; and the fix of the
commonest wrong key, a Megatron-LM argument's name (:data:`MEGATRON_NAMES`).

The command-line tools print them as that one line and exit with status 2 (see :mod:`jaxllm.cli`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ConfigError(ValueError):
    """A config value that cannot work: names the key, the value and the fix."""

    def __init__(self, key: str, value, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"config error: {key}={value!r}: {fix}")


class DataError(ValueError):
    """Bad data input. The message names the file or config key, the problem and the fix."""


class ConvertError(ValueError):
    """A model, directory, checkpoint or option that cannot be converted (``jaxllm.convert``, :mod:`jaxllm.formats`).

    Attributes:
      keys: the config keys (jaxllm ``SECTION.KEY``, a config.json key or a Megatron argument) at fault, possibly
        empty.
    """

    def __init__(self, message: str, keys=()):
        self.keys = tuple(keys)
        super().__init__(message)


# Our own errors pass through :func:`reading` as they are: they name the file already.
_OURS = (ConfigError, DataError, ConvertError)


@contextlib.contextmanager
def reading(path: str, what: str, error: type[Exception] = DataError, fix: str = "") -> Iterator[None]:
    """Inside: the reading of the user's file ``path`` (a ``what``: ``"safetensors weights"``, ``"JSON"``...), where
    whatever the reader raises for a file that exists but cannot be read (truncated, damaged, not that format,
    unreadable) becomes one ``error`` line naming the file, what it should be and the reader's reason, with ``fix``
    (default: replace it with a complete copy).  The one checked path for every file a user hands over."""
    try:
        yield
    except (*_OURS, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001  each reader raises its library's: OSError, ValueError, torch's
        # CheckpointException (a BaseException)...
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        reason = f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__
        raise error(f"{path} cannot be read as {what} ({reason}); {fix or 'replace it with a complete copy'}"
                    ) from None


# Megatron-LM / Megatron-DeepSpeed argument names (dashes as underscores) -> what to set instead.
MEGATRON_NAMES = {
    "num_layers": "model.num_layers", "hidden_size": "model.hidden_size",
    "num_attention_heads": "model.num_attention_heads", "num_query_groups": "model.num_kv_heads",
    "kv_channels": "model.kv_channels", "ffn_hidden_size": "model.ffn_hidden_size",
    "max_position_embeddings": "model.max_position_embeddings",
    "make_vocab_size_divisible_by": "model.make_vocab_size_divisible_by", "normalization": "model.norm",
    "swiglu": "model.activation=swiglu", "quick_geglu": "model.activation=quick_geglu",
    "window_size": "model.sliding_window (its (w - 1, 0) is w)",
    "position_embedding_type": "model.position_embedding",
    "use_rotary_position_embeddings": "model.position_embedding=rotary",
    "untie_embeddings_and_output_weights": "model.tie_embeddings=False", "hidden_dropout": "model.dropout",
    "init_method_std": "model.init_std", "layernorm_epsilon": "model.norm_eps", "norm_epsilon": "model.norm_eps",
    "recompute_granularity": "model.remat", "recompute_activations": "model.remat=full",
    "checkpoint_activations": "model.remat=full", "use_flash_attn": "model.attention_impl",
    "bf16": "model.dtype=bfloat16", "fp16": "model.dtype=float16", "seq_length": "train.seq_length",
    "micro_batch_size": "train.micro_batch_size", "global_batch_size": "train.global_batch_size",
    "train_iters": "train.train_iters", "lr_warmup_iters": "train.warmup_iters",
    "gradient_accumulation_steps": "train.global_batch_size (= micro batch x data-parallel size x accumulation steps)",
    "lr_decay_iters": "train.lr_decay_iters", "optimizer": "train.optimizer", "lr_decay_style": "train.lr_decay_style",
    "lr_warmup_fraction": "train.lr_warmup_fraction", "lr_wsd_decay_style": "train.lr_wsd_decay_style",
    "lr_wsd_decay_iters": "train.lr_wsd_decay_iters", "sgd_momentum": "train.sgd_momentum",
    "no_decoupled_weight_decay": "train.optimizer=adam (Megatron-LM's --optimizer adam without it is "
                                 "train.optimizer=adamw)",
    "adam_beta1": "train.beta1", "adam_beta2": "train.beta2", "adam_eps": "train.adam_eps",
    "clip_grad": "train.grad_clip", "weight_decay": "train.weight_decay", "seed": "train.seed",
    "eval_interval": "train.eval_interval", "eval_iters": "train.eval_iters", "log_interval": "train.log_interval",
    "save_interval": "checkpoint.interval", "data_path": "data.input", "tokenizer_type": "data.tokenizer",
    "tokenizer_model": "data.tokenizer", "data_file_list": "data.file_list", "split": "data.split",
    "data_cache_path": "data.cache_dir", "json_keys": "data.json_key", "reset_position_ids": "data.reset_position_ids",
    "reset_attention_mask": "data.reset_attention_mask", "eod_mask_loss": "data.eod_mask_loss",
    "tensor_model_parallel_size": "mesh.tensor", "pipeline_model_parallel_size": "mesh.pipeline",
    "context_parallel_size": "mesh.sequence", "ds_sequence_parallel_size": "mesh.sequence",
    "sequence_parallel": "parallel.megatron_sp", "zero_stage": "parallel.zero_stage",
    "num_layers_per_virtual_pipeline_stage": "parallel.pipeline_virtual_stages (virtual stages per device)",
    "virtual_pipeline_model_parallel_size": "parallel.pipeline_virtual_stages",
    "expert_model_parallel_size": "mesh.expert", "expert_tensor_parallel_size": "mesh.expert_tensor",
    "moe_grouped_gemm": "nothing: the experts are always grouped matmuls",
}
