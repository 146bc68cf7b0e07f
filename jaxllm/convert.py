"""Conversion: jaxllm workdirs <-> Hugging Face ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and
``DeepseekV3ForCausalLM`` directories, <-> Megatron-LM ``torch_dist`` checkpoints with their optimizer state, and
<- Megatron-DeepSpeed's DeepSpeed checkpoints.

CLI::

    python -m jaxllm.convert --to-hf WORKDIR OUT [--step N]
    python -m jaxllm.convert --from-hf DIR WORKDIR [--config.SECTION.KEY=VALUE ...]
    python -m jaxllm.convert --to-megatron WORKDIR OUT [--step N]
    python -m jaxllm.convert --from-megatron DIR WORKDIR [--iteration N] [--config.SECTION.KEY=VALUE ...]

``--to-megatron`` / ``--from-megatron`` (:func:`export_megatron`, :func:`import_megatron`; docs/checkpoints.md,
"Moving a Megatron run"): a run's parameters, Adam's moments and step, schedule and data position both ways,
megatron-core ``GPTModel``'s names and layouts from :mod:`jaxllm.model.megatron`, the files from
:mod:`jaxllm.runtime.torch_dist` (torch's weights-only and metadata-only unpicklers: no unrestricted pickle);
``--from-megatron`` also reads Megatron-DeepSpeed's checkpoints (:mod:`jaxllm.runtime.ds_checkpoint`).

``--to-hf`` (:func:`export_workdir`) writes the latest (or ``--step``) checkpoint of a run as
``OUT/config.json`` + ``OUT/model.safetensors`` (float32) for
``AutoModelForCausalLM.from_pretrained(OUT)``: GPT-2, Llama, Qwen2, Qwen3, Mistral or (experts) Mixtral, Qwen3-MoE or
(multi-head latent attention) DeepSeek-V3,
whichever holds the model exactly (the tables and the parameter mapping are :mod:`jaxllm.model.hf`'s;
any other model is a :class:`~jaxllm.model.hf.ConvertError` naming the keys that do not fit).  A run on the ``gpt2``
tokenizer gets its files too (``vocab.json``, ``merges.txt``), and a run on a Hugging Face
``tokenizer.json`` gets it with ``tokenizer_config.json`` and ``special_tokens_map.json``, a run on a
SentencePiece ``tokenizer.model`` gets it with a ``tokenizer_config.json`` for transformers' ``LlamaTokenizer``
(``AutoTokenizer.from_pretrained(OUT)``; ``eos_token_id`` in config.json is its end-of-document token).

``--from-hf`` (:func:`import_to_workdir`) reads ``DIR/config.json`` and ``DIR/model.safetensors``
(or the shards of ``model.safetensors.index.json``) into a step-0 checkpoint in ``WORKDIR``
(float32 parameters, a fresh optimizer state; the padding rows jaxllm adds are zeros) and writes
``WORKDIR/config.py`` for ``python -m jaxllm.train --config=WORKDIR/config.py --workdir=WORKDIR``
(and ``jaxllm.generate --workdir=WORKDIR``).  HF's ``vocab_size`` is ``model.vocab_size``;
``n_positions`` / ``max_position_embeddings`` is ``model.max_position_embeddings`` and
``train.seq_length`` (which ``--config.train.seq_length`` may shorten); GPT-2's ``resid_pdrop`` is
``model.dropout``; Mixtral's ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` and
``router_aux_loss_coef`` are ``model.num_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size`` (and
``ffn_hidden_size``) and ``moe_aux_loss_coeff``; Qwen3-MoE's ``num_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``intermediate_size`` (its dense layers') and ``router_aux_loss_coef`` the same keys,
``norm_topk_prob`` false ``model.moe_router_pre_softmax``, and its dense layers (``mlp_only_layers``,
``decoder_sparse_step``) ``model.moe_layer_freq``; DeepSeek-V3's ``n_routed_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``intermediate_size`` the same keys, ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim`` ``model.q_lora_rank``, ``kv_lora_rank``,
``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim``, ``routed_scaling_factor``
``model.moe_router_topk_scaling_factor``, ``n_group``, ``topk_group`` ``moe_router_num_groups``,
``moe_router_group_topk`` (1: none), ``n_shared_experts`` x ``moe_intermediate_size``
``moe_shared_expert_intermediate_size``, ``first_k_dense_replace`` ``moe_layer_freq`` (its sigmoid router with the
expert bias fixed); ``head_dim`` is ``model.kv_channels``.
Other keys are jaxllm's defaults, changed with
``--config.SECTION.KEY=VALUE`` (of the model keys only :data:`FREE_MODEL_KEYS`).  **The data must be
tokenized as the model expects**: the tokenizer in ``DIR`` is copied to ``WORKDIR/tokenizer`` and used
(GPT-2's ``vocab.json`` + ``merges.txt`` or such a ``tokenizer.json`` as ``data.tokenizer=gpt2``, else the
model's ``tokenizer.json`` or SentencePiece ``tokenizer.model``); otherwise set ``--config.data.*``.

In Python: :func:`from_hf` (a directory as a resolved config and parameters) and :func:`save_hf`
(a model section and parameters as a directory).  Only JSON and safetensors are read:
pickle-based weights are refused unread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pprint
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm import cli, config
from jaxllm.data.tokenizers import (
    GPT2_EOT_ID,
    GPT2_FILES,
    GPT2_VOCAB_SIZE,
    SENTENCEPIECE_FILE,
    TOKENIZER_NAMES,
    GPT2Tokenizer,
    SentencePieceTokenizer,
    file_tokenizer,
    gpt2_dir_or_packaged,
)
from jaxllm.errors import DataError
from jaxllm.model import gpt, megatron
from jaxllm.model.hf import (
    SAFETENSORS,
    ConvertError,
    hf_architecture,
    model_from_hf,
    params_from_hf,
    read_safetensors,
    to_hf,
)
from jaxllm.parallel import sharding
from jaxllm.resolve import resolve, resolve_model
from jaxllm.runtime import checkpoint, ds_checkpoint, optim, step, torch_dist

# Model keys --from-hf lets the user set; the others come from config.json.
# (mtp_num_layers: modules that start fresh, jaxllm.model.hf.params_from_hf)
FREE_MODEL_KEYS = ("dtype", "remat", "attention_impl", "dropout", "init_std", "make_vocab_size_divisible_by",
                   "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type", "mtp_num_layers",
                   "mtp_loss_scaling_factor")


# --------------------------------------------------------------------------- export


def _write_gpt2_tokenizer(data: config.Data, m: config.Model, out: str, hf: dict) -> None:
    """Writes GPT-2's tokenizer files into ``out`` if the run used them and they are still there."""
    if data.tokenizer != "gpt2":
        return
    directory = gpt2_dir_or_packaged(data.gpt2_dir)
    src = [os.path.join(directory, n) for n in GPT2_FILES]
    if not all(os.path.isfile(s) for s in src):
        warnings.warn(f"the run's GPT-2 tokenizer files ({directory}) are gone; no tokenizer written",
                      stacklevel=2)
        return
    shutil.copyfile(src[0], os.path.join(out, "vocab.json"))
    shutil.copyfile(src[1], os.path.join(out, "merges.txt"))
    eot = "<|endoftext|>"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fp:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": eot,
                   "eos_token": eot, "unk_token": eot, "model_max_length": m.max_position_embeddings}, fp, indent=2)
    hf.update(bos_token_id=GPT2_EOT_ID, eos_token_id=GPT2_EOT_ID)


def _write_hf_tokenizer(data: config.Data, m: config.Model, out: str, hf: dict) -> None:
    """Writes the run's Hugging Face tokenizer into ``out`` as transformers' ``AutoTokenizer`` reads it:
    ``tokenizer.json`` (a copy), ``tokenizer_config.json`` and ``special_tokens_map.json`` (its
    end-of-document token as ``eos_token``, with the ``bos_token``, ``unk_token``, ``pad_token`` and
    ``chat_template`` of a ``tokenizer_config.json`` beside the source); sets ``eos_token_id``."""
    if data.tokenizer in TOKENIZER_NAMES:
        return
    try:
        tok = file_tokenizer(data.tokenizer)
    except DataError as e:
        warnings.warn(f"the run's tokenizer cannot be read ({e}); no tokenizer written", stacklevel=2)
        return
    if isinstance(tok, SentencePieceTokenizer):
        _write_sentencepiece_tokenizer(tok, m, out, hf)
        return
    source = os.path.join(os.path.dirname(tok.path), "tokenizer_config.json")
    given = _read_json(source) if os.path.isfile(source) else {}
    special = {k: given[k] for k in ("bos_token", "unk_token", "pad_token") if k in given}
    special["eos_token"] = tok.decode([tok.eot_id])
    shutil.copyfile(tok.path, os.path.join(out, "tokenizer.json"))
    # clean_up_tokenization_spaces: decode as the tokenizers library (and jaxllm) does, " ," staying " ,"
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": m.max_position_embeddings,
                "clean_up_tokenization_spaces": False}
    if "chat_template" in given:
        settings["chat_template"] = given["chat_template"]
    for name, content in (("tokenizer_config.json", settings), ("special_tokens_map.json", special)):
        with open(os.path.join(out, name), "w") as fp:
            json.dump(content, fp, indent=2)
    hf.update(eos_token_id=tok.eot_id)


def _write_sentencepiece_tokenizer(tok: SentencePieceTokenizer, m: config.Model, out: str, hf: dict) -> None:
    """Writes a SentencePiece run's ``tokenizer.model`` (a copy) and a ``tokenizer_config.json`` naming
    transformers' ``LlamaTokenizer`` with its beginning-of-text token added, as a Llama 2 repository has them;
    sets ``bos_token_id`` and ``eos_token_id``.  transformers converts the model to its own tokenizer, which
    encodes text with leading spaces or a literal ``<s>`` differently from SentencePiece (docs/checkpoints.md)."""
    shutil.copyfile(tok.path, os.path.join(out, SENTENCEPIECE_FILE))
    special = {"bos_token": tok.decode([tok.bos_id]), "eos_token": tok.decode([tok.eot_id])}
    settings = {"tokenizer_class": "LlamaTokenizer", **special, "add_bos_token": True, "add_eos_token": False,
                "model_max_length": m.max_position_embeddings}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fp:
        json.dump(settings, fp, indent=2)
    hf.update(bos_token_id=tok.bos_id, eos_token_id=tok.eot_id)


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less the process's umask (0644 under the usual 022)."""
    umask = os.umask(0o022)  # the umask is read only by setting it: put it back at once
    os.umask(umask)
    return 0o666 & ~umask


def save_hf(m: config.Model, params: dict, out: str, *, data: config.Data | None = None) -> dict:
    """Writes ``out/config.json`` and ``out/model.safetensors`` (see :func:`jaxllm.model.hf.to_hf`), and the
    tokenizer's files when ``data`` (the run's data section) used GPT-2's or a Hugging Face tokenizer.json
    (char and byte tokenizers have no Hugging Face form); returns the config.json dict."""
    from safetensors.numpy import save_file

    hf, tensors = to_hf(m, params)
    os.makedirs(out, exist_ok=True)
    if data is not None:
        _write_gpt2_tokenizer(data, m, out, hf)
        _write_hf_tokenizer(data, m, out, hf)
    weights = os.path.join(out, SAFETENSORS)
    save_file(tensors, weights, metadata={"format": "pt"})
    os.chmod(weights, _new_file_mode())  # safetensors writes 0600; the export is for others to read too
    with open(os.path.join(out, "config.json"), "w") as fp:
        json.dump(hf, fp, indent=2, sort_keys=True)
    return hf


def export_workdir(workdir: str, out: str, step: int | None = None) -> dict:
    """``--to-hf``: the checkpoint of ``workdir`` (latest or ``step``) as the Hugging Face
    directory ``out``; returns the config.json dict.

    Raises:
      FileNotFoundError: no checkpoint. ConvertError: the model fits no architecture, or ``out``
        exists and is not empty (stale files there could be loaded along with the new ones).
    """
    if os.path.isdir(out) and os.listdir(out):
        raise ConvertError(f"{out} exists and is not empty: export into a new directory")
    cfg = checkpoint.load_config(workdir, step)
    m = resolve_model(cfg.model, seq_length=cfg.train.seq_length)  # one tensor device: the least padding
    hf_architecture(m)  # fail before reading the parameters
    # The checkpoint's arrays are as its layout stored them (vocabulary rows padded for its tensor size,
    # dimensions for ZeRO/FSDP; zeros at the end): cut to the model's shapes, whose real rows to_hf writes.
    # A smaller array (another model's) stays smaller, and to_hf names it.
    params = sharding.unpad(checkpoint.restore_params(m, workdir, step), gpt.describe(m).params)
    return save_hf(m, params, out, data=cfg.data)


# --------------------------------------------------------------------------- import


def _read_json(path: str) -> dict:
    with open(path) as fp:
        return json.load(fp)


def _refuse_used_workdir(workdir: str) -> None:
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise ConvertError(f"{ckpt_dir} already holds checkpoints: import into a new workdir")


def _apply_overrides(given: config.Config, overrides: dict[str, str], source: str) -> None:
    """``--config.SECTION.KEY=VALUE`` on top of an imported config: of the model keys only :data:`FREE_MODEL_KEYS`
    (``source`` determines the others)."""
    for key, text in overrides.items():
        config.check_key(key, text)
        section, _, name = key.partition(".")
        if section == "model" and name not in FREE_MODEL_KEYS:
            raise ConvertError(f"--config.{key}: the {source} determines it; only "
                               f"{', '.join('model.' + k for k in FREE_MODEL_KEYS)} may be set", keys=(key,))
        config.override(given, key, text)


def _resolve_for_its_mesh(given: config.Config) -> config.Resolved:
    """An imported checkpoint fits any mesh: the config checked on the devices its mesh names (a -1 axis as 1),
    whatever this machine has."""
    return resolve(given, num_devices=math.prod(max(n, 1) for n in given.mesh.devices().values()))


def _import(directory: str, overrides: dict[str, str]) -> tuple[config.Config, config.Resolved, dict]:
    """``(config as given, resolved config, params)`` of a Hugging Face directory; see :func:`from_hf`."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{directory} has no config.json: not a Hugging Face model directory")
    arch, keys = model_from_hf(_read_json(path))
    given = config.get_config()
    given.model.update(**keys)
    given.train.seq_length = positions = given.model.max_position_embeddings
    _apply_overrides(given, overrides, "Hugging Face config.json")
    if given.train.seq_length > positions:
        raise ConvertError(f"train.seq_length={given.train.seq_length} exceeds the {positions} positions of "
                           f"config.json", keys=("train.seq_length",))
    cfg = _resolve_for_its_mesh(given)
    return given, cfg, params_from_hf(arch, cfg.model, read_safetensors(directory))


def from_hf(directory: str, overrides: dict[str, str] | None = None) -> tuple[config.Resolved, dict]:
    """A Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE or DeepSeek-V3 directory as a jaxllm
    config and parameters.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or its sharded index).
      overrides: ``{"SECTION.KEY": "value"}`` changes to jaxllm's defaults, parsed as the key's
        type; model keys other than :data:`FREE_MODEL_KEYS` come from config.json.
    Returns:
      ``(cfg, params)``: the resolved config (``model.vocab_size`` = HF's ``vocab_size``;
      ``model.max_position_embeddings`` = ``train.seq_length`` = its positions unless
      shortened), and float32 numpy parameters shaped as ``gpt.describe(cfg.model).params``
      (padding rows zero; see :func:`jaxllm.model.hf.to_hf` for the layouts).
    Raises:
      ConvertError: missing or pickle-only files, an unsupported config.json (``keys`` names the
        key), tensors missing, of the wrong shape or left over, or a model key that may not be set.
      ConfigError: an unknown key or unparsable value, or an invalid resulting config (e.g. an
        empty ``data.input``; its files are read by training, not here).
    """
    return _import(directory, dict(overrides or {}))[1:]


def _find_gpt2_tokenizer(directory: str, dest: str) -> bool:
    """Copies GPT-2's tokenizer from a Hugging Face directory into ``dest`` as ``encoder.json`` +
    ``vocab.bpe`` (jaxllm's gpt2 tokenizer files); False, with nothing left, if it is not GPT-2's."""
    vocab, merges = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    tok_json = os.path.join(directory, "tokenizer.json")
    os.makedirs(dest, exist_ok=True)
    try:
        if os.path.isfile(vocab) and os.path.isfile(merges):
            shutil.copyfile(vocab, os.path.join(dest, GPT2_FILES[0]))
            shutil.copyfile(merges, os.path.join(dest, GPT2_FILES[1]))
        elif os.path.isfile(tok_json):
            bpe = _read_json(tok_json).get("model") or {}
            if bpe.get("type") != "BPE" or not isinstance(bpe.get("vocab"), dict):
                raise DataError("not a BPE tokenizer")
            with open(os.path.join(dest, GPT2_FILES[0]), "w") as fp:
                json.dump(bpe["vocab"], fp, ensure_ascii=False)
            with open(os.path.join(dest, GPT2_FILES[1]), "w", encoding="utf-8") as fp:
                fp.write("#version: 0.2\n")
                fp.writelines((p if isinstance(p, str) else " ".join(p)) + "\n" for p in bpe.get("merges", []))
        else:
            raise DataError("no tokenizer files")
        GPT2Tokenizer(dest)
        return True
    except (DataError, OSError, ValueError):
        shutil.rmtree(dest, ignore_errors=True)
        return False


def _find_model_tokenizer(directory: str, dest: str) -> bool:
    """Copies a Hugging Face directory's own tokenizer into ``dest``: its ``tokenizer.json`` (with the
    ``tokenizer_config.json`` that names its end-of-document token), else its SentencePiece
    ``tokenizer.model`` (:func:`~jaxllm.data.tokenizers.file_tokenizer`'s choice, which reads ``dest``);
    False, with nothing left, if there is none that loads."""
    names = ("tokenizer.json", "tokenizer_config.json", SENTENCEPIECE_FILE)
    found = [n for n in names if os.path.isfile(os.path.join(directory, n))]
    if not found:
        return False
    os.makedirs(dest, exist_ok=True)
    for n in found:
        shutil.copyfile(os.path.join(directory, n), os.path.join(dest, n))
    try:
        file_tokenizer(dest)
        return True
    except DataError:
        shutil.rmtree(dest, ignore_errors=True)
        return False


def _config_file_text(given: config.Config, directory: str, what: str = "Hugging Face model") -> str:
    return (f'"""The jaxllm config of the {what} imported from {os.path.abspath(directory)}\n'
            f'by jaxllm.convert. Train on with:\n'
            f'    python -m jaxllm.train --config={{this file}} --workdir={{its directory}}\n'
            f'(--config.SECTION.KEY=VALUE flags still apply; leave the model section as it is)."""\n\n'
            f"from jaxllm.config import from_dict\n\n"
            f"CONFIG = {pprint.pformat(given.to_dict(), sort_dicts=False, width=110)}\n\n\n"
            f"def get_config():\n    return from_dict(CONFIG)\n")


def import_to_workdir(directory: str, workdir: str, overrides: dict[str, str] | None = None) -> config.Resolved:
    """``--from-hf``: a step-0 training checkpoint of the Hugging Face model in ``directory``,
    written to ``workdir`` (which must hold no checkpoint), plus ``workdir/config.py``.

    The state is :func:`jaxllm.runtime.step.init_state`'s around HF's parameters (a fresh optimizer
    state), saved by :class:`jaxllm.runtime.checkpoint.Checkpointer` as training saves it.  Unless
    ``overrides`` set ``data.tokenizer`` or ``data.gpt2_dir``, the tokenizer found in ``directory`` is
    copied to ``workdir/tokenizer`` and used: GPT-2's (``data.tokenizer=gpt2``), else the model's
    ``tokenizer.json`` or SentencePiece ``tokenizer.model`` (``data.tokenizer=workdir/tokenizer``).
    ``config.py`` holds the config as given (derived sizes left to ``jaxllm.train``).

    Returns the resolved config. Raises what :func:`from_hf` raises, and ConvertError when
    ``workdir`` already has checkpoints.
    """
    overrides = dict(overrides or {})
    _refuse_used_workdir(workdir)
    tok_dir = os.path.abspath(os.path.join(workdir, "tokenizer"))
    if "data.tokenizer" not in overrides and "data.gpt2_dir" not in overrides:
        hf_path = os.path.join(directory, "config.json")
        vocab = _read_json(hf_path).get("vocab_size", 0) if os.path.isfile(hf_path) else 0
        if vocab >= GPT2_VOCAB_SIZE and _find_gpt2_tokenizer(directory, tok_dir):
            overrides.update({"data.tokenizer": "gpt2", "data.gpt2_dir": tok_dir})
        elif _find_model_tokenizer(directory, tok_dir):
            overrides["data.tokenizer"] = tok_dir
    try:
        given, cfg, params = _import(directory, overrides)
    except Exception:
        if tok_dir in (overrides.get("data.gpt2_dir"), overrides.get("data.tokenizer")):
            shutil.rmtree(tok_dir, ignore_errors=True)
        raise
    spec = gpt.describe(cfg.model)
    optimizer = optim.make_optimizer(cfg.train, spec.decay, spec.axes)
    with jax.default_device(jax.devices("cpu")[0]):  # host memory, whatever accelerator is present
        state = step.init_state(jax.device_put(params), optimizer)
    ckpt = checkpoint.Checkpointer(workdir, cfg)
    ckpt.maybe_save(0, state, force=True)
    ckpt.close()
    with open(os.path.join(workdir, "config.py"), "w") as fp:
        fp.write(_config_file_text(given, directory))
    return cfg


# --------------------------------------------------------------------------- Megatron-LM (torch_dist)

_MOMENTS = {"mu": "optimizer.state.exp_avg.", "nu": "optimizer.state.exp_avg_sq."}
# The float32 copies of bf16/fp16 parameters: megatron-core's Float16 optimizer's, its distributed optimizer's
# (fully_reshardable format)
_MASTERS = ("optimizer.state.fp32_param.", "optimizer.state.param.")


def _check_optimizer_format(common: dict, keys: list[str], path: str) -> None:
    """Refuses the distributed optimizer's formats that hold its state in flat buckets by data-parallel rank
    (``dp_reshardable``, Megatron-LM's default, and the older ``dp_zero_gather_scatter``) rather than per
    parameter.  Raises ConvertError."""
    kind = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if any(k.startswith("optimizer.distributed.") for k in keys) or kind in ("dp_reshardable",
                                                                            "dp_zero_gather_scatter"):
        raise ConvertError(f"{path}: the distributed optimizer's state is saved in flat buckets by data-parallel "
                           f"rank ({kind or 'optimizer.distributed.*'}), not per parameter: save the iteration "
                           f"again from Megatron-LM with --dist-ckpt-optim-fully-reshardable")


def _adam_step(opt, found: set) -> set:
    """Every Adam step count in Megatron's saved optimizer state (``state.common_step`` of megatron-core's
    FP32/Float16 optimizers, ``param_groups[*].step`` of its distributed optimizer; nested for chained ones)."""
    if isinstance(opt, dict):
        if "common_step" in opt:
            found.add(int(opt["common_step"]))
        for g in opt.get("param_groups", []) if isinstance(opt.get("param_groups"), list) else []:
            if isinstance(g, dict) and g.get("step") is not None:
                found.add(int(g["step"]))
        for v in opt.values():
            _adam_step(v, found)
    elif isinstance(opt, (list, tuple)):
        for v in opt:
            _adam_step(v, found)
    return found


def _check_position(path: str, iteration: int, args: dict, scheduler: dict | None) -> int:
    """The schedule's count (Megatron's successful updates: fp16's skipped ones leave it behind the
    iteration); checks that the data position is ``iteration`` x the global batch (jaxllm's is the step's).
    Raises ConvertError."""
    batch = args["global_batch_size"]
    consumed = args.get("consumed_train_samples")
    if consumed is not None and int(consumed) != iteration * batch:
        raise ConvertError(f"{path}: args.consumed_train_samples = {consumed}, not iteration {iteration} x global "
                           f"batch {batch}: the run changed its global batch (or ramped it up), and jaxllm's data "
                           f"position is the step's")
    updates = (scheduler or {}).get("num_steps", iteration * batch)  # in samples
    if int(updates) % batch or int(updates) > iteration * batch:
        raise ConvertError(f"{path}: the scheduler's num_steps = {updates} samples, not a whole number of global "
                           f"batches of {batch} up to iteration {iteration}")
    return int(updates) // batch


def _one_step(steps: set[int], default: int, path: str) -> int:
    """Adam's step count, one for every parameter group (``default`` where none is saved).  Raises ConvertError."""
    if len(steps) > 1:
        raise ConvertError(f"{path}: Adam step counts {sorted(steps)} differ between parameter groups")
    return steps.pop() if steps else default


def _with_adam_state(state: dict, mu: dict, nu: dict, count: int, schedule: int, iteration: int) -> dict:
    """``state`` (:func:`jaxllm.runtime.step.init_state`'s, AdamW) at step ``iteration`` with Adam's moments and
    step ``count`` and the learning-rate schedule's count ``schedule`` (Megatron's successful updates)."""
    import optax  # noqa: PLC0415

    def put(node):
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(count=jnp.asarray(count, node.count.dtype), mu=mu, nu=nu)
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=jnp.asarray(schedule, node.count.dtype))
        return node

    leaf = lambda n: isinstance(n, (optax.ScaleByAdamState, optax.ScaleByScheduleState))  # noqa: E731
    return {**state, "step": jnp.asarray(iteration, state["step"].dtype),
            "opt_state": jax.tree.map(put, state["opt_state"], is_leaf=leaf)}


class _Source(NamedTuple):
    """A Megatron checkpoint to import: where, its iteration, its arguments in Megatron-LM's names, the
    learning-rate scheduler's state, and ``read(cfg)``: ``(float32 parameters, {"mu", "nu"}: Adam's moments, Adam's
    step counts)``, tensors under megatron-core's names (what :func:`jaxllm.model.megatron.from_megatron` takes)."""

    path: str
    iteration: int
    args: dict
    scheduler: dict | None
    read: Callable
    notes: tuple[str, ...] = ()


def _torch_dist_source(directory: str, iteration: int | None) -> _Source:
    """Megatron-LM's ``torch_dist`` checkpoint (:mod:`jaxllm.runtime.torch_dist`)."""
    path, iteration = torch_dist.iteration_dir(directory, iteration)
    common = torch_dist.read_common(path)
    if common.get("iteration") != iteration:
        raise ConvertError(f"{path}/common.pt is of iteration {common.get('iteration')}, its directory of "
                           f"{iteration}: the checkpoint is inconsistent")

    def read(cfg):
        metadata = torch_dist.read_metadata(path)
        keys = [k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")]
        _check_optimizer_format(common, keys, path)
        taken = (*_MOMENTS.values(), *_MASTERS)
        left = sorted(k for k in keys if k.startswith("optimizer.") and not k.startswith(taken))
        if left:
            raise ConvertError(f"{path}: optimizer tensors jaxllm has no place for: {', '.join(left[:4])}")
        master = next((p for p in _MASTERS if any(k.startswith(p) for k in keys)), None)
        # the float32 copies, where saved, stand for the model's tensors: those are not read then
        tensors = torch_dist.read_tensors(path, metadata, [k for k in keys if k.startswith("optimizer.") or not master])
        part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
        weights = part(master) if master else {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
        for prefix in _MOMENTS.values():
            if not part(prefix):
                raise ConvertError(f"{path} holds no {prefix}* tensors: saved without Adam's state (--no-save-optim)")
        return weights, {name: part(prefix) for name, prefix in _MOMENTS.items()}, _adam_step(common.get("optimizer"),
                                                                                              set())

    args = vars(common.get("args")) if isinstance(common.get("args"), argparse.Namespace) else None
    if not args:
        raise ConvertError(f"{path}/common.pt holds no Megatron-LM arguments (args): not a Megatron-LM checkpoint")
    return _Source(path, iteration, args, common.get("opt_param_scheduler"), read)


def _deepspeed_source(directory: str, iteration: int | None) -> _Source:
    """Megatron-DeepSpeed's DeepSpeed checkpoint, native or universal (:mod:`jaxllm.runtime.ds_checkpoint`)."""
    path = ds_checkpoint.tag_dir(directory, iteration)
    states = ds_checkpoint.model_states(path)
    saved = states[0].get("args")
    if not isinstance(saved, argparse.Namespace):
        raise ConvertError(f"{path}: the model states hold no Megatron arguments (args): not a Megatron-DeepSpeed "
                           f"checkpoint")
    found = states[0].get("iteration")
    if iteration is not None and found != iteration:
        raise ConvertError(f"{path} is of iteration {found}, not --iteration {iteration}")
    args = vars(saved)
    universal = os.path.isdir(os.path.join(path, "zero"))
    if not universal and (args.get("tensor_model_parallel_size") or 1) > 1:
        if not os.path.isdir(path.rstrip(os.sep) + "_universal"):
            raise ConvertError(f"{path}: tensor-parallel ({args['tensor_model_parallel_size']}) shards of DeepSpeed's "
                               f"native layout are not joined here: convert the tag with DeepSpeed's ds_to_universal "
                               f"into {os.path.basename(path.rstrip(os.sep))}_universal first")
        source = _deepspeed_source(path.rstrip(os.sep) + "_universal", iteration)
        return source._replace(notes=(f"{path} holds tensor-parallel shards: read its conversion, {source.path}",))
    scheduler = states[0].get("lr_scheduler")
    if not isinstance(scheduler, dict) or "num_steps" not in scheduler:
        raise ConvertError(f"{path}: the learning-rate scheduler's state is not Megatron's OptimizerParamScheduler's "
                           f"(no num_steps: a DeepSpeed-config scheduler?); jaxllm cannot place the schedule")

    def read(cfg):
        vocab = cfg.model.vocab_size
        raw, steps = (ds_checkpoint.read_universal(path, states, vocab) if universal
                      else ds_checkpoint.read_native(path, states))
        weights, mu, nu = (megatron.from_deepspeed(raw[k], args["num_layers"], "float32 parameters" if k == "fp32"
                                                   else k) for k in ds_checkpoint.KINDS)
        return weights, {"mu": mu, "nu": nu}, steps

    return _Source(path, found, megatron.deepspeed_args(args), scheduler, read)


def import_megatron(directory: str, workdir: str, iteration: int | None = None,
                    overrides: dict[str, str] | None = None) -> tuple[config.Resolved, int, list[str]]:
    """``--from-megatron``: Megatron-LM's ``torch_dist`` checkpoint or Megatron-DeepSpeed's DeepSpeed checkpoint
    (native ZeRO-1/2/3 shards, or DeepSpeed's universal layout) in ``directory`` (its latest iteration, or
    ``iteration``) as a jaxllm checkpoint of that step in ``workdir`` (which must hold none), plus
    ``workdir/config.py``.

    Float32 parameters (the optimizer's float32 copies where a bf16/fp16 run saved them), Adam's moments and
    step count, the schedule at the iteration; the config is what the saved arguments say
    (:func:`jaxllm.model.megatron.args_overrides`), then ``overrides`` (model keys: :data:`FREE_MODEL_KEYS`).
    The next step, ``iteration`` (jaxllm counts from 0), takes samples ``iteration x global batch`` on, which
    is Megatron-LM's next sample for the same ``--data-path``, ``--split``, ``--seed`` and ``--seq-length``.
    Returns ``(resolved config, iteration, notes)``: the notes say which saved arguments jaxllm leaves
    behind (:func:`jaxllm.model.megatron.notes`) and which tag was read in a native DeepSpeed tag's place.
    Raises ConvertError (see :mod:`jaxllm.runtime.torch_dist`, :mod:`jaxllm.runtime.ds_checkpoint`) and
    ConfigError; nothing is written to ``workdir`` then.
    """
    _refuse_used_workdir(workdir)
    torch_dist.require_torch()
    source = (_deepspeed_source if ds_checkpoint.is_deepspeed(directory) else _torch_dist_source)(directory, iteration)
    path, iteration, args = source.path, source.iteration, source.args
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size",
                           "global_batch_size", "seq_length", "train_iters") if args.get(k) is None]
    if missing:
        raise ConvertError(f"{path}: the saved arguments lack {', '.join(missing)}")
    given = config.get_config()
    for key, text in megatron.args_overrides(args).items():
        config.override(given, key, text)
    _apply_overrides(given, dict(overrides or {}), "Megatron checkpoint's arguments")
    cfg = _resolve_for_its_mesh(given)
    schedule = _check_position(path, iteration, args, source.scheduler)
    weights, moments, steps = source.read(cfg)
    count = _one_step(steps, schedule, path)
    params = megatron.from_megatron(cfg.model, weights, "float32 parameters")
    moments = {name: megatron.from_megatron(cfg.model, moments[name], what)
               for name, what in (("mu", "exp_avg"), ("nu", "exp_avg_sq"))}
    spec = gpt.describe(cfg.model)
    optimizer = optim.make_optimizer(cfg.train, spec.decay, spec.axes)
    with jax.default_device(jax.devices("cpu")[0]):
        state = _with_adam_state(step.init_state(jax.device_put(params), optimizer), jax.device_put(moments["mu"]),
                                 jax.device_put(moments["nu"]), count, schedule, iteration)
    ckpt = checkpoint.Checkpointer(workdir, cfg)
    ckpt.maybe_save(iteration, state, force=True)
    ckpt.close()
    with open(os.path.join(workdir, "config.py"), "w") as fp:
        fp.write(_config_file_text(given, path, "Megatron checkpoint"))
    return cfg, iteration, [*source.notes, *megatron.notes(args)]


def megatron_args(cfg: config.Config, m: config.Model, iteration: int) -> argparse.Namespace:
    """Megatron-LM's arguments for the run ``cfg`` (its resolved ``model`` section ``m``, one device) at
    ``iteration``: what :func:`import_megatron` and a Megatron-LM run of the same model read."""
    t, d = cfg.train, cfg.data
    gelu = m.activation == "gelu"
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.head_dim, group_query_attention=True,
        num_query_groups=m.num_kv_heads, seq_length=t.seq_length, max_position_embeddings=m.max_position_embeddings,
        position_embedding_type="learned_absolute" if m.position_embedding == "learned" else "rope",
        rotary_base=m.rotary_base, rotary_percent=1.0,
        normalization="LayerNorm" if m.norm == "layernorm" else "RMSNorm",
        norm_epsilon=m.norm_eps, swiglu=not gelu, openai_gelu=gelu, add_bias_linear=m.use_bias,
        add_qkv_bias=m.use_bias or m.add_qkv_bias, qk_layernorm=m.qk_layernorm,
        untie_embeddings_and_output_weights=not m.tie_embeddings, num_experts=m.num_experts or None,
        moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size or None,
        moe_router_pre_softmax=m.moe_router_pre_softmax, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        padded_vocab_size=gpt.describe(m).params["wte"].shape[0], vocab_size=m.vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, hidden_dropout=m.dropout,
        init_method_std=m.init_std, bf16=m.dtype == "bfloat16", fp16=m.dtype == "float16",
        optimizer="adam", decoupled_weight_decay=True, lr=t.lr, min_lr=t.min_lr, lr_decay_style=t.lr_decay_style,
        lr_wsd_decay_style=t.lr_wsd_decay_style, lr_warmup_iters=t.warmup_iters,
        lr_warmup_fraction=t.lr_warmup_fraction or None, lr_decay_iters=t.lr_decay_iters,
        train_iters=t.train_iters, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        weight_decay=t.weight_decay, adam_beta1=t.beta1, adam_beta2=t.beta2,
        adam_eps=t.adam_eps, clip_grad=t.grad_clip, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, seed=t.seed, data_path=d.input.split(), split=d.split,
        log_interval=t.log_interval, eval_interval=t.eval_interval, eval_iters=t.eval_iters,
        save_interval=cfg.checkpoint.interval,
        consumed_train_samples=iteration * t.global_batch_size, iteration=iteration, ckpt_format="torch_dist",
        **megatron.tokenizer_args(d))


def _adam_and_schedule(opt_state) -> tuple:
    """AdamW's ``ScaleByAdamState`` (moments and step count) and the learning-rate schedule's count."""
    import optax  # noqa: PLC0415

    kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, kinds)) if isinstance(n, kinds)]
    adam = next(n for n in nodes if isinstance(n, optax.ScaleByAdamState))
    return adam, int(next(n.count for n in nodes if isinstance(n, optax.ScaleByScheduleState)))


def export_megatron(workdir: str, out: str, at_step: int | None = None) -> int:
    """``--to-megatron``: ``workdir``'s checkpoint (the latest, or ``at_step``) as a Megatron-LM checkpoint
    directory ``out`` (``latest_checkpointed_iteration.txt``, ``iter_NNNNNNN/``): megatron-core ``GPTModel``'s
    tensors (:func:`jaxllm.model.megatron.to_megatron`), Adam's moments as ``optimizer.state.exp_avg(_sq).*``
    (megatron-core's ``optim_state_to_sharding_state`` keys) and its step as ``common_step``, the arguments
    (:func:`megatron_args`), the schedule at the step.  Returns the iteration (the step).
    Raises ConvertError: ``out`` holds that iteration already, the optimizer is not AdamW, or the model is not
    one megatron-core's GPTModel holds."""
    torch = torch_dist.require_torch()
    cfg = checkpoint.load_config(workdir, at_step)
    if config.OPTIMIZER_ALIASES.get(cfg.train.optimizer, cfg.train.optimizer) != "adamw":
        raise ConvertError(f"train.optimizer={cfg.train.optimizer}: Megatron checkpoints are written with AdamW's "
                           f"state only", keys=("train.optimizer",))
    m = resolve_model(cfg.model, seq_length=cfg.train.seq_length)  # one tensor device: Megatron's padding at 1
    megatron.check_representable(m)
    spec = gpt.describe(m)
    optimizer = optim.make_optimizer(cfg.train, spec.decay, spec.axes)
    abstract = jax.eval_shape(lambda p: step.init_state(p, optimizer), spec.params)
    iteration, state = checkpoint.restore_on_host(workdir, {k: abstract[k] for k in ("params", "opt_state")},
                                                at_step)
    target = os.path.join(out, f"iter_{iteration:07d}")
    if os.path.exists(target):
        raise ConvertError(f"{target} exists: export into a new directory")
    adam, schedule = _adam_and_schedule(state["opt_state"])
    tensors = megatron.to_megatron(m, state["params"])
    for name, tree in (("mu", adam.mu), ("nu", adam.nu)):
        tensors.update({_MOMENTS[name] + k: v for k, v in megatron.to_megatron(m, tree).items()})
    t, batch = cfg.train, cfg.train.global_batch_size
    common = {"args": megatron_args(cfg, m, iteration), "checkpoint_version": 3.0, "iteration": iteration,
              "optimizer": {"state": {"common_step": torch.tensor(float(adam.count))}},
              "opt_param_scheduler": {"max_lr": t.lr, "min_lr": t.min_lr, "num_steps": schedule * batch,
                                      "lr_warmup_steps": round(optim.warmup_steps(t) * batch),
                                      "lr_decay_steps": t.lr_decay_iters * batch, "lr_decay_style": t.lr_decay_style},
              "num_floating_point_operations_so_far": 0}
    torch_dist.write(target, common, tensors, dict.fromkeys(megatron.extra_state_keys(m)))
    torch_dist.advance_tracker(out, iteration)
    return iteration


# --------------------------------------------------------------------------- CLI


def _megatron_main(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    if args.to_megatron:
        workdir, out = args.to_megatron
        iteration = export_megatron(workdir, out, args.step)
        print(f"wrote iteration {iteration} of {workdir} to {out} (Megatron-LM torch_dist, with Adam's state)")
        return 0
    directory, workdir = args.from_megatron
    cfg, iteration, notes = import_megatron(directory, workdir, args.iteration, overrides)
    for line in notes:
        print(f"note: {line}", file=sys.stderr)
    config_py = os.path.join(workdir, "config.py")
    print(f"imported iteration {iteration} of {directory} into {workdir} (step {iteration}, "
          f"data.input={cfg.data.input}, data.tokenizer={cfg.data.tokenizer})\n"
          f"train on:  python -m jaxllm.train --config={config_py} --workdir={workdir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module docstring); errors are one line on stderr and exit status 2."""
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.convert",
        description="Convert between jaxllm checkpoints and Hugging Face GPT-2 / Llama / Qwen2 / Qwen3 / Mistral / "
                    "Mixtral / Qwen3-MoE / DeepSeek-V3 directories (safetensors; see the module docstring).",
        epilog="--from-hf also takes --config.SECTION.KEY=VALUE options (e.g. --config.data.input=FILE, "
               "--config.data.tokenizer=char): the data must be tokenized with the model's tokenizer.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-hf", nargs=2, metavar=("WORKDIR", "OUT"),
                      help="export WORKDIR's latest checkpoint to the Hugging Face directory OUT")
    mode.add_argument("--from-hf", nargs=2, metavar=("DIR", "WORKDIR"),
                      help="import the Hugging Face directory DIR as a step-0 checkpoint in WORKDIR")
    mode.add_argument("--from-megatron", nargs=2, metavar=("DIR", "WORKDIR"),
                      help="import the Megatron-LM torch_dist checkpoint DIR, or Megatron-DeepSpeed's DeepSpeed "
                           "checkpoint DIR (native or universal), with its optimizer state into WORKDIR")
    mode.add_argument("--to-megatron", nargs=2, metavar=("WORKDIR", "OUT"),
                      help="export WORKDIR's latest checkpoint (with its optimizer state) as a Megatron-LM "
                           "torch_dist checkpoint in OUT")
    p.add_argument("--step", type=int, default=None,
                   help="--to-hf, --to-megatron: the checkpoint step (default: latest)")
    p.add_argument("--iteration", type=int, default=None,
                   help="--from-megatron: the iteration (default: latest_checkpointed_iteration.txt's, or "
                        "DeepSpeed's latest tag)")
    args, rest = p.parse_known_args(argv)
    overrides = {}
    for item in rest:
        m = re.fullmatch(r"--config\.([A-Za-z_]\w*\.[A-Za-z_]\w*)=(.*)", item)
        exporting = args.to_hf or args.to_megatron
        if not m or exporting:
            p.error(f"unrecognized argument {item!r}" + (" (an export takes no --config options)" if exporting else ""))
        overrides[m.group(1)] = m.group(2)
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # Orbax logs every file at INFO
    # OSError: a file missing, unreadable or unwritable
    with cli.usage_errors(dict.fromkeys((ConvertError, DataError, OSError), "error: ")):
        if args.to_megatron or args.from_megatron:
            return _megatron_main(args, overrides)
        if args.to_hf:
            workdir, out = args.to_hf
            hf = export_workdir(workdir, out, args.step)
            print(f"wrote {hf['architectures'][0]} ({hf['vocab_size']} vocab) to {out}")
            return 0
        directory, workdir = args.from_hf
        cfg = import_to_workdir(directory, workdir, overrides)
    config_py = os.path.join(workdir, "config.py")
    if not any(k.startswith("data.") for k in overrides) and cfg.data.tokenizer in ("char", "byte"):
        print(f"note: {directory} holds no tokenizer for this model (GPT-2's vocab.json + merges.txt, a "
              f"tokenizer.json or a SentencePiece tokenizer.model), so the config keeps jaxllm's default "
              f"data section (data.tokenizer={cfg.data.tokenizer}, data.input={cfg.data.input}); the data must be "
              f"tokenized as the model expects: import again with --config.data.* or edit {config_py}",
              file=sys.stderr)
    print(f"imported {hf_architecture(cfg.model).hf_class} from {directory} into "
          f"{workdir} (step 0, data.tokenizer={cfg.data.tokenizer})\n"
          f"train on:  python -m jaxllm.train --config={config_py} --workdir={workdir}\n"
          f"sample:    python -m jaxllm.generate --workdir={workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
