"""jaxllm.convert --from-megatron of Megatron-DeepSpeed's DeepSpeed checkpoints, against what DeepSpeed itself held.

tests/data/deepspeed/ holds checkpoints DeepSpeed 0.19.8's own engine saved on the CPU after three AdamW steps of a
small GPT named and laid out as Megatron-DeepSpeed's (tests/deepspeed_checkpoint.py, which says how they were made):
GPT-style under ZeRO-1 in bf16 with Megatron's nested module state (argonne's runs without a pipeline), ZeRO-2 in
float32 with DeepSpeed's per-parameter alignment and round-robin gradient order, ZeRO-3 in bf16, and two pipeline
stages under DeepSpeed's BF16_Optimizer (argonne's runs with one); Llama-style (RMSNorm, SwiGLU, rotary, grouped
queries, untied output) under ZeRO-1 and two pipeline stages; the pipelines, ZeRO-2 and ZeRO-3 also through
DeepSpeed's ``ds_to_universal``.
Beside each, the float32 masters and Adam moments the live engine held (DeepSpeed's ``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``) and the float32 model's logits on a batch.  The sizes are odd (hidden 15, three
heads, a vocabulary of 60 padded to 63) so that ZeRO's partitions pad.
"""

import enum
import shutil
import sys
import types
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import torch
from test_megatron_checkpoint import Payload, assert_refused, restored, run_cli

from jaxllm.formats import megatron
from jaxllm.model import gpt

DATA = Path(__file__).resolve().parent / "data" / "deepspeed"
NATIVE = ["zero1_bf16_nested", "zero2_fp32_aligned", "zero3_bf16", "pipeline2_bf16", "llama_zero1_bf16_nested",
          "llama_pipeline2_bf16"]
UNIVERSAL = [f"{c}_universal" for c in ("zero2_fp32_aligned", "zero3_bf16", "pipeline2_bf16", "llama_pipeline2_bf16")]
# ds_to_universal cuts the vocabulary's padding rows from ZeRO-1/2 shards (not from ZeRO-3's flat tensors); the
# import puts them back as zeros, as DeepSpeed's universal loader does
TRIMMED = ("zero2_fp32_aligned_universal", "pipeline2_bf16_universal", "llama_pipeline2_bf16_universal")
LAYERS, VOCAB, ITERS = 2, 60, 3
# megatron-core's names (jaxllm's export) -> Megatron-DeepSpeed's in a layer, longest first
LAYER = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
         "self_attention.linear_qkv.": "self_attention.query_key_value.",
         "self_attention.linear_proj.": "self_attention.dense.",
         "mlp.linear_fc1.layer_norm_": "post_attention_layernorm.", "mlp.linear_fc1.": "mlp.dense_h_to_4h.",
         "mlp.linear_fc2.": "mlp.dense_4h_to_h."}


def deepspeed_names(name: str, pipe: bool, llama: bool) -> list[str]:
    """Megatron-DeepSpeed's names of a megatron-core tensor (one per layer for the stacked ones)."""
    embed = ("1." if llama else "tied_modules.embed.") if pipe else "language_model.embedding."
    if name.startswith("embedding."):
        return [embed + name.removeprefix("embedding.")]
    if name == "output_layer.weight":
        return [f"{LAYERS + 3}.lm_head.weight" if pipe else "language_model.output_layer.weight"]
    if name.startswith("decoder.final_layernorm."):
        last = name.rsplit(".", 1)[1]
        return [f"{LAYERS + 2}.{last}" if pipe else f"language_model.encoder.final_layernorm.{last}"]
    rest = name.removeprefix("decoder.layers.")
    part = next(p for p in LAYER if rest.startswith(p))
    return [(f"{i + 2}." if pipe else f"language_model.encoder.layers.{i}.") + LAYER[part] + rest[len(part):]
            for i in range(LAYERS)]


def held(case: str) -> dict:
    """What the engine held when it saved the case (a universal tag: its source's), every stage's; the tied
    embedding of the first stage, whose positions the last stage's copy (its output layer) leaves untrained."""
    out = {}
    for f in sorted((DATA / case.removesuffix("_universal")).glob("expected_rank*.npz")):
        for k, v in np.load(f).items():
            out.setdefault(k, v)
    return out


@pytest.mark.parametrize("case", NATIVE + UNIVERSAL)
def test_import_equals_what_deepspeed_held(case, tmp_path, capsys):
    assert run_cli("--from-megatron", DATA / case, tmp_path / "run") == 0
    assert f"imported iteration {ITERS}" in capsys.readouterr().out
    m, at, state, adam = restored(tmp_path / "run")
    assert at == ITERS and int(state["step"]) == ITERS and int(adam.count) == ITERS
    llama, pipe = case.startswith("llama"), "pipeline" in case
    assert (m.vocab_size, m.num_layers) == (63, LAYERS)
    assert (m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.norm, m.activation, m.position_embedding,
            m.tie_embeddings, m.use_bias) == ((16, 4, 2, "rmsnorm", "swiglu", "rotary", False, False) if llama else
                                              (15, 3, 3, "layernorm", "gelu", "learned", True, True))
    expected, compared = held(case), set()
    for kind, tree in (("fp32", state["params"]), ("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        for name, x in megatron.to_megatron(m, tree).items():
            for i, ds_name in enumerate(deepspeed_names(name, pipe, llama)):
                ours, theirs = (x[i] if name.startswith("decoder.layers.") else x), expected[f"{kind}/{ds_name}"]
                if case in TRIMMED and ("word_embeddings" in ds_name or name == "output_layer.weight"):
                    np.testing.assert_array_equal(ours[VOCAB:], 0)
                    ours, theirs = ours[:VOCAB], theirs[:VOCAB]
                np.testing.assert_array_equal(ours, theirs, err_msg=f"{kind}/{ds_name}")
                compared.add(f"{kind}/{ds_name}")
    assert compared == {k for k in expected if "/" in k}  # every tensor the engine held
    assert all(np.abs(expected[k]).max() > 0 for k in compared if k.startswith("exp_avg"))
    if "logits" in expected:  # the model: jaxllm's logits are the float32 torch model's (but the padding rows')
        logits = gpt.forward(gpt.describe(m).graphdef, state["params"], expected["ids"].astype(np.int32))
        width = VOCAB if case in TRIMMED else None
        np.testing.assert_allclose(np.asarray(logits)[..., :width], expected["logits"][..., :width], rtol=0, atol=1e-5)


def rewrite_states(tag: Path, **changes) -> None:
    """The model states of a tag with ``changes`` to Megatron's saved arguments (``payload``: an entry)."""
    file = tag / "mp_rank_00_model_states.pt"
    states = torch.load(file, weights_only=False)  # the test's own copy of a fixture
    for k, v in changes.items():
        if k in ("payload", "lr_scheduler"):
            states[k] = v
        else:
            setattr(states["args"], k, v)
    torch.save(states, file)


LN1 = "language_model.encoder.layers.0.input_layernorm.weight"
SHARD = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
BAD = {  # case: (source, change of the copy, extra arguments, words of the one line)
    "a missing ZeRO shard": ("zero2_fp32_aligned",
                             lambda c: (c / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
                             (), "a shard is missing"),
    "a missing universal file": ("zero3_bf16_universal",
                                 lambda c: shutil.rmtree(c / "global_step3" / "zero" / LN1),
                                 (), f"zero/{LN1} is missing"),
    "native tensor-parallel shards": ("zero2_fp32_aligned",
                                      lambda c: rewrite_states(c / "global_step3", tensor_model_parallel_size=2), (),
                                      "ds_to_universal into global_step3_universal first"),
    "DeepSpeed's mixture of experts": ("zero2_fp32_aligned",
                                       lambda c: rewrite_states(c / "global_step3", num_experts=[4]), (),
                                       "num_experts=[4]"),
    "torch's Adam": ("zero1_bf16_nested", lambda c: rewrite_states(c / "global_step3", optimizer="adam"), (),
                     "optimizer='adam' without ds_fused_adam"),
    "microsoft's query/key/value thirds": ("zero1_bf16_nested", lambda c: rewrite_states(
        c / "global_step3", ds_sequence_parallel_fpdt=False), (), "ds_sequence_parallel_fpdt"),
    "a DeepSpeed-config scheduler": ("zero2_fp32_aligned", lambda c: rewrite_states(
        c / "global_step3", lr_scheduler={"last_batch_iteration": 2}), (), "no num_steps"),
    "a mismatched --iteration": ("zero1_bf16_nested", lambda c: None, ("--iteration", "5"), "holds no global_step5"),
    "pickled code in the model states": ("zero1_bf16_nested",
                                         lambda c: rewrite_states(c / "global_step3", payload=Payload()), (),
                                         "holds what the weights-only loader refuses"),
    "truncated model states": ("zero1_bf16_nested",
                               lambda c: truncate(c / "global_step3" / "mp_rank_00_model_states.pt"), (),
                               "mp_rank_00_model_states.pt cannot be read as a torch.save file"),
    "a truncated ZeRO shard": ("zero1_bf16_nested",
                               lambda c: truncate(c / "global_step3" / f"bf16_{SHARD}"), (),
                               f"bf16_{SHARD} cannot be read as a torch.save file"),
}


def truncate(path: Path) -> None:
    """``path`` cut to half its bytes: a copy interrupted, a quota hit while it was written."""
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, capsys):
    source, change, extra, words = BAD[case]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / source, ckpt)
    change(ckpt)
    assert_refused(ckpt, tmp_path / "run", capsys, words, *extra)


def fake_module(monkeypatch, name: str, **classes) -> None:
    """``name`` (and its parents) importable with ``classes`` in it, so that pickles naming DeepSpeed's classes
    are read and written here as DeepSpeed's own code writes them (DeepSpeed is not installed)."""
    for i in range(1, name.count(".") + 2):
        parent = ".".join(name.split(".")[:i])
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    for cls in classes.values():
        cls.__module__ = name
        setattr(sys.modules[name], cls.__qualname__, cls)


@pytest.fixture
def deepspeed_classes(monkeypatch):
    """Stand-ins named as the DeepSpeed classes an fp16 run's optimizer files and a curriculum run's arguments hold."""
    made = {"fragment_address": type("fragment_address", (), {}),
            "ZeroStageEnum": enum.IntEnum("ZeroStageEnum", {"disabled": 0, "optimizer_states": 1, "gradients": 2,
                                                            "weights": 3}),
            "LossScaler": type("LossScaler", (), {}), "DynamicLossScaler": type("DynamicLossScaler", (), {}),
            "CurriculumScheduler": type("CurriculumScheduler", (), {})}
    for name in made:
        made[name].__qualname__ = name
    fake_module(monkeypatch, "deepspeed.utils.tensor_fragment", a=made["fragment_address"])
    fake_module(monkeypatch, "deepspeed.runtime.zero.config", a=made["ZeroStageEnum"])
    fake_module(monkeypatch, "deepspeed.runtime.fp16.loss_scaler", a=made["LossScaler"], b=made["DynamicLossScaler"])
    fake_module(monkeypatch, "deepspeed.runtime.data_pipeline.curriculum_scheduler", a=made["CurriculumScheduler"])
    return made


def rewrite_optimizer(tag: Path, change) -> None:
    """Each data-parallel rank's optimizer file of a tag, ``change``d (``optimizer_state_dict`` in place)."""
    for file in tag.glob("*_optim_states.pt"):
        saved = torch.load(file, weights_only=False)
        change(saved["optimizer_state_dict"])
        torch.save(saved, file)


def test_an_fp16_curriculum_run_imports_and_adam_counts_its_own_steps(deepspeed_classes, tmp_path):
    """An fp16 run's dynamic loss scaler and a curriculum run's scheduler (objects of DeepSpeed's classes) are read
    as their attributes; Adam's step is the shards' (3), the schedule's Megatron's scheduler's (2 of 3 updates:
    one skipped, as fp16's loss scaler skips them)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "zero2_fp32_aligned", ckpt)
    scaler = deepspeed_classes["DynamicLossScaler"]()
    scaler.cur_scale, scaler.scale_window = 65536.0, 1000
    rewrite_optimizer(ckpt / "global_step3", lambda osd: osd.update(loss_scaler=scaler))
    curriculum = deepspeed_classes["CurriculumScheduler"]()
    curriculum.state = {"current_difficulty": 8}
    states = torch.load(ckpt / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    batch = states["args"].global_batch_size
    rewrite_states(ckpt / "global_step3", curriculum_scheduler=curriculum,
                   lr_scheduler={**states["lr_scheduler"], "num_steps": 2 * batch})
    assert run_cli("--from-megatron", ckpt, tmp_path / "run") == 0
    m, at, state, adam = restored(tmp_path / "run")
    schedule = next(n for n in jax.tree.leaves(state["opt_state"], is_leaf=lambda n: isinstance(
        n, optax.ScaleByScheduleState)) if isinstance(n, optax.ScaleByScheduleState))
    assert (at, int(adam.count), int(schedule.count)) == (ITERS, ITERS, 2)


def test_an_elastic_checkpoint_is_refused_in_one_line(deepspeed_classes, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "zero2_fp32_aligned", ckpt)
    rewrite_optimizer(ckpt / "global_step3", lambda osd: osd.update(
        base_optimizer_state=[osd["base_optimizer_state"]["state"][g] for g in (0, 1)]))
    assert_refused(ckpt, tmp_path / "run", capsys, "an elastic checkpoint")


def test_native_tensor_parallel_shards_read_through_their_universal_conversion(tmp_path, capsys):
    """A tensor-parallel run's native tag is read as its ``global_stepN_universal`` beside it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "zero2_fp32_aligned", ckpt)
    shutil.copytree(DATA / "zero2_fp32_aligned_universal" / "global_step3", ckpt / "global_step3_universal")
    rewrite_states(ckpt / "global_step3", tensor_model_parallel_size=2)
    assert run_cli("--from-megatron", ckpt, tmp_path / "run") == 0
    assert "tensor-parallel shards: read its conversion" in capsys.readouterr().err
    _, _, state, _ = restored(tmp_path / "run")
    np.testing.assert_array_equal(np.asarray(state["params"]["wte"])[VOCAB:], 0)  # the universal layout's rows
