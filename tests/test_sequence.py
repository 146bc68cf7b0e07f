"""Sequence parallelism (allgather, Ulysses, zigzag ring, USP) computes what one device computes.

8 fake CPU devices, float32, causal, three training steps on the same seed and data as
the single-device run (tests/multidevice.py); and ring attention's load balance, counted
per device (tests/sequence_balance.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import MLA, assert_same_training, run_layouts

IMPLS = ("allgather", "ring", "ulysses")
SP = lambda impl, **extra: {"parallel": {"sequence_impl": impl, **extra}}  # noqa: E731

LAYOUTS = {
    "single": {"eval": True},
    "single_rotary": {"model": {"position_embedding": "rotary"}},
    "single_gqa": {"model": {"num_kv_heads": 4}},
    "single_kv2": {"model": {"num_kv_heads": 2}},
    "single_dropout": {"model": {"dropout": 0.1}},
    "single_window": {"model": {"sliding_window": 5}},  # Mistral's: across the ring's and Ulysses' shards
    "single_mla": {"model": MLA},  # values narrower than queries and keys through the ring's merges
    "sequence2_data2_tensor2_ring_mla": {"mesh": {"sequence": 2, "data": 2, "tensor": 2}, **SP("ring"), "model": MLA},
    "sequence8_ring_window": {"mesh": {"sequence": 8}, **SP("ring"), "model": {"sliding_window": 5}},
    "sequence4_tensor2_ulysses_window": {"mesh": {"sequence": 4, "tensor": 2}, **SP("ulysses"),
                                         "model": {"sliding_window": 5}},
    **{f"sequence8_{impl}": {"mesh": {"sequence": 8}, **SP(impl), "eval": True} for impl in IMPLS},
    "sequence8_ring_rotary": {"mesh": {"sequence": 8}, **SP("ring"), "model": {"position_embedding": "rotary"}},
    "sequence4_tensor2_allgather": {"mesh": {"sequence": 4, "tensor": 2}, **SP("allgather")},
    "sequence4_tensor2_ring_megatron_sp": {"mesh": {"sequence": 4, "tensor": 2}, **SP("ring", megatron_sp=True)},
    "sequence4_tensor2_ulysses": {"mesh": {"sequence": 4, "tensor": 2}, **SP("ulysses")},
    "sequence2_data2_tensor2_allgather": {"mesh": {"sequence": 2, "data": 2, "tensor": 2}, **SP("allgather")},
    "sequence2_data2_tensor2_ring_dropout": {"mesh": {"sequence": 2, "data": 2, "tensor": 2}, **SP("ring"),
                                             "model": {"dropout": 0.1}},
    "sequence2_data2_tensor2_ulysses_gqa": {"mesh": {"sequence": 2, "data": 2, "tensor": 2}, **SP("ulysses"),
                                            "model": {"num_kv_heads": 4}},
    # USP: ulysses in groups of ulysses_degree devices, ring over the groups; by default a node's devices
    # (mesh.sequence) form a group and the ring crosses the nodes (dcn_sequence)
    "sequence2_dcn_sequence4_usp": {"mesh": {"sequence": 2, "dcn_sequence": 4}, **SP("usp"), "eval": True},
    "sequence4_tensor2_usp2_megatron_sp": {"mesh": {"sequence": 4, "tensor": 2},  # and the MLP in 2 chunks
                                           **SP("usp", ulysses_degree=2, megatron_sp=True), "model": {"mlp_chunks": 2}},
    "sequence4_pipeline2_usp2_1f1b": {"mesh": {"sequence": 4, "pipeline": 2},
                                      **SP("usp", ulysses_degree=2, pipeline_schedule="1f1b")},
    # fewer key/value heads than a group's devices: each repeated (2 heads over groups of 4; ulysses alike)
    "sequence8_usp4_kv2": {"mesh": {"sequence": 8}, **SP("usp", ulysses_degree=4), "model": {"num_kv_heads": 2}},
    "sequence2_pipeline2_data2_ring": {"mesh": {"sequence": 2, "pipeline": 2, "data": 2}, **SP("ring"), "eval": True},
    "sequence2_pipeline2_data2_ulysses": {"mesh": {"sequence": 2, "pipeline": 2, "data": 2}, **SP("ulysses")},
    # ZeRO over data x fsdp x sequence: the sequence devices hold shards of the model state, as data-parallel ones do
    **{f"sequence4_{axis}2_{impl}_zero{stage}": {"mesh": {"sequence": 4, axis: 2}, **SP(impl, zero_stage=stage)}
       for impl, stage, axis in (("ulysses", 1, "data"), ("ulysses", 2, "fsdp"), ("ulysses", 3, "data"),
                                 ("ring", 1, "fsdp"), ("ring", 2, "data"), ("ring", 3, "fsdp"))},
    "sequence2_pipeline2_data2_ring_zero3": {"mesh": {"sequence": 2, "pipeline": 2, "data": 2},
                                             **SP("ring", zero_stage=3, pipeline_schedule="1f1b")},
    # config errors, raised by config.resolve before anything compiles
    "error_usp_heads": {"mesh": {"sequence": 8}, **SP("usp", ulysses_degree=4),
                        "model": {"num_attention_heads": 2, "num_kv_heads": 2}},
    "error_usp_degree": {"mesh": {"sequence": 4, "dcn_sequence": 2}, **SP("usp", ulysses_degree=3)},
    "error_ulysses_degree_without_usp": {"mesh": {"sequence": 8}, **SP("ring", ulysses_degree=2)},
    "error_ulysses_heads": {"mesh": {"sequence": 4, "tensor": 2}, **SP("ulysses"),
                            "model": {"num_attention_heads": 4, "num_kv_heads": 4}},
    "error_ring_length": {"mesh": {"sequence": 8}, **SP("ring"), "train": {"seq_length": 24}},
}
REFERENCE = {"rotary": "single_rotary", "gqa": "single_gqa", "kv2": "single_kv2", "dropout": "single_dropout",
             "window": "single_window", "mla": "single_mla"}


@pytest.fixture(scope="module")
def results():
    return run_layouts(LAYOUTS, timeout=900)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n.startswith("sequence")])
def test_sequence_layout_matches_single_device(results, name):
    ref = results[next((r for k, r in REFERENCE.items() if name.endswith(k)), "single")]
    got = results[name]
    assert_same_training(got, ref)
    if got["eval_loss"] is not None:  # the eval step (ring: reordered like the train step) on the trained parameters
        np.testing.assert_allclose(got["eval_loss"], ref["eval_loss"], rtol=1e-5)


def test_zero_divides_the_model_state_over_the_sequence_devices(results):
    """ZeRO's shards span sequence x data (x fsdp): 1/8 of the single device's bytes on 8 devices, where
    the sequence devices used to hold full replicas (1/2 with data 2)."""
    ref = results["single"]
    for name, opt, params in (("sequence4_data2_ulysses_zero1", 8, 1), ("sequence4_fsdp2_ring_zero1", 8, 2),
                              ("sequence4_data2_ring_zero2", 8, 1), ("sequence4_data2_ulysses_zero3", 8, 8),
                              ("sequence4_fsdp2_ring_zero3", 8, 8),
                              ("sequence2_pipeline2_data2_ring_zero3", 6, 6)):  # embeddings: not over pipeline
        got = results[name]
        assert got["opt_bytes"] <= ref["opt_bytes"] / opt * 1.05, name  # biases of heads and MLP: replicated
        assert got["param_bytes"] <= ref["param_bytes"] / params * 1.05, name
        if params == 1:
            assert got["param_bytes"] == ref["param_bytes"], name


@pytest.mark.parametrize("name, key, text", [
    ("error_usp_heads", "model.num_attention_heads", "mesh.tensor x parallel.ulysses_degree = 4"),
    ("error_usp_degree", "parallel.ulysses_degree", "must divide the sequence devices (mesh.sequence x "
                                                    "mesh.dcn_sequence = 8)"),
    ("error_ulysses_degree_without_usp", "parallel.ulysses_degree", "set parallel.sequence_impl=usp"),
    ("error_ulysses_heads", "model.num_attention_heads", "parallel.sequence_impl=ulysses"),
    ("error_ring_length", "train.seq_length", "2 x mesh.sequence"),
])
def test_sequence_config_errors(results, name, key, text):
    assert results[name]["key"] == key
    assert text in results[name]["config_error"]


def test_ring_zigzag_balances_attention_work():
    script = Path(__file__).with_name("sequence_balance.py")
    r = json.loads(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                                  check=True).stdout)
    ring, contiguous = np.array(r["ring_zigzag"]["pairs"]), np.array(r["allgather_contiguous"]["pairs"])
    # every causally visible pair computed exactly once, over all devices
    np.testing.assert_allclose(ring.sum(), r["needed_pairs"], rtol=1e-6)
    np.testing.assert_allclose(contiguous.sum(), r["needed_pairs"], rtol=1e-6)
    # zigzag: equal per-device work; contiguous: the last device needs 13x the first's
    assert ring.max() <= 1.05 * ring.min(), ring
    assert contiguous.max() >= 3 * contiguous.min(), contiguous
    # and the work the ring issues is mostly needed: one masked diagonal block pair of n + 1
    useful_flops = ring.mean() * r["flops_per_pair"]
    assert useful_flops / r["ring_zigzag"]["flops"] >= 8 / 9 - 0.01, (useful_flops, r["ring_zigzag"]["flops"])


def test_ring_sends_the_next_block_before_the_attention():
    """Double buffering: in every loop body of ring attention, forward and backward, no matmul reads what
    the body's collective permutes receive (tests/ring_overlap.py), so XLA may overlap the two; the ring
    sending first and attending to what it received (the loop before) had 4 and 12 such matmuls."""
    script = Path(__file__).with_name("ring_overlap.py")
    r = json.loads(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                                  check=True).stdout)
    assert len(r["forward"]) == 1 and len(r["backward"]) == 2, r  # the backward recomputes the forward's loop
    for permutes, waiting in r["forward"] + r["backward"]:
        assert permutes >= 3 and waiting == 0, r
