"""jaxllm workdirs <-> Hugging Face model directories (``python -m jaxllm.convert --to-hf`` / ``--from-hf``) of the
architectures :mod:`jaxllm.families` registers (GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE,
DeepSeek-V3, OLMo 2, Gemma 3): config.json, safetensors weights and the tokenizer's files.

``--to-hf`` (:func:`export_workdir`) writes the latest (or ``--step``) checkpoint of a run as
``OUT/config.json`` + ``OUT/model.safetensors`` (float32) for
``AutoModelForCausalLM.from_pretrained(OUT)``: GPT-2, Llama, Qwen2, Qwen3, Mistral or (experts) Mixtral, Qwen3-MoE or
(multi-head latent attention) DeepSeek-V3, OLMo 2 (norms after attention and the MLP), Gemma 3 (local and global
layers), whichever holds the model exactly (the tables and the parameter mapping are :mod:`jaxllm.formats.hf`'s;
any other model is a :class:`~jaxllm.errors.ConvertError` naming the keys that do not fit).  A run on the ``gpt2``
tokenizer gets its files too (``vocab.json``, ``merges.txt``), and a run on a Hugging Face
``tokenizer.json`` gets it with ``tokenizer_config.json`` and ``special_tokens_map.json``, a run on a
SentencePiece ``tokenizer.model`` gets it with a ``tokenizer_config.json`` for transformers' ``LlamaTokenizer``
(``AutoTokenizer.from_pretrained(OUT)``; ``eos_token_id`` in config.json is its end-of-document token).

``--from-hf`` (:func:`import_to_workdir`) reads ``DIR/config.json`` and ``DIR/model.safetensors``
(or the shards of ``model.safetensors.index.json``) into a step-0 checkpoint in ``WORKDIR``
(float32 parameters, a fresh optimizer state; the padding rows jaxllm adds are zeros) and writes
``WORKDIR/config.py`` for ``python -m jaxllm.train --config=WORKDIR/config.py --workdir=WORKDIR``
(and ``jaxllm.generate --workdir=WORKDIR``), checked as training will check it before anything is written (a
tokenizer of more tokens than ``vocab_size`` is refused, with transformers' ``resize_token_embeddings`` as the fix:
:func:`_check_tokenizer`).  HF's ``vocab_size`` is ``model.vocab_size``;
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
expert bias fixed), ``num_nextn_predict_layers`` ``model.mtp_num_layers`` (the modules its file holds), rope type
``yarn`` ``model.rope_type`` and the ``model.yarn_*`` keys; ``head_dim`` is ``model.kv_channels``.
Other keys are jaxllm's defaults, changed with
``--config.SECTION.KEY=VALUE`` (of the model keys only
:data:`jaxllm.formats.workdir.FREE_MODEL_KEYS`).  **The data must be
tokenized as the model expects**: the tokenizer in ``DIR`` is copied to ``WORKDIR/tokenizer`` and used
(GPT-2's ``vocab.json`` + ``merges.txt`` or such a ``tokenizer.json`` as ``data.tokenizer=gpt2``, else the
model's ``tokenizer.json`` or SentencePiece ``tokenizer.model``); otherwise set ``--config.data.*``.

In Python: :func:`from_hf` (a directory as a resolved config and parameters) and :func:`save_hf`
(a model section and parameters as a directory).  Only JSON and safetensors are read:
pickle-based weights are refused unread.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import jax

from jaxllm import config
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
    make_tokenizer,
)
from jaxllm.errors import ConfigError, ConvertError, DataError, reading
from jaxllm.families.tables import Arch
from jaxllm.formats.hf import (
    SAFETENSORS,
    hf_architecture,
    model_from_hf,
    params_from_hf,
    read_safetensors,
    tensor_names,
    to_hf,
)
from jaxllm.formats.workdir import apply_overrides, importing, read_json, resolve_for_its_mesh, save_imported
from jaxllm.model import gpt
from jaxllm.parallel import sharding
from jaxllm.resolve import resolve_model
from jaxllm.runtime import checkpoint, optim, step


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
    given = read_json(source) if os.path.isfile(source) else {}
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


def _new_file_mode(directory: bool = False) -> int:
    """The mode ``open()`` gives a new file (``os.mkdir`` a new ``directory``): 0666 (0777) less the process's umask
    (0644, 0755 under the usual 022)."""
    umask = os.umask(0o022)  # the umask is read only by setting it: put it back at once
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def save_hf(m: config.Model, params: dict, out: str, *, data: config.Data | None = None) -> dict:
    """Writes ``out/config.json`` and ``out/model.safetensors`` (see :func:`jaxllm.formats.hf.to_hf`), and the
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
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=parent)  # written there, renamed whole: never half an export
    try:
        hf = save_hf(m, params, tmp, data=cfg.data)
        os.chmod(tmp, _new_file_mode(directory=True))  # mkdtemp's is 0700
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return hf


def _check_tokenizer(cfg: config.Resolved, config_json: str, found_in: str | None) -> None:
    """What training checks of the model against its tokenizer, checked by the import (whose model keys the
    ``--config`` options cannot change): :func:`jaxllm.resolve.resolve_model` with the vocabulary of the tokenizer
    training reads (``data.tokenizer``, :func:`~jaxllm.data.tokenizers.make_tokenizer`).  A ``char`` tokenizer is
    fitted to the corpus when training reads it: not known here.  ``found_in``: the Hugging Face directory the
    tokenizer was found in (None: ``data.tokenizer`` as the options set it).

    Raises:
      ConvertError: ``config.json``'s ``vocab_size`` (the embedding's rows) is below the tokenizer's tokens, with
        the fix (the embedding resized by transformers, or another tokenizer).  DataError: the tokenizer cannot be
        read.
    """
    d, m = cfg.data, cfg.model
    if d.tokenizer == "char":
        return
    tokens = make_tokenizer(d.tokenizer, d.gpt2_dir).vocab_size
    try:
        resolve_model(m, seq_length=cfg.train.seq_length, vocab_size=tokens)
    except ConfigError as e:
        if e.key != "model.vocab_size":
            raise
        named = f"the tokenizer in {found_in}" if found_in else f"data.tokenizer={d.tokenizer}"
        directory = os.path.dirname(config_json) or "."
        raise ConvertError(
            f"{config_json}: vocab_size={m.vocab_size} (the embedding's rows) is below the {tokens} tokens of {named}, "
            f"and training refuses a model.vocab_size below its tokenizer's; resize the embedding with transformers "
            f"(model = AutoModelForCausalLM.from_pretrained({directory!r}); model.resize_token_embeddings({tokens}); "
            f"model.save_pretrained({directory!r})) and import again, or give a tokenizer of at most {m.vocab_size} "
            f"tokens (--config.data.tokenizer)", keys=("vocab_size",)) from None


def _config(directory: str, overrides: dict[str, str], found_in: str | None = None
            ) -> tuple[Arch, config.Config, config.Resolved]:
    """``(architecture, config as given, resolved config)`` of a Hugging Face directory, checked as training will
    check it: the sequence against the positions, and the tokenizer against the vocabulary (:func:`_check_tokenizer`)
    when it is the model's, found in the directory ``found_in`` or set by ``overrides`` (without either the data
    section is jaxllm's default, which ``jaxllm.convert`` says must be replaced).  Reads ``config.json`` and the
    weights' tensor names only."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise ConvertError(f"{directory}: no such directory")
    if not os.path.isfile(path):
        raise ConvertError(f"{directory} has no config.json: not a Hugging Face model directory")
    hf = read_json(path)
    with reading(path, "a Hugging Face config.json", ConvertError):  # a value of another type than its key's
        arch, keys = model_from_hf(hf, lambda: tensor_names(directory))
    given = config.get_config()
    given.model.update(**keys)
    given.train.seq_length = positions = given.model.max_position_embeddings
    apply_overrides(given, overrides, "Hugging Face config.json")
    if given.train.seq_length > positions:
        raise ConvertError(f"train.seq_length={given.train.seq_length} exceeds the {positions} positions of "
                           f"config.json", keys=("train.seq_length",))
    cfg = resolve_for_its_mesh(given)
    if found_in or {"data.tokenizer", "data.gpt2_dir"} & set(overrides):  # else jaxllm's default, to be replaced
        _check_tokenizer(cfg, path, found_in)
    return arch, given, cfg


def _import(directory: str, overrides: dict[str, str], found_in: str | None = None
            ) -> tuple[config.Config, config.Resolved, dict]:
    """``(config as given, resolved config, params)`` of a Hugging Face directory; see :func:`from_hf`."""
    arch, given, cfg = _config(directory, overrides, found_in)
    return given, cfg, params_from_hf(arch, cfg.model, read_safetensors(directory))


def from_hf(directory: str, overrides: dict[str, str] | None = None) -> tuple[config.Resolved, dict]:
    """A Hugging Face directory of an architecture :mod:`jaxllm.families` registers as a jaxllm
    config and parameters.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or its sharded index).
      overrides: ``{"SECTION.KEY": "value"}`` changes to jaxllm's defaults, parsed as the key's
        type; model keys other than :data:`jaxllm.formats.workdir.FREE_MODEL_KEYS` come from config.json.
    Returns:
      ``(cfg, params)``: the resolved config (``model.vocab_size`` = HF's ``vocab_size``;
      ``model.max_position_embeddings`` = ``train.seq_length`` = its positions unless
      shortened), and float32 numpy parameters shaped as ``gpt.describe(cfg.model).params``
      (padding rows zero; see :func:`jaxllm.formats.hf.to_hf` for the layouts).
    Raises:
      ConvertError: missing or pickle-only files, an unsupported config.json (``keys`` names the
        key), tensors missing, of the wrong shape or left over, a model key that may not be set, or a
        ``data.tokenizer`` of more tokens than config.json's ``vocab_size`` (training's check,
        :func:`_check_tokenizer`).
      ConfigError: an unknown key or unparsable value, or an invalid resulting config (e.g. an
        empty ``data.input``; its files are read by training, not here).
    """
    return _import(directory, dict(overrides or {}))[1:]


def _find_gpt2_tokenizer(directory: str, dest: str) -> bool:
    """Copies GPT-2's tokenizer from a Hugging Face directory into ``dest`` as ``encoder.json`` +
    ``vocab.bpe`` (jaxllm's gpt2 tokenizer files); False, with nothing left, if it has none: no ``vocab.json`` +
    ``merges.txt`` of GPT-2's size, and no ``tokenizer.json`` or one that is not GPT-2's (the model's own, for
    :func:`_find_model_tokenizer`).

    Raises:
      DataError, ConvertError: ``vocab.json`` + ``merges.txt`` or ``tokenizer.json`` are there but cannot be read
        (never another tokenizer instead).
    """
    vocab, merges = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    tok_json = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(vocab) and os.path.isfile(merges):
        if len(read_json(vocab)) != GPT2_VOCAB_SIZE:
            return False  # another byte-level BPE (Qwen2's): the model's own tokenizer.json
        os.makedirs(dest, exist_ok=True)
        shutil.copyfile(vocab, os.path.join(dest, GPT2_FILES[0]))
        shutil.copyfile(merges, os.path.join(dest, GPT2_FILES[1]))
        try:
            GPT2Tokenizer(dest)
        except DataError as e:  # named after the copy: say which files of the model's directory they are
            raise DataError(str(e).replace(os.path.join(dest, GPT2_FILES[0]), vocab).replace(
                os.path.join(dest, GPT2_FILES[1]), merges)) from None
        return True
    if not os.path.isfile(tok_json):
        return False
    bpe = read_json(tok_json).get("model") or {}
    if bpe.get("type") != "BPE" or not isinstance(bpe.get("vocab"), dict):
        return False
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, GPT2_FILES[0]), "w") as fp:
        json.dump(bpe["vocab"], fp, ensure_ascii=False)
    with open(os.path.join(dest, GPT2_FILES[1]), "w", encoding="utf-8") as fp:
        fp.write("#version: 0.2\n")
        fp.writelines((p if isinstance(p, str) else " ".join(p)) + "\n" for p in bpe.get("merges", []))
    try:
        GPT2Tokenizer(dest)
        return True
    except DataError:  # a BPE tokenizer.json of another vocabulary: the model's own (_find_model_tokenizer)
        shutil.rmtree(dest, ignore_errors=True)
        return False


def _find_model_tokenizer(directory: str, dest: str) -> bool:
    """Copies a Hugging Face directory's own tokenizer into ``dest``: its ``tokenizer.json`` (with the
    ``tokenizer_config.json`` that names its end-of-document token), else its SentencePiece
    ``tokenizer.model`` (:func:`~jaxllm.data.tokenizers.file_tokenizer`'s choice, which reads ``dest``);
    False, with nothing written, if it has neither.

    Raises:
      DataError: the tokenizer is there but cannot be read (never another tokenizer instead).
    """
    names = ("tokenizer.json", "tokenizer_config.json", SENTENCEPIECE_FILE)
    found = [n for n in names if os.path.isfile(os.path.join(directory, n))]
    if not {"tokenizer.json", SENTENCEPIECE_FILE} & set(found):
        return False
    os.makedirs(dest, exist_ok=True)
    for n in found:
        shutil.copyfile(os.path.join(directory, n), os.path.join(dest, n))
    try:
        file_tokenizer(dest)
    except DataError as e:  # named after the copy: say which file of the model's directory it is
        raise DataError(str(e).replace(dest, directory)) from None
    return True


def import_to_workdir(directory: str, workdir: str, overrides: dict[str, str] | None = None) -> config.Resolved:
    """``--from-hf``: a step-0 training checkpoint of the Hugging Face model in ``directory``,
    written to ``workdir`` (which must hold no checkpoint), plus ``workdir/config.py``.

    The state is :func:`jaxllm.runtime.step.init_state`'s around HF's parameters (a fresh optimizer
    state), saved by :class:`jaxllm.runtime.checkpoint.Checkpointer` as training saves it.  Unless
    ``overrides`` set ``data.tokenizer`` or ``data.gpt2_dir``, the tokenizer found in ``directory`` is
    copied to ``workdir/tokenizer`` and used: GPT-2's (``data.tokenizer=gpt2``), else the model's
    ``tokenizer.json`` or SentencePiece ``tokenizer.model`` (``data.tokenizer=workdir/tokenizer``).
    ``config.py`` holds the config as given (derived sizes left to ``jaxllm.train``).  The config is checked as
    training will check it (the tokenizer against ``vocab_size`` too: :func:`_check_tokenizer`) before anything is
    written; a failed import leaves nothing (:func:`jaxllm.formats.workdir.importing`).

    Returns the resolved config. Raises what :func:`from_hf` raises, and ConvertError when
    ``workdir`` already has checkpoints.
    """
    overrides = dict(overrides or {})
    with tempfile.TemporaryDirectory(prefix="jaxllm-import-") as tmp:
        # the tokenizer found (copied to scratch) and the config checked as training will check it: nothing written
        found, found_in, scratch = {}, None, os.path.join(tmp, "tokenizer")
        if "data.tokenizer" not in overrides and "data.gpt2_dir" not in overrides:
            found = _find_tokenizer(directory, scratch)
            found_in = directory if found else None
        _config(directory, {**overrides, **found}, found_in)
        with importing(workdir, "jaxllm.convert --from-hf"):
            if found:
                tok_dir = os.path.abspath(os.path.join(workdir, "tokenizer"))
                shutil.copytree(scratch, tok_dir)
                found = {k: tok_dir if v == scratch else v for k, v in found.items()}
            given, cfg, params = _import(directory, {**overrides, **found}, found_in)
            _save(workdir, cfg, params, given, directory)
    return cfg


def _find_tokenizer(directory: str, dest: str) -> dict[str, str]:
    """The ``data.*`` options of the tokenizer in a Hugging Face directory, copied into ``dest``: GPT-2's
    (:func:`_find_gpt2_tokenizer`, for a ``vocab_size`` of at least GPT-2's), else the model's own
    (:func:`_find_model_tokenizer`); ``{}``, with nothing written, if it has none."""
    hf_path = os.path.join(directory, "config.json")
    vocab = read_json(hf_path).get("vocab_size", 0) if os.path.isfile(hf_path) else 0
    if isinstance(vocab, int) and vocab >= GPT2_VOCAB_SIZE and _find_gpt2_tokenizer(directory, dest):
        return {"data.tokenizer": "gpt2", "data.gpt2_dir": dest}
    if _find_model_tokenizer(directory, dest):
        return {"data.tokenizer": dest}
    return {}


def _save(workdir: str, cfg: config.Resolved, params: dict, given: config.Config, directory: str) -> None:
    """The imported model as a step-0 checkpoint with a fresh optimizer state, and its ``config.py``."""
    spec = gpt.describe(cfg.model)
    optimizer = optim.make_optimizer(cfg.train, spec.decay, spec.axes)
    with jax.default_device(jax.devices("cpu")[0]):  # host memory, whatever accelerator is present
        state = step.init_state(jax.device_put(params), optimizer)
    save_imported(workdir, cfg, state, 0, given, directory, "Hugging Face model")

