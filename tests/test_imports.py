"""The package's structure: no import cycle among its modules, no library module importing a
command-line tool, no mesh axis or CPU-only path in the model, and `config` importing nothing of
the library (checked on the source: module-level imports, as Python runs them at import time)."""

import ast
from pathlib import Path

from jaxllm import config

ROOT = Path(__file__).resolve().parents[1] / "jaxllm"
# the command-line tools (python -m jaxllm.NAME): they may import the library, never the reverse
TOOLS = {"jaxllm.train", "jaxllm.bench", "jaxllm.plan", "jaxllm.tune", "jaxllm.convert", "jaxllm.generate",
         "jaxllm.plot", "jaxllm.cli", "jaxllm.harness", "jaxllm.default_config", "jaxllm.data.prepare",
         "jaxllm.data.inspect"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("jaxllm",) + path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The jaxllm modules ``name`` imports: statements at module level, also under a module-level ``if``
    (``TYPE_CHECKING`` included: a cycle for the type checker is one for the reader) or ``try``;
    ``from P import n`` counts as P.n where that is a module, else as P."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in mods and m != name}


def _graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_graph_is_seen():
    """The walk finds the edges it should (so the checks below cannot pass on an empty graph)."""
    graph = _graph()
    assert "jaxllm.model.gpt" in graph["jaxllm.resolve"] and "jaxllm.runtime.run" in graph["jaxllm.train"]
    assert "jaxllm.parallel.sharding" in graph["jaxllm.runtime.run"]


def test_no_import_cycle():
    graph = _graph()
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_library_imports_no_tool():
    bad = {m: sorted(n for n in deps if n in TOOLS) for m, deps in _graph().items() if m not in TOOLS}
    assert not {m: t for m, t in bad.items() if t}


def test_config_imports_nothing_of_the_library():
    assert _graph()["jaxllm.config"] <= {"jaxllm.errors"}


def test_model_names_no_mesh_axis_and_no_backend():
    """The model knows a layout only through ``Ops`` and logical axis names: no mesh axis, no
    ``jax.sharding``, no CPU-only path (those are chosen in jaxllm.runtime.cpu)."""
    mesh_axes = config.MESH_AXES
    for path in (ROOT / "model").glob("*.py"):
        tree = ast.parse(path.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & set(mesh_axes), (path.name, strings & set(mesh_axes))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"sharding", "shard_map", "host_threads"}, (path.name, names & {"sharding", "shard_map"})
    below = {m: deps for m, deps in _graph().items() if m.startswith("jaxllm.model")}
    assert not {m: d for m, d in below.items() if any(n.startswith(("jaxllm.parallel", "jaxllm.runtime")) for n in d)}
