"""jaxllm.plan beyond the 2,048 devices one XLA:CPU process holds: the others on stand-in processes
(cli.stand_in_processes), so the compile is the whole mesh's; checked here against one process's compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest

ROOT = Path(__file__).resolve().parents[1]


def plan(*args):
    return forkserver.run(["-m", "jaxllm.plan", "--config=configs/gpt3.py:GPT125M", *args], dict(os.environ), ROOT,
                          600)


def test_plan_compiles_for_more_devices_than_one_xla_cpu_process_holds():
    # 3,072 devices (the Frontier study's 1T run); ZeRO-1 over data 768
    r = plan("--devices=3072", "--config.mesh.tensor=4", "--config.mesh.data=768", "--config.parallel.zero_stage=1",
             "--config.train.global_batch_size=768", "--config.train.seq_length=128", "--config.model.num_layers=2",
             "--device=MI250X")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mesh {'data': 768, 'fsdp': 1, 'expert': 1, 'pipeline': 1, 'tensor': 4, 'sequence': 1}" in r.stdout
    assert "(embed over data 768)" in r.stdout and "FITS in MI250X" in r.stdout


def test_plan_of_all_of_frontier_gives_a_verdict():
    # 75,264 GCDs = data 147 x pipeline 64 x tensor 8: 37 processes, 36 of them stand-ins
    r = plan("--devices=75264", "--config.mesh.tensor=8", "--config.mesh.pipeline=64", "--config.mesh.data=147",
             "--config.parallel.zero_stage=1", "--config.parallel.pipeline_schedule=1f1b",
             "--config.model.num_layers=64", "--config.train.seq_length=128",
             "--config.train.global_batch_size=9408", "--device=MI250X")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mesh {'data': 147, 'fsdp': 1, 'expert': 1, 'pipeline': 64, 'tensor': 8, 'sequence': 1}" in r.stdout
    assert "(embed over data 147)" in r.stdout and "FITS in MI250X" in r.stdout


@pytest.mark.parametrize("args,line", [
    (["--devices_per_process=4096"], "--devices_per_process=4096: give 1 to 2048 (XLA:CPU's most in one process)"),
    (["--devices_per_process=4"], "--devices_per_process=4: 8192 devices make 2048 processes; give at least 8 (at "
                                  "most 1024 stand-ins)"),
    (["--config.mesh.tensor=3"], "config error: mesh={'data': 8192, 'fsdp': 1, 'expert': 1, 'pipeline': 1, "
                                 "'tensor': 3, 'sequence': 1}: the mesh covers 24576 devices but there are 8192"),
])
def test_plan_above_one_process_refuses_in_one_line(args, line):
    r = plan("--devices=8192", "--config.mesh.data=8192", "--config.train.global_batch_size=8192", *args)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), r.stderr[-3000:]


EXITS = r'''
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
from jaxllm import cli
cli.stand_in_processes(6, 2)
import jax
assert len(jax.devices()) == 6 and jax.process_count() == 3
if sys.argv[1] == "raise":
    raise RuntimeError("unexpected")
sys.exit(int(sys.argv[1]))
'''


@pytest.mark.parametrize("how,code", [("0", 0), ("3", 3), ("raise", 1)])
def test_a_process_with_stand_ins_exits_at_once_with_its_status(how, code):
    # the stand-ins leave the job with this process: no wait at jax.distributed's shutdown barrier (300 s)
    r = subprocess.run([sys.executable, "-c", EXITS, how], cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr[-3000:]
    assert ("RuntimeError: unexpected" in r.stderr) == (how == "raise")


PLANS = r'''
import json, sys
from jaxllm import cli
per_process = int(sys.argv[1])
if per_process < 16:
    cli.stand_in_processes(16, per_process)
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

cases = {  # hidden 80: ZeRO shards over data 6 padded (14 rows each)
    "zero1": (tiny(mesh__tensor=2, mesh__pipeline=2, mesh__data=4, parallel__zero_stage=1,
                   parallel__pipeline_schedule="1f1b"), 16),
    "zero2": (tiny(mesh__tensor=2, mesh__data=6, parallel__zero_stage=2), 12),
    "fsdp": (tiny(mesh__tensor=2, mesh__fsdp=4, mesh__data=2, parallel__zero_stage=3), 16),
}
out = {}
for name, (c, n) in cases.items():
    p = plan(c, n, collectives=True)
    out[name] = {k: p[k] for k in ("params", "grads", "opt_state", "batch", "temp", "total", "mesh")}
    out[name]["collectives"] = {"x".join(a): [t.ops, t.wire, t.hops] for a, t in p["collectives"].items()}
print("RESULT" + json.dumps(out))
cli.exit_now()
'''


@pytest.fixture(scope="module")
def plans():
    def run(per_process):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={per_process}"}
        r = subprocess.run([sys.executable, "-c", PLANS, str(per_process)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.split("RESULT", 1)[1])
    # one process of 16 devices; processes of 6, 6 and 4 devices, this one and two stand-ins
    return run(16), run(6)


@pytest.mark.parametrize("case", ["zero1", "zero2", "fsdp"])
def test_stand_in_processes_compile_what_one_process_compiles(plans, case):
    one, stand_ins = plans[0][case], plans[1][case]
    assert one["collectives"] and one == stand_ins  # every byte and every collective
