"""ZeRO and FSDP over data-parallel sizes that do not divide the hidden size: the split dimensions are
stored padded (:func:`jaxllm.parallel.sharding.stored`) and every layout trains as one device does."""

import pytest

from tests.harness import assert_same_training, run_layouts

# hidden 64 over 6 or 3 devices: stored as 66 rows; a global batch of 12 rows splits over 6, 4 and 3
MODEL = {"hidden_size": 64, "num_attention_heads": 4}
UNEVEN = 66


def layout(mesh, micro, **parallel):
    return {"mesh": mesh, "model": MODEL, "train": {"global_batch_size": 12, "micro_batch_size": micro},
            "parallel": parallel}


LAYOUTS = {
    "single": layout({}, 6),
    "zero1_data6": {**layout({"data": 6}, 1, zero_stage=1), "restore_on": {"data": 4}},
    "zero2_data6": layout({"data": 6}, 1, zero_stage=2),
    "zero3_data6": layout({"data": 6}, 1, zero_stage=3),
    "zero2_data3_tensor2": layout({"data": 3, "tensor": 2}, 2, zero_stage=2),
    "fsdp3_pipeline2_1f1b": layout({"fsdp": 3, "pipeline": 2}, 2, pipeline_schedule="1f1b"),
}


@pytest.fixture(scope="module")
def results():
    return run_layouts(LAYOUTS)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_uneven_layout_trains_as_one_device(results, name):
    got = results[name]
    assert_same_training(got, results["single"])
    assert any(UNEVEN in shape for shape in got["stored_shapes"]), got["stored_shapes"]  # padding was needed


def test_zero_stages_divide_the_padded_state(results):
    ref = results["single"]
    assert results["zero1_data6"]["param_bytes"] == ref["param_bytes"]  # ZeRO-1: parameters replicated
    for name in ("zero1_data6", "zero2_data6", "zero3_data6"):
        assert results[name]["opt_bytes"] <= ref["opt_bytes"] / 6 * 1.1, name
    assert results["zero3_data6"]["param_bytes"] <= ref["param_bytes"] / 6 * 1.1


def test_checkpoint_of_data6_restores_on_data4(results):
    restored = results["zero1_data6"]["restored"]
    assert restored["equal"], restored
    assert not any(UNEVEN in shape for shape in restored["stored_shapes"])  # data 4 divides 64: no padding
