"""lm-eval's model ``jaxllm`` (jaxllm.harness) against lm-eval's own Hugging Face backend on the export.

A tiny run on a BPE ``tokenizer.json`` of its own (trained here with the tokenizers library) is made
by the training CLI and exported with ``python -m jaxllm.convert --to-hf`` (model and tokenizer);
lm-eval's ``HFLM`` reads the export in float32.  Both answer the same requests: log-likelihoods (a
context longer than the model's 32 positions among them), rolling log-likelihoods of a text of
several windows, greedy generations cut at a stop string, and a local multiple-choice task, in
Python and through the command line ``python -m jaxllm.harness``.  And an open model imported: a tiny random
transformers ``Qwen3ForCausalLM`` with that tokenizer, read by ``python -m jaxllm.convert --from-hf``, answers
as the Hugging Face backend answers on the same directory.  Offline: nothing is downloaded.
"""

import glob
import json
import os
from pathlib import Path

import numpy as np
import pytest
import transformers
from conftest import run_python, word_sentences
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from jaxllm.harness import JaxLLM

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
TOL = 1e-4
SEQ = 32
WORDS = "the quick brown fox jumps over the lazy dog".split()
TRAIN = ["--config.data.sampling=uniform", "--config.data.split=9,1", "--config.model.num_layers=2",
         "--config.model.hidden_size=64", "--config.model.num_attention_heads=4", "--config.model.dtype=float32",
         f"--config.train.seq_length={SEQ}", "--config.train.micro_batch_size=8", "--config.train.global_batch_size=8",
         "--config.train.train_iters=60", "--config.train.warmup_iters=2", "--config.train.lr=0.01",
         "--config.train.min_lr=0.001", "--config.train.eval_interval=0", "--config.train.log_interval=60",
         "--config.checkpoint.interval=60", "--config.log.samples=0", "--config.log.tensorboard=False"]
TASK = "jaxllm_tiny_choice"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``(workdir, export)``: a run the training CLI made on its own tokenizer.json, and its --to-hf export."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("lm_eval")
    text = word_sentences(WORDS)
    (d / "corpus.txt").write_text(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(d / "tokenizer.json"))
    run_python("-m", "jaxllm.train", f"--workdir={d / 'run'}", f"--config.data.input={d / 'corpus.txt'}",
               f"--config.data.tokenizer={d / 'tokenizer.json'}", *TRAIN, env=ENV)
    run_python("-m", "jaxllm.convert", "--to-hf", str(d / "run"), str(d / "hf"), env=ENV)
    return d / "run", d / "hf"


@pytest.fixture(scope="module")
def qwen3(run, tmp_path_factory):
    """``(hf_dir, workdir)``: a tiny random Qwen3 saved with the run's tokenizer, and its ``--from-hf`` import."""
    import torch

    d = tmp_path_factory.mktemp("qwen3")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(run[0].parent / "tokenizer.json"),
                                               eos_token="<|endoftext|>")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=len(tok), max_position_embeddings=SEQ, rope_theta=500.0,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=None))
    with torch.no_grad():  # norms away from 1 as well, so that a misplaced one shows
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape))
    model.save_pretrained(d / "hf")
    tok.save_pretrained(d / "hf")
    # the tokenizer comes along (WORKDIR/tokenizer): no data flags
    run_python("-m", "jaxllm.convert", "--from-hf", str(d / "hf"), str(d / "run"), "--config.model.dtype=float32",
               env=ENV)
    return d / "hf", d / "run"


@pytest.fixture(scope="module")
def ours(run):
    return JaxLLM(workdir=str(run[0]), batch_size=4)


@pytest.fixture(scope="module")
def hf(run):
    return HFLM(pretrained=str(run[1]), backend="causal", dtype="float32", device="cpu", batch_size=4)


def requests(kind, *args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_export_has_the_runs_tokenizer(run, ours):
    tok = transformers.AutoTokenizer.from_pretrained(run[1])
    eot = ours.run.tokenizer.eot_id
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == eot == 0
    assert json.loads((run[1] / "config.json").read_text())["eos_token_id"] == eot
    assert json.loads((run[1] / "special_tokens_map.json").read_text()) == {"eos_token": "<|endoftext|>"}
    text = "the lazy fox , jumps.\nover<|endoftext|>dog"
    assert tok.encode(text) == ours.run.tokenizer.encode(text).tolist() == ours.tok_encode(text)
    assert tok.decode(tok.encode(text)) == text == ours.run.tokenizer.decode(tok.encode(text))


def test_loglikelihood_equals_hf_backend(ours, hf):
    long_context = " ".join(WORDS * 4)  # more than SEQ tokens: both keep its last ones
    assert len(ours.tok_encode(long_context)) > SEQ
    greedy = ours.generate_until(requests("generate_until", ("the quick", {"until": ["\n"], "max_gen_toks": 6})))[0]
    reqs = requests("loglikelihood", ("the quick", " brown fox"), ("the quick ", "brown fox"), ("", "the lazy dog"),
                    (long_context, " over the lazy dog."), ("the quick", greedy), ("fox", " jumps"),
                    ("the", " dog dog dog dog"))
    mine, theirs = ours.loglikelihood(reqs), hf.loglikelihood(reqs)
    np.testing.assert_allclose([m[0] for m in mine], [t[0] for t in theirs], atol=TOL, rtol=0)
    assert [m[1] for m in mine] == [t[1] for t in theirs]
    assert mine[4][1] and not mine[6][1]  # the model's own greedy text is greedy; a repeated word is not
    assert all(m[0] < 0 for m in mine)


def test_imported_qwen3_equals_hf_backend(qwen3):
    """Issue 50's acceptance: ``jaxllm.harness`` on an imported Qwen3 equals lm-eval's HF backend (1e-4 nats)."""
    ours = JaxLLM(workdir=str(qwen3[1]), batch_size=4)
    hf = HFLM(pretrained=str(qwen3[0]), backend="causal", dtype="float32", device="cpu", batch_size=4)
    long_context = " ".join(WORDS * 4)  # more than the model's SEQ positions: both keep its last tokens
    assert len(ours.tok_encode(long_context)) > SEQ
    reqs = requests("loglikelihood", ("the quick", " brown fox"), (long_context, " over the lazy dog."),
                    ("fox", " jumps"), ("the lazy dog", " dog dog dog dog"))
    mine, theirs = ours.loglikelihood(reqs), hf.loglikelihood(reqs)
    np.testing.assert_allclose([m[0] for m in mine], [t[0] for t in theirs], atol=TOL, rtol=0)
    assert [m[1] for m in mine] == [t[1] for t in theirs]
    texts = requests("loglikelihood_rolling", (" ".join(np.random.default_rng(3).choice(WORDS, 60)) + ".",))
    np.testing.assert_allclose(ours.loglikelihood_rolling(texts), hf.loglikelihood_rolling(texts), atol=TOL, rtol=0)


def test_loglikelihood_rolling_equals_hf_backend(ours, hf):
    texts = ["the lazy dog.", " ".join(np.random.default_rng(2).choice(WORDS, 120)) + ".\n"]
    assert len(ours.tok_encode(texts[1])) > 3 * SEQ  # several windows
    mine = ours.loglikelihood_rolling(requests("loglikelihood_rolling", *((t,) for t in texts)))
    theirs = hf.loglikelihood_rolling(requests("loglikelihood_rolling", *((t,) for t in texts)))
    np.testing.assert_allclose(mine, theirs, atol=TOL, rtol=0)


def test_generate_until_equals_hf_backend(ours, hf):
    args = [("the quick", {"until": ["."], "max_gen_toks": 10, "do_sample": False}),
            ("over the lazy", {"until": ["\n"], "max_gen_toks": 12}),
            ("dog jumps over", {"until": "fox", "max_gen_toks": 8, "temperature": 0.0}),
            ("the", {"until": ["."], "max_gen_toks": 10}),
            ("over the lazy", {"until": [], "max_gen_toks": 12})]
    mine = ours.generate_until(requests("generate_until", *args))
    theirs = hf.generate_until(requests("generate_until", *args))
    assert mine == theirs and all(mine)
    assert mine[4].startswith(mine[1] + "\n") and "\n" not in mine[1]  # cut before the stop string


def write_task(directory: Path) -> Path:
    """A local multiple-choice task of 8 documents (a JSON Lines file), as lm-eval's YAML describes one."""
    rng = np.random.default_rng(1)
    with open(directory / "docs.jsonl", "w") as f:
        for _ in range(8):
            words = list(rng.choice(WORDS, 4))
            choices = [" " + w for w in rng.choice(WORDS, 3, replace=False)]
            f.write(json.dumps({"context": " ".join(words), "choices": choices, "label": int(rng.integers(3))}) + "\n")
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {directory / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    return directory


def test_task_accuracy_equals_hf_backend_in_python_and_cli(ours, hf, run, tmp_path):
    tasks = write_task(tmp_path)
    manager = TaskManager(include_path=str(tasks))
    mine = simple_evaluate(model=ours, tasks=[TASK], task_manager=manager, log_samples=True)
    theirs = simple_evaluate(model=hf, tasks=[TASK], task_manager=manager, log_samples=True)
    acc = theirs["results"][TASK]["acc,none"]
    assert mine["results"][TASK]["acc,none"] == acc
    assert [s["acc"] for s in mine["samples"][TASK]] == [s["acc"] for s in theirs["samples"][TASK]]
    np.testing.assert_allclose([[r[0][0] for r in s["resps"]] for s in mine["samples"][TASK]],
                               [[r[0][0] for r in s["resps"]] for s in theirs["samples"][TASK]], atol=TOL, rtol=0)
    run_python("-m", "jaxllm.harness", "--model", "jaxllm", "--model_args", f"workdir={run[0]}", "--batch_size", "4",
               "--tasks", TASK, "--include_path", str(tasks), "--output_path", str(tmp_path / "out"), env=ENV)
    [path] = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    assert json.loads(Path(path).read_text())["results"][TASK]["acc,none"] == acc
