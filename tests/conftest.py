"""Session settings for the tests, set before anything imports jax.

XLA's CPU backend compiles without LLVM's optimization passes and, under JAX 0.10 (the last whose XLA has
them), with its older element-wise emitters instead of the MLIR fusion emitters: the tests' models are
tiny, so they spend their time compiling, not running. The first cut a layout run by about a fifth
(30.4 s -> 23.8 s), the second halves the train step's compile again (a 2-layer MoE layout on 8 devices:
3.6 s -> 1.7 s; three layouts 27.3 s -> 23.0 s in all, the same losses to the bit, parameters within
3e-6). The subprocesses the tests start inherit them.
Results agree with XLA's default build to float rounding; every comparison in the suite is
between runs made with the same setting.  The few tests that run many steps of a larger
model (bfloat16 on CPU is emulated in generated code, which -O0 slows) start their
subprocesses with :func:`optimized_env`. LLVM's -O1 instead of -O0 gained nothing (2026-12-03: the documented
commands of tests/test_docs.py, the first 71: 654 s at -O1 and 650 s at -O0, run side by side from cold caches).
"""

import os
from importlib.metadata import version
from pathlib import Path


def _fast_compile(jaxlib: str) -> tuple[str, ...]:
    """The fast-compile flags that ``jaxlib``'s XLA knows: XLA aborts every process on an unknown flag (printing
    nothing under pytest), and JAX 0.11 dropped the older emitters' switch (tests/test_gpu_env.py checks both)."""
    older = tuple(int(x) for x in jaxlib.split(".")[:2]) < (0, 11)
    return ("--xla_backend_optimization_level=0", *(["--xla_cpu_use_fusion_emitters=false"] if older else []))


FAST_COMPILE = _fast_compile(version("jaxlib"))
os.environ["XLA_FLAGS"] = " ".join(dict.fromkeys(filter(None, [*os.environ.get("XLA_FLAGS", "").split(),
                                                               *FAST_COMPILE])))


# One persistent compilation cache for every process of a run of the suite (the workers and what they start),
# kept for the next run in this clone: JAX keys an entry by program, jaxlib, XLA flags and devices, so a hit
# is the executable a compile would give. Every program is kept (about 5,600 after one run): the suite's
# subprocesses compile the same small programs again. No size limit: with one, JAX locks the folder and reads
# every entry's access time at every write (test_kv_cache_decoding_matches_full_forward[unrolled]: 132 s; 8 s without
# it, at a 1 s minimum).
# jaxllm.train uses it in place of WORKDIR/compile_cache (jaxllm/runtime/compile_cache.py);
# tests/test_compile_cache.py checks the cache's own behaviour in folders of its own.
COMPILE_CACHE = Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax_compilation_cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(COMPILE_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def xla_flags(*extra: str) -> str:
    """``XLA_FLAGS`` for a test's subprocess that replaces the variable: the fast-compile flags, then ``extra``."""
    return " ".join(dict.fromkeys(f for flags in (*FAST_COMPILE, *extra) for f in flags.split()))


def optimized_env(env: dict) -> dict:
    """``env`` with XLA's default CPU compilation back."""
    return {**env, "XLA_FLAGS": " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE)}


# The longest test files (about so many seconds in a full run on the 2-core machine, 2026-12-03, a cold cache),
# handed to the two workers first: xdist's default order (most tests first) left test_docs.py, two tests and 11
# minutes, to run alone at the end. The others follow in their usual order.
LONGEST_FIRST = ("test_docs.py",  # 728
                 "test_moe.py",  # 351
                 "test_sequence.py",  # 282
                 "test_megatron_checkpoint.py",  # 222
                 "test_e2e.py",  # 221
                 "test_pipeline.py",  # 157
                 "test_gpu_program.py",  # 151
                 "test_sharding.py",  # 138
                 "test_restart.py",  # 120
                 "test_tune.py")  # 117


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept


# --- the suite's budget, shown at its end: the wall time and the ten files that took longest ----------

import time  # noqa: E402
from collections import Counter  # noqa: E402

_FILE_SECONDS, _STARTED = Counter(), time.monotonic()


def pytest_runtest_logreport(report):
    _FILE_SECONDS[report.nodeid.split("::")[0]] += report.duration  # setup, call and teardown of each test


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    wall = time.monotonic() - _STARTED
    terminalreporter.section("the suite's time")
    write(f"wall {wall / 60:.1f} min ({wall:.0f} s); the tests' own times, summed per file, the ten largest:")
    for path, seconds in _FILE_SECONDS.most_common(10):
        write(f"{seconds:8.0f} s  {path}")


# --- corpora: files of this repository or made from Python's standard library, no other folder --

import json  # noqa: E402
import sysconfig  # noqa: E402

import pytest  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
# Tiny Shakespeare (public domain; tests/data/README.md): 1,115,394 characters, 65 distinct
TINY_SHAKESPEARE = DATA / "tinyshakespeare.txt"
MARKER = "<|file|>"


def shakespeare_documents() -> list[str]:
    """Tiny Shakespeare as documents: its blank-line-separated speeches (7,222)."""
    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")
    return [d + "\n" for d in text.split("\n\n") if d.strip()]


STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def write_stdlib_corpus(path: Path) -> Path:
    """One text file of many documents, as the PEPs file of the README's end-to-end run is (703
    documents, 13.9 MB): the running Python's standard library modules without their tests (every
    non-empty ``.py`` file, sorted; 731 of them, 12.1 MB on Python 3.11), each after a line
    ``<|file|> Lib/PATH`` (its document marker). More than 500 documents, so that Megatron's
    default split 969,30,1 leaves each of train, validation and test at least one (megatron-core
    loops forever building an empty split that is asked for samples)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(root)
            if any(part in STDLIB_SKIP or part.startswith(".") for part in rel.parts):
                continue
            text = p.read_text(encoding="utf-8")
            if text.strip():
                f.write(f"{MARKER} Lib/{rel.as_posix()}\n" + text + ("" if text.endswith("\n") else "\n"))
                n += 1
    assert n > 500, f"{root}: only {n} standard library modules; the tests need more than 500 documents"
    return path


def corpus_documents(path) -> list[str]:
    """A marked corpus as documents, read independently of jaxllm: the text between its ``<|file|>`` lines."""
    docs, cur = [], None
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(MARKER.encode()):
                if cur is not None:
                    docs.append(b"".join(cur).decode("utf-8", errors="replace"))
                cur = []
            else:
                cur.append(line)
    docs.append(b"".join(cur).decode("utf-8", errors="replace"))
    return docs


def english_passage(chars: int = 60_000) -> str:
    """English technical prose with reST-like markup from the standard library: Python's language
    reference as ``pydoc`` ships it (``pydoc_data.topics``), ``chars`` characters from a line start."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    start = text.index("\n", 100_000) + 1
    return text[start:start + chars]


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory) -> Path:
    """The marked standard library corpus (:func:`write_stdlib_corpus`), written once per session."""
    return write_stdlib_corpus(tmp_path_factory.mktemp("stdlib") / "stdlib.txt")


@pytest.fixture(scope="session")
def stdlib_byte(stdlib_corpus):
    """Prefix of the marked standard library corpus prepared with the byte tokenizer, one document per module."""
    from jaxllm.data.text import prepare

    prefix = stdlib_corpus.parent / "stdlib_byte"
    prepare([str(stdlib_corpus)], "byte", str(prefix), document_marker=MARKER, progress=False)
    return str(prefix)


@pytest.fixture(scope="session")
def shakespeare_jsonl(tmp_path_factory):
    """Tiny Shakespeare's speeches as JSON Lines (``{"text": ...}``)."""
    path = tmp_path_factory.mktemp("shakespeare") / "speeches.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for doc in shakespeare_documents():
            f.write(json.dumps({"text": doc}) + "\n")
    return path


@pytest.fixture(scope="session")
def shakespeare_gpt2(shakespeare_jsonl):
    """Prefix of Tiny Shakespeare's speeches prepared with GPT-2's BPE (the files shipped with jaxllm; an
    end-of-document token each)."""
    from jaxllm.data.text import prepare

    prefix = shakespeare_jsonl.parent / "shakespeare_gpt2"
    prepare([str(shakespeare_jsonl)], "gpt2", str(prefix), progress=False)
    return str(prefix)


@pytest.fixture(scope="session")
def shakespeare_byte(shakespeare_jsonl):
    """Prefix of Tiny Shakespeare's speeches prepared with the byte tokenizer (to blend with stdlib_byte)."""
    from jaxllm.data.text import prepare

    prefix = shakespeare_jsonl.parent / "shakespeare_byte"
    prepare([str(shakespeare_jsonl)], "byte", str(prefix), progress=False)
    return str(prefix)


# --- helpers of the tests that train a tiny run through the CLI and read it back (test_api, test_lm_eval) --

import subprocess  # noqa: E402
import sys  # noqa: E402

import forkserver  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_python(*args, env: dict | None = None, timeout: int = 300, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository (env: default this one's with ``JAX_PLATFORMS=cpu``); asserts exit 0.
    A child of a process that has imported jax (tests/forkserver.py), or with ``fresh`` a new interpreter (a
    test of what a process imports)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"} if env is None else env
    r = (subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
         if fresh else forkserver.run(args, env, ROOT, timeout))
    assert r.returncode == 0, f"{args[:2]}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def run_tool(module: str, *args, cwd=ROOT) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in this process, in ``cwd``, through the tool's ``main(argv)``
    (:func:`jaxllm.cli.run_tool`): its exit status and what it printed, as ``subprocess.run(..., capture_output=True,
    text=True)`` gives a process's.  For what needs no fresh process: flags, configs and the checks made before a
    training run's console starts (signals, several processes and a run that trains stay processes)."""
    import contextlib
    import importlib
    import io

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = importlib.import_module(module).main([str(a) for a in args])
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess([module, *map(str, args)], code, out.getvalue(), err.getvalue())


def word_sentences(words: list[str], n: int = 500, seed: int = 0) -> str:
    """``n`` lines of 3-9 words drawn from ``words``, each ending ``.``: a corpus a tiny model learns in a minute."""
    rng = np.random.default_rng(seed)
    return "".join(" ".join(rng.choice(words, rng.integers(3, 10))) + ".\n" for _ in range(n))


def train_sentencepiece(path, vocab_size: int = 400, **options) -> Path:
    """A SentencePiece BPE model trained on Tiny Shakespeare's first 100,000 characters with Llama 2's
    settings (byte fallback, digits split, text not normalized, whitespace kept; ``options`` override
    them: a vocabulary under 259 pieces needs ``byte_fallback=False``), written to ``path``."""
    import sentencepiece

    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")[:100_000]
    settings = dict(model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
                    remove_extra_whitespaces=False, minloglevel=2) | options
    with open(path, "wb") as f:
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=f,
                                                 vocab_size=vocab_size, **settings)
    return Path(path)
