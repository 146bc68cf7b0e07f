"""The commands that README.md and docs/*.md show, and how CI runs each one: as written, or with the flags the
document itself shows after it.

A command is a line of a fenced ```bash block (``\\``-continued lines joined, ``#``
comments dropped) or a ``$ ``-prefixed line of any fenced block (a transcript).  A line
``a && b`` is the commands ``a`` and ``b``.  Every command is exercised:

* installing (``python3 -m venv``, ``. .venv/bin/activate``, ``pip install``) and the test
  command (``python -m pytest``) are what ``.ci/run`` does, checked against its text;
* cluster submissions (``sbatch``, ``qsub``) run their script with ``DRY_RUN=1`` and the
  allocation's environment (nodes from ``-N``/``-l select=``), knobs kept, and the config of
  the ``jaxllm.train`` command it prints must pass ``config.resolve`` for the job's devices;
* everything else runs for real in a sandbox checkout, exactly as written, unless the line after
  it in the document is ``# tests add: FLAGS``: then with those flags appended (to the last command of
  the line), so that a 2000-step recipe trains a few steps and a benchmark takes a few points; the
  reader sees what the tests run.

The README's end-to-end section (between ``<!-- e2e -->`` and ``<!-- /e2e -->``) is run
by ``tests/test_e2e.py`` in order, with the kill in between, at the size the README states
after the section.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import forkserver

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
E2E_BEGIN, E2E_END = "<!-- e2e -->", "<!-- /e2e -->"

CI = ("python3 -m venv ", ". .venv/bin/activate", "source .venv/bin/activate", "pip install ", "ruff check",
      "python -m pytest")


TESTS_ADD = "# tests add: "  # the line after a command in a document: the flags the tests append to it


@dataclass
class Command:
    where: str  # "docs/FILE.md:LINE"
    text: str
    e2e: bool  # inside the README's end-to-end section
    tests_add: str = ""  # the flags its document says the tests append ("": it runs as written)


def documented(path: Path) -> list[Command]:
    """Every command of ``path`` in document order (see the module doc)."""
    out, lang, e2e, pending, start = [], None, False, "", 0
    rel = path.relative_to(ROOT)
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if line == E2E_BEGIN or line == E2E_END:
            e2e = line == E2E_BEGIN
            continue
        if line.startswith("```"):
            lang = line[3:].strip() if lang is None else None
            continue
        if lang is None:
            continue
        if line.startswith(TESTS_ADD) and not pending and out and out[-1].where == f"{rel}:{start}":
            out[-1].tests_add = line[len(TESTS_ADD):].strip()
            continue
        if not pending:
            if lang == "bash" and line and not line.startswith("#"):
                pending, start = line, n
            elif line.startswith("$ "):
                pending, start = line[2:], n
            else:
                continue
        elif pending:
            pending += " " + line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        text = re.sub(r"\s+#\s.*$", "", pending)  # a trailing comment (docs never quote a " # ")
        for part in text.split(" && "):
            out.append(Command(f"{rel}:{start}", part.strip(), e2e))
        pending = ""
    return out


def python_blocks(path: Path, e2e: bool = True) -> list[str]:
    """The ```python blocks of ``path`` (inside the end-to-end section when ``e2e``)."""
    blocks, current, inside = [], None, False
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line in (E2E_BEGIN, E2E_END):
            inside = line == E2E_BEGIN
        elif current is None and line == "```python" and inside == e2e:
            current = []
        elif current is not None and line == "```":
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(raw)
    return blocks


def split_env(text: str) -> tuple[dict[str, str], list[str]]:
    """Leading ``NAME=VALUE`` words -> (environment, the rest of the words)."""
    words, env = shlex.split(text), {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def as_tested(command: Command) -> str:
    """What the tests run of ``command``: its text, with the flags its document shows after it."""
    return f"{command.text} {command.tests_add}" if command.tests_add else command.text


def submission(text: str, sandbox: Path) -> tuple[dict[str, str], list[str]] | None:
    """``sbatch``/``qsub`` command -> (environment, argv) of its script's dry run; else None."""
    env, words = split_env(text)
    if not words or words[0] not in ("sbatch", "qsub"):
        return None
    tool, words, nodes, args = words[0], words[1:], 1, []
    takes_value = {"-A", "-N", "-t", "-p", "-q", "-l", "-v", "-C", "-J", "--nodes"}
    while words and words[0].startswith("-"):
        opt = words.pop(0)
        value = words.pop(0) if opt in takes_value else ""
        if opt in ("-N", "--nodes"):
            nodes = int(value)
        elif opt == "-l" and value.startswith("select="):
            nodes = int(value.split("=")[1].split(":")[0])
        elif opt == "-v":
            env.update(kv.split("=", 1) for kv in value.split(","))
    script, args = words[0], words[1:]
    env["DRY_RUN"] = "1"
    if "PYTHON" in env:  # the cluster's environment (e.g. /eagle/PROJECT/envs/...): this one checks the config
        env["PYTHON"] = sys.executable
    if tool == "sbatch":
        env["SLURM_JOB_NUM_NODES"] = str(nodes)
    else:
        nodefile = sandbox / "pbs_nodefile"
        nodefile.write_text("".join(f"x3000c0s{i}b0n0\n" for i in range(nodes)))
        env["PBS_NODEFILE"] = str(nodefile)
    return env, ["bash", script, *args]


def make_sandbox(path: Path) -> Path:
    """A checkout-like directory at ``path``: the repository's files linked (``tests/data`` holds the
    shipped Tiny Shakespeare), but ``benchmarks/results`` copied (documented commands append records there,
    which must not reach the committed ones); nothing beside it."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("jaxllm", "kernels", "configs", "launch", "docs", "tests", "pyproject.toml", "README.md"):
        (path / name).symlink_to(ROOT / name)
    (path / "benchmarks").mkdir()
    for entry in (ROOT / "benchmarks").iterdir():
        if entry.name == "results":
            shutil.copytree(entry, path / "benchmarks" / "results")
        elif entry.name != "__pycache__":
            (path / "benchmarks" / entry.name).symlink_to(entry)
    return path


def run(command: Command, sandbox: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs ``command`` as tested (:func:`as_tested`, or as a dry run) in ``sandbox``; returns the finished process."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python` is this interpreter
    sub = submission(command.text, sandbox)
    if sub is not None:
        extra, argv = sub
        return subprocess.run(argv, cwd=sandbox, env={**env, **extra}, capture_output=True, text=True,
                              timeout=timeout)
    return shell(as_tested(command), sandbox, env, timeout)


def shell(text: str, cwd, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """``bash -c TEXT`` as ``subprocess.run(..., capture_output=True, text=True)`` gives it: a ``python`` command the
    shell would pass on unchanged (:func:`python_command`) by a child of tests/forkserver.py's server."""
    python = python_command(text)
    if python is not None:
        extra, args = python
        return forkserver.run(args, {**env, **extra}, cwd, timeout)
    return subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def python_command(text: str) -> tuple[dict[str, str], list[str]] | None:
    """``[NAME=VALUE ...] python ARGS`` that the shell would pass on as :func:`shlex.split` reads it (no ``$`` or
    backquote, no operator, glob, brace, tilde or backslash outside quotes) -> (environment, ARGS); else None."""
    quote = None
    for c in text:
        if c in "$`" or (quote is None and c in "|;&<>()*?[]{}~\\"):
            return None
        quote = (c if c in "'\"" else None) if quote is None else (None if c == quote else quote)
    env, words = split_env(text)
    return (env, words[1:]) if len(words) > 1 and words[0] in ("python", "python3") else None


# Builds the config from jaxllm.train's flags as jaxllm.train does (absl's global flags) and validates it.
_VALIDATE = """
import os, sys
from absl import app, flags
from jaxllm import cli, config
from jaxllm.resolve import resolve
cli.define_config_flag()
flags.DEFINE_string("workdir", "", "")
def main(argv):
    cfg = flags.FLAGS.config
    if not all(os.path.exists(p) for p in cfg.data.input.split(",")):  # a cluster path
        cfg.data.input = config.default_corpus()
    resolve(cfg, num_devices=int(argv[1]), backend="cuda")
app.run(main, argv=[sys.argv[0], *sys.argv[2:], sys.argv[1]])
"""


def check_launched_config(dry_run_stdout: str, sandbox: Path) -> subprocess.CompletedProcess:
    """Validates the config of the ``jaxllm.train`` command a dry run printed, for the number of
    devices its summary line gives, as ``jaxllm.train`` would on the cluster (a cluster path in
    ``data.input`` is replaced by one that exists here); returns the finished check (exit 0: valid)."""
    lines = dry_run_stdout.splitlines()
    devices = re.search(r" devices=(\d+)", next(ln for ln in lines if ln.startswith("# jaxllm launch:"))).group(1)
    words = shlex.split(next(ln for ln in lines if "-m jaxllm.train" in ln))
    argv = words[words.index("jaxllm.train") + 1:]
    return forkserver.run(["-c", _VALIDATE, devices, *argv], dict(os.environ), sandbox, timeout=120)
