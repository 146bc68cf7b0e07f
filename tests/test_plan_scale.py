"""jaxllm.plan beyond the 2,048 devices XLA:CPU compiles for in one process (cli.lift_host_device_limit), and
its one-line refusal above cli.MAX_PLAN_DEVICES."""

import subprocess
import sys
from pathlib import Path

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
    assert "(embed over data 768)" in r.stdout and "FITS in MI250X" in r.stdout


def test_plan_refuses_more_than_it_compiles_for_in_one_line():
    r = plan("--devices=75264", "--config.mesh.tensor=8", "--config.mesh.pipeline=64",
             "--config.mesh.data=147", "--config.train.global_batch_size=9408")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "devices=75264" in lines[0] and "8192" in lines[0], r.stderr
