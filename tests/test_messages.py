"""Messages that used to mislead (issue 31), as real processes (the flags' own, in this process through the tools'
``main(argv)``, as the process gives them: conftest.run_tool): each mistake is one line naming the real
cause and the fix (exit 2); Megatron's flags without ``--config.`` are taken for the keys they mean; an
empty validation split skips evaluation as Megatron-LM does; the plot says above or below. The data is
generated from the Python standard library: nothing from outside the repository."""

import json
import os
import sysconfig
from pathlib import Path

import forkserver
import pytest
from conftest import run_tool

from jaxllm import cli
from jaxllm.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
JSON_SOURCES = Path(sysconfig.get_paths()["stdlib"]) / "json"  # six files, about 50k bytes
TINY = ["--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.num_attention_heads=2",
        "--config.train.seq_length=32", "--config.train.micro_batch_size=2", "--config.train.global_batch_size=2",
        "--config.train.train_iters=2", "--config.train.warmup_iters=1", "--config.train.eval_iters=1",
        "--config.log.samples=0", "--config.log.tensorboard=False", "--config.log.progress_bar=False"]


def run(*args, module="jaxllm.train", env=None):
    return forkserver.run(["-m", module, *map(str, args)], env or ENV, ROOT, 300)


def one_line(r, code=2):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr + r.stdout, (r.returncode, r.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    """An indexed dataset (byte tokens) of the json package's sources."""
    out = tmp_path_factory.mktemp("json") / "json"
    r = run("--input", JSON_SOURCES, "--tokenizer", "byte", "--output-prefix", out, module="jaxllm.prepare")
    assert r.returncode == 0, r.stderr
    return str(out)


def test_a_blend_weight_that_is_not_a_number(prefix, tmp_path):
    line = one_line(run(f"--config.data.input=abc {prefix}", f"--workdir={tmp_path / 'w'}", *TINY))
    assert line == (f"data error: data.input: weight 'abc' of {prefix} is not a number; write \"W1 PREFIX1 W2 "
                    f"PREFIX2 ...\" with a number before each prefix (e.g. \"0.5 {prefix}\"), or the prefixes alone")
    line = one_line(run(f"--config.data.input=0.5 {prefix} 1e-x {prefix}", f"--workdir={tmp_path / 'w'}", *TINY))
    assert "weight '1e-x' of" in line and "is not a number" in line


def test_a_missing_tokenizer_json_is_not_found(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.json"
    line = one_line(run(f"--config.data.tokenizer={missing}", f"--workdir={tmp_path / 'w'}", *TINY))
    assert line == (f"config error: data.tokenizer='{missing}': not found: no such file or directory {missing}; give "
                    f"the path of an existing Hugging Face tokenizer.json, SentencePiece tokenizer.model (or of a "
                    f"directory holding one)")
    line = one_line(run("--config.data.tokenizer=GPT2BPETokenizer", f"--workdir={tmp_path / 'w'}", *TINY))
    assert "neither a tokenizer jaxllm knows nor an existing path; Megatron's GPT2BPETokenizer is gpt2 here" in line


def test_a_sample_longer_than_the_data_blames_train_seq_length(prefix, tmp_path):
    uniform = [f"--config.data.input={prefix}", "--config.data.sampling=uniform", "--config.data.split=9,1",
               f"--workdir={tmp_path / 'w'}", *TINY]
    line = one_line(run(*uniform, "--config.train.seq_length=100000", "--config.model.max_position_embeddings=0"))
    assert line.startswith("data error: train.seq_length=100000: a sample is 100,001 tokens and all of ")
    assert "use a train.seq_length that each split of data.split='9,1' can hold, or more text" in line
    line = one_line(run(*uniform, "--config.train.seq_length=8192"))  # the train split holds one, validation not
    assert line.startswith("data error: train.seq_length=8192: the valid split of ")
    assert "use train.seq_length <= 4,833, give the valid split more of the text in data.split='9,1'" in line


def test_an_empty_validation_split_skips_evaluation_as_megatron(prefix, tmp_path):
    r = run(f"--config.data.input={prefix}", "--config.data.split=1,0,0", "--config.train.eval_interval=1",
            "--config.train.log_interval=1", "--config.train.compile_cache_dir=", f"--workdir={tmp_path / 'w'}", *TINY)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("jaxllm: note: data.split='1,0,0' leaves no validation split, so the run does not evaluate (as "
            "Megatron-LM); give validation a weight (e.g. data.split=969,30,1) to evaluate") in r.stdout
    assert "nan" not in r.stdout and "valid samples" not in r.stdout and "no evaluation" in r.stdout
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["train", "train"]


def test_a_mesh_axis_that_does_not_divide_the_devices(tmp_path):
    env = {**ENV, "XLA_FLAGS": " ".join(filter(None, [ENV.get("XLA_FLAGS"),
                                                      "--xla_force_host_platform_device_count=4"]))}
    line = one_line(run("--config.mesh.data=-1", "--config.mesh.tensor=3", f"--workdir={tmp_path / 'w'}", *TINY,
                        env=env))
    assert line == ("config error: mesh.tensor=3: does not divide the 4 devices, so mesh.data=-1 cannot take the "
                    "rest; give mesh.tensor a divisor of 4 (e.g. mesh.tensor=2)")


def test_megatron_flags_without_config_are_taken_for_their_keys(prefix, tmp_path):
    r = run_tool("jaxllm.train", "--check_devices=2", "--micro-batch-size", "4", "--global-batch-size=8",
                 "--tensor-model-parallel-size", "2", "--bf16", "--tokenizer-model", "/lus/x/tokenizer.model",
                 "--tokenizer-type", "Llama2Tokenizer")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[:5] == [
        "note: --micro-batch-size=4 (Megatron's) taken as --config.train.micro_batch_size=4",
        "note: --global-batch-size=8 (Megatron's) taken as --config.train.global_batch_size=8",
        "note: --tensor-model-parallel-size=2 (Megatron's) taken as --config.mesh.tensor=2",
        "note: --bf16 (Megatron's) taken as --config.model.dtype=bfloat16",
        # the tokenizer's class is the file's: Megatron's --tokenizer-type gives way to its file
        "note: --tokenizer-model=/lus/x/tokenizer.model (Megatron's) taken as --config.data.tokenizer="
        "/lus/x/tokenizer.model"]
    assert "config ok for 2 cpu devices: tensor 2, 2 microbatch(es)/step" in r.stdout  # 8 / (4 x 1)
    # Another tool: its own --split stays its flag; Megatron's --data-path takes the words up to the next flag.
    out = tmp_path / "batches.npy"
    r = run_tool("jaxllm.inspect_data", "--data-path", "0.25", prefix, "0.75", prefix, "--seq-length", "16",
                 "--micro-batch-size=2", "--global-batch-size=2", "--split=train", "--steps=0:1", f"--output={out}",
                 f"--workdir={tmp_path / 'w'}")
    assert r.returncode == 0, r.stderr
    import numpy as np

    assert np.load(out).shape == (1, 2, 17)
    assert "taken as --config.data.input=0.25 " in r.stdout


@pytest.mark.parametrize("args, words", [
    (["--gradient-accumulation-steps=4"], "error: --gradient-accumulation-steps (Megatron-DeepSpeed's) has no one "
                                          "flag in jaxllm: set train.global_batch_size (= micro batch x data-parallel "
                                          "size x accumulation steps) with --config.train.global_batch_size=VALUE"),
    (["--normalization=RMSNorm"], "error: --normalization=RMSNorm is Megatron's flag for --config.model.norm, "
                                  "whose value must be one of layernorm, rmsnorm (jaxllm's names); pass "
                                  "--config.model.norm=VALUE"),
    (["--micro-batch-size=four"], "is Megatron's flag for --config.train.micro_batch_size, whose value must be an "
                                  "integer"),
    (["--seq-length"], "error: --seq-length needs a value: it is Megatron's flag for --config.train.seq_length=VALUE"),
    (["--micro-batch-size=4", "--config.train.micro_batch_size=8"], "both set train.micro_batch_size; give it once"),
    (["--no-such-flag=1"], "Unknown command line flag 'no_such_flag'"),
])
def test_megatron_flags_that_cannot_be_taken_are_one_line(tmp_path, args, words):
    assert words in one_line(run_tool("jaxllm.train", *args, f"--workdir={tmp_path / 'w'}"))
    assert not (tmp_path / "w").exists()


def test_plot_says_above_for_a_loss_above_the_unigram_entropy(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "loss": 6.0}\n'
                                            '{"step": 1, "kind": "eval", "eval_loss": 5.5, "unigram_entropy": 4.41}\n')
    r = run(tmp_path, module="jaxllm.plot")
    assert r.returncode == 0, r.stderr
    assert ("validation loss 5.5000 nats/token, unigram entropy of the validation split 4.4100: 1.0900 nats above "
            "it (not yet better than predicting tokens by their frequency alone)") in r.stdout
    assert "-1.09" not in r.stdout


@pytest.mark.parametrize("error,more,line", [
    (ConfigError("train.lr", -1, "give > 0"), {ValueError: "error: "}, "config error: train.lr=-1: give > 0"),
    (DataError("x.bin: missing"), {ValueError: "error: "}, "data error: x.bin: missing"),
    (DataError("x.bin: missing"), {DataError: "error: "}, "error: x.bin: missing"),  # jaxllm.convert's
    (ValueError("--mfu=2: a fraction"), {ValueError: ""}, "--mfu=2: a fraction"),  # jaxllm.plan's
])
def test_usage_errors_one_line_and_exit_2(error, more, line, capsys):
    """Each tool's table on top of the common one: the most derived type with an entry decides the words."""
    with pytest.raises(SystemExit) as e, cli.usage_errors(more):
        raise error
    assert e.value.code == 2 and capsys.readouterr().err == line + "\n"
    with pytest.raises(KeyError), cli.usage_errors(more):  # not ours: through, with its traceback
        raise KeyError("k")
