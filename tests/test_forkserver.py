"""tests/forkserver.py's children give what a new interpreter gives: the same stdout, stderr and exit status."""

import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
COMMANDS = [
    # argv, devices from the command's XLA_FLAGS, __main__, an exit status and both streams
    ["-c", "import sys, jax; print(sys.argv, len(jax.devices()), __name__); print('to stderr', file=sys.stderr); "
           "sys.exit(3)", "an argument"],
    ["-c", "raise ValueError('uncaught')"],  # the traceback and exit 1
    ["SCRIPT", "raise"],  # a script's traceback
    ["-m", "jaxllm.plan", "--no_such_flag"],  # a tool's one line and exit 2
    ["-m", "jaxllm.plan", "--config=configs/gpt3.py:GPT125M", "--devices=2"],  # a config error on the devices
    ["SCRIPT", "x"],  # a script: its sys.path[0], sys.argv and __file__
]
SCRIPT = ("import sys; print(sys.path[0], sys.argv, __file__, __name__)\n"
          "if sys.argv[1:] == ['raise']:\n    raise KeyError('from the script')\n")


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a)[:40])
def test_child_is_a_new_interpreter(args, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    args = [str(tmp_path / "script.py") if a == "SCRIPT" else a for a in args]
    got = forkserver.run(args, ENV, ROOT, timeout=120)
    want = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)


def test_a_child_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run(["-c", "import time; time.sleep(60)"], ENV, ROOT, timeout=1)
    assert forkserver.run(["-c", "print(1)"], ENV, ROOT, timeout=60).stdout == "1\n"  # the server goes on
