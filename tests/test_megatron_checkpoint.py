"""jaxllm.convert --from-megatron / --to-megatron against megatron-core itself (CPU, gloo processes).

megatron-core saves Megatron-LM torch_dist checkpoints of GPTModels (GPT-2 style and Llama style laid out tensor 2
x pipeline 2, a mixture of experts pipeline 2 x expert 2) after three AdamW steps (tests/megatron_checkpoint.py).
Import: every parameter and Adam moment jaxllm holds equals what megatron-core's own reader reads, and jaxllm's
logits equal megatron-core's forward of the checkpoint (float32).  Export: megatron-core loads what jaxllm writes
into a GPTModel with every tensor and the logits bit for bit the original's.  Continue: a jaxllm run exported at
step N and imported again takes Megatron-LM's samples of step N (megatron-core's dataset code) with the loss of
the run that went on by itself.  Bad input: one line, exit 2, nothing in the workdir.
"""

import argparse
import os
import pickle
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import torch
from test_megatron import linked, megatron_split, megatron_tokens

from jaxllm import config, convert, train
from jaxllm.data.loader import Batches, Data
from jaxllm.formats import megatron
from jaxllm.model import gpt
from jaxllm.resolve import resolve_model
from jaxllm.runtime import checkpoint, optim, step

SCRIPT = Path(__file__).resolve().parent / "megatron_checkpoint.py"
ITERS = 3


def torchrun(nproc: int, *args) -> None:
    """tests/megatron_checkpoint.py in ``nproc`` gloo processes (torch's launcher picks a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SCRIPT),
           *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (megatron-core's checkpoint directory, megatron-core's reading of it: tests/megatron_checkpoint.py's
    ``load``); each made once."""
    made = {}

    def get(kind):
        if kind not in made:
            d = tmp_path_factory.mktemp(kind)
            torchrun(4, "save", kind, d / "ckpt", ITERS)
            torchrun(1, "load", kind, d / "ckpt", d / "read.npz")
            made[kind] = d / "ckpt", dict(np.load(d / "read.npz"))
        return made[kind]

    return get


def restored(workdir):
    """(resolved model section, step, params, Adam's state) of a workdir's latest checkpoint."""
    cfg = checkpoint.load_config(str(workdir))
    m = resolve_model(cfg.model, seq_length=cfg.train.seq_length)
    spec = gpt.describe(m)
    optimizer = optim.make_optimizer(cfg.train, spec.decay, spec.axes)
    abstract = jax.eval_shape(lambda p: step.init_state(p, optimizer), spec.params)
    at, state = checkpoint.restore_on_host(str(workdir), {k: abstract[k] for k in ("step", "params", "opt_state")})
    adam = next(n for n in jax.tree.leaves(state["opt_state"], is_leaf=lambda n: hasattr(n, "nu")) if hasattr(n, "nu"))
    return m, at, state, adam


def run_cli(*args) -> int:
    return convert.main([str(a) for a in args])


@pytest.mark.parametrize("kind", ["gpt", "llama", "moe"])
def test_import_equals_megatron_and_export_loads_back(kind, saved, tmp_path, capsys):
    ckpt, read = saved(kind)
    assert run_cli("--from-megatron", ckpt, tmp_path / "run") == 0
    assert f"imported iteration {ITERS}" in capsys.readouterr().out
    m, at, state, adam = restored(tmp_path / "run")
    assert at == ITERS and int(state["step"]) == ITERS and int(adam.count) == ITERS
    # every parameter and moment, in megatron-core's names and layouts, equals megatron-core's reading
    ours = megatron.to_megatron(m, state["params"])
    for name, tree in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        ours.update({f"optimizer.state.{name}.{k}": v for k, v in megatron.to_megatron(m, tree).items()})
    theirs = {k.removeprefix("tensor."): v for k, v in read.items() if k.startswith("tensor.")}
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    held = {k.removeprefix("adam."): v for k, v in read.items() if k.startswith("adam.")}  # what AdamW loaded
    assert sorted(held) == sorted(k for k in ours if k.startswith("optimizer."))
    for k, v in held.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    assert any(np.abs(v).max() > 0 for k, v in theirs.items() if ".exp_avg." in k)  # the moments are not zeros
    logits = np.asarray(gpt.forward(gpt.describe(m).graphdef, state["params"], read["tokens"].astype(np.int32)))
    np.testing.assert_allclose(logits, read["logits"], rtol=0, atol=1e-5)

    assert run_cli("--to-megatron", tmp_path / "run", tmp_path / "export") == 0
    assert (tmp_path / "export" / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
    torchrun(1, "load", kind, tmp_path / "export", tmp_path / "back.npz")
    back = np.load(tmp_path / "back.npz")
    assert sorted(back.files) == sorted(read)
    for k in read:
        np.testing.assert_array_equal(back[k], read[k], err_msg=k)


def byte_run(data_input: str, cache: Path, iters: int) -> config.Config:
    cfg = config.get_config()
    cfg.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, dtype="float32",
                     make_vocab_size_divisible_by=1)  # Megatron's padded vocabulary is the vocabulary
    cfg.train.update(seq_length=32, micro_batch_size=2, global_batch_size=4, train_iters=iters, warmup_iters=1,
                     lr=3e-3, min_lr=3e-4, lr_decay_iters=10, eval_interval=0, log_interval=1, seed=7)
    cfg.data.update(input=data_input, tokenizer="byte", split="98,2", cache_dir=str(cache))
    cfg.checkpoint.interval = 2
    cfg.log.samples = 0
    return cfg


def losses(workdir) -> dict[int, float]:
    import json  # noqa: PLC0415

    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def test_continue_a_run_through_megatron(stdlib_byte, shakespeare_byte, tmp_path):
    """jaxllm trains 2 steps of a blend and saves; --to-megatron, --from-megatron into a new workdir; the imported
    config (its config.py, as `jaxllm.train --config` reads it) trains steps 3 and 4 on Megatron-LM's samples 8-15 with
    the losses of the first run's own (step 4's loss is of the parameters that Adam's imported moments updated)."""
    import megatron.core.datasets.gpt_dataset as gpt_dataset  # noqa: PLC0415
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: PLC0415

    prefixes = linked([stdlib_byte, shakespeare_byte], tmp_path)
    blend = f"0.3 {prefixes[0]} 0.7 {prefixes[1]}"
    first = tmp_path / "first"
    train.train(byte_run(blend, tmp_path / "cache1", 2), str(first))
    assert run_cli("--to-megatron", first, tmp_path / "megatron") == 0
    assert run_cli("--from-megatron", tmp_path / "megatron", tmp_path / "second") == 0
    imported = runpy.run_path(str(tmp_path / "second" / "config.py"))["get_config"]()
    assert imported.data.input == blend and imported.train.seq_length == 32 and imported.model.vocab_size == 256
    imported.train.train_iters = 4
    imported.data.cache_dir = str(tmp_path / "cache2")
    imported.log.samples = 0
    train.train(byte_run(blend, tmp_path / "cache1", 4), str(first))
    train.train(imported, str(tmp_path / "second"))
    assert sorted(losses(tmp_path / "second")) == [3, 4]
    for at in (3, 4):
        assert abs(losses(tmp_path / "second")[at] - losses(first)[at]) <= 1e-6, at

    mcore = {"gpt": gpt_dataset, "builder": BlendedMegatronDatasetBuilder}
    data = Data(imported, str(tmp_path / "second"))
    ds = megatron_split(mcore, prefixes, [0.3, 0.7], "98,2", 32, 7, tuple(data.num_samples.values()), 0)
    for at in (2, 3):  # jaxllm's steps 3 and 4 (0-based batches 2 and 3)
        np.testing.assert_array_equal(Batches(data).batch("train", at), megatron_tokens(ds, at * 4, 4))


def test_training_arguments_jaxllm_lacks_are_named(saved, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved("gpt")[0], ckpt)
    rewrite_common(ckpt, attention_dropout=0.1, lr_decay_iters=None)
    assert run_cli("--from-megatron", ckpt, tmp_path / "run") == 0
    assert "note: Megatron argument attention_dropout=0.1 is left behind" in capsys.readouterr().err
    cfg = checkpoint.load_config(str(tmp_path / "run"))
    assert cfg.train.lr_decay_iters == cfg.train.train_iters == 20  # Megatron's default decay: the whole run


class Payload:
    """What a malicious pickle would run on load: refused before it is called."""

    def __reduce__(self):
        return print, ("payload ran",)


def rewrite_common(ckpt: Path, top: dict | None = None, **changes) -> None:
    """common.pt with ``changes`` to its arguments and ``top`` to its entries."""
    path = ckpt / f"iter_{ITERS:07d}" / "common.pt"
    common = torch.load(path, weights_only=False)
    args = vars(common["args"])
    args.update(changes)
    common["args"] = argparse.Namespace(**args)
    common.update(top or {})
    torch.save(common, path)


def drop_chunk(ckpt: Path) -> None:
    """Removes one chunk of the qkv weight from the index: its shards no longer cover it."""
    path = ckpt / f"iter_{ITERS:07d}" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file
    item = metadata.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    item.chunks.pop()
    path.write_bytes(pickle.dumps(metadata))


def escape_directory(ckpt: Path) -> None:
    """Points a chunk's file outside the checkpoint."""
    path = ckpt / f"iter_{ITERS:07d}" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../outside.distcp"
    path.write_bytes(pickle.dumps(metadata))


def poison_metadata(ckpt: Path) -> None:
    path = ckpt / f"iter_{ITERS:07d}" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    metadata.planner_data = Payload()
    path.write_bytes(pickle.dumps(metadata))


BAD = {  # what is changed -> (the change, extra arguments, words of the one line)
    "a missing shard": (lambda c: (c / f"iter_{ITERS:07d}" / "__1_0.distcp").unlink(), (), "__1_0.distcp is missing"),
    "shards that do not add up": (drop_chunk, (), "linear_qkv.weight hold"),
    "erf GELU": (lambda c: rewrite_common(c, openai_gelu=False), (), "openai_gelu=False"),
    "rotary on part of the head": (lambda c: rewrite_common(c, rotary_percent=0.5), (), "rotary_percent=0.5"),
    "arguments the tensors do not fit": (lambda c: rewrite_common(c, ffn_hidden_size=128), (),
                                         "linear_fc1.weight has shape [4, 256, 64]"),
    "the distributed optimizer's buckets": (
        lambda c: rewrite_common(c, top={"content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}), (),
        "--dist-ckpt-optim-fully-reshardable"),
    "a chunk outside the directory": (escape_directory, (), "outside the checkpoint's directory"),
    "a mismatched --iteration": (lambda c: None, ("--iteration", "5"), "holds no iteration 5"),
    "pickled code in common.pt": (lambda c: rewrite_common(c, payload=Payload()), (), "common.pt holds what"),
    "pickled code in .metadata": (poison_metadata, (), "builtins.print is not a class"),
    "a truncated common.pt": (lambda c: truncate(c / f"iter_{ITERS:07d}" / "common.pt"), (),
                              "common.pt cannot be read as a torch.save file"),
    "a truncated .metadata": (lambda c: truncate(c / f"iter_{ITERS:07d}" / ".metadata"), (), ".metadata"),
    "a truncated shard": (lambda c: truncate(c / f"iter_{ITERS:07d}" / "__1_0.distcp"), (),
                          "cannot be read as torch_dist shards"),
    "a damaged metadata.json": (lambda c: (c / f"iter_{ITERS:07d}" / "metadata.json").write_text("{"), (),
                                "metadata.json cannot be read as JSON"),
}


def truncate(path: Path) -> None:
    """``path`` cut to half its bytes: a copy interrupted, a quota hit while it was written."""
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_writes_nothing(case, saved, tmp_path, capsys):
    change, extra, words = BAD[case]
    original, _ = saved("gpt")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(original, ckpt)
    change(ckpt)
    assert_refused(ckpt, tmp_path / "run", capsys, words, *extra)


def assert_refused(ckpt: Path, run: Path, capsys, words: str, *extra) -> None:
    """``--from-megatron ckpt run``: exit 2 with one line holding ``words``, no pickled code run, nothing in
    ``run``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_cli("--from-megatron", ckpt, run, *extra)
    err = capsys.readouterr()
    assert e.value.code == 2 and words in err.err and len(err.err.strip().splitlines()) == 1, err.err
    assert "payload ran" not in err.out + err.err
    assert not run.exists()


def test_float32_copies_skipped_updates_and_the_tracker(saved, tmp_path):
    """The optimizer's float32 copies of a bf16 run's parameters (``optimizer.state.param.*``, the distributed
    optimizer's fully reshardable format) are imported over the model's; an update the fp16 loss scaler skipped
    leaves the schedule behind the iteration (its ``num_steps``); an export never moves a save directory's
    ``latest_checkpointed_iteration.txt`` back."""
    from jaxllm.formats import torch_dist  # noqa: PLC0415

    original, _ = saved("gpt")
    path = original / f"iter_{ITERS:07d}"
    metadata = torch_dist.read_metadata(str(path))
    tensors = torch_dist.read_tensors(str(path), metadata, [k for k, v in metadata.state_dict_metadata.items()
                                                            if hasattr(v, "chunks")])
    masters = {f"optimizer.state.param.{k}": v + 0.5 for k, v in tensors.items() if not k.startswith("optimizer.")}
    common = torch_dist.read_common(str(path))
    common["opt_param_scheduler"]["num_steps"] = (ITERS - 1) * common["args"].global_batch_size
    objects = {k: None for k, v in metadata.state_dict_metadata.items() if not hasattr(v, "chunks")}
    variant = tmp_path / "variant"
    torch_dist.write(str(variant / f"iter_{ITERS:07d}"), common, {**tensors, **masters}, objects)
    torch_dist.advance_tracker(str(variant), ITERS)
    assert run_cli("--from-megatron", variant, tmp_path / "run") == 0
    m, _, state, adam = restored(tmp_path / "run")
    ours = megatron.to_megatron(m, state["params"])
    for k, v in ours.items():
        np.testing.assert_array_equal(v, masters[f"optimizer.state.param.{k}"], err_msg=k)
    assert int(adam.count) == ITERS and int(state["step"]) == ITERS
    kind = optax.ScaleByScheduleState
    schedule = [n for n in jax.tree.leaves(state["opt_state"], is_leaf=lambda n: isinstance(n, kind))
                if isinstance(n, kind)]
    assert [int(n.count) for n in schedule] == [ITERS - 1]

    out = tmp_path / "save_dir"
    out.mkdir()
    (out / "latest_checkpointed_iteration.txt").write_text("1000")
    assert run_cli("--to-megatron", tmp_path / "run", out) == 0
    assert (out / f"iter_{ITERS:07d}" / "common.pt").is_file()
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "1000"


def test_shakespeare_recipe_through_megatron(tmp_path, capsys):
    """configs/shakespeare_char.py's model, LayerNorm without biases (nanoGPT's): --to-megatron writes megatron-core's
    LayerNorm biases as zeros, megatron-core loads the checkpoint into its GPTModel with jaxllm's logits, and
    --from-megatron gives the bias-less model back, whose next step has the loss of the run that went on by itself.
    A Megatron LayerNorm bias that is not zero has no bias-less form: refused in one line."""
    from jaxllm.formats import torch_dist  # noqa: PLC0415

    def recipe(iters):
        cfg = runpy.run_path(str(Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.py"))[
            "get_config"]()
        cfg.train.update(train_iters=iters, eval_interval=0, log_interval=1)
        cfg.data.cache_dir = str(tmp_path / "cache")
        cfg.checkpoint.interval = 0
        cfg.log.update(samples=0, tensorboard=False, progress_bar=False)
        return cfg

    first, out = tmp_path / "first", tmp_path / "megatron"
    train.train(recipe(2), str(first))
    assert run_cli("--to-megatron", first, out) == 0
    torchrun(1, "load", "shakespeare", out, tmp_path / "read.npz")
    read = np.load(tmp_path / "read.npz")
    assert not read["tensor.decoder.final_layernorm.bias"].any()
    m, _, state, _ = restored(first)
    assert not m.use_bias and m.norm == "layernorm"
    logits = np.asarray(gpt.forward(gpt.describe(m).graphdef, state["params"], read["tokens"].astype(np.int32)))
    np.testing.assert_allclose(logits, read["logits"], rtol=0, atol=1e-5)

    assert run_cli("--from-megatron", out, tmp_path / "second", "--config.data.tokenizer=char",
                   "--config.data.sampling=uniform") == 0
    imported = runpy.run_path(str(tmp_path / "second" / "config.py"))["get_config"]()
    assert imported.model.use_bias is False
    imported.train.train_iters = 3
    imported.data.cache_dir = str(tmp_path / "cache")
    imported.log.update(samples=0, tensorboard=False, progress_bar=False)
    train.train(recipe(3), str(first))
    train.train(imported, str(tmp_path / "second"))
    assert sorted(losses(tmp_path / "second")) == [3]
    assert abs(losses(tmp_path / "second")[3] - losses(first)[3]) <= 1e-6

    path = out / "iter_0000002"
    metadata = torch_dist.read_metadata(str(path))
    tensors = torch_dist.read_tensors(str(path), metadata, [k for k, v in metadata.state_dict_metadata.items()
                                                            if hasattr(v, "chunks")])
    tensors["decoder.final_layernorm.bias"] = tensors["decoder.final_layernorm.bias"] + 0.25
    objects = {k: None for k, v in metadata.state_dict_metadata.items() if not hasattr(v, "chunks")}
    learned = tmp_path / "learned"
    torch_dist.write(str(learned / "iter_0000002"), torch_dist.read_common(str(path)), tensors, objects)
    torch_dist.advance_tracker(str(learned), 2)
    capsys.readouterr()
    assert_refused(learned, tmp_path / "refused", capsys, "decoder.final_layernorm.bias is not zero (max |x| 0.25)",
                   "--config.data.tokenizer=char")
