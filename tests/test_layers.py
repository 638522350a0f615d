"""The package's layers (docs/design.md, "Shape"): a module imports from its own layer and the layers
below it, never above, imports inside functions included; so no cycle runs between layers.

Every module of ``gpucache/`` is parsed with ``ast`` (nothing is imported), each ``import`` and
``from ... import`` anywhere in it resolved (relative ones too; ``from .. import x`` to the module
``x`` when there is one), and the two modules' layers compared. The same imports make the
module graph, which has no cycle between modules either, within a layer or across.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "gpucache"

#: Top to bottom. A module belongs to the first entry whose name is it or a package above it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("gpucache.cli", "gpucache.bench", "gpucache.__main__")),  # the commands (and
    # `python -m gpucache`); the benchmark users run
    ("api", ("gpucache",)),  # the package's __init__: it wires the public names, nothing else
    # imported by users who train with Lightning or Ultralytics (each needs its extra)
    ("integrations", ("gpucache.lightning", "gpucache.ultralytics")),
    # synthetic photos for tests and benchmarks: public (gpucache.testing, imported on first use),
    # used by nothing in the library below
    ("testing", ("gpucache.testing",)),
    ("node", ("gpucache.node",)),
    # the node shares (gpucache/shares/) sit one module a layer: the epoch order over them here,
    # the build side with ingest, their record with the store, the partition in the base
    ("loader", ("gpucache.loader", "gpucache._dataset", "gpucache.shares._order")),
    # the node cache folder's checks and its build lock, which the loader's decoded tier uses
    # too (built once per node beside the store, docs/guides/decoded.md)
    ("node files", ("gpucache.node._dir", "gpucache.node._lock")),
    ("decode", ("gpucache.decode",)),
    ("transforms", ("gpucache.transforms",)),
    ("ingest", ("gpucache.ingest", "gpucache.shares._select", "gpucache.shares._tar")),
    ("store", ("gpucache.store", "gpucache.shares._record")),
    # leaf helpers any layer may use; they import nothing of gpucache's: distributed ranks, the
    # compiled part's binding, the progress bar, every error raised to users, the usable cores,
    # the ordered thread map, files opened as this user's own, the version, a plan's columns,
    # the node shares' partition function
    (
        "base",
        (
            "gpucache.base",
            "gpucache._native",
            "gpucache._errors",
            "gpucache._version",
            "gpucache.shares",
        ),
    ),
]


def module_names(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: place it in tests/test_layers.py LAYERS"
    return best


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(imported gpucache module, line)`` for every import statement in the file."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # `from pkg import mod` depends on mod, not on all of pkg
                sub = f"{target}.{a.name}"
                out.append((sub if sub in known else target, node.lineno))
    return [(m, line) for m, line in out if m == "gpucache" or m.startswith("gpucache.")]


def violations(root: Path = ROOT) -> list[str]:
    mods = module_names(root)
    known = set(mods)
    bad, edges = [], set()
    for mod, path in sorted(mods.items()):
        here = layer_of(mod)
        for target, line in imports(mod, path, known):
            while target not in known and "." in target:  # a name inside a module
                target = target.rsplit(".", 1)[0]
            there = layer_of(target)
            if there != here:
                edges.add((here, there))
            if there < here:
                bad.append(
                    f"{path.relative_to(root.parent)}:{line}: {mod} ({LAYERS[here][0]}) "
                    f"imports {target} ({LAYERS[there][0]}), a higher layer"
                )
    # no cycle between layers (implied by the order above; checked on its own all the same)
    graph: dict[int, set[int]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state: dict[int, int] = {}

    def visit(n: int, trail: list[int]) -> None:
        state[n] = 1
        for m in graph.get(n, ()):
            if state.get(m) == 1:
                cycle = trail[trail.index(m) :] + [m] if m in trail else [n, m]
                bad.append("cycle between layers: " + " -> ".join(LAYERS[i][0] for i in cycle))
            elif m not in state:
                visit(m, trail + [m])
        state[n] = 2

    for n in list(graph):
        if n not in state:
            visit(n, [n])
    return list(dict.fromkeys(bad))


def module_cycles(root: Path = ROOT) -> list[str]:
    """One entry per strongly connected component of more than one module in the import graph
    (every import, those inside functions included): its modules, then the imports that close it."""
    mods = module_names(root)
    known = set(mods)
    graph: dict[str, dict[str, list[int]]] = {mod: {} for mod in mods}
    for mod, path in mods.items():
        for target, line in imports(mod, path, known):
            while target not in known and "." in target:  # a name inside a module
                target = target.rsplit(".", 1)[0]
            if target == mod:
                continue
            lines = graph[mod].setdefault(target, [])
            if line not in lines:  # `from x import a, b`: one line
                lines.append(line)
    # Tarjan's algorithm, iterative (the graph has a few hundred nodes; no recursion limit)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    out = []
    for comp in sorted(components):
        lines = [
            f"  {mods[a].relative_to(root.parent)}:{line}: {a} imports {b}"
            for a in comp
            for b in sorted(graph[a])
            if b in comp
            for line in sorted(graph[a][b])
        ]
        out.append(f"import cycle between {', '.join(comp)}:\n" + "\n".join(lines))
    return out


def test_every_import_goes_to_the_same_or_a_lower_layer():
    bad = violations()
    assert not bad, "\n".join(bad)


def test_every_module_has_a_layer_and_the_base_imports_nothing_of_gpucache():
    mods = module_names(ROOT)
    base = len(LAYERS) - 1
    for mod, path in mods.items():
        layer_of(mod)
        if layer_of(mod) == base:
            assert not imports(mod, path, set(mods)), f"{mod} is a leaf helper"


def test_no_import_cycle_runs_between_modules():
    """Within a layer too: a cycle (even one closed by an import inside a function) means the
    modules cannot be read, tested or imported one without the other. Break it by moving what
    both need into a module below them, or by passing the value in instead of importing it."""
    cycles = module_cycles()
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(cycles)


def test_the_cycle_check_sees_a_cycle_closed_inside_a_function(tmp_path):
    pkg = tmp_path / "gpucache"
    (pkg / "store").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "store" / "__init__.py"):
        init.write_text("")
    (pkg / "store" / "_a.py").write_text("from . import _b\n")
    (pkg / "store" / "_b.py").write_text("from ._c import x\n")
    (pkg / "store" / "_c.py").write_text(
        "x = 1\n\n\ndef f():\n    from gpucache.store._a import y\n"
    )
    (pkg / "store" / "_d.py").write_text("from . import _a\n")  # into the cycle, not part of it
    (cycle,) = module_cycles(pkg)
    head, *lines = cycle.splitlines()
    assert head == (
        "import cycle between gpucache.store._a, gpucache.store._b, gpucache.store._c:"
    ), cycle
    assert "gpucache/store/_c.py:5: gpucache.store._c imports gpucache.store._a" in cycle, cycle
    assert len(lines) == 3 and "_d" not in cycle, cycle
    (pkg / "store" / "_c.py").write_text("x = 1\n")
    assert module_cycles(pkg) == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "gpucache"
    for sub in ("store", "node"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "node" / "_cache.py").write_text("from ..store import _store\n")
    (pkg / "store" / "_store.py").write_text("def f():\n    from ..node import _cache\n")
    bad = violations(pkg)
    assert any("gpucache.store._store (store) imports gpucache.node._cache" in b for b in bad), bad
    assert any(b.startswith("cycle between layers") for b in bad), bad
