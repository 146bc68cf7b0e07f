"""Multi-host runs: launcher detection, the launch scripts (dry runs), and real 2-process training on CPU."""

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import xla_flags

from jaxllm.platform.distributed import LaunchError, Topology, detect, device_env, expand_nodelist, jax_local_device_ids

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"  # public domain (tests/data/README.md)
LAUNCH_PREFIXES = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "PALS_", "PBS_", "MPI_", "JAXLLM_", "XLA_FLAGS")


def clean_env(**extra):
    """This environment without any launcher's variables (so a CI job inside Slurm stays single-process), with
    the tests' fast-compile flags before ``extra``'s ``XLA_FLAGS``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES)}
    return {**env, "JAX_PLATFORMS": "cpu", **extra, "XLA_FLAGS": xla_flags(extra.get("XLA_FLAGS", ""))}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- detect()

def nodefile(tmp_path, hosts, slots=1):
    path = tmp_path / "nodefile"
    path.write_text("".join(f"{h}\n" for h in hosts for _ in range(slots)))
    return str(path)


def test_slurm_two_nodes_four_tasks_each():
    env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_NODELIST": "nid[001-002]", "SLURM_JOB_NODELIST": "nid[001-002]",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    topo = detect(env, scontrol=False)
    assert topo == Topology("nid001:12355", 8, 5, 1, 4, (1,), "slurm", ("nid001", "nid002"))
    # One task per node: all of the node's devices, no restriction.
    one = detect({**env, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
                  "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, scontrol=False)
    assert (one.num_processes, one.process_id, one.local_size, one.local_device_ids) == (2, 1, 1, None)


def test_pals_polaris(tmp_path):
    env = {"PBS_NODEFILE": nodefile(tmp_path, ["x3005c0s13b0n0.hsn.cm.polaris", "x3005c0s19b1n0.hsn.cm.polaris"]),
           "PALS_RANKID": "6", "PALS_LOCAL_RANKID": "2", "PALS_LOCAL_SIZE": "4", "PALS_NODEID": "1"}
    topo = detect(env)  # no PMI_SIZE: local size x nodes
    assert topo == Topology("x3005c0s13b0n0.hsn.cm.polaris:12355", 8, 6, 2, 4, (2,), "pals",
                            ("x3005c0s13b0n0.hsn.cm.polaris", "x3005c0s19b1n0.hsn.cm.polaris"))
    assert detect({**env, "PMI_SIZE": "8", "PMI_RANK": "6"}).num_processes == 8
    # mpiexec does not bind GPUs on Polaris: the local rank becomes the visible device.
    assert device_env(topo, env, "cuda") == {"CUDA_VISIBLE_DEVICES": "2"}


def test_open_mpi_needs_a_coordinator_without_node_list():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchError, match="JAXLLM_COORDINATOR_ADDRESS.*no node list"):
        detect(env)
    topo = detect({**env, "JAXLLM_COORDINATOR_ADDRESS": "10.1.2.3", "JAXLLM_COORDINATOR_PORT": "4000"})
    assert topo == Topology("10.1.2.3:4000", 4, 3, 1, 2, (1,), "ompi+explicit", ())


def test_pmi_ranks_win_over_slurm_proxy_task():
    # Intel MPI / MPICH hydra under Slurm: srun starts one proxy per node, so SLURM_PROCID is the node.
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
           "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "9"}
    topo = detect(env, scontrol=False)
    assert topo == Topology("gpu07:12355", 4, 2, 0, 2, (0,), "pmi", ("gpu07", "gpu08"))


def test_explicit_wins_and_single_process_without_launcher():
    explicit = {"JAXLLM_COORDINATOR_ADDRESS": "127.0.0.1:5000", "JAXLLM_NUM_PROCESSES": "2", "JAXLLM_PROCESS_ID": "1"}
    assert detect(explicit) == Topology("127.0.0.1:5000", 2, 1, source="explicit")
    over_slurm = detect({**explicit, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"},
                        scontrol=False)
    assert (over_slurm.num_processes, over_slurm.process_id, over_slurm.coordinator_address) == (2, 1, "127.0.0.1:5000")
    assert detect({"HOME": "/root", "PATH": "/bin"}) is None


@pytest.mark.parametrize("env,key", [
    ({"JAXLLM_NUM_PROCESSES": "2"}, "JAXLLM_NUM_PROCESSES"),
    ({"JAXLLM_PROCESS_ID": "0"}, "JAXLLM_PROCESS_ID"),
    ({"JAXLLM_NUM_PROCESSES": "2", "JAXLLM_PROCESS_ID": "2", "JAXLLM_COORDINATOR_ADDRESS": "h:1"},
     "JAXLLM_PROCESS_ID"),
    ({"JAXLLM_NUM_PROCESSES": "two", "JAXLLM_PROCESS_ID": "0"}, "JAXLLM_NUM_PROCESSES"),
    ({"JAXLLM_NUM_PROCESSES": "2", "JAXLLM_PROCESS_ID": "0"}, "JAXLLM_COORDINATOR_ADDRESS"),
    ({"JAXLLM_COORDINATOR_ADDRESS": "h:1"}, "JAXLLM_COORDINATOR_ADDRESS"),
    ({"PMI_RANK": "0"}, "PMI_SIZE"),
])
def test_bad_environment_names_the_variable(env, key):
    with pytest.raises(LaunchError) as e:
        detect(env)
    assert e.value.key == key and str(e.value).startswith(f"launch environment error: {key}=")


def test_expand_nodelist():
    assert expand_nodelist("nid[001-002]") == ["nid001", "nid002"]
    assert expand_nodelist("a[8-10,12],login1") == ["a8", "a9", "a10", "a12", "login1"]
    assert expand_nodelist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]


def test_device_visibility():
    topo = Topology("h:1", 8, 3, 3, 4, (3,), "slurm")
    assert device_env(topo, {}, "rocm") == {"ROCR_VISIBLE_DEVICES": "3"}  # one variable: HIP would filter again
    assert device_env(topo, {}, "cuda") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert device_env(topo, {"ROCR_VISIBLE_DEVICES": "5"}, "rocm") == {}  # the launcher bound it already
    assert device_env(topo, {}, None) == {}  # CPU
    assert device_env(Topology("h:1", 2, 1, 0, 1, None, "slurm"), {}, "cuda") == {}  # one process per node
    # Every task sees the node's 4 GPUs (Perlmutter's --gpu-bind=none): jax picks the local rank's.
    assert jax_local_device_ids(topo, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == [3]
    assert jax_local_device_ids(topo, {"CUDA_VISIBLE_DEVICES": "3"}) is None


def test_cli_bad_environment_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=clean_env(JAXLLM_NUM_PROCESSES="2"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("launch environment error: JAXLLM_NUM_PROCESSES='2': set JAXLLM_PROCESS_ID")


# ---------------------------------------------------------------- launch scripts (dry runs)

SCRIPTS = ["frontier.sbatch", "polaris.pbs", "perlmutter.sbatch", "slurm.sbatch", "local.sh"]


def dry_run(script, *args, **env):
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "USER": "alice"}
    r = subprocess.run(["bash", str(ROOT / "launch" / script), *args], capture_output=True, text=True, timeout=60,
                       env={**base, **env}, cwd="/")
    lines = r.stdout.splitlines()
    exports = dict(shlex.split(ln[len("export "):])[0].split("=", 1) for ln in lines if ln.startswith("export "))
    commands = [shlex.split(ln) for ln in lines if ln and not ln.startswith(("export ", "#"))]
    launch_line = next((ln for ln in lines if ln.startswith("# jaxllm launch:")), "x")
    summary = dict(kv.split("=") for kv in launch_line.split()[3:])
    return r, exports, commands, summary


KNOBS = {"MODEL_SIZE_KEY": "GPT1_5B", "SEQ_LEN": "1024", "MICRO_BATCH": "2", "GAS": "4", "TP": "2", "PP": "1",
         "SP": "2", "SP_TYPE": "ulysses", "ZERO_STAGE": "1", "WORKDIR": "/scratch/run1"}


def expected_overrides(dp):
    return [f"--config={ROOT}/configs/gpt3.py:GPT1_5B", "--config.mesh.tensor=2", "--config.mesh.pipeline=1",
            "--config.mesh.sequence=2", f"--config.mesh.data={dp}", "--config.train.micro_batch_size=2",
            f"--config.train.global_batch_size={2 * 4 * dp}", "--config.train.seq_length=1024",
            "--config.parallel.sequence_impl=ulysses", "--config.parallel.zero_stage=1", "--workdir=/scratch/run1",
            "--config.train.lr=1e-4"]


def train_args(cmd):
    i = cmd.index("jaxllm.train")
    return cmd[:i - 3], cmd[i + 1:]  # the launcher part, the flags after "python -u -m jaxllm.train"


def slurm_env(**extra):
    return {"SLURM_JOB_ID": "1234", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "nid[001-002]",
            "SLURM_SUBMIT_DIR": str(ROOT), **KNOBS, **extra}


def test_frontier_dry_run_one_process_per_gcd():
    r, exports, commands, summary = dry_run("frontier.sbatch", "--dry-run", "--config.train.lr=1e-4", **slurm_env())
    assert r.returncode == 0, r.stderr
    launcher, flags = train_args(commands[0])
    assert launcher == ["srun", "-N", "2", "-n", "16", "--ntasks-per-node=8", "--cpus-per-task=7",
                        "--gpus-per-task=1", "--gpu-bind=closest"]  # srun sets ROCR_VISIBLE_DEVICES per task
    assert flags == expected_overrides(dp=16 // (2 * 2))
    assert summary == {"nodes": "2", "processes": "16", "devices": "16", "dp": "4", "global_batch": "32"}
    assert exports["NCCL_SOCKET_IFNAME"] == "hsn0" and exports["FI_CXI_ATS"] == "0"
    assert exports["MIOPEN_USER_DB_PATH"].startswith("/tmp/") and exports["JAX_PLATFORMS"] == "rocm"
    # One process per node: it drives all 8 GCDs.
    r, _, commands, summary = dry_run("frontier.sbatch", **slurm_env(DRY_RUN="1", PROCS_PER_NODE="1"))
    assert train_args(commands[0])[0] == ["srun", "-N", "2", "-n", "2", "--ntasks-per-node=1", "--cpus-per-task=56",
                                          "--gpus-per-node=8"]
    assert summary["processes"] == "2" and summary["dp"] == "4"


def test_expert_parallel_knobs():
    """EP splits the data-parallel size as Megatron's --expert-model-parallel-size: data = DP / EP; the dry run's
    config check passes for a 4-expert model on the job's 16 devices."""
    env = slurm_env(LLAMA="1", MODEL_SIZE_KEY="tiny", EP="2", NUM_EXPERTS="4", SEQ_LEN="64")
    r, _, commands, summary = dry_run("frontier.sbatch", "--dry-run", **env)
    assert r.returncode == 0, r.stderr
    flags = train_args(commands[0])[1]
    assert {"--config.mesh.data=2", "--config.mesh.expert=2", "--config.model.num_experts=4"} <= set(flags)
    assert summary["dp"] == "4" and summary["global_batch"] == "32"
    r, *_ = dry_run("frontier.sbatch", "--dry-run", **slurm_env(EP="3"))
    assert r.returncode == 2 and "EP=3 does not divide the data-parallel size DP = 4" in r.stderr


def test_polaris_dry_run(tmp_path):
    hosts = ["x3005c0s13b0n0.hsn.cm.polaris.alcf.anl.gov", "x3005c0s19b1n0.hsn.cm.polaris.alcf.anl.gov"]
    env = {"PBS_NODEFILE": nodefile(tmp_path, hosts), "PBS_O_WORKDIR": str(ROOT), "PBS_JOBID": "77.polaris", **KNOBS}
    # qsub passes no arguments: flags come as JAXLLM_ARGS
    r, exports, commands, summary = dry_run("polaris.pbs", "--dry-run", JAXLLM_ARGS="--config.train.lr=1e-4", **env)
    assert r.returncode == 0, r.stderr
    launcher, flags = train_args(commands[0])
    assert launcher == ["mpiexec", "-n", "8", "--ppn", "4", "--depth", "8", "--cpu-bind", "depth"]
    # run from the repository (PBS_O_WORKDIR): the config stays relative
    assert flags == ["--config=configs/gpt3.py:GPT1_5B", *expected_overrides(dp=8 // 4)[1:]]
    assert summary == {"nodes": "2", "processes": "8", "devices": "8", "dp": "2", "global_batch": "16"}
    assert exports["NCCL_NET"] == "AWS Libfabric" and exports["NCCL_NET_GDR_LEVEL"] == "PHB"
    assert exports["NCCL_CROSS_NIC"] == "1" and exports["NCCL_COLLNET_ENABLE"] == "1"
    assert "aws-ofi-nccl" in exports["LD_LIBRARY_PATH"]
    # What each of the 8 ranks then sees: mpiexec's PALS variables -> its rank and its GPU.
    for rank in range(8):
        rank_env = {"PBS_NODEFILE": env["PBS_NODEFILE"], "PALS_RANKID": str(rank), "PALS_LOCAL_RANKID": str(rank % 4),
                    "PALS_LOCAL_SIZE": "4"}
        topo = detect(rank_env)
        assert (topo.coordinator_address, topo.num_processes, topo.process_id) == (f"{hosts[0]}:12355", 8, rank)
        assert device_env(topo, rank_env, "cuda") == {"CUDA_VISIBLE_DEVICES": str(rank % 4)}


def test_perlmutter_dry_run():
    r, exports, commands, summary = dry_run("perlmutter.sbatch", "--dry-run", "--config.train.lr=1e-4", **slurm_env())
    assert r.returncode == 0, r.stderr
    launcher, flags = train_args(commands[0])
    assert launcher == ["srun", "-N", "2", "-n", "8", "--ntasks-per-node=4", "--cpus-per-task=32", "--cpu-bind=cores",
                        "--gpus-per-node=4", "--gpu-bind=none"]
    assert flags == expected_overrides(dp=8 // 4)
    assert summary["processes"] == "8" and exports["JAX_PLATFORMS"] == "cuda"
    # Each task sees the node's 4 GPUs; jax gets the local rank's one.
    topo = detect({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
                   "SLURM_STEP_NODELIST": "nid[001-002]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, scontrol=False)
    assert jax_local_device_ids(topo, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == [2]


def test_generic_slurm_dry_run_cpu_and_gpu():
    r, exports, commands, summary = dry_run("slurm.sbatch", "--dry-run", "--config=configs/shakespeare_char.py",
                                            "--config.train.micro_batch_size=3", SLURM_JOB_NUM_NODES="2",
                                            SLURM_SUBMIT_DIR=str(ROOT), DEVICES_PER_PROCESS="4", TP="2")
    assert r.returncode == 0, r.stderr
    launcher, flags = train_args(commands[0])
    assert launcher == ["srun", "-N", "2", "-n", "2", "--ntasks-per-node=1"]
    assert flags == [f"--config={ROOT}/configs/shakespeare_char.py", "--config.mesh.tensor=2",  # run from /
                     "--config.mesh.pipeline=1", "--config.mesh.sequence=1", "--config.mesh.data=4",
                     "--config.train.micro_batch_size=3"]
    assert exports["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4" and exports["JAX_PLATFORMS"] == "cpu"
    assert "# jaxllm check: config ok for 8 cpu devices: data 4 x tensor 2" in r.stdout
    r, _, commands, summary = dry_run("slurm.sbatch", SLURM_JOB_NUM_NODES="2", GPUS_PER_NODE="8", DRY_RUN="1",
                                      MICRO_BATCH="1", GAS="2")
    assert r.returncode == 0, r.stderr
    assert train_args(commands[0])[0] == ["srun", "-N", "2", "-n", "16", "--ntasks-per-node=8", "--gpus-per-node=8"]
    assert summary["devices"] == "16" and "# jaxllm check: config ok for 16 " in r.stdout


def test_local_dry_run_and_bad_knobs():
    r, exports, commands, summary = dry_run("local.sh", "2", "--dry-run", "--config.mesh.data=-1",
                                            "--config.train.micro_batch_size=2", PORT="23999")
    assert r.returncode == 0, r.stderr
    assert exports == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                       "JAXLLM_COORDINATOR_ADDRESS": "127.0.0.1:23999", "JAXLLM_NUM_PROCESSES": "2",
                       "PYTHONPATH": str(ROOT)}  # run from /: jaxllm from the repository
    assert [c[:2] for c in commands] == [["env", "JAXLLM_PROCESS_ID=0"], ["env", "JAXLLM_PROCESS_ID=1"]]
    assert commands[0][-2:] == ["--config.mesh.data=-1", "--config.train.micro_batch_size=2"]
    assert summary["devices"] == "8"
    for script, env in [("local.sh", {"TP": "3"}), ("frontier.sbatch", {"ZERO_STAGE": "5"}),
                        ("frontier.sbatch", {"MICRO_BATCH": "0"}), ("local.sh", {"SP_TYPE": "deepspeed"})]:
        r = dry_run(script, "2", "--dry-run", **slurm_env(**{**{k: "" for k in KNOBS}, **env}))[0]
        assert r.returncode == 2 and r.stderr.startswith("launch: ") and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("sp_type, flag", [("megatron", "--config.parallel.megatron_sp=True"),
                                            ("ds", "--config.parallel.sequence_impl=ulysses"),
                                            ("ring", "--config.parallel.sequence_impl=ring")])
def test_sp_type_takes_alcf_values(sp_type, flag):
    r, _, commands, _ = dry_run("local.sh", "2", "--dry-run", "--config.mesh.data=-1",
                                "--config.train.micro_batch_size=2", PORT="23999", SP_TYPE=sp_type)
    assert r.returncode == 0, r.stderr
    assert train_args(commands[0])[1][0] == flag


def test_wb_project_turns_wandb_on():
    r, _, commands, _ = dry_run("local.sh", "2", "--dry-run", "--config.mesh.data=-1",
                                "--config.train.micro_batch_size=2", PORT="23999", WB_PROJECT="AuroraGPT")
    assert r.returncode == 0, r.stderr
    assert train_args(commands[0])[1][:2] == ["--config.log.wandb=True", "--config.log.wandb_project=AuroraGPT"]


def test_relative_paths_resolve_where_the_script_runs(tmp_path):
    """WORKDIR, --workdir, DATA_FILE_LIST, --config.data.file_list and --config=FILE are made absolute against the
    directory the script is run from (a config only the repository has is the repository's), and jaxllm.train runs
    there, so that the prefixes of a data-file list resolve there too; errors name the path read."""
    (tmp_path / "my.py").write_text("from jaxllm.config import get_config  # noqa: F401\n")
    r = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "2", "--dry-run", "--config=my.py",
                        "--workdir=run1", "--config.data.file_list=lists/b.txt", "--config.mesh.data=-1",
                        "--config.train.micro_batch_size=2"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=clean_env(PORT="23999", DATA_FILE_LIST="lists/a.txt", WORKDIR="w", PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    flags = train_args(shlex.split(r.stdout.splitlines()[-2]))[1]
    assert flags[0] == f"--config={tmp_path}/my.py" and f"--workdir={tmp_path}/w" in flags
    assert f"--config.data.file_list={tmp_path}/lists/a.txt" in flags and flags[-4:-2] == [
        f"--workdir={tmp_path}/run1", f"--config.data.file_list={tmp_path}/lists/b.txt"]
    r, *_ = dry_run("local.sh", "2", "--dry-run", "--config=configs/shakespeare_char.py",
                    "--config.train.micro_batch_size=3", PORT="23999", TP="2")
    assert r.returncode == 0 and f"--config={ROOT}/configs/shakespeare_char.py" in r.stdout, r.stderr  # the repo's
    # A real run of 2 processes from tmp_path: the list's relative prefix is tmp_path's, named as resolved in
    # the error, which process 0 alone prints (process 1 writes it to its log file).
    (tmp_path / "list.txt").write_text("1.0 data/missing web\n")
    r = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "2", "--workdir=run2", *TINY[1:3],
                        "--config.mesh.data=-1", "--config.mesh.tensor=1", "--config.mesh.fsdp=1",
                        "--config.train.micro_batch_size=1", "--config.train.global_batch_size=4"], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path,
                       env=clean_env(DATA_FILE_LIST="list.txt", PYTHON=sys.executable, JAXLLM_MAX_RESTARTS="0",
                                     DEVICES_PER_PROCESS="1"))
    assert r.returncode == 2 and f"{tmp_path}/data/missing: no " in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("data error: ") == 1, r.stderr[-3000:]
    assert "data error: " in (tmp_path / "run2" / "logs" / "process_1.log").read_text()
    r = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "2", "--workdir=run3", *TINY[1:3],
                        "--config.log.sample_tokens=0"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=clean_env(PYTHON=sys.executable, DEVICES_PER_PROCESS="1"))
    assert r.returncode == 2 and r.stderr.count("config error: log.sample_tokens=0") == 1, r.stderr[-3000:]
    assert (tmp_path / "run2").is_dir() and not (ROOT / "run2").exists()


def test_scripts_pass_shellcheck():
    r = subprocess.run(["shellcheck", "-x", *[f"launch/{s}" for s in [*SCRIPTS, "common.sh"]]], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


# ---------------------------------------------------------------- real multi-process runs (CPU, gloo)

TINY = [f"--config.data.input={SHAKESPEARE}", "--config.data.tokenizer=char", "--config.data.sampling=uniform",
        "--config.data.split=9,1", "--config.model.num_layers=2",
        "--config.model.hidden_size=64", "--config.model.num_attention_heads=4", "--config.model.dtype=float32",
        "--config.model.make_vocab_size_divisible_by=1", "--config.train.seq_length=32",
        "--config.train.micro_batch_size=1", "--config.train.global_batch_size=8", "--config.train.warmup_iters=2",
        "--config.train.lr_decay_iters=6", "--config.train.log_interval=1", "--config.train.eval_interval=5",
        "--config.train.eval_iters=1", "--config.log.tensorboard=False", "--config.log.progress_bar=False",
        "--config.log.samples=1", "--config.log.sample_tokens=8",
        "--config.mesh.data=2", "--config.mesh.tensor=2", "--config.mesh.fsdp=2"]


def metrics_of(workdir, kind="train"):
    lines = [json.loads(ln) for ln in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["loss" if kind == "train" else "eval_loss"] for m in lines if m["kind"] == kind}


def one_process(workdir, iters):
    return subprocess.run([sys.executable, "-m", "jaxllm.train", f"--workdir={workdir}", *TINY,
                           f"--config.train.train_iters={iters}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))


def test_two_processes_match_one_and_checkpoint_restores_in_one(tmp_path):
    two, ref, resumed = tmp_path / "two", tmp_path / "ref", tmp_path / "resumed"
    r = subprocess.run(["bash", "launch/local.sh", "2", f"--workdir={two}", *TINY, "--config.train.train_iters=5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=clean_env())
    assert r.returncode == 0, r.stderr[-4000:]
    assert "jaxllm.platform.distributed: 2 processes" in r.stdout and "4 local of 8 global cpu device(s)" in r.stdout
    assert "samples skipped (multi-process run)" in r.stdout
    assert r.stdout.count("jaxllm: 0.") == 1  # only process 0 prints
    # quiet by default: Gloo's connection lines and XLA's warnings go to WORKDIR/logs, not the console
    assert "[Gloo]" not in r.stdout + r.stderr and "Gloo" in (two / "logs" / "process_1.out").read_text()

    r = one_process(ref, 6)  # uninterrupted, 8 devices in one process
    assert r.returncode == 0, r.stderr[-4000:]
    got, want = metrics_of(two), metrics_of(ref)
    assert sorted(got) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([got[s] for s in range(1, 6)], [want[s] for s in range(1, 6)], rtol=1e-5)
    np.testing.assert_allclose(metrics_of(two, "eval")[5], metrics_of(ref, "eval")[5], rtol=1e-5)

    # The 2-process checkpoint (step 5) resumes in one process and continues exactly.
    shutil.copytree(two, resumed)
    r = one_process(resumed, 6)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resuming at step 5" in r.stdout
    np.testing.assert_allclose(metrics_of(resumed)[6], want[6], rtol=1e-5)

    # The hierarchical mesh: the data axis across the two processes (DCN), tensor x fsdp within each;
    # log.verbose shows the library's chatter on the console.
    hybrid = tmp_path / "hybrid"
    r = subprocess.run(["bash", "launch/local.sh", "2", f"--workdir={hybrid}", *TINY, "--config.mesh.data=1",
                        "--config.mesh.dcn_data=2", "--config.train.train_iters=5", "--config.log.verbose=True"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=clean_env())
    assert r.returncode == 0, r.stderr[-4000:]
    assert "[Gloo]" in r.stdout
    assert "mesh {'data': 2, 'fsdp': 2, 'expert': 1, 'pipeline': 1, 'tensor': 2, 'sequence': 1}" in r.stdout
    got = metrics_of(hybrid)
    np.testing.assert_allclose([got[s] for s in range(1, 6)], [want[s] for s in range(1, 6)], rtol=1e-5)


@pytest.mark.parametrize("victim", [1, 0], ids=["kill_worker", "kill_coordinator"])
def test_losing_a_process_fails_the_other_quickly(tmp_path, victim):
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAXLLM_NUM_PROCESSES="2",
                    JAXLLM_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}")
    cmd = [sys.executable, "-m", "jaxllm.train", f"--workdir={tmp_path}", *TINY, "--config.train.train_iters=100000",
           "--config.train.eval_interval=0"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "JAXLLM_PROCESS_ID": str(i)}, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / f"err{i}.log", "w")) for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        while not ((tmp_path / "metrics.jsonl").exists() and len(metrics_of(tmp_path)) >= 2):  # both are training
            assert all(p.poll() is None for p in procs), (tmp_path / "err0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the 2-process run did not start training"
            time.sleep(0.5)
        procs[victim].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        survivor = procs[1 - victim]
        rc = survivor.wait(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rc != 0 and elapsed < 60, (rc, elapsed)
