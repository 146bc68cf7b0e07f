"""Shared by the layout tests: runs layouts on 8 fake CPU devices (tests/multidevice.py, in a
subprocess: the device count must be set before jax is imported) and compares a layout's
run with the single-device one."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from jaxllm.families import deepseek_v3

# DeepSeek-V2/V3's multi-head latent attention in the layouts' model (hidden 128, 8 heads): query latent 24,
# key/value latent 16, per head 8 + 4 rotary query/key dimensions and 10 value ones
MLA = {**deepseek_v3.PRESET, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4,
       "v_head_dim": 10}


def run_layouts(layouts: dict, timeout: int = 900) -> dict:
    """``{name: overrides}`` -> ``{name: result}`` (see tests/multidevice.py for both)."""
    script = Path(__file__).with_name("multidevice.py")
    out = subprocess.run([sys.executable, str(script), json.dumps(list(layouts.values()))], capture_output=True,
                         text=True, timeout=timeout, check=True)
    return dict(zip(layouts, json.loads(out.stdout)))


def assert_same_training(got: dict, ref: dict) -> None:
    """Three steps' losses within 1e-5 relative and parameters within 1e-5 of the reference run, a
    falling loss, and every parameter sharded as the rules table declares."""
    assert "error" not in got and "error" not in ref, got.get("error") or ref.get("error")
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert got["losses"][-1] < got["losses"][0]  # it trains
    for key, value in ref["params"].items():
        np.testing.assert_allclose(got["params"][key], value, rtol=1e-5, atol=1e-5, err_msg=key)
    assert got["sharding_mismatches"] == []
