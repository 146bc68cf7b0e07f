"""A run whose workdir's filesystem fills up, as real processes on a real full filesystem: a small tmpfs mounted in
a mount namespace of the test's own (``unshare --mount --map-root-user``: no root needed where user namespaces are
allowed), filled with empty files (no inode left, as a file quota on Lustre) or one large file (no byte left).

Out of inodes, the save at step 20 fails inside Orbax: the run stops there with exit 74 and one line naming step 10,
the newest complete checkpoint, and leaves no partial step directory; once space is freed, the rerun resumes from step
10 and finishes, its metrics.jsonl holding each step once.  With fewer bytes free than the checkpoint's files take but
more than its arrays, the arrays' writes fail in Orbax's background threads: the same, for step 50.  With fewer bytes
free than the arrays take, the free-space check refuses the saves before writing anything (the line saying what was
free and what was needed); with checkpoint.fail_on_save_error=False the run trains on past the failed save at 50 in
one warning line, but not past its last save's failure: exit 74, never 0.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare.txt"  # public domain (tests/data/README.md)

# Runs inside the namespace: mounts the tmpfs, runs jaxllm.train in phases, records what each left behind.
DRIVER = r"""
import json, os, subprocess, sys, time
mount, out, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=600", "tmpfs", mount], check=True)
workdir = os.path.join(mount, "run")
results = {}


def train(phase, iters, *more):
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", f"--workdir={workdir}", *flags,
                        f"--config.train.train_iters={iters}", *more], capture_output=True, text=True)
    rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()]
    results[phase] = {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
                      "checkpoints": sorted(os.listdir(os.path.join(workdir, "checkpoints"))),
                      "steps": [row["step"] for row in rows if row["kind"] == "train"],
                      "seconds": time.perf_counter() - start}


def fill(leave_inodes=None, leave_bytes=None):
    if leave_inodes is not None:
        n = os.statvfs(mount).f_favail - leave_inodes
        for i in range(n):
            open(os.path.join(mount, f"filler{i}"), "w").close()
    if leave_bytes is not None:
        fs = os.statvfs(mount)
        with open(os.path.join(mount, "big"), "wb") as f:
            f.write(b"\0" * (fs.f_bavail * fs.f_frsize - leave_bytes))


def free():
    for name in os.listdir(mount):
        if name != "run":
            os.remove(os.path.join(mount, name))


def used(path):  # bytes a directory takes on the filesystem, its files' blocks
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)


train("first", 10)
fill(leave_inodes=8)  # the run starts (its lock file), its checkpoint's ~30 files do not fit
train("inodes", 40)
free()
train("freed", 40)
step40 = used(os.path.join(workdir, "checkpoints", "40"))
fill(leave_bytes=int(0.8 * step40))  # more than its arrays' bytes (the check passes), less than its files take
train("bytes", 60)
free()
fill(leave_bytes=100_000)  # less than the ~0.2 MB the arrays take: the check refuses the saves
train("checked", 60, "--config.checkpoint.fail_on_save_error=False")  # going on past 50, not past the last, 60
json.dump(results, open(out, "w"))
"""


def test_a_full_filesystem_stops_the_run_at_the_failed_save(tmp_path):
    mount = tmp_path / "mnt"
    mount.mkdir()
    flags = [f"--config.data.input={SHAKESPEARE}", "--config.data.tokenizer=char", "--config.data.sampling=uniform",
             "--config.data.split=9,1", f"--config.data.cache_dir={tmp_path / 'index'}",
             "--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.num_attention_heads=2",
             "--config.model.dtype=float32", "--config.model.make_vocab_size_divisible_by=1",
             "--config.train.seq_length=32", "--config.train.micro_batch_size=4", "--config.train.global_batch_size=4",
             "--config.train.warmup_iters=1", "--config.train.lr_decay_iters=100", "--config.train.eval_interval=0",
             "--config.train.log_interval=1", f"--config.train.compile_cache_dir={tmp_path / 'compile_cache'}",
             "--config.checkpoint.interval=10", "--config.log.samples=0", "--config.log.tensorboard=False",
             "--config.log.progress_bar=False"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(FAST_COMPILE)}
    r = subprocess.run(["unshare", "--mount", "--map-root-user", sys.executable, "-c", DRIVER, str(mount),
                        str(tmp_path / "results.json"), *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    phases = json.loads((tmp_path / "results.json").read_text())
    first, inodes, freed, tight, full = (phases[p] for p in ("first", "inodes", "freed", "bytes", "checked"))
    assert first["rc"] == 0 and first["checkpoints"] == ["10"], first["stderr"]

    lines = [ln for ln in inodes["stderr"].splitlines() if ln.strip()]
    assert inodes["rc"] == 74 and len(lines) == 1, inodes["stderr"]
    assert lines[0].startswith(f"error: checkpoint step 20 was not saved to {mount}/run/checkpoints ("), lines[0]
    assert "No space left on device" in lines[0]
    assert lines[0].endswith("; the newest complete checkpoint there is step 10; stopping: free space (or fix the "
                             "directory) and rerun, which resumes from step 10 (checkpoint.fail_on_save_error=False "
                             "trains on instead)"), lines[0]
    assert inodes["checkpoints"] == ["10"]  # no 20.orbax-checkpoint-tmp-* left to hold the space
    assert inodes["steps"][-1] < 30  # stopped at the failed save, not at the next one

    assert freed["rc"] == 0 and "resuming at step 10" in freed["stdout"], freed["stderr"]
    assert freed["checkpoints"] == ["30", "40"] and freed["steps"] == list(range(1, 41))

    lines = [ln for ln in tight["stderr"].splitlines() if ln.strip()]
    assert tight["rc"] == 74 and len(lines) == 1, tight["stderr"]
    assert lines[0].startswith(f"error: checkpoint step 50 was not saved to {mount}/run/checkpoints ("), lines[0]
    assert "No space left on device" in lines[0] and "the checkpoint's arrays take" not in lines[0], lines[0]
    assert "; the newest complete checkpoint there is step 40; stopping" in lines[0], lines[0]
    assert tight["checkpoints"] == ["30", "40"]  # (its steps are too quick to end before the failure is known)

    lines = [ln for ln in full["stderr"].splitlines() if ln.strip()]
    assert full["rc"] == 74 and len(lines) == 2, full["stderr"]
    assert lines[0].endswith(f"checkpoint step 50 was not saved to {mount}/run/checkpoints (OSError: [Errno 28] No "
                             "space left on device: 0.1 MiB free, the checkpoint's arrays take 0.2 MiB); the newest "
                             "complete checkpoint there is step 40; training goes on and the next save tries again "
                             "(checkpoint.fail_on_save_error=False)"), lines[0]  # (absl's warning prefix first)
    assert lines[1] == (f"error: checkpoint step 60 was not saved to {mount}/run/checkpoints (OSError: [Errno 28] No "
                        "space left on device: 0.1 MiB free, the checkpoint's arrays take 0.2 MiB); the newest "
                        "complete checkpoint there is step 40; stopping: free space (or fix the directory) and rerun, "
                        "which resumes from step 40"), lines[1]
    assert full["checkpoints"] == ["30", "40"] and full["steps"][-1] == 60
