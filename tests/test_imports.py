"""The package's structure: the layers of docs/architecture.md (a module imports only its own layer and
those below), no import cycle among its modules and packages, no library module importing a command-line
tool, no mesh axis or CPU-only path in the model, `config` importing nothing of the library (checked
on the source: module-level imports, as Python runs them at import time; for the layers, every import), and
no package at the checkout's top that another installed distribution's import name would resolve to."""

import ast
from importlib.metadata import packages_distributions
from pathlib import Path

from jaxllm import config

ROOT = Path(__file__).resolve().parents[1] / "jaxllm"
# the command-line tools (python -m jaxllm.NAME): they may import the library, never the reverse
TOOLS = {"jaxllm.train", "jaxllm.bench", "jaxllm.plan", "jaxllm.tune", "jaxllm.convert", "jaxllm.generate",
         "jaxllm.plot", "jaxllm.cli", "jaxllm.harness", "jaxllm.default_config", "jaxllm.prepare",
         "jaxllm.inspect_data"}
# docs/architecture.md's tree, lowest layer first: each entry a module or a package (all its modules);
# "jaxllm" is the package's own __init__ only
LAYERS = (
    ("jaxllm.errors", "jaxllm.config"),
    ("jaxllm.platform",),
    ("jaxllm.data",),
    ("jaxllm.model",),
    ("jaxllm.families",),
    ("jaxllm.parallel",),
    ("jaxllm.resolve",),
    ("jaxllm.runtime",),
    ("jaxllm.analysis",),
    ("jaxllm.formats",),
    ("jaxllm.api", "jaxllm"),
    tuple(sorted(TOOLS)),
)
# how the tree in docs/architecture.md names each layer, in the same order
TREE_NAMES = ("config.py", "platform/", "data/", "model/", "families/", "parallel/", "resolve.py", "runtime/",
              "analysis/", "formats/", "api.py", "train.py")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("jaxllm",) + path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path], nested: bool = False) -> set[str]:
    """The jaxllm modules ``name`` imports: statements at module level, also under a module-level ``if``
    (``TYPE_CHECKING`` included: a cycle for the type checker is one for the reader) or ``try``; with
    ``nested``, also those inside functions and classes.  ``from P import n`` counts as P.n where that is a
    module, else as P."""
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

    tree = ast.parse(path.read_text())
    visit([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if nested else tree.body)
    return {m for m in found if m in mods and m != name}


def _graph(nested: bool = False) -> dict[str, set[str]]:
    """module -> the jaxllm modules it imports (see :func:`_imports`)."""
    mods = _modules()
    return {name: _imports(name, path, mods, nested) for name, path in mods.items()}


def _with_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with the imports Python adds: importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``
    first, so a package whose ``__init__`` imports a module that imports the package is a cycle."""
    def packages(m):
        parts = m.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}
    return {m: (deps | {p for n in deps for p in packages(n) if p in graph}) - {m} for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def _layer(module: str) -> int:
    """The index in :data:`LAYERS` of the layer holding ``module``."""
    for i, layer in enumerate(LAYERS):
        if any(module == e or (e != "jaxllm" and module.startswith(e + ".")) for e in layer):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS (docs/architecture.md's tree): place it there")


def _against_layers(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` from a module to one of a higher layer, as ``"importer -> imported"``."""
    return sorted(f"{m} -> {n}" for m, deps in graph.items() for n in deps if _layer(n) > _layer(m))


def test_graph_is_seen():
    """The walk finds the edges it should (so the checks below cannot pass on an empty graph)."""
    graph = _graph()
    assert "jaxllm.model.gpt" in graph["jaxllm.resolve"] and "jaxllm.runtime.run" in graph["jaxllm.train"]
    assert "jaxllm.parallel.sharding" in graph["jaxllm.runtime.run"]


def test_no_import_cycle():
    """Neither among modules nor through a package's ``__init__`` (Python runs it before any of its modules)."""
    cycle = _cycle(_with_packages(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_check_sees_a_package_cycle():
    """A package whose ``__init__`` imports one of its modules that imports another of them (the package
    first) is a cycle: ``jaxllm.data`` importing ``loader``, which imports ``jaxllm.data.blend``, was one."""
    graph = {"jaxllm": set(), "jaxllm.pkg": set(), "jaxllm.pkg.a": {"jaxllm.pkg.b"}, "jaxllm.pkg.b": set()}
    assert _cycle(_with_packages(graph)) is None
    graph["jaxllm.pkg"] = {"jaxllm.pkg.a"}
    assert _cycle(_with_packages(graph)) == ["jaxllm.pkg", "jaxllm.pkg.a", "jaxllm.pkg"]


def test_layers_as_documented():
    """Every module is in a layer of :data:`LAYERS` and imports (anywhere in it) only its own and lower ones;
    the tree in docs/architecture.md lists the layers in that order."""
    assert not _against_layers(_graph(nested=True))
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    tree = text[text.index("## The tree"):].split("```")[1]
    positions = [tree.find(name) for name in TREE_NAMES]
    assert -1 not in positions and positions == sorted(positions), dict(zip(TREE_NAMES, positions))


def test_layer_check_sees_a_planted_import():
    """The check fails on one import against the order: the model importing the runtime."""
    graph = _graph(nested=True)
    graph["jaxllm.model.gpt"] = graph["jaxllm.model.gpt"] | {"jaxllm.runtime.run"}
    assert _against_layers(graph) == ["jaxllm.model.gpt -> jaxllm.runtime.run"]


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


def test_no_top_level_package_shadows_an_installed_distribution():
    """``python -m pytest`` (and any script run from the checkout) puts the checkout first on ``sys.path``: a
    folder there named as another distribution's package is what ``import NAME`` finds instead. A folder
    ``kernels/`` did that to Hugging Face's ``kernels`` (transformers 5 imports it): every transformers model
    import in the suite failed (CI, 2026-12-03)."""
    ours = {d.name for d in ROOT.parent.iterdir() if (d / "__init__.py").is_file()}
    assert ours >= {"jaxllm", "jaxllm_kernels"}, ours
    shadowed = {name: owners for name, owners in packages_distributions().items()
                if name in ours and set(owners) - {"jaxllm"}}
    assert not shadowed, shadowed
