"""Weights & Biases logging (``log.wandb``) through the real CLI and the real wandb package, offline: the
W&B run holds what metrics.jsonl holds at the same steps and the resolved config, a restart resumes the
same W&B run, and without wandb the run stops with one line before anything compiles."""

import glob
import json
import math
import os
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

from wandb.proto import wandb_internal_pb2

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
# A tiny byte-level run on the json package's sources (five documents: two for validation), logging every step
# and evaluating every other step.
TINY = [f"--config.data.input={Path(sysconfig.get_paths()['stdlib']) / 'json'}", "--config.data.tokenizer=byte",
        "--config.data.split=3,2,0", "--config.model.num_layers=1", "--config.model.hidden_size=32",
        "--config.model.num_attention_heads=2",
        "--config.train.seq_length=32", "--config.train.micro_batch_size=4", "--config.train.global_batch_size=4",
        "--config.train.warmup_iters=1", "--config.train.lr_decay_iters=100", "--config.train.eval_interval=2",
        "--config.train.eval_iters=1", "--config.train.log_interval=1", "--config.checkpoint.interval=2",
        "--config.log.samples=0", "--config.log.tensorboard=False", "--config.log.progress_bar=False",
        "--config.log.wandb=True", "--config.log.wandb_project=jaxllm-test"]


def train(workdir, iters, env=ENV):
    return subprocess.run([sys.executable, "-m", "jaxllm.train", f"--workdir={workdir}", *TINY,
                           f"--config.train.train_iters={iters}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def wandb_records(path):
    """The records of a ``.wandb`` file: LevelDB's log format (32 KiB blocks of chunks: checksum, length,
    type), after W&B's 7-byte header; each record a ``wandb.proto`` Record."""
    data = Path(path).read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    records, pos, chunk = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0:  # zeros: the end of what was written
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


def offline_run(run_dir):
    """``(run id, project, name, config, {step: {key: value}})`` of an offline run's directory."""
    records = wandb_records(*glob.glob(str(run_dir / "run-*.wandb")))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    updates = [*run.config.update, *(u for r in records if r.WhichOneof("record_type") == "config"
                                     for u in r.config.update)]
    cfg = {u.key: json.loads(u.value_json) for u in updates if u.key != "_wandb"}
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
    return run.run_id, run.project, run.display_name, cfg, history


def saved_config(workdir):
    """The resolved config the run saved with its last checkpoint (Orbax's JSON item ``config``)."""
    latest = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    return json.loads((workdir / "checkpoints" / str(latest) / "config" / "metadata").read_text())


def assert_history_is_metrics_jsonl(history, records):
    by_step = {}
    for record in records:
        by_step.setdefault(record.pop("step"), {}).update({k: v for k, v in record.items() if k != "kind"})
    assert sorted(history) == sorted(by_step)
    for step, values in by_step.items():
        assert history[step].keys() == values.keys(), step
        for key, value in values.items():
            got = history[step][key]
            if value is None:  # metrics.jsonl writes a non-finite float as null
                assert got is None or not math.isfinite(got), (step, key, got)
            else:
                assert got == value, (step, key, got, value)


def test_wandb_run_holds_metrics_jsonl_and_the_config_and_resumes(tmp_path):
    work = tmp_path / "tiny-run"
    r = train(work, 4)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted((work / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    run_id = (work / "wandb_run_id").read_text().strip()
    got_id, project, name, cfg, history = offline_run(runs[0])
    assert (got_id, project, name) == (run_id, "jaxllm-test", "tiny-run")
    assert cfg == saved_config(work)
    assert cfg["log"]["wandb"] is True and cfg["model"]["padded_vocab_size"] == 256  # resolved
    records = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in records] == [1, 2, 2, 3, 4, 4]  # train every step, eval every other
    assert_history_is_metrics_jsonl(history, records)
    assert {"loss", "lr", "grad_norm", "eval_loss", "startup_s"} <= history[2].keys() | history[1].keys()

    r = train(work, 6)  # resumes at step 4: the same W&B run
    assert r.returncode == 0, r.stderr[-3000:]
    assert (work / "wandb_run_id").read_text().strip() == run_id
    resumed = sorted(set((work / "wandb").glob("offline-run-*")) - set(runs))
    assert len(resumed) == 1 and resumed[0].name.endswith(run_id), resumed
    got_id, _, _, _, history = offline_run(resumed[0])
    assert got_id == run_id
    new = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()][len(records):]
    assert_history_is_metrics_jsonl(history, new)
    assert sorted(history) == [5, 6]


def test_wandb_missing_is_one_line_before_anything_compiles(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()  # a wandb module that cannot be imported, first on the path: as if wandb were not installed
    (hidden / "wandb.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    path = os.pathsep.join(p for p in (str(hidden), os.environ.get("PYTHONPATH")) if p)
    r = train(tmp_path / "run", 2, env={**ENV, "PYTHONPATH": path})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert lines[0].startswith("config error: log.wandb=True: the wandb package cannot be imported (No module "
                               "named 'wandb'); pip install 'jaxllm[wandb]'"), lines[0]
    assert not (tmp_path / "run" / "data").exists()  # stopped before the data was read
