"""Pipeline parallelism computes what one device computes (8 fake CPU devices, float32, 3 steps)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import MLA, assert_same_training, run_layouts

from jaxllm import config, train
from jaxllm.parallel import schedules
from jaxllm.resolve import resolve

L4 = {"num_layers": 4}
INTERLEAVED2 = {"pipeline_schedule": "interleaved", "pipeline_virtual_stages": 2}
MTP = {**L4, **MLA, "mtp_num_layers": 2, "dropout": 0.1}
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
    # multi-token prediction's two depths after the forward loop, spread over the stages, with DeepSeek-V3's
    # attention (multi-head latent attention) in the stages and the depths
    "single_mtp": {"model": MTP},
    "pipeline2_tensor2_data2_mtp": {"mesh": {"pipeline": 2, "tensor": 2, "data": 2}, "model": MTP},
    "pipeline2_interleaved2_mtp": {"mesh": {"pipeline": 2}, "parallel": INTERLEAVED2, "model": MTP},
}


FULL = {"remat": "full"}
DROPOUT = {"dropout": 0.1}
# The 1F1B family: each schedule once against the single-device run, the three layouts sharing out the
# acceptance list (pipeline 2 and 4, x data 2, x tensor 2, x sequence 2 (ring; allgather), 2 virtual
# stages; no remat, full remat, save_dots) with dropout (the keys of every chunk, row and token: the
# same masks with 4 microbatches of 4 rows as with 8 of 2, and in ring attention's reordered sequence),
# ZeRO-3 and megatron_sp riding along.  Only three, as each compiles its own fused loop: this module
# must stay quick on 2 cores.
FUSED = {
    "1f1b_pipeline2_data2_sequence2_ring_zero3_dropout": {
        "mesh": {"pipeline": 2, "data": 2, "sequence": 2}, "model": {**L4, **DROPOUT},
        "parallel": {"pipeline_schedule": "1f1b", "zero_stage": 3, "sequence_impl": "ring"}},
    "zb_h1_pipeline4_tensor2_megatron_sp_save_dots_dropout": {
        "mesh": {"pipeline": 4, "tensor": 2}, "parallel": {"pipeline_schedule": "zb_h1", "megatron_sp": True},
        "model": {**L4, "remat": "save_dots", **DROPOUT}},
    "interleaved_1f1b_pipeline2_tensor2_sequence2_remat_full_dropout": {
        "mesh": {"pipeline": 2, "tensor": 2, "sequence": 2},
        "parallel": {**INTERLEAVED2, "pipeline_schedule": "interleaved_1f1b"}, "model": {**L4, **FULL, **DROPOUT}},
}
LAYOUTS.update(FUSED)


@pytest.fixture(scope="module")
def results():
    return run_layouts(LAYOUTS, timeout=1800)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.startswith("single")])
def test_pipeline_matches_single_device(results, name):
    ref, got = results["single_mtp" if "mtp" in name else "single_dropout" if "dropout" in name else "single"], results[
        name]
    assert_same_training(got, ref)
    np.testing.assert_allclose([m.get("mtp_loss", 0) for m in got["moe"]], [m.get("mtp_loss", 0) for m in ref["moe"]],
                               rtol=1e-5)


def test_pipelined_eval_step_matches_single_device(results):
    assert results["pipeline2"]["eval_loss"] == pytest.approx(results["single"]["eval_loss"], rel=1e-5)


def test_bubble_fraction():
    assert schedules.bubble_fraction(4, 1, 4) == pytest.approx(3 / 7)
    assert schedules.bubble_fraction(4, 2, 8) == pytest.approx(3 / 19)
    assert schedules.bubble_fraction(1, 1, 8) == 0


CASES = [("1f1b", 2, 1, 2), ("1f1b", 4, 1, 8), ("1f1b", 3, 1, 9), ("interleaved_1f1b", 2, 2, 4),
         ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 3, 3, 6), ("zb_h1", 2, 1, 4), ("zb_h1", 4, 1, 12)]


@pytest.mark.parametrize("schedule, p, v, m", CASES)
def test_timetable_respects_the_dependencies(schedule, p, v, m):
    """Every (microbatch, virtual stage) is forwarded and backwarded exactly once, each after what it
    depends on; the stash slots never hold two items at once; W follows its B on the same stage."""
    tt = schedules.timetable(schedule, p, v, m)
    f_at, b_at, w_at = {}, {}, {}
    for t in range(len(tt.forward)):
        for s in range(p):
            if tt.forward[t, s] >= 0:
                f_at[tt.forward[t, s], tt.forward_chunk[t, s] * p + s] = t
            if tt.backward[t, s] >= 0:
                b_at[tt.backward[t, s], tt.backward_chunk[t, s] * p + s] = t
            if tt.weight[t, s] >= 0:
                w_at[tt.weight[t, s], s] = t
    items = {(i, j) for i in range(m) for j in range(p * v)}
    assert set(f_at) == items and set(b_at) == items and len(f_at) == len(b_at) == m * p * v
    last = p * v - 1
    for i, j in items:
        if j > 0:  # the previous virtual stage's output arrives by one roll
            assert f_at[i, j] > f_at[i, j - 1]
        if j < last:  # the next virtual stage's input gradient arrives by one roll
            assert b_at[i, j] > b_at[i, j + 1]
        assert b_at[i, j] >= f_at[i, j]
    assert all(b_at[i, last] == f_at[i, last] for i in range(m))  # the head's gradient seeds it in place
    if schedule == "zb_h1":
        assert set(w_at) == {(i, s) for i in range(m) for s in range(p)}
        assert all(w_at[i, s] >= b_at[i, s] for i, s in w_at)
        assert len({t for (i, _), t in w_at.items()}) == m  # W of a microbatch: one iteration on every stage
    else:
        assert not w_at
    # stash: every slot holds one forwarded, not yet backwarded item; the peak is what is allocated
    peak = 0
    for s in range(p):
        holding = {}
        for t in range(len(tt.forward)):
            if tt.forward[t, s] >= 0:
                assert tt.stash_write[t, s] not in holding
                holding[tt.stash_write[t, s]] = (tt.forward[t, s], tt.forward_chunk[t, s])
            peak = max(peak, len(holding))
            if tt.backward[t, s] >= 0:
                assert holding.pop(tt.stash_read[t, s]) == (tt.backward[t, s], tt.backward_chunk[t, s])
    assert tt.stash == peak == min(m * v, p * v + p - 1)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 8), (4, 32), (8, 64)])
def test_stats_against_hand_formulas(p, m):
    """1F1B's lockstep bubble is GPipe's; zb_h1 (slot costs F 1, recomputed F + B 2, W 1) takes W out of
    the warm-up and cool-down: 3 (p - 1) / (4 m + 3 (p - 1)); interleaving divides by v."""
    assert schedules.stats("1f1b", p, 1, m).bubble == pytest.approx((p - 1) / (m + p - 1))
    assert schedules.stats("interleaved_1f1b", p, 2, m).bubble == pytest.approx((p - 1) / (2 * m + p - 1))
    assert schedules.stats("zb_h1", p, 1, m).bubble == pytest.approx(3 * (p - 1) / (4 * m + 3 * (p - 1)))
    assert schedules.stats("gpipe", p, 1, m).in_flight == m  # all of them, as residuals
    assert schedules.stats("1f1b", p, 1, m).in_flight == min(m, 2 * p - 1)  # independent of m
    assert schedules.stats("zb_h1", p, 1, m).deferred == p


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
    ({"parallel": {"pipeline_schedule": "interleaved_1f1b"}}, "parallel.pipeline_virtual_stages", "needs >= 2"),
    ({"parallel": {"pipeline_virtual_stages": 2}}, "parallel.pipeline_virtual_stages", "gpipe needs exactly 1"),
    ({"parallel": {"pipeline_schedule": "zb_h1", "pipeline_virtual_stages": 2}}, "parallel.pipeline_virtual_stages",
     "zb_h1 needs exactly 1"),
    ({"parallel": {"pipeline_schedule": "2f2b"}}, "parallel.pipeline_schedule",
     "gpipe, interleaved, 1f1b, interleaved_1f1b, zb_h1"),
])
def test_pipeline_config_errors(sections, key, words):
    with pytest.raises(config.ConfigError) as e:
        resolve(_config(**sections), num_devices=8)
    assert e.value.key == key and words in str(e.value), str(e.value)


@pytest.mark.parametrize("parallel, note", [
    ({}, "4 pipeline stages (gpipe, bubble 27.3%, 8 microbatches in flight per stage)"),
    ({"pipeline_schedule": "1f1b"}, "4 pipeline stages (1f1b, bubble 27.3%, 7 microbatches in flight per stage)"),
    ({"pipeline_schedule": "zb_h1"}, "4 pipeline stages (zb_h1, bubble 22.0%, 7 microbatches in flight per stage, "
                                     "4 awaiting W)"),
    ({"pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2},
     "4 x 2 virtual pipeline stages (interleaved_1f1b, bubble 15.8%, 11 microbatch-chunks in flight per stage)"),
])
def test_log_line_reports_bubble_and_stash(parallel, note):
    cfg = _config(mesh={"pipeline": 4, "data": 2}, parallel=parallel, model={"num_layers": 8},
                  train={"micro_batch_size": 1})
    assert train.pipeline_note(resolve(cfg, num_devices=8)) == " through " + note


def test_plan_reports_the_schedule():
    r = subprocess.run([sys.executable, "-m", "jaxllm.plan", "--config=configs/gpt3.py:GPT125M", "--devices=8",
                        "--config.model.num_layers=4", "--config.train.seq_length=128",
                        "--config.mesh.pipeline=4", "--config.mesh.data=2", "--config.train.global_batch_size=8",
                        "--config.parallel.pipeline_schedule=1f1b"],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("pipeline: 4 stages x 1 virtual, 4 microbatches, 1f1b, bubble 42.9%, 4 microbatches in flight per stage"
            in r.stdout), r.stdout
