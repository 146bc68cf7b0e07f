"""jaxllm.plan beyond the 2,048 devices XLA:CPU compiles for in one process (cli.lift_host_device_limit), and
beyond the devices one process makes (a thread each): compiled with the data-parallel axes shrunk
(plan.compiled_sizes), checked here against the full compile of the same meshes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def plan(*args):
    return subprocess.run([sys.executable, "-m", "jaxllm.plan", "--config=configs/gpt3.py:GPT125M", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_plan_compiles_for_more_devices_than_one_xla_cpu_process_holds():
    # 3,072 devices (the Frontier study's 1T run); ZeRO-1 over data 768
    r = plan("--devices=3072", "--config.mesh.tensor=4", "--config.mesh.data=768", "--config.parallel.zero_stage=1",
             "--config.train.global_batch_size=768", "--config.train.seq_length=128", "--config.model.num_layers=2",
             "--device=MI250X")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mesh {'data': 768, 'fsdp': 1, 'expert': 1, 'pipeline': 1, 'tensor': 4, 'sequence': 1}" in r.stdout
    assert "(embed over data 768)" in r.stdout and "FITS in MI250X" in r.stdout and "shrunk" not in r.stdout


def test_plan_of_all_of_frontier_compiles_shrunk_and_gives_a_verdict():
    # 75,264 GCDs = data 147 x pipeline 64 x tensor 8: compiled for data 16 (8,192 devices)
    r = plan("--devices=75264", "--config.mesh.tensor=8", "--config.mesh.pipeline=64", "--config.mesh.data=147",
             "--config.parallel.zero_stage=1", "--config.parallel.pipeline_schedule=1f1b",
             "--config.model.num_layers=64", "--config.train.seq_length=128",
             "--config.train.global_batch_size=9408", "--device=MI250X")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mesh {'data': 147, 'fsdp': 1, 'expert': 1, 'pipeline': 64, 'tensor': 8, 'sequence': 1}" in r.stdout
    assert "for data 16 of 147 (the data-parallel axes shrunk" in r.stdout
    assert "(embed over data 147)" in r.stdout and "FITS in MI250X" in r.stdout


def test_plan_refuses_what_it_cannot_shrink_to_one_process_in_one_line():
    # tensor 8 x pipeline 64 x sequence 32 = 16,384 devices before any data parallelism
    r = plan("--devices=32768", "--config.mesh.tensor=8", "--config.mesh.pipeline=64", "--config.mesh.sequence=32",
             "--config.mesh.data=2", "--config.train.global_batch_size=128", "--config.model.num_layers=64",
             "--config.train.seq_length=4096")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("config error: devices=32768: the mesh's axes other than data and fsdp hold 16384")


SHRUNK = r'''
import json
from jaxllm import config
from jaxllm.plan import plan

def tiny(**kw):
    c = config.get_config()
    c.model.update(num_layers=4, hidden_size=80, num_attention_heads=4, vocab_size=256, dtype="float32")
    c.train.update(seq_length=32, micro_batch_size=1, global_batch_size=48)
    for k, v in kw.items():
        section, key = k.split("__")
        setattr(getattr(c, section), key, v)
    return c

cases = {  # hidden 80: padded for data 6 (ZeRO shards of 14) but not for data 4 or 2
    "zero1": (tiny(mesh__tensor=2, mesh__pipeline=2, mesh__data=4, parallel__zero_stage=1,
                   parallel__pipeline_schedule="1f1b"), 16, 8),
    "zero2": (tiny(mesh__tensor=2, mesh__data=6, parallel__zero_stage=2), 12, 4),
    "fsdp": (tiny(mesh__tensor=2, mesh__fsdp=4, mesh__data=2, parallel__zero_stage=3), 16, 8),
}
out = {}
for name, (c, n, small) in cases.items():
    full, shrunk = plan(c, n, collectives=True), plan(c, n, collectives=True, compile_devices=small)
    keep = ("params", "grads", "opt_state", "batch", "temp", "total", "update_slack", "mesh", "compiled_mesh")
    out[name] = {k: [full[k], shrunk[k]] for k in keep}
    out[name]["wire"] = {"x".join(a): [full["collectives"][a].wire, t.wire] for a, t in shrunk["collectives"].items()}
    out[name]["hops"] = {"x".join(a): [full["collectives"][a].hops, t.hops] for a, t in shrunk["collectives"].items()}
print("RESULT" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def shrunk_plans():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16"}
    r = subprocess.run([sys.executable, "-c", SHRUNK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("RESULT", 1)[1])


@pytest.mark.parametrize("case", ["zero1", "zero2", "fsdp"])
def test_shrunk_plan_matches_the_full_compile(shrunk_plans, case):
    r = shrunk_plans[case]
    full, shrunk = r["compiled_mesh"]
    assert full == r["mesh"][0] and shrunk != full  # the reference compiled the whole mesh; the plan did not
    for key in ("params", "grads", "opt_state", "batch", "mesh"):  # counted at full size, to the byte
        assert r[key][0] == r[key][1], key
    # the traffic over each shrunk axis, counted over its full size (the padding of hidden 80 over data 6 aside)
    shrunk_axes = [a for a, n in shrunk.items() if n != full[a]]
    spanning = [axes for axes in r["wire"] if any(a in axes.split("x") for a in shrunk_axes)]
    assert spanning
    for axes in spanning:
        assert r["wire"][axes][1] == pytest.approx(r["wire"][axes][0], rel=0.05), axes
        assert r["hops"][axes][1] == r["hops"][axes][0], axes
    # an axis kept whole carries arrays split over a shrunk one at the compiled (larger) shard: FSDP's gradient
    # shards reduced over data, counted up to fsdp / compiled fsdp times (the plan's docstring)
    for axes in r["wire"].keys() - set(spanning):
        a, b = r["wire"][axes]
        assert a <= b * 1.05 and b <= a * math.prod(full[x] / shrunk[x] for x in shrunk_axes) * 1.05, axes
    # XLA's temporaries: at kilobytes, its choices for other sizes move them a few per cent either way
    (a, b), slack = r["total"], r["update_slack"][1]
    assert slack > 0 and r["update_slack"][0] == 0
    assert -0.05 * a <= b - a <= 0.05 * a + slack
