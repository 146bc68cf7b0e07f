"""Session settings for the tests, set before anything imports jax.

XLA's CPU backend compiles without LLVM's optimization passes: the tests' models are tiny,
so they spend their time compiling, not running, and this cuts it by about a fifth
(measured on a layout run: 30.4 s -> 23.8 s). The subprocesses the tests start inherit it.
Results agree with an optimized build to float rounding; every comparison in the suite is
between runs made with the same setting.  The few tests that run many steps of a larger
model (bfloat16 on CPU is emulated in generated code, which -O0 slows) start their
subprocesses with :func:`optimized_env`.
"""

import os

O0 = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), O0]))


def optimized_env(env: dict) -> dict:
    """``env`` with XLA's optimizations back on."""
    return {**env, "XLA_FLAGS": " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != O0)}


# --- indexed datasets made by jaxllm.data.prepare from ../shared/data, once per session ---------

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PEPS_MARKER = "<|file|>"


def shakespeare_documents() -> list[str]:
    """Tiny Shakespeare as documents: its blank-line-separated speeches (7,222)."""
    text = (SHARED_DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")
    return [d + "\n" for d in text.split("\n\n") if d.strip()]


def peps_documents() -> list[str]:
    """peps.txt as documents: the text between its ``<|file|> peps/pep-NNNN.rst`` lines (703)."""
    docs, cur = [], None
    with open(SHARED_DATA / "peps.txt", "rb") as f:
        for line in f:
            if line.startswith(PEPS_MARKER.encode()):
                if cur is not None:
                    docs.append(b"".join(cur).decode("utf-8", errors="replace"))
                cur = []
            else:
                cur.append(line)
    docs.append(b"".join(cur).decode("utf-8", errors="replace"))
    return docs


@pytest.fixture(scope="session")
def peps_byte(tmp_path_factory):
    """Prefix of peps.txt prepared with the byte tokenizer, one document per PEP."""
    from jaxllm.data.prepare import prepare

    prefix = tmp_path_factory.mktemp("peps") / "peps_byte"
    prepare([str(SHARED_DATA / "peps.txt")], "byte", str(prefix), document_marker=PEPS_MARKER, progress=False)
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
    """Prefix of Tiny Shakespeare's speeches prepared with GPT-2's BPE (an end-of-document token each)."""
    from jaxllm.data.prepare import prepare

    prefix = shakespeare_jsonl.parent / "shakespeare_gpt2"
    prepare([str(shakespeare_jsonl)], "gpt2", str(prefix), gpt2_dir=str(SHARED_DATA / "gpt2"), progress=False)
    return str(prefix)


@pytest.fixture(scope="session")
def shakespeare_byte(shakespeare_jsonl):
    """Prefix of Tiny Shakespeare's speeches prepared with the byte tokenizer (to blend with peps_byte)."""
    from jaxllm.data.prepare import prepare

    prefix = shakespeare_jsonl.parent / "shakespeare_byte"
    prepare([str(shakespeare_jsonl)], "byte", str(prefix), progress=False)
    return str(prefix)
