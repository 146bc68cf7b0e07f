"""In-job restart, stragglers and relative paths, through launch/local.sh: 2 processes x 4 CPU devices.

A process is killed (SIGKILL) once the run has logged a step past a complete checkpoint of its node-local
tier only; the launcher restarts the job by itself, it resumes from that checkpoint and its losses equal
an uninterrupted run's bit for bit, metrics.jsonl holding each step once; with the killed process's local
tier deleted (its node lost), it resumes from the shared tier, as exactly.  Killed twice from the same
checkpoint, the job stops with one line.  The uninterrupted run has a straggler
(``JAXLLM_DEBUG_SLOW_PROCESS``: process 1 sleeps in every step), named in one warning line.  The runs share
one compilation cache, so only the first compiles.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_distributed import TINY, clean_env

ROOT = Path(__file__).resolve().parents[1]
ITERS, INTERVAL = 12, 4
FLAGS = [*[f for f in TINY if not f.startswith(("--config.train.eval_interval", "--config.log.samples"))],
         "--config.train.eval_interval=0", "--config.log.samples=0", f"--config.train.train_iters={ITERS}",
         f"--config.checkpoint.interval={INTERVAL}", "--config.train.lr_decay_iters=12"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compilation cache for every run of this module."""
    return tmp_path_factory.mktemp("compile_cache")


def launch(workdir, cache, **env):
    """``launch/local.sh 2`` on FLAGS in ``workdir``, started (stdout and stderr to files in ``workdir``'s parent)."""
    out = open(f"{workdir}.out", "w")
    err = open(f"{workdir}.err", "w")
    return subprocess.Popen(["bash", "launch/local.sh", "2", f"--workdir={workdir}", *FLAGS,
                             f"--config.train.compile_cache_dir={cache}"], cwd=ROOT, stdout=out, stderr=err,
                            env=clean_env(PYTHON=sys.executable, **env),
                            start_new_session=True)


def records(workdir):
    path = Path(workdir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def losses(workdir):
    """step -> loss of the train records."""
    return {r["step"]: r["loss"] for r in records(workdir) if r["kind"] == "train"}


def checkpoints(workdir):
    """The complete steps of the shared tier, and of the node-local tier where every process holds them."""
    shared = {int(p.name) for p in (Path(workdir) / "checkpoints").glob("*") if p.name.isdigit()}
    tier = Path(workdir) / "checkpoints" / "local_tier"  # process 0's local directory
    if not tier.exists():
        return sorted(shared)
    held = [{int(p.name) for p in d.glob("*") if p.name.isdigit()}
            for d in Path(tier.read_text().strip()).parent.glob("p*of2-*")]
    return sorted(shared | set.intersection(*held))


def process_1(launcher):
    """The pid of the launcher's child with JAXLLM_PROCESS_ID=1."""
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if b"JAXLLM_PROCESS_ID=1" in environ:
            return int(child)
    raise AssertionError("no process 1 among the launcher's children")


def kill_after(launcher, workdir, skip: int = 0, timeout=240, local_only=False):
    """Waits until ``workdir`` has a complete checkpoint (``local_only``: one the shared tier has not) and a step
    past it among its metrics records after the first ``skip``, then SIGKILLs process 1; returns that step."""
    deadline = time.monotonic() + timeout
    while True:
        assert launcher.poll() is None, Path(f"{workdir}.err").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run did not get there"
        saved = checkpoints(workdir)
        train = [r["step"] for r in records(workdir)[skip:] if r["kind"] == "train"]
        if saved and train and train[-1] > saved[-1] and not (local_only and saved[-1] % INTERVAL == 0):
            os.kill(process_1(launcher), signal.SIGKILL)
            return saved[-1]
        time.sleep(0.1)


def launch_lines(workdir):
    return [ln for ln in Path(f"{workdir}.err").read_text().splitlines() if ln.startswith("launch: ")]


def test_straggler_restart_and_twice_the_same_failure(tmp_path, cache):
    # Uninterrupted, process 1 sleeping 1 s in every step: named in one warning line
    ref = tmp_path / "ref"
    p = launch(ref, cache, JAXLLM_DEBUG_SLOW_PROCESS="1:1")
    assert p.wait(timeout=400) == 0, Path(f"{ref}.err").read_text()[-3000:]
    out = Path(f"{ref}.out").read_text()
    warnings = [ln for ln in out.splitlines() if "warning: straggler" in ln]
    assert len(warnings) == 1 and "straggler: process 1 (host " in warnings[0], out[-3000:]
    assert all("| spread " in ln for ln in out.splitlines() if ln.startswith("step ")), out[-3000:]
    want = losses(ref)
    assert sorted(want) == list(range(1, ITERS + 1))

    # Killed once between two saves, with a node-local tier every 2 steps: restarted by the launcher from the
    # newest checkpoint (local when every process holds it), finishes exactly
    once = tmp_path / "once"
    p = launch(once, cache, JAXLLM_ARGS=f"--config.checkpoint.local_dir={tmp_path / 'local'} "
               "--config.checkpoint.local_interval=2")
    saved = kill_after(p, once, local_only=True)
    assert p.wait(timeout=400) == 0, Path(f"{once}.err").read_text()[-3000:]
    lines = launch_lines(once)
    assert len(lines) == 1 and lines[0].startswith("launch: restart 1 of 3: jaxllm.train failed with status 137 "
                                                   "(SIGKILL) after step "), lines
    assert lines[0].endswith(f"; resuming from the checkpoint at step {saved} (node-local; step "
                             f"{saved - saved % INTERVAL} of {once}/checkpoints if a node lacks it)"), lines
    assert f"jaxllm: restored step {saved} from the node-local checkpoints" in Path(f"{once}.out").read_text()
    steps = [r["step"] for r in records(once) if r["kind"] == "train"]
    assert steps == list(range(1, ITERS + 1))  # once each: the rows logged past the restored step were superseded
    assert losses(once) == want  # bit for bit

    # The same, the killed process's node lost with its local tier: resumed from the shared tier, exactly
    lost = tmp_path / "lost"
    p = launch(lost, cache, JAXLLM_ARGS=f"--config.checkpoint.local_dir={tmp_path / 'lost_local'} "
               "--config.checkpoint.local_interval=2")
    saved = kill_after(p, lost, local_only=True)
    for d in (tmp_path / "lost_local").glob("*/p1of2-*"):
        shutil.rmtree(d)  # before the restart reads it: the restart needs a new start of python and jax
    assert p.wait(timeout=400) == 0, Path(f"{lost}.err").read_text()[-3000:]
    out, shared = Path(f"{lost}.out").read_text(), saved - saved % INTERVAL
    assert "from the node-local checkpoints" not in out
    assert f"resuming at step {shared}" in out if shared else "resuming at step" not in out  # (0: started over)
    assert [r["step"] for r in records(lost) if r["kind"] == "train"] == list(range(1, ITERS + 1))
    assert losses(lost) == want

    # Killed twice from the same checkpoint: one line, the job ends with the status of the failure
    twice = tmp_path / "twice"
    p = launch(twice, cache)
    saved = kill_after(p, twice)
    deadline = time.monotonic() + 240
    while not launch_lines(twice):  # the restart
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    again = kill_after(p, twice, skip=len(records(twice)))
    assert again == saved
    assert p.wait(timeout=120) == 137
    lines = launch_lines(twice)
    assert len(lines) == 2 and lines[1].startswith("launch: not restarting: jaxllm.train failed with status 137 "
                                                   "(SIGKILL) after step "), lines
    assert f"the same way as before from the same checkpoint ({saved})" in lines[1]


def test_a_dead_coordinator_is_one_line_on_the_survivor(tmp_path, cache):
    """Process 0 (the coordinator) killed: process 1, which JAX's distributed client then ends (C++ errors of the
    coordination service and gRPC, a fatal line), says so in one jaxllm line; those lines go to its log file."""
    from test_distributed import free_port  # noqa: PLC0415

    workdir = tmp_path / "run"
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4",
                    JAXLLM_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAXLLM_NUM_PROCESSES="2")
    args = [sys.executable, "-m", "jaxllm.train", f"--workdir={workdir}", *FLAGS, "--config.train.train_iters=10000",
            f"--config.train.compile_cache_dir={cache}"]
    procs = [subprocess.Popen(args, cwd=ROOT, env={**env, "JAXLLM_PROCESS_ID": str(i)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 240
    while not records(workdir):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, procs[0].stderr.read()[-3000:]
        time.sleep(0.2)
    procs[0].kill()
    procs[0].wait()
    err = procs[1].communicate(timeout=120)[1]
    assert procs[1].returncode != 0
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("prepare:", "jaxllm: waiting"))]
    assert lines == ["jaxllm: process 1 stops: the job's coordinator (process 0) or another of its processes died, "
                     f"and JAX's distributed service ends the others (its lines: {workdir}/logs/process_1.out)"], err
    assert "Terminating process because the JAX distributed service detected fatal errors" in (
        workdir / "logs" / "process_1.out").read_text()
