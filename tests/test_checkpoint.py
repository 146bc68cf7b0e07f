"""Checkpoints end to end, with real Orbax and real processes: exact resume after SIGKILL (1 and
8 devices), kills during asynchronous saves, damaged checkpoints, restore onto other meshes,
preemption by SIGTERM/SIGUSR1, and the non-finite step guard."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import jax
import numpy as np
import pytest

from jaxllm import config, train
from jaxllm.data.loader import Batches
from jaxllm.data.text import ensure_prepared
from jaxllm.resolve import resolve
from jaxllm.runtime import checkpoint
from jaxllm.runtime.run import Run

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare.txt"  # public domain (tests/data/README.md)
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
# Synchronous CPU dispatch: two 8-device programs in flight at once (train and eval steps) can starve
# the in-process collectives of the host's thread pool on a 2-core machine (XLA aborts the rendezvous).
ENV8 = {**ENV, "XLA_FLAGS": ENV.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
        "JAX_CPU_ENABLE_ASYNC_DISPATCH": "false"}
ITERS = 20
MESH8 = {"mesh.tensor": 2, "mesh.fsdp": 2, "mesh.data": 2}
# Evaluating every step changes nothing in the training state but makes a step slow enough that
# a signal sent once a step is logged reliably lands before the run ends.
SLOW = {"train.eval_interval": 1, "train.eval_iters": 100}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    cfg = config.get_config().data
    cfg.update(input=str(SHAKESPEARE), tokenizer="char")
    return ensure_prepared(cfg, str(tmp_path_factory.mktemp("data")))


def overrides(data_dir, **extra):
    """The tiny float32 run of these tests: 20 steps, a save every 5, every step logged."""
    o = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.dtype": "float32",
         "model.make_vocab_size_divisible_by": 1, "train.seq_length": 32, "train.micro_batch_size": 2,
         "train.global_batch_size": 8, "train.train_iters": ITERS, "train.warmup_iters": 5, "train.lr": 3e-3,
         "train.min_lr": 3e-4, "train.lr_decay_iters": ITERS, "train.eval_interval": 0, "train.log_interval": 1,
         "data.input": data_dir, "data.tokenizer": "char", "data.sampling": "uniform", "data.split": "9,1",
         "checkpoint.interval": 5, "checkpoint.keep": 2,
         "checkpoint.keep_period": 10, "log.samples": 0, "log.tensorboard": False, "log.progress_bar": False}
    o.update({k.replace("__", "."): v for k, v in extra.items()})
    return o


def make_config(o):
    cfg = config.get_config()
    for key, value in o.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def command(workdir, o):
    return [sys.executable, "-m", "jaxllm.train", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in o.items())]


def train_losses(workdir):
    """Every logged train step as (step, loss, nonfinite_steps), in file order (a partial last line is skipped)."""
    path = Path(workdir) / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if m["kind"] == "train":
            out.append((m["step"], m["loss"], m["nonfinite_steps"]))
    return out


def finalized(workdir):
    d = Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def signal_when(workdir, o, until, signum, env=ENV, delay=0.0, timeout=300):
    """Starts the CLI on ``workdir``, sends ``signum`` once ``until()`` holds (after ``delay`` s),
    and returns ``(returncode, output)``."""
    log = Path(workdir).with_name(Path(workdir).name + f".{signum}.{time.monotonic_ns()}.log")
    with open(log, "w") as out:
        p = subprocess.Popen(command(workdir, o), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while not until():
            assert p.poll() is None, f"the run ended (rc {p.returncode}) before the signal:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "timed out waiting to send the signal"
            time.sleep(0.005)
        time.sleep(delay)
        p.send_signal(signum)
        p.wait(timeout=timeout)
    return p.returncode, log.read_text()


def run_cli(workdir, o, env=ENV):
    r = subprocess.run(command(workdir, o), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def last_step(workdir):
    return max((s for s, _, _ in train_losses(workdir)), default=0)


def assert_matches(workdir, reference):
    """Every loss ever logged in ``workdir`` (all attempts) equals the uninterrupted run's, bitwise,
    and the run reached the last step."""
    logged = train_losses(workdir)
    assert logged and logged[-1][0] == ITERS
    for step, loss, _ in logged:
        assert loss == reference[step], f"step {step}: {loss!r} != {reference[step]!r}"


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """The uninterrupted single-device run (in this process): its workdir and {step: loss}."""
    workdir = tmp_path_factory.mktemp("reference")
    train.train(make_config(overrides(data_dir)), str(workdir))
    return workdir, {s: loss for s, loss, _ in train_losses(workdir)}


def test_keep_and_keep_period(reference):
    # saves at 5, 10, 15, 20; keep=2 keeps 15 and 20, keep_period=10 also 10
    assert finalized(reference[0]) == [10, 15, 20]
    assert sorted(reference[1]) == list(range(1, ITERS + 1))


def test_sigkill_then_rerun_resumes_exactly(data_dir, reference, tmp_path):
    workdir = tmp_path / "run"
    o = overrides(data_dir)
    rc, out = signal_when(workdir, {**o, **SLOW}, lambda: last_step(workdir) >= 12 and 10 in finalized(workdir),
                          signal.SIGKILL)
    assert rc == -signal.SIGKILL, out
    assert last_step(workdir) < ITERS
    rc, out = run_cli(workdir, o)
    assert rc == 0, out[-3000:]
    assert "resuming at step 10" in out or "resuming at step 15" in out
    assert_matches(workdir, reference[1])


def test_kills_during_async_saves_keep_the_previous_checkpoint(data_dir, reference, tmp_path):
    """A save every step keeps saves in flight; SIGKILL at several delays after a temporary
    (in-progress) step directory appears, each attempt resuming the last; then a clean rerun."""
    workdir = tmp_path / "run"
    o = overrides(data_dir, checkpoint__interval=1, checkpoint__keep_period=0)
    ckpts = workdir / "checkpoints"
    cfg, _ = train.setup(make_config(o), str(workdir))
    abstract = Run(cfg).abstract_state
    kills = []
    for delay in (0.0, 0.003, 0.02):
        after = last_step(workdir) + 2

        def saving(after=after):
            return (last_step(workdir) >= after and finalized(workdir)
                    and any("tmp" in p.name for p in ckpts.iterdir()))

        rc, out = signal_when(workdir, o, saving, signal.SIGKILL, delay=delay)
        assert rc == -signal.SIGKILL, out
        kills.append(sorted(p.name for p in ckpts.iterdir()))
        ckpt = checkpoint.Checkpointer(str(workdir), make_config(o))
        latest = ckpt.latest_step()
        assert latest is not None and latest == finalized(workdir)[-1]  # temporary directories are not steps
        assert int(ckpt.restore(abstract)["step"]) == latest and not ckpt.invalid, kills
        ckpt.close()
    assert last_step(workdir) < ITERS
    rc, out = run_cli(workdir, o)
    assert rc == 0, out[-3000:]
    assert_matches(workdir, reference[1])


def test_damaged_checkpoints_fall_back_to_the_previous_step(data_dir, reference, tmp_path, caplog):
    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    (workdir / "metrics.jsonl").unlink()
    o = overrides(data_dir)
    cfg, _ = train.setup(make_config(o), str(workdir))
    abstract = Run(cfg).abstract_state
    ckpts = workdir / "checkpoints"
    data_files = lambda step: [p for p in (ckpts / str(step) / "state").rglob("*") if p.is_file() and p.stat().st_size]  # noqa: E731

    (ckpts / "20" / "state" / "_METADATA").unlink()  # a deleted file
    for f in data_files(15):  # truncated files
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    ckpt = checkpoint.Checkpointer(str(workdir), cfg)
    state = ckpt.restore(abstract)
    assert int(state["step"]) == 10 and ckpt.invalid == {15, 20}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w.split(" in ")[0] for w in warnings] == ["checkpoint step 20", "checkpoint step 15"], warnings
    assert all(f"in {ckpts} cannot be restored (" in w and "\n" not in w for w in warnings)

    with pytest.raises(checkpoint.CheckpointError, match="can be restored: step 15: "):
        ckpt.restore(abstract, step=15)
    ckpt.close()

    # The rerun resumes from 10, replaces 15 and 20 and computes what the uninterrupted run did.
    train.train(make_config(o), str(workdir))
    assert_matches(workdir, reference[1])
    assert finalized(workdir) == [10, 15, 20]
    ckpt = checkpoint.Checkpointer(str(workdir), cfg)
    assert int(ckpt.restore(abstract)["step"]) == 20 and not ckpt.invalid
    ckpt.close()

    for step in (10, 15, 20):
        for f in data_files(step):
            f.write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError,
                       match="no checkpoint in .* can be restored: step 20: .*step 15: .*step 10: "):
        checkpoint.Checkpointer(str(workdir), cfg).restore(abstract)


def test_preemption_saves_at_the_step_boundary_and_exits_75(data_dir, reference, tmp_path):
    workdir = tmp_path / "run"
    o = overrides(data_dir)
    stops = []
    for signum, after in ((signal.SIGTERM, 3), (signal.SIGUSR1, 7)):
        rc, out = signal_when(workdir, {**o, **SLOW}, lambda a=after: last_step(workdir) >= a, signum)
        assert rc == train.EXIT_PREEMPTED == 75, out[-3000:]
        stop = last_step(workdir)
        assert stop < ITERS and finalized(workdir)[-1] == stop  # saved exactly where it stopped
        assert f"preempted: saved a checkpoint at step {stop}" in out
        stops.append(stop)
    assert stops[0] < stops[1]
    rc, out = run_cli(workdir, o)
    assert rc == 0 and f"resuming at step {stops[1]}" in out, out[-3000:]
    assert_matches(workdir, reference[1])


def test_8_devices_resume_exactly_and_restore_onto_other_meshes(data_dir, tmp_path):
    ref, workdir = tmp_path / "reference8", tmp_path / "run8"
    o = overrides(data_dir, **{k.replace(".", "__"): v for k, v in MESH8.items()})
    rc, out = run_cli(ref, o, env=ENV8)
    assert rc == 0 and "mesh {'data': 2, 'fsdp': 2, 'expert': 1, 'pipeline': 1, 'tensor': 2" in out, out[-3000:]
    reference = {s: loss for s, loss, _ in train_losses(ref)}
    # Slowed by a save every step, not by SLOW's evaluation: the eval step's collective permute can
    # deadlock XLA's in-process CPU collectives with 8 fake devices on a 2-core host.
    rc, out = signal_when(workdir, {**o, "checkpoint.interval": 1},
                          lambda: last_step(workdir) >= 11 and 10 in finalized(workdir), signal.SIGKILL, env=ENV8)
    assert rc == -signal.SIGKILL, out
    rc, out = run_cli(workdir, o, env=ENV8)
    assert rc == 0, out[-3000:]
    assert_matches(workdir, reference)

    layouts = {"fsdp8": {"fsdp": 8}, "single": {}, "data4_tensor2": {"data": 4, "tensor": 2},
               "pipeline2_data4": {"pipeline": 2, "data": 4}}
    r = forkserver.run([ROOT / "tests" / "reshard.py", ref, json.dumps(layouts)], ENV, ROOT, 600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout)
    assert results["saved_mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} and results["step"] == ITERS
    for name in layouts:
        assert results[name]["different"] == [] and results[name]["shardings_ok"], (name, results[name])
    assert [results[n]["devices"] for n in layouts] == [8, 1, 8, 8]

    # The 8-device run's text generation on one device: parameters restored onto this host.
    r = subprocess.run([sys.executable, "-m", "jaxllm.generate", f"--workdir={ref}", "--prompt=ROMEO:",
                        "--num_tokens=20"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    sample = r.stdout.split("-" * 40)[0]
    assert r.returncode == 0 and sample.startswith("ROMEO:") and len(sample) == len("ROMEO:") + 20 + 1, r.stderr


HUGE_INIT = {"model.init_std": 1e30}  # gradients overflow float32: every step's gradient norm is NaN


def test_nonfinite_step_is_skipped_and_counted(data_dir, tmp_path):
    cfg, data = train.setup(make_config(overrides(data_dir, **{"model__init_std": 1e30})), str(tmp_path))
    run = Run(cfg)
    loader = Batches(data, rows=run.process_rows())
    state = run.initial_state()
    before = jax.device_get(state)
    for s in range(2):
        state, m = run.train_step(state, *run.global_batch(*loader.train_batch(s)))
        assert not np.isfinite(float(m["grad_norm"]))
        assert int(m["nonfinite_steps"]) == int(m["nonfinite_in_a_row"]) == s + 1
    after = jax.device_get(state)
    assert int(after["step"]) == 2 and int(after["nonfinite_steps"]) == 2
    for a, b in zip(jax.tree.leaves((before["params"], before["opt_state"])),
                    jax.tree.leaves((after["params"], after["opt_state"]))):
        np.testing.assert_array_equal(a, b)

    # A finite step after them updates, resets the run of skipped steps and keeps the total.
    normal = Run(resolve(make_config(overrides(data_dir)), num_devices=1,
                                vocab_size=data.vocab_size)).initial_state()
    state = {**state, "params": normal["params"], "opt_state": normal["opt_state"]}
    opt0 = jax.device_get(state["opt_state"])
    state, m = run.train_step(state, *run.global_batch(*loader.train_batch(2)))
    assert np.isfinite(float(m["grad_norm"])) and int(m["nonfinite_in_a_row"]) == 0 and int(m["nonfinite_steps"]) == 2
    # (its learning rate is the schedule's first, 0: skipped steps do not advance the optimizer's count)
    after = jax.tree.leaves(jax.device_get(state["opt_state"]))
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(opt0), after)]
    assert sum(changed) > len(changed) // 2


def test_run_stops_after_max_nonfinite_steps_in_a_row(data_dir, tmp_path):
    rc, out = run_cli(tmp_path, overrides(data_dir, model__init_std=1e30, train__max_nonfinite_steps=3))
    assert rc == 1, out[-3000:]
    assert "error: the loss or gradient norm was NaN/inf for 3 steps in a row (steps 1-3" in out
    assert "Traceback" not in out
    assert [(s, n) for s, _, n in train_losses(tmp_path)] == [(1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("key,value", [("checkpoint.keep_period", -1), ("train.max_nonfinite_steps", 0),
                                       ("checkpoint.keep", 0), ("checkpoint.interval", -5)])
def test_checkpoint_config_errors(key, value):
    cfg = config.get_config()
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(config.ConfigError) as e:
        resolve(cfg, num_devices=1)
    assert e.value.key == key and str(e.value).startswith(f"config error: {key}={value}")


def test_resuming_with_another_model_is_a_clear_error(tmp_path):
    """A checkpoint of another model is not "damaged": the error names the keys that differ."""
    from jaxllm.runtime.checkpoint import Checkpointer, CheckpointError

    spec = config.get_config()
    spec.model.update(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64, dtype="float32")
    cfg = resolve(spec, num_devices=1)
    ckpt = Checkpointer(str(tmp_path), cfg)
    ckpt.maybe_save(1, Run(cfg).initial_state(), force=True)
    ckpt.close()
    spec.model.hidden_size = 64
    cfg = resolve(spec, num_devices=1)
    ckpt = Checkpointer(str(tmp_path), cfg)
    with pytest.raises(CheckpointError, match=r"another model: model.hidden_size=32 \(this run: 64\)"):
        ckpt.restore(Run(cfg).abstract_state)
    ckpt.close()
    assert (tmp_path / "checkpoints" / "1").exists()  # nothing deleted


def _digests(directory: Path) -> dict[str, str]:
    import hashlib

    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("key,value", [("model.qk_layernorm", True), ("model.num_experts", 4),
                                       ("model.add_qkv_bias", True), ("model.mtp_num_layers", 1)])
def test_a_key_that_changes_the_parameters_is_another_model(tmp_path, key, value):
    """Any model key that changes the parameters (the checkpoint's model against this run's, by gpt.describe: no
    list of keys kept by hand) is a ModelMismatch naming the key and both values: a config error (exit 2), not a
    damaged checkpoint; nothing is deleted."""
    spec = config.get_config()
    spec.model.update(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64, dtype="float32",
                      use_bias=False)
    cfg = resolve(spec, num_devices=1)
    ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
    ckpt.maybe_save(1, Run(cfg).initial_state(), force=True)
    ckpt.close()
    section, name = key.split(".")
    setattr(getattr(spec, section), name, value)
    saved = getattr(cfg.model, name)
    cfg = resolve(spec, num_devices=1)
    ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
    with pytest.raises(checkpoint.ModelMismatch) as e:
        ckpt.restore(Run(cfg).abstract_state)
    ckpt.close()
    assert isinstance(e.value, config.ConfigError) and e.value.key == key
    assert f"another model: {key}={saved!r} (this run: {value!r})." in str(e.value), str(e.value)
    assert (tmp_path / "checkpoints" / "1").exists()


def _digests(directory: Path) -> dict[str, str]:
    import hashlib

    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def test_resuming_another_model_stops_in_one_line_and_touches_nothing(data_dir, reference, tmp_path):
    """The run itself: one line on stderr naming the key and both values, exit 2, before anything compiles; the
    checkpoints are left as they were, byte for byte."""
    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    before = _digests(workdir / "checkpoints")
    r = subprocess.run(command(workdir, {**overrides(data_dir), "model.qk_layernorm": True}), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "another model: model.qk_layernorm=False (this run: True)" in lines[0], r.stderr
    assert _digests(workdir / "checkpoints") == before


def test_a_flipped_byte_is_detected_and_the_step_before_restored(data_dir, reference, tmp_path, caplog):
    """Orbax and TensorStore restore a chunk with a changed byte without a word: the checksums saved with
    the step catch it, the step goes to damaged/ and the run resumes from the one before, exactly."""
    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    (workdir / "metrics.jsonl").unlink()
    ckpts = workdir / "checkpoints"
    chunk = max((p for p in (ckpts / "20" / "state").glob("ocdbt.process_0/d/*")), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    result = train.train(make_config(overrides(data_dir)), str(workdir))
    assert result["resumed_at"] == 15
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"checkpoint step 20 in {ckpts} cannot be restored (1 array(s) do not match the "
                                  "checksums saved with them ("), warnings[0]
    assert warnings[0].endswith(f"moved to {ckpts / 'damaged' / '20'}; restored step 15 instead")
    assert (ckpts / "damaged" / "20" / "state").is_dir() and finalized(workdir) == [10, 15, 20]
    assert_matches(workdir, reference[1])


def test_a_failed_save_keeps_the_previous_step_and_stops_or_goes_on(data_dir, reference, tmp_path, monkeypatch,
                                                                    caplog):
    """The checkpoint directory disappears after step 9 (a file in its place: a write that fails even for
    root, whom permissions do not stop) and is back after step 14: the save at 10 fails and the run stops in one
    line naming step 5, which is intact; with checkpoint.fail_on_save_error=False one warning line, training goes
    on and saves 15 and 20.  (A full filesystem: tests/test_full_disk.py.)"""
    o = overrides(data_dir, train__compile_cache_dir=str(reference[0] / "compile_cache"))
    original = checkpoint.Checkpointer.maybe_save
    seen = {}

    def maybe_save(self, step, state, *, force=False):
        ckpts = Path(self.directory)
        away = ckpts.with_name("checkpoints.away")
        if step in (9, 14):
            self._finish(self.shared)  # the save in flight completes first (or reports its failure)
        if step == 9:
            ckpts.rename(away)
            ckpts.write_text("")
        if step == 14:
            ckpts.unlink()
            away.rename(ckpts)
            seen["before 15"] = finalized(ckpts.parent)
        return original(self, step, state, force=force)

    monkeypatch.setattr(checkpoint.Checkpointer, "maybe_save", maybe_save)
    workdir = tmp_path / "run"
    train.train(make_config({**o, "checkpoint.fail_on_save_error": False}), str(workdir))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"checkpoint step 10 was not saved to {workdir / 'checkpoints'} ("), warnings[0]
    assert warnings[0].endswith("; it holds no complete checkpoint; training goes on and the next save tries "
                                "again (checkpoint.fail_on_save_error=False)"), warnings[0]
    assert seen["before 15"] == [5] and finalized(workdir) == [15, 20]
    assert_matches(workdir, reference[1])

    workdir = tmp_path / "stops"
    with pytest.raises(checkpoint.SaveError, match=r"^checkpoint step 10 was not saved to .*; it holds no complete "
                                                   r"checkpoint; stopping: free space \(or fix the directory\) and "
                                                   r"rerun, which starts over \(checkpoint.fail_on_save_error=False "
                                                   r"trains on instead\)$"):
        train.train(make_config(o), str(workdir))
    assert last_step(workdir) == 10 and [p.name for p in (workdir / "checkpoints.away").iterdir()] == ["5"]
