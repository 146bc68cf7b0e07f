"""Pipeline parallelism computes what one device computes (8 fake CPU devices, float32, 3 steps)."""

import subprocess
import sys
from pathlib import Path

import pytest
from harness import assert_same_training, run_layouts

from jaxllm import config, pipeline, train

L4 = {"num_layers": 4}
INTERLEAVED2 = {"pipeline_schedule": "interleaved", "pipeline_virtual_stages": 2}
# tests/multidevice.py's batch: global 16, micro batch 2, so 8 microbatches / data-parallel size.
LAYOUTS = {
    "single": {"model": L4, "eval": True},
    "pipeline2": {"mesh": {"pipeline": 2}, "model": L4, "eval": True},
    "pipeline4": {"mesh": {"pipeline": 4}, "model": L4},
    "pipeline4_data2": {"mesh": {"pipeline": 4, "data": 2}, "model": L4},
    "pipeline2_tensor2_data2": {"mesh": {"pipeline": 2, "tensor": 2, "data": 2}, "model": L4},
    "pipeline2_interleaved2_m8": {"mesh": {"pipeline": 2}, "parallel": INTERLEAVED2, "model": L4},
    "pipeline2_interleaved2_m2": {"mesh": {"pipeline": 2}, "parallel": INTERLEAVED2, "model": L4,
                                  "train": {"micro_batch_size": 8}},
    "pipeline4_remat_full": {"mesh": {"pipeline": 4}, "model": {**L4, "remat": "full"}},
    "pipeline2_fsdp2_megatron_sp": {"mesh": {"pipeline": 2, "fsdp": 2, "tensor": 2},
                                    "parallel": {"megatron_sp": True}, "model": L4},
    "single_dropout": {"model": {**L4, "dropout": 0.1}},
    "pipeline2_dropout": {"mesh": {"pipeline": 2}, "model": {**L4, "dropout": 0.1}},
}


@pytest.fixture(scope="module")
def results():
    return run_layouts(LAYOUTS, timeout=1200)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.startswith("single")])
def test_pipeline_matches_single_device(results, name):
    ref, got = results["single_dropout" if "dropout" in name else "single"], results[name]
    assert_same_training(got, ref)


def test_pipelined_eval_step_matches_single_device(results):
    assert results["pipeline2"]["eval_loss"] == pytest.approx(results["single"]["eval_loss"], rel=1e-5)


def test_bubble_fraction():
    assert pipeline.bubble_fraction(4, 1, 4) == pytest.approx(3 / 7)
    assert pipeline.bubble_fraction(4, 2, 8) == pytest.approx(3 / 19)
    assert pipeline.bubble_fraction(1, 1, 8) == 0


def _config(**sections):
    cfg = config.get_config()
    cfg.model.update(num_layers=4, vocab_size=256)
    cfg.train.update(micro_batch_size=2, global_batch_size=16)
    for section, values in sections.items():
        getattr(cfg, section).update(**values)
    return cfg


@pytest.mark.parametrize("sections, key, words", [
    ({"mesh": {"pipeline": 8}}, "model.num_layers", "pipeline stages x virtual stages (mesh.pipeline x "
                                                    "parallel.pipeline_virtual_stages) = 8 x 1"),
    ({"mesh": {"pipeline": 2, "data": 4}, "parallel": INTERLEAVED2, "model": {"num_layers": 6}},
     "model.num_layers", "= 2 x 2 = 4"),
    ({"mesh": {"pipeline": 4, "data": 2}, "train": {"global_batch_size": 10}}, "train.global_batch_size",
     "must be divisible by train.micro_batch_size x data-parallel size"),
    ({"mesh": {"pipeline": 4, "data": 2}, "train": {"global_batch_size": 4}}, "train.global_batch_size",
     "gives 1 microbatches"),
    ({"mesh": {"pipeline": 4, "data": 2}, "train": {"global_batch_size": 24}}, "train.global_batch_size",
     "must be a multiple of the 4 pipeline stages"),
    ({"parallel": {"pipeline_schedule": "interleaved"}}, "parallel.pipeline_virtual_stages", "needs >= 2"),
    ({"parallel": {"pipeline_virtual_stages": 2}}, "parallel.pipeline_virtual_stages", "gpipe exactly 1"),
    ({"parallel": {"pipeline_schedule": "1f1b"}}, "parallel.pipeline_schedule", "gpipe, interleaved"),
])
def test_pipeline_config_errors(sections, key, words):
    with pytest.raises(config.ConfigError) as e:
        config.resolve(_config(**sections), num_devices=8)
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_log_line_and_plan_report_the_bubble():
    cfg = config.resolve(_config(mesh={"pipeline": 4, "data": 2}), num_devices=8)
    assert train.pipeline_note(cfg) == " through 4 pipeline stages (gpipe, bubble 42.9%)"
    r = subprocess.run([sys.executable, "-m", "jaxllm.plan", "--config=configs/gpt3.py:GPT125M", "--devices=8",
                        "--config.model.num_layers=4", "--config.train.seq_length=128",
                        "--config.mesh.pipeline=4", "--config.mesh.data=2", "--config.train.global_batch_size=8"],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pipeline: 4 stages x 1 virtual, 4 microbatches, bubble 42.9%" in r.stdout, r.stdout
