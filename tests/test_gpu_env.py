"""jaxllm.platform.gpu_env: the GPU settings are known to this jaxlib, applied per vendor, the user's win;
and the warning when GPUs are on the machine but JAX runs on the CPU."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from conftest import FAST_COMPILE, _fast_compile

from jaxllm.platform import gpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every flag this jaxlib's XLA parses (a Setting.since later than it would abort it)
FLAGS = sorted({s.text() for s in gpu_env.SETTINGS
                if s.is_flag and (s.since is None or gpu_env.jaxlib_release() >= s.since)})


def _start_jax(xla_flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
    return subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_every_flag_is_known_to_this_jaxlib():
    """XLA aborts on a flag it does not know: ours all start a backend (the CPU one parses the same flags)."""
    r = _start_jax(" ".join(FLAGS))
    assert r.returncode == 0 and r.stdout.strip() == "3.0", r.stderr[-2000:]
    bad = _start_jax("--xla_gpu_graph_level=0")  # AMD scripts' older spelling: this XLA refuses it
    assert bad.returncode != 0 and "Unknown flag in XLA_FLAGS: --xla_gpu_graph_level=0" in bad.stderr


def test_the_tests_fast_compile_flags_are_known_to_this_jaxlib():
    """conftest.py's flags start a backend under the installed jaxlib; JAX 0.11's XLA dropped the older emitters'
    switch, which it names when asked for it (so conftest passes it to JAX 0.10 only)."""
    r = _start_jax(" ".join(FAST_COMPILE))
    assert r.returncode == 0 and r.stdout.strip() == "3.0", r.stderr[-2000:]
    assert _fast_compile("0.10.2") == ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
    assert _fast_compile("0.12.0.1") == _fast_compile("0.11.2") == ("--xla_backend_optimization_level=0",)
    if len(FAST_COMPILE) == 1:  # JAX 0.11 or newer
        bad = _start_jax("--xla_cpu_use_fusion_emitters=false")
        assert bad.returncode != 0 and "Unknown flag in XLA_FLAGS: --xla_cpu_use_fusion_emitters" in bad.stderr


def test_settings_this_jaxlibs_xla_no_longer_has_are_not_applied():
    """jaxlib 0.12's XLA has no pipelined all-gather, reduce-scatter and all-reduce flags (a compile option of that
    name is refused, XLA_FLAGS maps them to their successors' default): applied under 0.10 and 0.11 only; their
    successors ``--xla_gpu_pipeline_*=on`` (which 0.10 and 0.11 do not know) from 0.12 on."""
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    pipelined = {f"--xla_gpu_enable_pipelined_{c}" for c in kinds}
    successors = {f"--xla_gpu_pipeline_{c}" for c in kinds}
    for old in ("0.10.2", "0.11.2"):
        assert gpu_env.retired("cuda", old) == [] and pipelined <= {s.name for s in gpu_env.settings_for("cuda", old)}
        assert not successors & {s.name for s in gpu_env.settings_for("cuda", old)}
    assert {s.name for s in gpu_env.retired("cuda", "0.12.0.1")} == pipelined
    new = {s.name: s.value for s in gpu_env.settings_for("cuda", "0.12.0.1")}
    assert not pipelined & set(new) and {n: new[n] for n in successors} == dict.fromkeys(successors, "on")
    assert gpu_env.jaxlib_release("0.12.0.1") == (0, 12) and gpu_env.retired("rocm", "0.12.0.1") == []
    env = {}
    gpu_env.apply(env, "cuda")
    applied = (pipelined | successors) & gpu_env.flag_names(env["XLA_FLAGS"])
    assert applied == (successors if gpu_env.jaxlib_release() >= (0, 12) else pipelined)


def test_every_setting_has_a_source_and_a_reason():
    for s in gpu_env.SETTINGS:
        assert s.vendors and set(s.vendors) <= {"cuda", "rocm"}, s
        assert s.source.startswith("https://") and len(s.why) > 20 and s.measured is False, s
    names = [(s.name, v) for s in gpu_env.SETTINGS for v in s.vendors]
    assert len(names) == len(set(names)), "a setting given twice for one vendor"


def test_performance_md_lists_every_setting():
    with open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8") as f:
        doc = f.read()
    table = doc[doc.index("### GPU settings: XLA flags and runtime variables"):]
    for s in gpu_env.SETTINGS:
        row = next(ln for ln in table.splitlines() if ln.startswith(f"| `{s.name}` |"))
        cells = row.split(" | ")
        value = f"`{s.value}`" if s.value else "(empty)"
        for vendor, cell in (("cuda", cells[1]), ("rocm", cells[2])):
            if vendor in s.vendors:
                assert cell == value, (s, row)
            elif not any(o.name == s.name and vendor in o.vendors for o in gpu_env.SETTINGS):
                assert cell == "-", (s, row)
        assert s.source.split(";")[0].strip() in row and row.endswith(" | no |"), row


def test_apply_cuda_and_rocm():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    applied = gpu_env.apply(env, "cuda")
    words = env["XLA_FLAGS"].split()
    assert words[-1] == "--xla_dump_to=/tmp/x"  # the user's flags stay, after ours
    assert words[:-1] == [s.text() for s in gpu_env.settings_for("cuda") if s.is_flag]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in words and "--xla_gpu_enable_cublaslt=true" not in words
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9" and "HIP_FORCE_DEV_KERNARG" not in env
    assert applied.vendor == "cuda" and not applied.kept
    assert applied.line().startswith("jaxllm.platform.gpu_env: cuda settings (jaxllm/platform/gpu_env.py, from "
                                     "sources, not measured): --xla_gpu_enable_latency_hiding_scheduler=true ")

    env = {}
    gpu_env.apply(env, "rocm")
    assert "--xla_gpu_enable_cublaslt=true" in env["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in env["XLA_FLAGS"]
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.975" and env["HSA_FORCE_FINE_GRAIN_PCIE"] == "1"
    assert env["GPU_MAX_HW_QUEUES"] == "2" and env["HIP_FORCE_DEV_KERNARG"] == "1"


def test_the_users_values_win():
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false "
                        "--xla_gpu_all_gather_combine_threshold_bytes=1",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    applied = gpu_env.apply(env, "cuda")
    words = env["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in words
    assert words.count("--xla_gpu_enable_latency_hiding_scheduler=false") == 1
    assert "--xla_gpu_all_gather_combine_threshold_bytes=1" in words
    assert not [w for w in words if w.startswith("--xla_gpu_all_gather_combine_threshold_bytes=8")]
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert set(applied.kept) == {"--xla_gpu_enable_latency_hiding_scheduler=false",
                                 "--xla_gpu_all_gather_combine_threshold_bytes=1", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5"}
    assert applied.line().endswith("; yours kept: --xla_gpu_enable_latency_hiding_scheduler=false "
                                   "--xla_gpu_all_gather_combine_threshold_bytes=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.5")


def test_vendor_from_the_environment_nothing_without_gpus():
    env = {"JAX_PLATFORMS": "cuda"}
    assert gpu_env.apply(env).vendor == "cuda" and "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]
    env = {"JAX_PLATFORMS": "rocm"}
    assert gpu_env.apply(env).vendor == "rocm" and env["GPU_MAX_HW_QUEUES"] == "2"
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=x"}
    applied = gpu_env.apply(env)
    assert applied.vendor is None and applied.line() == ""
    assert env == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=x"}


def _fake_tool(directory, name, output):
    path = directory / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_gpus_on_machine_from_device_files_and_smi(tmp_path, monkeypatch):
    dev = tmp_path / "dev"
    dev.mkdir()
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    assert gpu_env.gpus_on_machine(str(dev)) is None
    _fake_tool(bin_, "rocm-smi", "============ ROCm System Management Interface ============\n"
                                 "GPU[0]\t\t: Card Series: \t\tAMD Instinct MI250X")
    assert gpu_env.gpus_on_machine(str(dev)) == "AMD"
    (dev / "nvidia0").touch()
    assert gpu_env.gpus_on_machine(str(dev)) == "NVIDIA"
    (dev / "nvidia0").unlink()
    (dev / "kfd").touch()
    assert gpu_env.gpus_on_machine(str(dev)) == "AMD"
    (dev / "kfd").unlink()
    _fake_tool(bin_, "nvidia-smi", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)")
    assert gpu_env.gpus_on_machine(str(dev)) == "NVIDIA"

    warning = gpu_env.cpu_warning("cpu", {}, str(dev))
    assert warning == ("jaxllm: warning: this machine has NVIDIA GPUs but JAX runs on the CPU (no GPU backend in this "
                       'JAX installation, or it failed to start): pip install -e ".[cuda]"')
    assert gpu_env.cpu_warning("gpu", {}, str(dev)) == ""
    assert gpu_env.cpu_warning("cpu", {"JAX_PLATFORMS": "cpu"}, str(dev)) == ""


def test_train_warns_when_gpus_are_here_but_jax_runs_on_cpu(tmp_path):
    """The real CLI, with an nvidia-smi that lists a GPU: one warning line, then the config error (exit 2)."""
    _fake_tool(tmp_path, "nvidia-smi", "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-0)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", "--config.model.attention_impl=flash",
                        f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    warning = "jaxllm: warning: this machine has NVIDIA GPUs but JAX runs on the CPU"
    warnings = [ln for ln in lines if ln.startswith(warning)]
    assert len(warnings) == 1 and "model.attention_impl='flash'" in lines[-1]
