"""The collectives of a compiled step per mesh axis (jaxllm.analysis.collectives) and the step-time model
on a cluster (jaxllm.analysis.step_time, ``jaxllm.plan --cluster``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.analysis import collectives, step_time
from jaxllm.analysis.collectives import Traffic
from jaxllm.platform import hlo
from jaxllm.platform.hardware import CLUSTERS, Cluster

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from jaxllm import config
from jaxllm.analysis.collectives import collectives
from jaxllm.resolve import resolve
from jaxllm.runtime.run import Run

out = {}
for name, (layers, mesh, microbatches) in json.loads(sys.argv[1]).items():
    c = config.get_config()
    c.model.update(num_layers=layers, hidden_size=64, num_attention_heads=4, vocab_size=256, dtype="float32",
                   remat="full")
    c.train.update(seq_length=32, micro_batch_size=1, global_batch_size=mesh.get("data", 1) * microbatches)
    c.mesh.update(**mesh)
    cfg = resolve(c, num_devices=8)
    run = Run(cfg)
    batch = jax.ShapeDtypeStruct(cfg.batch_shape, "int32", sharding=run.batch_sharding)
    hlo = run.train_step.lower(run.abstract_state, batch, batch).compile().as_text()
    params = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(run.logical_state["params"]))
    table = run.logical_state["params"]["wte"].size * 4
    out[name] = {"params": params, "table": table, "traffic": {" x ".join(k): v.__dict__ for k, v in
                                                collectives(hlo, dict(run.mesh.shape)).items()}}
sys.stdout.write(json.dumps(out))
"""

PROGRAMS = {"data8": (2, {"data": 8}, 1), "data8_micro4": (2, {"data": 8}, 4),
            "data4_tensor2_micro4": (2, {"tensor": 2, "data": 4}, 4),
            **{f"tensor2_{n}layers": (n, {"tensor": 2, "data": 4}, 1) for n in (2, 4, 6)}}


@pytest.fixture(scope="module")
def compiled():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(PROGRAMS)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_data_parallel_step_sends_a_ring_all_reduce_of_the_gradients(compiled):
    got = compiled["data8"]
    assert set(got["traffic"]) == {"data"}
    data = got["traffic"]["data"]
    assert set(data["kinds"]) == {"all-reduce"}
    # float32 gradients, a ring all-reduce over 8 devices sends 2 x 7/8 of them; the tied table's two
    # gradients (embedding and output layer) are reduced apart, and the loss's scalars add a few bytes
    expected = 2 * 7 / 8 * (got["params"] + got["table"])
    assert expected <= data["wire"] <= expected * 1.001, (data["wire"], expected)


def test_data_parallel_gradients_are_reduced_once_per_step_not_per_micro_batch(compiled):
    """Four micro batches send over ``data`` one all-reduce of the gradients (step.reduces_once): the
    replicas' gradients are accumulated apart and summed after the last micro batch, not all-reduced inside
    the layer scan's backward of each (four times one micro batch's bytes before).  The tied table's two
    gradients are added before it, so it is less than one micro batch sends.  Tensor parallelism's own
    collectives still run per micro batch."""
    got = compiled["data8_micro4"]
    four, one = got["traffic"]["data"], compiled["data8"]["traffic"]["data"]
    expected = 2 * 7 / 8 * got["params"]
    assert four["ops"] == 1 and expected <= four["wire"] <= expected * 1.001, (four, expected)
    assert four["wire"] < one["wire"], (four, one)
    mixed, per_micro = compiled["data4_tensor2_micro4"]["traffic"], compiled["tensor2_2layers"]["traffic"]
    data_bytes = lambda t: sum(v["wire"] for k, v in t.items() if "data" in k.split(" x "))  # noqa: E731
    data_ops = sum(v["ops"] for k, v in mixed.items() if "data" in k.split(" x "))
    assert data_ops == 1 and data_bytes(mixed) <= data_bytes(per_micro), (mixed, per_micro)
    assert mixed["tensor"]["wire"] == pytest.approx(4 * per_micro["tensor"]["wire"], rel=1e-3), (mixed, per_micro)


def test_tensor_collectives_grow_with_the_layers_scan_trip_count(compiled):
    ops = [compiled[f"tensor2_{n}layers"]["traffic"]["tensor"]["ops"] for n in (2, 4, 6)]
    wire = [compiled[f"tensor2_{n}layers"]["traffic"]["tensor"]["wire"] for n in (2, 4, 6)]
    per_two_layers = ops[1] - ops[0]
    assert per_two_layers > 0 and ops[2] - ops[1] == per_two_layers, ops
    assert wire[2] - wire[1] == pytest.approx(wire[1] - wire[0], rel=1e-9)
    # Megatron-LM's tensor parallelism: at least two all-reduces per layer forward and two backward
    assert per_two_layers >= 2 * 4


@pytest.mark.parametrize("line, groups", [
    ("%x = f32[4]{0} all-reduce(%y), channel_id=1, replica_groups={{0,1},{2,3}}, use_global_device_ids=true",
     [[0, 1], [2, 3]]),
    ("%x = f32[4]{0} all-reduce(%y), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("%x = f32[4]{0} all-reduce(%y), replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=2], "
     "device_ids=([4,2,2]T(1,0,2)) {'axis_1'}, use_global_device_ids=true",
     [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]),
    ("%x = f32[4]{0} all-reduce(%y), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=1] "
     "{'axis_0'}, use_global_device_ids=true", [[0, 2], [1, 3]]),  # no device_ids: the devices in order
    ("%x = f32[4]{0} collective-permute(%y), channel_id=3, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}",
     [[0, 2], [2, 0], [1, 3], [3, 1]]),
])
def test_device_groups_of_each_hlo_form(line, groups):
    assert collectives.groups(line, 16 if "device_ids" in line else 8) == groups


def test_a_ragged_all_to_all_sends_its_smaller_buffer():
    """A ragged all-to-all's bytes are decided at run time; the program holds its buffers: the dispatch's input is
    the device's routed rows, its output the worst case (8 ranks' worth), the combine the other way round. Either
    way a device sends (n - 1) / n of the smaller, a balanced router's rows (the exchanges of XLA:GPU's program,
    parallel/experts.py's ragged dispatcher)."""
    mesh = {"fsdp": 2, "expert": 8}
    dispatch = ("%r = ((bf16[65536,2048]{1,0}, bf16[524288,2048]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, s64[8]{0}), "
                "bf16[524288,2048]{1,0}) ragged-all-to-all-start(%a, %b, %c, %d, %e, %f), channel_id=1, "
                "replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}")
    combine = dispatch.replace("(bf16[65536,2048]{1,0}, bf16[524288,2048]{1,0},", "(bf16[524288,2048]{1,0}, "
                               "bf16[65536,2048]{1,0},").replace("bf16[524288,2048]{1,0}) ragged",
                                                                 "bf16[65536,2048]{1,0}) ragged")
    rows = 65536 * 2048 * 2
    for line in (dispatch, combine):
        (op,) = hlo.parse("ENTRY %e {\n  " + line + "\n}")[1]["e"]
        kind, axes, n, size, wire, hops = collectives.message(op, 16, mesh)
        assert (kind, axes, n, size, wire, hops) == ("ragged-all-to-all", ("expert",), 8, rows, rows * 7 / 8, 7)


def test_step_time_model_sums_compute_bubble_and_links():
    cluster = Cluster("A100-40GB", 4, intra_bw=100e9, inter_bw=10e9, intra_latency=1e-5, inter_latency=2e-5,
                      nodes=2, sources="test")
    mesh = {"data": 2, "pipeline": 1, "tensor": 4}
    plan = {"model_flops": 8 * 312e12 * 0.5, "mesh": mesh, "compute_dtype": "bfloat16", "bubble": 0.2,
            "seq_tokens": 4096,
            "collectives": {("tensor",): Traffic(ops=10, wire=50e9, hops=60),
                            ("data",): Traffic(ops=1, wire=5e9, hops=2)}}
    est = step_time.estimate(plan, cluster, mfu=0.5)
    assert est["compute"] == pytest.approx(1.0)  # half the FLOPs of 8 devices' second, at MFU 50%
    assert est["bubble"] == pytest.approx(0.25)  # 1 / (1 - 0.2) - 1
    assert est["comms"][("tensor",)] == pytest.approx((0.5 + 60e-5, 50e9, False))  # inside a node of 4
    assert est["comms"][("data",)] == pytest.approx((0.5 + 4e-5, 5e9, True))  # data crosses the 2 nodes
    assert est["step"] == pytest.approx(1.0 + 0.25 + 0.5 + 60e-5 + 0.5 + 4e-5)
    assert est["tokens_per_s"] == pytest.approx(4096 / est["step"])


def test_innermost_axes_stay_inside_a_frontier_node():
    mesh = {"data": 6, "fsdp": 1, "expert": 1, "pipeline": 64, "tensor": 8, "sequence": 1}
    per_node = CLUSTERS["frontier"].per_node
    assert not step_time.crosses_nodes(("tensor",), mesh, per_node)
    assert step_time.crosses_nodes(("pipeline",), mesh, per_node)
    assert step_time.crosses_nodes(("data",), mesh, per_node)


def test_plan_models_the_step_on_a_cluster_and_says_it_is_a_model():
    args = [sys.executable, "-m", "jaxllm.plan", "--config=configs/gpt3.py:GPT125M", "--devices=8",
            "--config.mesh.tensor=4", "--config.mesh.data=2", "--config.train.seq_length=256", "--cluster=polaris"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--mfu" in r.stderr, r.stderr
    r = subprocess.run([*args, "--mfu=0.4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert any(line.startswith("step-time MODEL on polaris (8 x A100-40GB") for line in lines), r.stdout
    row = lambda axes: next(line for line in lines if line.startswith(f"  {axes} "))  # noqa: E731
    assert "inside a node" in row("tensor") and "off the node" in row("data"), r.stdout


def test_plan_records_each_dispatchers_expert_traffic_as_send_rows_predicts(tmp_path):
    """``jaxllm.plan --output``: one JSON record per plan, the figures the report prints.  64 experts, top 8,
    over expert 4 x data 2 (the dense gradients' collectives over both axes, the dispatch over ``expert``
    alone): the dropless alltoall's static buffers hold min(topk, local experts) = 8 rows per token and rank,
    so the compiled step sends 8x allgather's token rows over ``expert`` (experts.dispatch_rows)."""
    out = tmp_path / "plans.jsonl"
    for dispatcher in ("allgather", "alltoall"):
        r = subprocess.run(
            [sys.executable, "-m", "jaxllm.plan", "--config=configs/moe.py:tiny", "--devices=8",
             "--config.mesh.expert=4", "--config.mesh.data=2", "--config.model.num_experts=64",
             "--config.model.moe_router_topk=8", "--config.model.hidden_size=512", "--config.train.micro_batch_size=1",
             f"--config.model.moe_token_dispatcher_type={dispatcher}", "--cluster=frontier", "--mfu=0.35",
             f"--output={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        rec = json.loads(out.read_text().splitlines()[-1])
        assert rec["dispatcher"] == dispatcher and rec["fits"] is True and rec["device_name"] == "MI250X"
        assert rec["overrides"][-1] == f"--config.model.moe_token_dispatcher_type={dispatcher}"
        assert f"experts' token dispatcher: {dispatcher}" in r.stdout
        expert = rec["collectives"]["expert"]
        row = next(line for line in r.stdout.splitlines() if line.startswith("  expert "))
        assert f"({expert['wire_bytes'] / 1e9:.2f} GB sent per device" in row, row
        assert f"{rec['step_time']['step']:10.3f} s" in r.stdout.splitlines()[-1]
        assert rec["step_time"]["step"] == pytest.approx(
            rec["step_time"]["compute"] + sum(s for s, _, _ in rec["step_time"]["comms"].values()))
    gathered, exchanged = [json.loads(x)["collectives"]["expert"] for x in out.read_text().splitlines()]
    assert {"all-gather", "reduce-scatter"} <= set(gathered["kinds"]) and "all-to-all" not in gathered["kinds"]
    assert "all-to-all" in exchanged["kinds"] and "all-gather" not in exchanged["kinds"]
    assert exchanged["wire_bytes"] / gathered["wire_bytes"] == pytest.approx(8, rel=0.1)
