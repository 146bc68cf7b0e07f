"""A user's first mistakes and interruptions: each gets one line and the right exit code, and nothing on disk is
lost or left half-written.  Real processes, but for the mistakes caught in the flags and the config, which the
tool's ``main(argv)`` meets in this process as the process would (conftest.run_tool)."""

import functools
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
from conftest import run_tool

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare.txt"  # public domain (tests/data/README.md)
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
# A tiny run of the Shakespeare recipe: 2 layers, hidden 32, float32 (the recipe's own).
TINY = ["--config=configs/shakespeare_char.py", "--config.model.num_layers=2", "--config.model.hidden_size=32",
        "--config.train.eval_iters=2", "--config.train.log_interval=1", "--config.log.samples=0",
        "--config.log.tensorboard=False", "--config.log.progress_bar=False"]


def run(*args, cwd=ROOT, read_only=None, timeout=300, module="jaxllm.train"):
    """``python -m MODULE ARGS``; ``read_only``: a directory the process cannot write (for root, whom
    permissions do not stop, a read-only bind mount in a mount namespace of its own)."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    if read_only is not None and os.geteuid() == 0:
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(read_only), *cmd]
    elif read_only is not None:
        read_only.chmod(0o555)
    try:
        if read_only is None:
            return forkserver.run(cmd[1:], ENV, cwd, timeout)
        return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    finally:
        if read_only is not None:
            read_only.chmod(0o755)


def one_line(r, code=2):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr + r.stdout, (r.returncode, r.stderr)
    return lines[0]


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("args, words", [
    (["--config.train.lrr=1"], "config error: train.lrr='1': no such key in section train; did you mean train.lr?"),
    (["--config.modl.num_layers=2"], "no such section; the sections are model, train, data"),
    (["--config.train.gradient_accumulation_steps=4"], "Megatron-DeepSpeed's gradient_accumulation_steps is "
                                                       "train.global_batch_size"),
    (["--config.tensor_model_parallel_size=2"], "Megatron-DeepSpeed's tensor_model_parallel_size is mesh.tensor"),
    (["--config.model.padded_vocab_size=64"], "is derived"),
    (["--config.train.lr=fast"], "config error: train.lr='fast': must be a number"),
    (["--config.model.use_bias=maybe"], "must be true or false"),
    (["--config=configs/missing.py"], "config error: --config=configs/missing.py: no such file"),
    (["--config=configs/gpt3.py:GPT999"], "unknown size; choose one of GPT125M"),
])
def test_config_mistakes_are_one_line(tmp_path, args, words):
    r = run_tool("jaxllm.train", f"--workdir={tmp_path / 'w'}", *args)
    assert words in one_line(r)
    assert not (tmp_path / "w").exists()  # nothing written


def test_a_tool_in_process_prints_and_exits_as_its_process(tmp_path):
    """A tool's ``main(argv)`` in this process gives what ``python -m`` gives: exit status, stdout and stderr, one
    call after another with nothing carried over (a mesh flag of one call is gone in the next; a config file
    without get_config() is refused after files that had one), the environment as it was."""
    empty = write(tmp_path / "empty.py", "x = 1\n")
    calls = [("jaxllm.train", ["--check_devices=2", "--config.mesh.tensor=2"]),
             ("jaxllm.train", ["--check_devices=2"]),
             ("jaxllm.train", [f"--config={empty}", f"--workdir={tmp_path / 'w'}"]),
             ("jaxllm.plan", [*TINY[:3], f"--output={tmp_path}"]),  # plan's refusals end through cli.exit_now
             ("jaxllm.generate", ["--prompt=x"])]  # absl's required --workdir
    for module, _ in calls:  # imported first: importing jax sets variables of its own, once
        importlib.import_module(module)
    environment = dict(os.environ)
    for module, args in calls:
        here = run_tool(module, *args)
        process = run(*args, module=module)
        assert (here.returncode, here.stdout, here.stderr) == (process.returncode, process.stdout, process.stderr)
    assert dict(os.environ) == environment and not (tmp_path / "w").exists()


def test_a_bad_config_is_its_one_line_without_jax_platforms(tmp_path):
    """With JAX's CUDA plugin installed (the test extra) and no GPU, JAX_PLATFORMS unset as on a user's shell: the
    whole output of a bad config is its one line (the plugin's start-up traceback goes to no console), and nothing
    is left of the workdir it would have made."""
    env = {k: v for k, v in ENV.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", f"--workdir={tmp_path / 'w'}",
                        "--config.model.num_attention_heads=3"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr == ("config error: model.hidden_size=256: must be divisible by model.num_attention_heads=3\n"), \
        r.stderr
    assert not (tmp_path / "w").exists()


def test_broken_config_files_are_one_line(tmp_path):
    train = functools.partial(run_tool, "jaxllm.train", f"--workdir={tmp_path / 'w'}")
    syntax = write(tmp_path / "syntax.py", "def get_config(:\n")
    assert "SyntaxError at line 1" in one_line(train(f"--config={syntax}"))
    empty = write(tmp_path / "empty.py", "x = 1\n")
    assert "defines no get_config()" in one_line(train(f"--config={empty}"))
    raising = write(tmp_path / "raising.py", "def get_config():\n    raise ValueError('no such recipe')\n")
    assert "no such recipe" in one_line(train(f"--config={raising}"))


@pytest.mark.parametrize("line, words", [
    ("c.model.num_layer = 2", "config error: model.num_layer=2: no such key in section model; did you mean "
                              "model.num_layers?"),
    ("c.train.micro_batch_size = 'four'", "config error: train.micro_batch_size='four': must be an integer"),
    ("c.train.micro_batch_size = -3", "config error: train.micro_batch_size=-3: must be > 0"),
])
def test_mistakes_inside_a_config_file_are_the_command_lines_line(tmp_path, line, words):
    """An unknown key, a bad type and a bad value set inside a config file: the one line the same mistake gives as
    a ``--config.*`` flag, nothing written."""
    bad = write(tmp_path / "bad.py", f"from jaxllm.config import get_config as base\n\n\ndef get_config():\n"
                                     f"    c = base()\n    {line}\n    return c\n")
    assert one_line(run_tool("jaxllm.train", f"--config={bad}", f"--workdir={tmp_path / 'w'}")) == words
    assert not (tmp_path / "w").exists()


def test_an_empty_corpus_is_one_line_naming_it(tmp_path):
    empty = write(tmp_path / "empty.txt", "")
    line = one_line(run(f"--config.data.input={empty}", f"--workdir={tmp_path / 'w'}"))
    assert line.startswith(f"data error: data input {empty}: no document with any text") and "give a corpus" in line
    assert not (tmp_path / "w").exists()


def test_launcher_dry_run_checks_the_config_it_would_run():
    env = {**ENV, "MODEL_SIZE_KEY": "GPT999"}
    r = subprocess.run(["bash", "launch/local.sh", "2", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert "unknown size" in one_line(r)
    r = subprocess.run(["bash", "launch/local.sh", "2", "--dry-run", "--config.mesh.tensor=3"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert "the mesh covers 3 devices but there are 8" in one_line(r)
    r = subprocess.run(["bash", "launch/local.sh", "2", "--dry-run", "--config.mesh.data=-1",
                        "--config.train.micro_batch_size=2"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "# jaxllm check: config ok for 8 cpu devices: data 8" in r.stdout, r.stderr


def test_workdir_that_is_a_file(tmp_path):
    file = write(tmp_path / "file", "x\n")
    assert "config error: --workdir=" in one_line(run_tool("jaxllm.train", f"--workdir={file}", *TINY))
    assert file.read_text() == "x\n"


def test_read_only_workdir_and_plot(tmp_path):
    """A directory the user cannot write, for a run (a resume, say), a new run inside it, and the plot of a run."""
    readonly = tmp_path / "ro"
    readonly.mkdir()
    (readonly / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "loss": 2.0}\n')
    line = one_line(run(f"--workdir={readonly}", *TINY, read_only=readonly))
    assert line.startswith(f"config error: --workdir='{readonly}': cannot be written"), line
    line = one_line(run(f"--workdir={readonly / 'new'}", *TINY, read_only=readonly))
    assert line.startswith("config error: --workdir="), line
    line = one_line(run(readonly, module="jaxllm.plot", read_only=readonly))
    assert line.startswith(f"error: cannot write {readonly / 'loss.png'}"), line
    assert sorted(p.name for p in readonly.iterdir()) == ["metrics.jsonl"]


def test_unwritable_outputs_of_prepare_and_convert_are_one_line(tmp_path):
    """An output in a folder the user cannot write: ``jaxllm.prepare --output-prefix`` and each ``jaxllm.convert``
    mode's folder, refused before anything is read or written; an input whose lines lack the JSON key leaves no
    output folder behind."""
    readonly = tmp_path / "ro"
    readonly.mkdir()
    corpus = write(tmp_path / "c.jsonl", '{"text": "a line"}\n')
    r = run("--input", corpus, "--tokenizer=byte", f"--output-prefix={readonly / 'd' / 'x'}", module="jaxllm.prepare",
            read_only=readonly)
    assert one_line(r) == (f"config error: --output-prefix='{readonly / 'd' / 'x'}': cannot be written (Read-only "
                           f"file system: {readonly}); give a place you can write"), r.stderr
    for mode, written in (("--from-hf", "WORKDIR"), ("--to-hf", "OUT"), ("--from-megatron", "WORKDIR"),
                          ("--to-megatron", "OUT")):
        line = one_line(run(mode, tmp_path, readonly / "out", module="jaxllm.convert", read_only=readonly))
        assert line.startswith(f"config error: {mode} {written}='{readonly / 'out'}': cannot be written"), line
    assert list(readonly.iterdir()) == []
    keyless = write(tmp_path / "k.jsonl", '{"body": "a line"}\n')
    line = one_line(run("--input", keyless, "--tokenizer=byte", f"--output-prefix={tmp_path / 'new' / 'sub' / 'x'}",
                        module="jaxllm.prepare"))
    assert "no string at key 'text'" in line and not (tmp_path / "new").exists(), line


def test_unwritable_outputs_of_plan_bench_tune_and_inspect_data_are_one_line(tmp_path):
    """What each planning and data tool (and lm-eval's results) writes, refused before any compile or model load
    when it cannot be written: a file in a read-only folder, a directory given for a file, a file given for a
    folder; nothing created."""
    readonly, file = tmp_path / "ro", write(tmp_path / "file", "x\n")
    readonly.mkdir()
    tiny = TINY[:3]
    cases = [("jaxllm.plan", [*tiny, f"--output={readonly / 'plan.jsonl'}"], "--output", readonly / "plan.jsonl",
              "cannot be written (Read-only file system"),
             ("jaxllm.bench", [*tiny, f"--output={tmp_path}"], "--output", tmp_path, "is a directory; give a file"),
             ("jaxllm.tune", [*tiny, f"--output_dir={file}"], "--output_dir", file, "is a file; give a directory"),
             ("jaxllm.inspect_data", [*tiny, "--steps=0:1", f"--output={readonly / 'b.npy'}"], "--output",
              readonly / "b.npy", "cannot be written (Read-only file system"),
             ("jaxllm.inspect_data", [*tiny, "--steps=0:1", f"--output={tmp_path / 'b.npy'}", f"--workdir={file}"],
              "--workdir", file, "is a file; give a directory"),
             ("jaxllm.harness", ["--model", "jaxllm", "--model_args", f"workdir={tmp_path / 'none'}", "--tasks",
                                 "hellaswag", "--output_path", str(readonly / "results")], "--output_path",
              readonly / "results", "cannot be written (Read-only file system")]
    for module, args, flag, path, cause in cases:
        line = one_line(run(*args, module=module, read_only=readonly))
        assert line.startswith(f"config error: {flag}='{path}': {cause}"), (module, line)
    assert list(readonly.iterdir()) == [] and file.read_text() == "x\n" and not (tmp_path / "b.npy").exists()


def test_binary_input_stops_and_can_be_insisted_on(tmp_path):
    binary = tmp_path / "program"
    binary.write_bytes(Path(sys.executable).resolve().read_bytes()[:200_000])
    line = one_line(run(f"--workdir={tmp_path / 'w'}", *TINY, f"--config.data.input={binary}",
                        "--config.data.sampling=megatron"))
    assert line.startswith(f"data error: data input {binary}: ") and "characters are not UTF-8 text" in line, line
    assert "set data.max_undecodable (--max-undecodable)" in line
    r = run("--input", binary, "--tokenizer=byte", f"--output-prefix={tmp_path / 'p' / 'x'}",
            "--max-undecodable=1", module="jaxllm.prepare")
    assert r.returncode == 0 and (tmp_path / "p" / "x.idx").exists(), r.stderr


def test_zero_sample_tokens_is_refused_with_the_way_to_no_samples(tmp_path):
    """Samples of 0 tokens would train and save, then fail at the end: refused before anything runs."""
    line = one_line(run(f"--workdir={tmp_path / 'w'}", *TINY, "--config.log.samples=2", "--config.log.sample_tokens=0"))
    assert line == ("config error: log.sample_tokens=0: each of the log.samples=2 end-of-run samples needs at least "
                    "1 token; for no samples set log.samples=0"), line
    assert not (tmp_path / "w" / "checkpoints").exists() and not (tmp_path / "w" / "data").exists()


def test_latin1_text_is_read_with_a_line_that_says_how_to_reencode(tmp_path):
    """Latin-1 text: under data.max_undecodable (1%) its accented letters become U+FFFD with one line saying how
    many and how to re-encode; above it the run stops, naming re-encoding; the re-encoded file keeps them."""
    text = "The quick brown fox jumps over the lazy dog. " * 60 + "Café au lait, s'il vous plaît.\n"
    latin1 = tmp_path / "notes.txt"
    latin1.write_bytes(text.encode("latin-1"))  # é and î: one byte each, not UTF-8
    prefix = tmp_path / "p" / "x"
    r = run("--input", latin1, "--tokenizer=char", f"--output-prefix={prefix}", module="jaxllm.prepare")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "U+FFFD" in ln]
    assert lines == [f"prepare: data input {latin1}: 2 of its {len(text):,} characters are bytes that do not decode "
                     f"as UTF-8, read as U+FFFD; if it is text in another encoding, re-encode it to UTF-8 first (e.g. "
                     f"from Latin-1: iconv -f latin1 -t utf-8 {latin1} > {latin1}.utf8)"], r.stderr
    assert "\ufffd" in "".join(json.loads(Path(f"{prefix}.meta.json").read_text())["chars"])

    latin1.write_bytes(("Voilà l'été à Noël. " * 20).encode("latin-1"))  # 25% of the characters
    line = one_line(run(f"--workdir={tmp_path / 'w'}", *TINY, f"--config.data.input={latin1}"))
    assert line.startswith(f"data error: data input {latin1}: 25.0% of its 400 characters are not UTF-8 text"), line
    assert f"re-encode it to UTF-8 (e.g. from Latin-1: iconv -f latin1 -t utf-8 {latin1} > {latin1}.utf8)" in line

    utf8 = tmp_path / "notes.utf8.txt"
    utf8.write_text(latin1.read_bytes().decode("latin-1"), encoding="utf-8")  # what iconv writes
    r = run("--input", utf8, "--tokenizer=char", f"--output-prefix={prefix}", module="jaxllm.prepare")
    assert r.returncode == 0 and "U+FFFD" not in r.stderr, r.stderr
    assert set("àéë") <= set(json.loads(Path(f"{prefix}.meta.json").read_text())["chars"])


@pytest.mark.slow
def test_damaged_checkpoints_one_line_each_and_kept_apart(tmp_path):
    """The newest step damaged (Orbax's restore of it raises dozens of asyncio tracebacks): one
    warning line, the run resumes from the step before, the damaged step moves to
    checkpoints/damaged/ (so checkpoint.keep counts good ones), the details go to WORKDIR/logs;
    with every step damaged: one error line, exit 1."""
    workdir = tmp_path / "run"
    args = [f"--workdir={workdir}", *TINY, "--config.train.eval_interval=0", "--config.checkpoint.interval=2",
            "--config.checkpoint.keep=2"]
    r = run(*args, "--config.train.train_iters=4")
    assert r.returncode == 0, r.stderr
    manifest = workdir / "checkpoints" / "4" / "state" / "manifest.ocdbt"
    manifest.write_bytes(manifest.read_bytes()[:20])
    r = run(*args, "--config.train.train_iters=6")
    assert r.returncode == 0 and "Traceback" not in r.stderr + r.stdout, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if "cannot be restored" in ln]
    assert len(warnings) == 1 and "checkpoint step 4 in" in warnings[0] and "restored step 2 instead" in warnings[0]
    assert "Event loop is closed" not in r.stderr and "resuming at step 2" in r.stdout
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6", "damaged"]  # keep=2: the good 4 and 6
    assert os.listdir(workdir / "checkpoints" / "damaged") == ["4"]
    assert "cannot be restored" in (workdir / "logs" / "process_0.log").read_text()

    for step in ("4", "6"):
        for f in (workdir / "checkpoints" / step / "state").rglob("*"):
            if f.is_file():
                f.write_bytes(b"")
    r = run(*args, "--config.train.train_iters=8")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("prepare:")]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: no checkpoint in "), r.stderr
    assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr


def test_abandoned_restore_reads_go_to_the_log_not_the_console(tmp_path):
    """A failed Orbax restore leaves asyncio tasks whose errors nobody retrieves; asyncio logs each
    when it is garbage-collected, at an unpredictable time (the flaky half of the test above).
    With the run's console policy that record lands in WORKDIR/logs, and other asyncio errors stay."""
    code = f"""
import asyncio, gc, logging
from jaxllm.platform import console
console.configure({str(tmp_path)!r}, process=0, verbose=False)

async def read():
    raise ValueError("DATA_LOSS: Error decoding manifest")

loop = asyncio.new_event_loop()
task = loop.create_task(read())
loop.run_until_complete(asyncio.sleep(0))
loop.close()
del task
gc.collect()
logging.getLogger("asyncio").error("another asyncio error")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "never retrieved" not in r.stderr and "Traceback" not in r.stderr and "another asyncio error" in r.stderr
    log = (tmp_path / "logs" / "process_0.log").read_text()
    assert "Task exception was never retrieved" in log and "DATA_LOSS: Error decoding manifest" in log


def _metrics_steps(workdir):
    path = Path(workdir) / "metrics.jsonl"
    return [line for line in path.read_text().splitlines() if '"train"' in line] if path.exists() else []


def train_process(args):
    """``python -m jaxllm.train ARGS`` in the background, with Ctrl-C's default disposition (a shell
    gives background jobs an ignored SIGINT, which the child would inherit)."""
    return subprocess.Popen([sys.executable, "-m", "jaxllm.train", *args], cwd=ROOT, text=True,
                            env={**ENV, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
def test_ctrl_c_saves_and_resumes_and_a_finished_run_says_so(tmp_path):
    """Ctrl-C (SIGINT) saves at the next step boundary and exits 75; the rerun resumes there; a
    second Ctrl-C ends the process at once; one before the first step exits 130 with one line;
    rerunning a finished run says so without compiling."""
    workdir = tmp_path / "run"
    args = [f"--workdir={workdir}", *TINY, "--config.train.train_iters=400", "--config.train.eval_interval=0",
            "--config.checkpoint.interval=0"]
    proc = train_process(args)
    deadline = time.time() + 300
    while len(_metrics_steps(workdir)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err
    assert "Ctrl-C: saving a checkpoint at the end of this step" in err and "Traceback" not in err
    saved = int(err.split("saved a checkpoint at step ")[1].split(";")[0])
    assert (workdir / "checkpoints" / str(saved)).is_dir() and 3 <= saved < 400

    # A second Ctrl-C aborts without saving: exit 130, one line.  (Evaluating 100 batches after
    # every step keeps the run between the two signals, so the first cannot finish its save.)
    slow = ["--config.train.eval_interval=1", "--config.train.eval_iters=100"]
    proc = train_process([*args, *slow])
    deadline = time.time() + 300
    while len(_metrics_steps(workdir)) < saved + 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGINT and "Traceback" not in err, (proc.returncode, err)
    assert f"resuming at step {saved}" in out and sorted(os.listdir(workdir / "checkpoints")) == [str(saved)]

    # Ctrl-C before the first step (here while the step compiles): one line, exit 130.
    proc = train_process(args)
    for line in proc.stdout:
        if line.startswith("jaxllm: "):  # the start-up line: compiling next
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == "jaxllm: interrupted before the first training step; nothing to save"

    r = run(*args[:-3], "--config.train.train_iters=3", "--config.train.eval_interval=0")
    assert r.returncode == 0 and f"is finished: its checkpoint is at step {saved}" in r.stdout, r.stderr
    assert "compiled" not in r.stdout


@pytest.mark.parametrize("signum, words", [(signal.SIGINT, "interrupted (Ctrl-C)"),
                                           (signal.SIGTERM, "terminated (SIGTERM)")], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_while_preparing_is_one_line_and_leaves_nothing(tmp_path, stdlib_corpus, signum, words):
    """``jaxllm.prepare`` interrupted (Ctrl-C) or terminated while it tokenizes (its temporary files exist): one line,
    exit 130 or 143, the folder it made and its partial files gone."""
    out = tmp_path / "new" / "data"
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm.prepare", "--input", str(stdlib_corpus), "--tokenizer",
                             "gpt2", f"--output-prefix={out}"], cwd=ROOT, text=True, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (out.parent.is_dir() and any(out.parent.iterdir())) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum and "Traceback" not in err, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == f"jaxllm.prepare: {words}; nothing written to {out} (the partial " \
                                           "files removed)"
    assert not (tmp_path / "new").exists()


# Run as ``python IN_GC.py WORKDIR SIGNAL ARGS``: jaxllm.train, with the signal raised inside a garbage-collection
# callback once the tokenizing has begun, where a user's Ctrl-C can land (JAX registers one: _xla_gc_callback).
IN_GC = """import gc, glob, os, runpy, signal, sys
workdir, signum = sys.argv[1], getattr(signal, sys.argv[2])
def callback(phase, info):
    if phase == "start" and not callback.fired and glob.glob(os.path.join(workdir, "data", ".*tmp*")):
        callback.fired = True
        signal.raise_signal(signum)
        sum(range(1000))  # Python code after the signal: its handler runs here, inside the callback
callback.fired = False
gc.callbacks.append(callback)
sys.argv = ["jaxllm.train", *sys.argv[3:], f"--workdir={workdir}"]
runpy.run_module("jaxllm.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("signum, line", [
    ("SIGINT", "jaxllm: interrupted before the first training step; nothing to save"),
    ("SIGTERM", "jaxllm.train: terminated (SIGTERM); nothing to save before the first training step")],
    ids=["ctrl_c", "sigterm"])
def test_a_signal_inside_a_library_callback_still_stops_training(tmp_path, stdlib_corpus, signum, line):
    """Ctrl-C or SIGTERM that lands inside a garbage-collection callback while ``jaxllm.train`` tokenizes a new
    corpus, where Python prints "Exception ignored" and drops the exception (the run used to go on to its end, exit
    0): the run stops, one line, exit 130 or 143, the data folder empty (no partial tokens, no lock)."""
    script, workdir = write(tmp_path / "in_gc.py", IN_GC), tmp_path / "run"
    r = subprocess.run([sys.executable, str(script), str(workdir), signum, *TINY, "--config.data.tokenizer=gpt2",
                        f"--config.data.input={stdlib_corpus}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 128 + getattr(signal, signum) and "Exception ignored" not in r.stderr, (r.returncode,
                                                                                                 r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1] == line and "Traceback" not in r.stderr
    assert list((workdir / "data").iterdir()) == [] and not _metrics_steps(workdir)


def checksums(workdir):
    """step -> the checksums of every array the checkpoint at that step holds (saved with it)."""
    ckpts = Path(workdir) / "checkpoints"
    return {int(p.name): json.loads((p / "checksums" / "metadata").read_text()) for p in ckpts.iterdir()
            if p.name.isdigit()}


def losses(workdir):
    rows = [json.loads(ln) for ln in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]


def test_a_busy_workdir_refuses_a_second_run_and_an_import(tmp_path):
    """Two jaxllm.train on one workdir: the second is refused in one line (exit 2), naming the first, and so is an
    import into it, neither writing anything; the first finishes with the checkpoints (their checksums) and the
    metrics of the same run alone.  The first is slowed down (JAXLLM_DEBUG_SLOW_PROCESS) to be still running."""
    args = [*TINY, "--config.train.train_iters=30", "--config.train.eval_interval=0",
            "--config.checkpoint.interval=10", f"--config.train.compile_cache_dir={tmp_path / 'cache'}"]
    alone, busy = tmp_path / "alone", tmp_path / "busy"
    assert run(f"--workdir={alone}", *args).returncode == 0
    first = subprocess.Popen([sys.executable, "-m", "jaxllm.train", f"--workdir={busy}", *args], cwd=ROOT,
                             env={**ENV, "JAXLLM_DEBUG_SLOW_PROCESS": "0:0.5"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not losses_so_far(busy) and time.time() < deadline and first.poll() is None:
        time.sleep(0.2)
    holder = json.loads((busy / "run.lock").read_text())
    listing = sorted(p.name for p in busy.iterdir())
    line = one_line(run(f"--workdir={busy}", *args))
    assert line.startswith(f"config error: --workdir='{busy}': is in use by jaxllm.train (pid {first.pid} on "
                           f"{holder['host']}, started {holder['started']}), which holds {busy / 'run.lock'}; wait "
                           "for it to end, or use another --workdir"), line
    line = one_line(run("--from-megatron", ROOT / "tests" / "data" / "deepspeed" / "zero1_bf16_nested", busy,
                        module="jaxllm.convert"))
    assert line.startswith(f"config error: WORKDIR='{busy}': is in use by jaxllm.train (pid {first.pid}"), line
    assert sorted(p.name for p in busy.iterdir()) == listing and holder["pid"] == first.pid
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert not (busy / "run.lock").exists()  # released at the end
    assert checksums(busy) == checksums(alone) and sorted(checksums(busy)) == [20, 30]
    assert losses(busy) == losses(alone) and [s for s, _ in losses(busy)] == list(range(1, 31))


def losses_so_far(workdir):
    path = Path(workdir) / "metrics.jsonl"
    return path.exists() and path.read_text().strip()
