"""Every command in README.md and docs/*.md runs (see tests/doc_commands.py for how)."""

import time

import pytest
from doc_commands import CI, DOCS, ROOT, check_launched_config, documented, make_sandbox, run, submission

pytestmark = pytest.mark.slow


def test_docs_show_commands_and_ci_does_the_install_ones():
    commands = [c for path in DOCS for c in documented(path)]
    assert len(commands) > 20 and any(c.e2e for c in commands)
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && ruff check . && python -m pytest\n' in ci  # the README's test command
    for c in commands:
        if c.text.startswith(CI):
            assert c.text in ("python3 -m venv .venv", ". .venv/bin/activate", "pip install -e .",
                              'pip install -e ".[test]"', "ruff check .", "python -m pytest"), c
            assert c.text.split(" .")[0].split(' "')[0] in ci, c


def test_documented_commands_run(tmp_path):
    """In document order, README first, in one sandbox (a command may use an earlier one's
    run directory); a command shown twice runs once."""
    box, done = make_sandbox(tmp_path / "repo"), set()
    for path in DOCS:
        for command in documented(path):
            if command.e2e or command.text.startswith(CI) or command.text in done:
                continue  # tests/test_e2e.py; .ci/run; already run
            done.add(command.text)
            start = time.perf_counter()
            r = run(command, box)
            print(f"{time.perf_counter() - start:6.1f} s  {command.where}  {command.text[:90]}")  # shown with -s
            assert r.returncode == 0, f"{command.where}: {command.text}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
            if submission(command.text, box):  # a dry run checks the knobs; this, the config on the job's devices
                v = check_launched_config(r.stdout, box)
                assert v.returncode == 0, f"{command.where}: {command.text}\n{v.stderr[-2000:]}"
