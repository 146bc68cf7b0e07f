"""Shared by the layout tests: runs layouts on 8 fake CPU devices (tests/multidevice.py, in a
process of its own: the device count must be set before JAX starts its backend; a child of
tests/forkserver.py's server) and compares a layout's run with the single-device one."""

import base64
import json
import os
from pathlib import Path

import forkserver
import numpy as np

from jaxllm.families import deepseek_v3

# DeepSeek-V2/V3's multi-head latent attention in the layouts' model (hidden 128, 8 heads): query latent 24,
# key/value latent 16, per head 8 + 4 rotary query/key dimensions and 10 value ones
MLA = {**deepseek_v3.PRESET, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4,
       "v_head_dim": 10}


def run_layouts(layouts: dict, timeout: int = 900) -> dict:
    """``{name: overrides}`` -> ``{name: result}`` (see tests/multidevice.py for both)."""
    script = Path(__file__).with_name("multidevice.py")
    # JAX_PLATFORMS as the script sets it before importing jax: the forked child's jax read it at the server's start
    out = forkserver.run([script, json.dumps(list(layouts.values()))], {**os.environ, "JAX_PLATFORMS": "cpu"},
                         os.getcwd(), timeout)
    out.check_returncode()
    results = json.loads(out.stdout)
    for r in results:
        if "params" in r:
            r["params"] = {k: unpacked(v) for k, v in r["params"].items()}
    return dict(zip(layouts, results))


def unpacked(packed: dict) -> np.ndarray:
    """A parameter as tests/multidevice.py's ``packed`` wrote it: float32 ``[*shape]``."""
    return np.frombuffer(base64.b64decode(packed["float32"]), np.float32).reshape(packed["shape"])


def assert_same_training(got: dict, ref: dict) -> None:
    """Three steps' losses within 1e-5 relative and parameters within 1e-5 of the reference run, a
    falling loss, and every parameter sharded as the rules table declares."""
    assert "error" not in got and "error" not in ref, got.get("error") or ref.get("error")
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert got["losses"][-1] < got["losses"][0]  # it trains
    for key, value in ref["params"].items():
        np.testing.assert_allclose(got["params"][key], value, rtol=1e-5, atol=1e-5, err_msg=key)
    assert got["sharding_mismatches"] == []
