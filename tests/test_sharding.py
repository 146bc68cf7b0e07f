"""Every parallel layout computes what one device computes (8 fake CPU devices, float32, 3 steps)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import MLA, assert_same_training, run_layouts

from jaxllm import config
from jaxllm.families import llama
from jaxllm.parallel import sharding

QWEN = {**llama.PRESET, "add_qkv_bias": True, "qk_layernorm": True, "use_rope_scaling": True,
        "rope_original_max_position_embeddings": 16, "sliding_window": 6}
LAYOUTS = {
    "single": {"eval": True},
    "data8": {"mesh": {"data": 8}, "eval": True},
    "fsdp8": {"mesh": {"fsdp": 8}},
    "tensor4_data2": {"mesh": {"tensor": 4, "data": 2}},
    "tensor2_fsdp2_data2_megatron_sp": {"mesh": {"tensor": 2, "fsdp": 2, "data": 2}, "parallel": {"megatron_sp": True},
                                        "eval": True},
    "zero1_data8": {"mesh": {"data": 8}, "parallel": {"zero_stage": 1}},
    "zero2_data8": {"mesh": {"data": 8}, "parallel": {"zero_stage": 2}},
    "zero3_data8": {"mesh": {"data": 8}, "parallel": {"zero_stage": 3}, "eval": True},
    "single_gqa": {"model": {"num_kv_heads": 4}},
    "tensor4_gqa": {"mesh": {"tensor": 4, "data": 2}, "model": {"num_kv_heads": 4}},
    "fill_data_tensor2": {"mesh": {"data": -1, "tensor": 2}},
    # Qwen2's query/key/value biases without other biases, Qwen3's per-head query/key norms, Llama 3.1's rotary
    # scaling, Mistral's sliding window
    "single_qwen": {"model": QWEN},
    "tensor2_fsdp2_data2_qwen": {"mesh": {"tensor": 2, "fsdp": 2, "data": 2}, "model": QWEN},
    # the heads over tensor, the latent projections' embed over fsdp
    "single_mla": {"model": MLA},
    "tensor2_fsdp2_data2_mla": {"mesh": {"tensor": 2, "fsdp": 2, "data": 2}, "model": MLA},
    # multi-token prediction's two depths (their modules' parameters, the rolled tokens over the batch's layout,
    # their dropout keys)
    "single_mtp": {"model": {"mtp_num_layers": 2, "dropout": 0.1}},
    "tensor2_fsdp2_data2_mtp": {"mesh": {"tensor": 2, "fsdp": 2, "data": 2},
                                "model": {"mtp_num_layers": 2, "dropout": 0.1}},
    "hybrid_dcn_data2_tensor2_fsdp2": {"mesh": {"dcn_data": 2, "tensor": 2, "fsdp": 2}},
    "tensor8_kv2": {"mesh": {"tensor": 8}, "model": {"num_kv_heads": 2}},
    # a kernel (here Pallas, interpreted on CPU) runs per shard under shard_map, against XLA attention on one device
    "tensor2_fsdp2_data2_pallas": {"mesh": {"tensor": 2, "fsdp": 2, "data": 2}, "model": {"attention_impl": "pallas"}},
    # compiled only: a vocabulary (96 rows, 48 x tensor 2: no padding) that no other dimension of the model shares
    "hlo_tensor2_fsdp2_data2": {"mesh": {"tensor": 2, "fsdp": 2, "data": 2}, "hlo": True,
                                "model": {"vocab_size": 96, "make_vocab_size_divisible_by": 48}},
}


@pytest.fixture(scope="module")
def results():
    return run_layouts(LAYOUTS, timeout=900)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.startswith(("single", "hlo")) and n != "tensor8_kv2"])
def test_layout_matches_single_device(results, name):
    single = next((f"single_{kind}" for kind in ("gqa", "qwen", "mla", "mtp") if kind in name), "single")
    ref, got = results[single], results[name]
    assert_same_training(got, ref)
    np.testing.assert_allclose([m.get("mtp_loss", 0) for m in got["moe"]], [m.get("mtp_loss", 0) for m in ref["moe"]],
                               rtol=1e-5)


@pytest.mark.parametrize("name", ["data8", "zero3_data8", "tensor2_fsdp2_data2_megatron_sp"])
def test_evaluation_of_200_batches_matches_single_device(results, name):
    """The validation loss of 200 batches on 8 devices (one program over the stacked batches; as
    200 executions in flight it aborted XLA:CPU's collectives) equals the single-device one."""
    assert results[name]["eval_loss"] == pytest.approx(results["single"]["eval_loss"], rel=1e-5)


def test_embedding_and_output_layer_are_not_replicated(results):
    """On tensor 2 x fsdp 2 x data 2 no per-device array of the train step spans the whole padded
    vocabulary (96 rows): the embedding lookup, output layer and loss, and their gradients, see only
    the device's 48-row shard (Megatron-LM's vocabulary-parallel layers, jaxllm.parallel.vocab_parallel).  A
    plain ``table[ids]`` gather makes the SPMD partitioner replicate the table ("Involuntary full
    rematerialization", an all-gather to f32[96,64]), which fails both assertions."""
    got = results["hlo_tensor2_fsdp2_data2"]
    assert got["partitioner_warnings"] == []
    assert got["vocab_shapes"] == []
    assert "f32[48,64]" in got["shard_shapes"]  # the table's shard (48 of 96 rows, 64 of 128 columns): seen


def test_tensor_8_with_2_kv_heads_is_a_config_error(results):
    assert results["tensor8_kv2"]["key"] == "model.num_kv_heads"
    assert "mesh.tensor = 8" in results["tensor8_kv2"]["config_error"]


def test_fsdp_divides_parameter_and_optimizer_bytes(results):
    ref, fsdp = results["single"], results["fsdp8"]
    assert fsdp["param_bytes"] + fsdp["opt_bytes"] <= (ref["param_bytes"] + ref["opt_bytes"]) / 8 * 1.05


def test_zero1_divides_optimizer_bytes_only(results):
    ref, zero1 = results["single"], results["zero1_data8"]
    assert zero1["opt_bytes"] <= ref["opt_bytes"] / 8 * 1.05
    assert zero1["param_bytes"] == ref["param_bytes"]
    assert results["zero3_data8"]["param_bytes"] <= ref["param_bytes"] / 8 * 1.05


def test_rules_table_specs():
    cfg = config.get_config()
    table = sharding.rules(cfg)
    P = sharding.PartitionSpec
    qkv = ("layers", "embed", "heads", "head_dim")
    assert sharding.logical_to_spec(qkv, table) == P("pipeline", "fsdp", "tensor", None)
    assert sharding.logical_to_spec(("vocab", "embed"), table) == P("tensor", "fsdp")
    # an activation's act_embed is never split (its batch is over data, fsdp and expert); a weight's embed is
    assert sharding.logical_to_spec(("batch", "length", "act_embed"), table) == P(("data", "fsdp", "expert"),
                                                                                  "sequence", None)
    with pytest.raises(ValueError, match="mesh axis twice"):
        sharding.logical_to_spec(("batch", "length", "embed"), table)
    cfg.parallel.megatron_sp = True
    assert sharding.logical_to_spec(("batch", "residual", "act_embed"), sharding.rules(cfg)) == P(
        ("data", "fsdp", "expert"), ("sequence", "tensor"), None)
    assert sharding.rules(cfg, zero=True)["embed"] == ("fsdp", "data", "expert", "sequence")
    # an expert's weights: the experts over expert, its embed dimension over the axes holding its replicas
    experts = ("experts", "expert_embed", "expert_mlp")
    assert sharding.logical_to_spec(experts, table) == P("expert", "fsdp", "tensor")
    assert sharding.logical_to_spec(experts, sharding.rules(cfg, zero=True)) == P("expert", ("fsdp", "data",
                                                                                               "sequence"), "tensor")


def test_plan_gpt1_5b_on_8_devices_with_fsdp():
    """The acceptance command: compiles ahead of time and reports 16 bytes/param / 8 of model state."""
    r = subprocess.run([sys.executable, "-m", "jaxllm.plan", "--config=configs/gpt3.py:GPT1_5B", "--devices=8",
                        "--config.mesh.fsdp=8", "--device=H200"], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    n = float(out.split("B parameters")[0].split()[-1]) * 1e9
    state_gib = float(out.split("model state (sum)")[1].split("GiB")[0])
    assert abs(state_gib * 2**30 - 16 * n / 8) / (16 * n / 8) < 0.10, out
    for part in ("parameters", "gradients", "optimizer state"):  # the division, as the rules table makes it
        assert out.split(f"\n  {part} ")[1].split("\n")[0].endswith("(embed over fsdp 8)"), out
    assert "FITS in H200" in out or "DOES NOT FIT in H200" in out


def test_plan_config_error_exits_2():
    r = subprocess.run([sys.executable, "-m", "jaxllm.plan", "--config=configs/gpt3.py:GPT125M", "--devices=8",
                        "--config.mesh.tensor=8", "--config.model.num_attention_heads=12"], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and r.stderr.startswith("config error: model.num_attention_heads=12"), r.stderr


def test_zero_tables_split_the_stages_parts():
    """ZeRO-1 splits the optimizer state over the data-parallel axes, ZeRO-2 also the gradients, ZeRO-3 also
    the parameters (DeepSpeed's stages); the fsdp axis splits all three at every stage."""
    cfg = config.get_config()
    plain, zero = ("fsdp",), ("fsdp", "data", "expert", "sequence")
    for stage, want in enumerate([(plain, plain, plain), (plain, plain, zero), (plain, zero, zero),
                                  (zero, zero, zero)]):
        cfg.parallel.zero_stage = stage
        tables = sharding.zero_tables(cfg)
        assert (tables.params["embed"], tables.grads["embed"], tables.opt_state["embed"]) == want, stage
        assert tables.opt_state["expert_embed"] == (("fsdp", "data", "sequence") if stage else ("fsdp",))
