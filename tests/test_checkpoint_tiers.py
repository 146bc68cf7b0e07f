"""Node-local plus shared checkpoints with real processes (2 processes x 4 CPU devices, gloo): a run killed
between two shared saves resumes from the local tier when every process has its step, from the shared one
when a process's local copy is gone, bit for bit; and a resume with another tokenizer or sequence length is
refused in one line naming the key."""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_checkpoint import train_losses
from test_distributed import clean_env, free_port

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare.txt"  # public domain (tests/data/README.md)
ITERS = 16
# Shared saves at 8 and 16, local ones every 2 steps; the compilation cache is shared by all runs of a test.
TIERS = {"checkpoint.interval": 8, "checkpoint.local_interval": 2, "checkpoint.keep": 2}
TINY = {"data.input": SHAKESPEARE, "data.tokenizer": "char", "data.sampling": "uniform", "data.split": "9,1",
        "model.num_layers": 2, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.dtype": "float32",
        "model.make_vocab_size_divisible_by": 1, "train.seq_length": 32, "train.micro_batch_size": 1,
        "train.global_batch_size": 8, "train.warmup_iters": 2, "train.lr_decay_iters": ITERS,
        "train.train_iters": ITERS, "train.log_interval": 1, "train.eval_interval": 0, "log.tensorboard": False,
        "log.progress_bar": False, "log.samples": 0}
MESH = {"mesh.data": 2, "mesh.tensor": 2, "mesh.fsdp": 2}


def flags(workdir, o):
    return [f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in o.items())]


def losses(workdir):
    """{step: [loss, ...]} of every logged train step, all attempts (a partial last line is skipped)."""
    out = {}
    for step, loss, _ in train_losses(workdir):
        out.setdefault(step, []).append(loss)
    return out


def local_steps(local_dir, process):
    """The finalized local steps of ``process`` (``LOCAL_DIR/RUN_ID/pPof2-MESH/STEP``)."""
    return sorted(int(p.name) for p in Path(local_dir).glob(f"*/p{process}of2-*/*") if p.name.isdigit())


def assert_matches(workdir, reference):
    """Every loss logged in ``workdir`` (the killed attempt's and the resumed one's) is the uninterrupted
    run's, bitwise, and the run reached the last step."""
    logged = losses(workdir)
    assert max(logged) == ITERS, sorted(logged)
    for step, values in logged.items():
        assert values == [reference[step]] * len(values), (step, values, reference[step])


def two_processes(workdir, o, until=None, timeout=420):
    """Runs ``jaxllm.train`` as 2 processes x 4 CPU devices, as ``launch/local.sh 2`` starts them; with
    ``until``, once it holds, kills process 1 with SIGKILL and then process 0 (what a launcher does when a
    node dies).  Returns ``(return codes, process 0's output)``."""
    e = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAXLLM_NUM_PROCESSES="2",
                  JAXLLM_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}")
    log = Path(str(workdir) + f".{time.monotonic_ns()}.log")
    cmd = [sys.executable, "-m", "jaxllm.train", *flags(workdir, o)]
    with open(log, "w") as out:
        procs = [subprocess.Popen(cmd, cwd=ROOT, env={**e, "JAXLLM_PROCESS_ID": str(i)}, text=True,
                                  stdout=out if i == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for i in range(2)]
        try:
            deadline = time.monotonic() + timeout
            while until is not None and not until():
                assert all(p.poll() is None for p in procs), f"ended before the kill:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "timed out waiting for the kill"
                time.sleep(0.02)
            if until is not None:
                procs[1].send_signal(signal.SIGKILL)
                procs[1].wait()
                procs[0].send_signal(signal.SIGKILL)
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return codes, log.read_text()


@pytest.mark.slow
def test_killed_run_resumes_from_the_local_tier_or_the_shared_one(tmp_path):
    cache = {"train.compile_cache_dir": tmp_path / "compile_cache"}
    ref, run, local = tmp_path / "ref", tmp_path / "run", tmp_path / "local"
    o = {**TINY, **MESH, **TIERS, **cache, "checkpoint.local_dir": local}
    codes, out = two_processes(ref, {**o, "checkpoint.local_dir": tmp_path / "ref_local"})
    assert codes == [0, 0], out[-3000:]
    reference = {s: v[0] for s, v in losses(ref).items()}
    assert sorted(reference) == list(range(1, ITERS + 1))

    # Killed after a local save newer than the shared step 8, before the shared save at 16.
    def killable():
        done = max(losses(run), default=0)
        return done >= 11 and set(local_steps(local, 0)) & set(local_steps(local, 1)) & {10, 12, 14}

    codes, out = two_processes(run, o, until=killable)
    assert codes == [-signal.SIGKILL] * 2, out[-3000:]
    shared = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert shared == [8], shared
    newest_local = max(set(local_steps(local, 0)) & set(local_steps(local, 1)))
    shutil.copytree(run, tmp_path / "run.kill")
    shutil.copytree(local, tmp_path / "local.kill")

    codes, out = two_processes(run, o)  # every process holds newest_local: the local tier
    assert codes == [0, 0], out[-3000:]
    assert f"restored step {newest_local} from the node-local checkpoints" in out
    assert f"resuming at step {newest_local}" in out, out[-3000:]
    assert_matches(run, reference)

    for path, kept in ((run, tmp_path / "run.kill"), (local, tmp_path / "local.kill")):
        shutil.rmtree(path)
        shutil.copytree(kept, path)
    for p in local.glob("*/p1of2-*"):  # process 1's node is gone: the shared step 8, with no word of local
        shutil.rmtree(p)
    codes, out = two_processes(run, o)
    assert codes == [0, 0], out[-3000:]
    assert "resuming at step 8" in out and "node-local" not in out, out[-3000:]

    assert_matches(run, reference)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Two Hugging Face tokenizer.json files of 400 tokens each, trained on two halves of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tokenizers")
    text = SHAKESPEARE.read_text()[:200_000]
    paths = []
    for name, part in (("a", text[:100_000]), ("b", text[100_000:])):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.train_from_iterator([part], trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        assert tok.get_vocab_size() == 400
        (d / name).mkdir()
        tok.save(str(d / name / "tokenizer.json"))
        paths.append(d / name / "tokenizer.json")
    (d / "corpus.txt").write_text(text[:20_000])
    return d / "corpus.txt", paths


def test_resume_with_another_tokenizer_or_seq_length_is_refused(tokenizers, tmp_path):
    corpus, (tok_a, tok_b) = tokenizers
    o = {**TINY, "data.input": corpus, "data.tokenizer": tok_a, "data.split": "9,1", "train.train_iters": 2,
         "checkpoint.interval": 1}
    run = lambda **changes: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "jaxllm.train", *flags(tmp_path, {**o, **changes})], cwd=ROOT, env=clean_env(),
        capture_output=True, text=True, timeout=300)
    r = run()
    assert r.returncode == 0, r.stderr[-3000:]
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    data = sorted(p.name for p in (tmp_path / "data").iterdir())
    for changes, key, words in [({"data.tokenizer": tok_b, "train.train_iters": 4}, "data.tokenizer",
                                 "was trained with another tokenizer (hf, 400 tokens"),
                                ({"train.seq_length": 64, "train.train_iters": 4}, "train.seq_length",
                                 "was trained with train.seq_length=32")]:
        r = run(**changes)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
        assert lines[0].startswith(f"config error: {key}=") and words in lines[0], lines[0]
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before  # nothing written
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == data  # nor tokenized (the same data reused)


@pytest.mark.parametrize("local, key", [({"local_dir": "LOCAL"}, "checkpoint.local_interval"),
                                        ({"local_interval": 5}, "checkpoint.local_dir"),
                                        ({"local_dir": "FILE", "local_interval": 5}, "checkpoint.local_dir")])
def test_local_tier_keys(tmp_path, local, key):
    """Half a local tier, or a local_dir that cannot be written (a file): one line naming the key, nothing
    created."""
    from jaxllm import config
    from jaxllm.resolve import resolve
    from jaxllm.runtime.checkpoint import Checkpointer

    (tmp_path / "FILE").write_text("")
    spec = config.get_config()
    spec.model.update(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64)
    spec.checkpoint.update(**{k: str(tmp_path / v) if k == "local_dir" else v for k, v in local.items()})
    with pytest.raises(config.ConfigError) as e:
        Checkpointer(str(tmp_path / "run"), resolve(spec, num_devices=1))
    assert e.value.key == key and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "LOCAL").exists() and not (tmp_path / "run").exists()
