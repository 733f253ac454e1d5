"""The import graph of veloxpatch (and model_adapters): no cycle, every import
pointing down the declared layers (foundation, caches, api and auto,
calibration, eval, serve, cli), and the caches reaching nothing that knows models.

Built from the source with `ast`, as the project's checker
(shared/tools/import_cycles.py) sees it: every `import` counts, inside functions
too; `from X import name` imports X, and X.name when that is a module; a package
is its `__init__.py`. As Python runs it, importing `a.b.c` from outside package
`a.b` also runs `a.b`'s `__init__.py` (a module's own packages are already
running when it is). In a set of modules that import each other, a package
whose own submodules are in the set is set aside (`from . import x` in them
names the package); the set is a cycle when two modules or more remain.
"""

import ast
from collections import deque
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("veloxpatch", "model_adapters")
CACHES = "veloxpatch.caches"
CLI = "veloxpatch.cli"
# what the caches must not reach: they get dims, fingerprints and options from
# Options.bind, never from a model, a calibration run or the API over them
OFF_LIMITS_TO_CACHES = (
    "model_adapters",
    "veloxpatch.api",
    "veloxpatch.loading.models",
    "veloxpatch.loading.gguf",
    CLI,
)
CALIBRATION = "veloxpatch.calibration"


def within(name: str, prefix: str) -> bool:
    """Whether module `name` is `prefix` or inside package `prefix`."""
    return name == prefix or name.startswith(prefix + ".")


def ancestors(name: str) -> list[str]:
    """`a.b.c` -> ["a", "a.b"]: the packages Python imports before `a.b.c`."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file under `packages`."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts).removesuffix(".__init__")] = path
    return files


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name an import statement of the file names (absolute),
    `from X import a` giving X and X.a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                assert node.level <= len(parts), f"{path}:{node.lineno}: beyond top"
                head = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{head}.{base}" if base else head
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules importing it runs directly."""
    graph = {}
    for name, path in files.items():
        targets = set()
        for target in imported_names(path, name):
            if target in files:
                targets.add(target)
                # packages of the target that are not already running
                targets.update(p for p in ancestors(target) if p not in ancestors(name))
        targets.discard(name)
        graph[name] = targets
    return graph


def reachable(graph, start) -> dict[str, str | None]:
    """Breadth-first from `start` (a module or several): every module reached
    -> the one it was reached from (None for a start), shortest paths first."""
    starts = [start] if isinstance(start, str) else list(start)
    parent: dict[str, str | None] = dict.fromkeys(starts)
    todo = deque(starts)
    while todo:
        v = todo.popleft()
        for w in sorted(graph[v]):
            if w not in parent:
                parent[w] = v
                todo.append(w)
    return parent


def path_to(parent, end) -> list[str]:
    path = [end]
    while parent[path[-1]] is not None:
        path.append(parent[path[-1]])
    return path[::-1]


def cycles(graph) -> list[str]:
    """One line per import cycle: its modules, and a shortest loop through it."""
    reach = {v: reachable(graph, v) for v in graph}
    found, seen = [], set()
    for v in sorted(graph):
        if v in seen:
            continue
        component = {w for w in reach[v] if v in reach[w]}
        seen |= component
        # a package is set aside when its own submodules are in the cycle
        real = sorted(
            c for c in component if not any(within(o, c) for o in component - {c})
        )
        if len(real) < 2:
            continue
        start = real[0]
        inside = {u: graph[u] & component for u in component}
        loop = min(
            (path_to(reachable(inside, w), start) for w in inside[start]),
            key=len,
        )
        found.append(
            f"import cycle of {len(component)} modules: {', '.join(sorted(component))}"
            f"\n  e.g. {' -> '.join([start, *loop])}"
        )
    return found


def reaches_off_limits(graph, sources, off_limits) -> list[str]:
    """One line per off-limits module (or package) some source reaches: the
    shortest such import path."""
    parent = reachable(graph, sorted(sources))
    found = []
    for banned in off_limits:
        hits = [m for m in parent if within(m, banned)]
        if hits:
            path = min((path_to(parent, m) for m in hits), key=lambda p: (len(p), p))
            found.append(f"{path[0]} reaches {banned}: {' -> '.join(path)}")
    return found


def imports_into(graph, package) -> list[str]:
    """One line per module outside `package` that imports a module inside it."""
    return [
        f"{m} imports {', '.join(sorted(w for w in graph[m] if within(w, package)))}"
        for m in sorted(graph)
        if not within(m, package) and any(within(w, package) for w in graph[m])
    ]


@cache
def project_graph():
    return import_graph(module_files(ROOT))


def test_no_import_cycle():
    found = cycles(project_graph())
    assert not found, "\n".join(found)


def test_caches_reach_no_model_calibration_or_api_module():
    graph = project_graph()
    caches = [m for m in graph if within(m, CACHES)]
    assert len(caches) > 5, "no cache modules found"
    found = reaches_off_limits(graph, caches, [*OFF_LIMITS_TO_CACHES, CALIBRATION])
    assert not found, "\n".join(found)


def test_nothing_below_the_cli_imports_it():
    """The CLI is the top layer: the library, the server and the evaluation
    never import it (`python -m veloxpatch.cli` is its one entry point)."""
    graph = project_graph()
    assert any(within(m, CLI) for m in graph), "no cli modules found"
    found = imports_into(graph, CLI)
    assert not found, "\n".join(found)


def test_graph_sees_every_kind_of_import(tmp_path):
    """The checker itself: function-level and relative imports, submodules
    named by `from`, package __init__s, and a planted cycle it must report."""
    sources = {
        "pkg/__init__.py": "from . import sub\n",
        "pkg/sub/__init__.py": "from .leaf import X\n",
        "pkg/sub/leaf.py": "X = 1\n\n\ndef f():\n    from . import Y\n",
        "pkg/sub/other.py": "from . import leaf\nfrom .. import top\n",
        "pkg/top.py": "def f():\n    import pkg.sub.other\n",
        "pkg/a.py": "def f():\n    from .b import g\n",
        "pkg/b.py": "from pkg import a\n",
    }
    for rel, text in sources.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(module_files(tmp_path, ("pkg",)))
    assert graph == {
        "pkg": {"pkg.sub"},
        "pkg.sub": {"pkg.sub.leaf"},
        "pkg.sub.leaf": {"pkg.sub"},  # its own package: set aside in cycles
        "pkg.sub.other": {"pkg", "pkg.sub", "pkg.sub.leaf", "pkg.top"},
        "pkg.top": {"pkg.sub", "pkg.sub.other"},  # pkg.sub runs first
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg", "pkg.a"},
    }
    found = cycles(graph)
    assert len(found) == 2, found
    assert found[0].endswith("e.g. pkg.a -> pkg.b -> pkg.a")
    assert "pkg.sub.other, pkg.top\n" in found[1]
    assert reaches_off_limits(graph, ["pkg.b"], ["pkg.sub.leaf", "pkg.top"]) == [
        "pkg.b reaches pkg.sub.leaf: pkg.b -> pkg -> pkg.sub -> pkg.sub.leaf"
    ]
    assert imports_into(graph, "pkg.sub") == [
        "pkg imports pkg.sub",
        "pkg.top imports pkg.sub, pkg.sub.other",
    ]


# bottom to top: a module imports its own layer and those below, never above.
# calibration sits above the API: fitting a scorer patches the model and runs
# a probe through it; the caches read its files (caches/calibration_files.py)
LAYERS = (
    (
        "foundation",
        (
            "model_adapters",
            "veloxpatch.__init__",  # the package face alone: its names load lazily
            "veloxpatch.blas",
            "veloxpatch.checked_io",
            "veloxpatch.errors",
            "veloxpatch.loading",
            "veloxpatch.mlx_flags",
            "veloxpatch.mlx_lm_internals",
            "veloxpatch.option_text",
            "veloxpatch.prose",
            "veloxpatch.sharding",
        ),
    ),
    ("caches", (CACHES,)),
    (
        "api and auto",
        (
            "veloxpatch.api",
            "veloxpatch.attention",
            "veloxpatch.auto",
            "veloxpatch.context",
            "veloxpatch.memory",
            "veloxpatch.patcher",
            "veloxpatch.pricing",
            "veloxpatch.probe",
            "veloxpatch.registry",
        ),
    ),
    ("calibration", (CALIBRATION,)),
    ("eval", ("veloxpatch.eval",)),
    ("serve", ("veloxpatch.serve",)),
    ("cli", (CLI,)),
)


def layer_of(module: str) -> int | None:
    """The index of the layer holding `module` (the longest prefix wins)."""
    if module == "veloxpatch":
        module = "veloxpatch.__init__"
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if within(module, prefix) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def test_every_import_points_down_the_layers():
    graph = project_graph()
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules on no layer: {unplaced}"
    up = sorted(
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {w} ({LAYERS[layer_of(w)][0]})"
        for m in graph
        for w in graph[m]
        if layer_of(w) > layer_of(m)
    )
    assert not up, f"{len(up)} imports run up a layer:\n" + "\n".join(up)
