"""The public API as other programs call it, on a run made by the training CLI.

One small byte-level run (``python -m jaxllm.train`` in a subprocess, checkpoints at steps 60
and 120, vocabulary 256 padded to 288 rows) is exported with ``python -m jaxllm.convert --to-hf``;
``jaxllm.load`` of the run gives transformers' logits on the export, its per-token
log-likelihoods and its greedy text.  Also: bad inputs, ``jaxllm.shardings`` on 4 fake devices,
``import jaxllm`` without JAX, and the README's snippet.
"""

import json
import os
import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers
from conftest import ROOT, run_python, word_sentences

import jaxllm

TOL = 1e-4
SEQ, VOCAB, PADDED = 32, 256, 288
STEPS = (60, 120)
TRAIN = ["--config.data.tokenizer=byte", "--config.data.sampling=uniform", "--config.data.split=9,1",
         "--config.model.num_layers=2", "--config.model.hidden_size=64", "--config.model.num_attention_heads=4",
         "--config.model.dtype=float32", "--config.model.make_vocab_size_divisible_by=96",
         f"--config.train.seq_length={SEQ}", "--config.train.micro_batch_size=4", "--config.train.global_batch_size=8",
         f"--config.train.train_iters={STEPS[1]}", "--config.train.warmup_iters=2", "--config.train.lr=0.01",
         "--config.train.min_lr=0.001", "--config.train.eval_interval=0", "--config.train.log_interval=60",
         f"--config.checkpoint.interval={STEPS[0]}", "--config.log.samples=0", "--config.log.tensorboard=False"]
TEXT = "the quick brown fox jumps over the lazy dog.\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A run the training CLI made, as a user makes one: a text file, a few flags."""
    d = tmp_path_factory.mktemp("api")
    (d / "corpus.txt").write_text(word_sentences(TEXT.split()))
    run_python("-m", "jaxllm.train", f"--workdir={d / 'run'}", f"--config.data.input={d / 'corpus.txt'}", *TRAIN)
    assert sorted(int(s) for s in os.listdir(d / "run" / "checkpoints") if s.isdigit()) == list(STEPS)
    return d / "run"


@pytest.fixture(scope="module")
def trained(workdir):
    return jaxllm.load(str(workdir))


@pytest.fixture(scope="module")
def hf(workdir, tmp_path_factory):
    """transformers' model (float32) from the run's Hugging Face export, by the CLI."""
    out = tmp_path_factory.mktemp("hf") / "out"
    run_python("-m", "jaxllm.convert", "--to-hf", str(workdir), str(out))
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def hf_logits(m, tokens):
    with torch.no_grad():
        return m(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def test_load_gives_the_run(trained, workdir):
    assert trained.step == STEPS[1] and trained.workdir == str(workdir)
    m = trained.config.model
    assert (m.num_layers, m.hidden_size, m.vocab_size, m.padded_vocab_size) == (2, 64, VOCAB, PADDED)
    assert trained.config.train.seq_length == SEQ and trained.config.mesh_shape["tensor"] == 1
    assert trained.tokenizer.name == "byte" and trained.vocab_size == VOCAB and trained.max_length == SEQ
    assert trained.params["wte"].shape == (PADDED, 64) and trained.params["wte"].dtype == np.float32
    assert jaxllm.model.gpt.num_params(trained.params) == jaxllm.model.gpt.num_params(
        jaxllm.model.gpt.describe(m).params)
    earlier = jaxllm.load(str(workdir), step=STEPS[0])
    assert earlier.step == STEPS[0]
    assert not np.array_equal(earlier.params["wte"], trained.params["wte"])  # another checkpoint's values
    assert "step=120" in repr(trained) and "vocab_size 256" in repr(trained)


def test_logits_equal_transformers_on_the_export(trained, hf):
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))
    out = trained.logits(tokens)
    assert out.shape == (2, SEQ, VOCAB) and out.dtype == np.float32  # the real vocabulary only
    np.testing.assert_allclose(out, hf_logits(hf, tokens), atol=TOL, rtol=0)
    np.testing.assert_allclose(trained.logits(tokens[1, :5][None]), out[1:, :5], atol=TOL, rtol=0)  # causal


def reference_scores(hf, ids):
    """ln p(ids[i + 1] | ids[:i + 1]) from transformers' logits (float64 log-softmax)."""
    logp = torch.log_softmax(torch.tensor(hf_logits(hf, ids[None, :-1])[0], dtype=torch.float64), dim=-1).numpy()
    return logp[np.arange(len(ids) - 1), ids[1:]]


def test_score_is_the_log_likelihood_of_each_next_token(trained, hf):
    short = TEXT[:SEQ + 1]  # within the context: one window
    ids = trained.tokenizer.encode(short)  # the run's own tokenizer; transformers gets the same ids
    scores = trained.score(short)
    assert scores.shape == (len(ids) - 1,) == (SEQ,) and scores.dtype == np.float32 and (scores < 0).all()
    np.testing.assert_allclose(scores, reference_scores(hf, ids), atol=TOL, rtol=0)
    assert -scores.mean() < np.log(VOCAB) - 1  # trained: well below the uniform distribution's loss
    # Longer than the context: windows of SEQ tokens starting SEQ/2 apart, the last one ending at the text's
    # end; each token is scored by the first window that holds it (written last here, so it wins).
    long = TEXT * 2
    ids = trained.tokenizer.encode(long)
    scores, targets = trained.score(long), len(ids) - 1
    assert scores.shape == (targets,) and targets > 2 * SEQ
    want = np.empty(targets)
    for s in sorted({*range(0, targets - SEQ, SEQ // 2), targets - SEQ}, reverse=True):
        want[s:s + SEQ] = reference_scores(hf, ids[s:s + SEQ + 1])
    np.testing.assert_allclose(scores, want, atol=TOL, rtol=0)


def hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids[None], dtype=torch.long), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].numpy()


def test_greedy_generate_equals_transformers(trained, hf):
    prompts = ["the quick", "lazy dog."]  # as many tokens each: one batch
    ids = np.stack([trained.tokenizer.encode(p) for p in prompts])
    n = SEQ - ids.shape[1]  # within the context: the sampler never re-encodes
    ours = trained.sample(ids, n, top_k=1)  # top_k=1: greedy (any temperature)
    assert ours.shape == (2, n) and ours.dtype == np.int32
    for row, prompt in enumerate(prompts):
        mine, theirs = ours[row], hf_greedy(hf, ids[row], n)
        differ = np.flatnonzero(mine != theirs)
        if differ.size:
            # The cached decode and transformers' forward round differently (~1e-6): where the two best
            # tokens tie to that, either is the argmax. Allow only that, and compare up to there.
            i = differ[0]
            step_logits = hf_logits(hf, np.concatenate([ids[row], theirs[:i]])[None])[0, -1]
            assert abs(step_logits[mine[i]] - step_logits[theirs[i]]) < TOL, (prompt, i, mine, theirs)
            mine, theirs = mine[:i], theirs[:i]
        assert mine.tolist() == theirs.tolist(), prompt
        text = trained.generate(prompt, num_tokens=n, top_k=1)  # the continuation alone, decoded
        assert text.startswith(trained.tokenizer.decode(theirs.tolist())) and len(text) == n, (prompt, text)
    sampled = [trained.generate("the", num_tokens=20, seed=s, temperature=1.0) for s in (0, 0, 1)]
    assert sampled[0] == sampled[1] != sampled[2]  # the seed decides


def test_bad_inputs_raise_clear_errors(trained, workdir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 7 in .*checkpoints: it holds steps 60, 120; "
                                                r"pass one of them, or step=None for the latest \(120\)"):
        jaxllm.load(str(workdir), step=7)
    missing = tmp_path / "no-such-run"
    with pytest.raises(FileNotFoundError, match="no-such-run: no such run directory.*jaxllm.train --workdir"):
        jaxllm.load(str(missing))
    assert not missing.exists()  # nothing created
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*checkpoints: train first"):
        jaxllm.load(str(tmp_path))
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        trained.logits(np.array([[1, 256]]))
    with pytest.raises(ValueError, match=r"more than the learned position table's 32"):
        trained.logits(np.zeros((1, SEQ + 1), np.int32))
    with pytest.raises(ValueError, match=r"shape \[batch, len\]"):
        trained.logits(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="at least 2"):
        trained.score("a")
    with pytest.raises(ValueError, match="temperature=0: must be > 0"):
        trained.generate("a", temperature=0)


SHARDINGS = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, numpy as np
import jaxllm


def flat(tree):
    return {jax.tree_util.keystr(k): str(tuple(v.spec)) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


run = jaxllm.load(sys.argv[1])
tokens = np.arange(64).reshape(2, 32) % 256
out = {"devices": jax.device_count()}
for zero in (0, 1):
    spec = jaxllm.config.from_dict(run.config.to_dict())  # the run's config, on data 2 x tensor 2
    spec.mesh.update(data=2, tensor=2)
    spec.parallel.zero_stage = zero
    cfg = jaxllm.resolve.resolve(spec, num_devices=4, vocab_size=run.vocab_size, data_files=False)
    mesh = jaxllm.make_mesh(cfg)
    shardings = jaxllm.shardings(cfg, mesh)
    params = jax.device_put(run.params, shardings)
    wq = params["layers"]["attn"]["wq"]
    logits = jax.jit(lambda p, t: jaxllm.model.gpt.forward(run.graphdef, p, t))(params, tokens)[..., :256]
    out[zero] = {"params": flat(shardings), "opt": flat(jaxllm.optimizer_shardings(cfg, mesh)),
                 "wq_shard": list(wq.sharding.shard_shape(wq.shape)),
                 "same_values": all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                                         jax.tree.leaves(run.params))),
                 "logits_err": float(np.abs(np.asarray(logits) - run.logits(tokens)).max())}
try:
    jaxllm.shardings(run.config, mesh)  # the run's 1-device config on the 4-device mesh
except ValueError as e:
    out["mismatch"] = str(e)
try:
    jaxllm.shardings(jaxllm.get_config(), mesh)
except TypeError as e:
    out["unresolved"] = str(e)
out["one_device_mesh"] = dict(jaxllm.make_mesh(run.config).shape)  # the first device of the four
spec.mesh.update(sequence=2)  # data 2 x tensor 2 x sequence 2
try:
    jaxllm.make_mesh(jaxllm.resolve.resolve(spec, num_devices=8, vocab_size=256, data_files=False))
except ValueError as e:
    out["too_few"] = str(e)
print(json.dumps(out))
"""


def test_shardings_lay_out_a_tensor_parallel_run(workdir):
    """On 4 fake devices (a subprocess: the count is set before JAX starts), data 2 x tensor 2: the
    rules table's specs for known parameters, ``device_put`` with them, the same logits."""
    out = json.loads(run_python("-c", SHARDINGS, str(workdir)).stdout.splitlines()[-1])
    assert out["devices"] == 4
    for zero in ("0", "1"):
        p = out[zero]["params"]
        # Megatron: QKV and the first MLP matrix column-parallel, the output projections row-parallel,
        # the embedding vocabulary-parallel; layers over pipeline, embed over fsdp (both 1 device here)
        assert p["['layers']['attn']['wq']"] == "('pipeline', 'fsdp', 'tensor', None)"
        assert p["['layers']['attn']['wo']"] == "('pipeline', 'tensor', None, 'fsdp')"
        assert p["['layers']['mlp']['w1']"] == "('pipeline', 'fsdp', 'tensor')"
        assert p["['layers']['mlp']['w2']"] == "('pipeline', 'tensor', 'fsdp')"
        assert p["['wte']"] == "('tensor', 'fsdp')" and p["['ln_f']['scale']"] == "('fsdp',)"
        assert out[zero]["wq_shard"] == [2, 64, 2, 16]  # heads split in 2
        assert out[zero]["same_values"] and out[zero]["logits_err"] < TOL
    # the optimizer moments: as the parameters, then (ZeRO-1) embed over data and sequence too; Adam's count replicated
    mu = "[1][0].mu['layers']['attn']['wq']"
    assert out["0"]["opt"][mu] == "('pipeline', 'fsdp', 'tensor', None)"
    assert out["1"]["opt"][mu] == "('pipeline', ('fsdp', 'data', 'expert', 'sequence'), 'tensor', None)"
    assert out["1"]["opt"]["[1][0].count"] == "()"
    assert "is not the config's" in out["mismatch"] and "jaxllm.make_mesh(config)" in out["mismatch"]
    assert "a resolved config is needed" in out["unresolved"]
    assert out["one_device_mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "pipeline": 1, "tensor": 1, "sequence": 1}
    assert "covers 8 devices, and 4 are given" in out["too_few"]


def test_import_jaxllm_and_plot_import_no_jax(workdir):
    """The CLIs set GPU flags and environment before JAX starts: the package must not start it."""
    run_python("-c", textwrap.dedent(f"""
        import runpy, sys
        import jaxllm
        assert "jax" not in sys.modules
        assert set(jaxllm.__all__) <= set(dir(jaxllm))
        jaxllm.get_config(), jaxllm.ConfigError, jaxllm.Config
        assert "jax" not in sys.modules
        sys.argv = ["plot", {str(workdir)!r}]
        try:
            runpy.run_module("jaxllm.plot", run_name="__main__")
        except SystemExit as e:
            assert not e.code, e.code
        assert "jax" not in sys.modules, "python -m jaxllm.plot imported jax"
        """), fresh=True)
    assert (workdir / "loss.png").is_file()


@pytest.mark.parametrize("package", ["jaxllm", "jaxllm.model", "jaxllm.parallel", "jaxllm.runtime",
                                     "jaxllm.platform", "jaxllm.data"])
def test_every_name_in_all_exists(package):
    names = {}
    exec(f"from {package} import *", names)  # noqa: S102  (imports the submodules __all__ names too)
    module = sys.modules[package]
    assert module.__all__ and all(n in names for n in module.__all__), sorted(set(module.__all__) - set(names))


def test_readme_snippet_runs(workdir, tmp_path, monkeypatch, capsys):
    """README's "Using jaxllm from Python" block, as written, on this run in place of the quick start's."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using jaxllm from Python", 1)[1].split("\n## ", 1)[0]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "default").symlink_to(workdir)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "README.md", "exec"), {"__name__": "__main__"})  # noqa: S102
    out = capsys.readouterr().out
    assert "TrainedModel(workdir='runs/default', step=120" in out and "nats/token" in out
    assert "'heads': ('tensor',)" in out
