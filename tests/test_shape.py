"""The codebase's bars, checked on the files with ``ast`` (nothing is imported): few private
functions with long parameter lists, and few private modules at the package's top.

Public functions and the methods of public classes are excepted from the first bar: their
parameters are the documented API. Public is a name in the ``__all__`` of ``gpucache`` or of a
public subpackage, found where it is defined by following the ``from ... import`` that re-exports
it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import ROOT, module_names

#: The packages whose ``__all__`` is the public surface.
PUBLIC_PACKAGES = (
    "gpucache",
    "gpucache.transforms",
    "gpucache.ultralytics",
    "gpucache.testing",
    "gpucache.bench",
)
MAX_LONG_PRIVATE = 4  # private functions taking 8 parameters or more
LONG = 8
MAX_TOP_PRIVATE = 8  # private modules (`_x.py`, `_x/`) directly under gpucache/


def _tree(mods: dict[str, Path], module: str) -> ast.Module:
    return ast.parse(mods[module].read_text(), str(mods[module]))


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return []


def definition(mods: dict[str, Path], module: str, name: str) -> tuple[str, str] | None:
    """``(module, name)`` where ``name``, as seen in ``module``, is defined by a ``def`` or a
    ``class``; None for a module, a constant or a name from outside gpucache."""
    seen = set()
    while (module, name) not in seen and module in mods:
        seen.add((module, name))
        tree = _tree(mods, module)
        for node in tree.body:
            defines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            if isinstance(node, defines) and node.name == name:
                return module, name
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                alias = next((a for a in node.names if (a.asname or a.name) == name), None)
                if alias is not None:
                    module, name = _resolve(module, mods[module], node), alias.name
                    break
        else:
            return None
    return None


def public_definitions(root: Path = ROOT) -> set[tuple[str, str]]:
    mods = module_names(root)
    out = set()
    for package in PUBLIC_PACKAGES:
        if package in mods:
            for name in _all(_tree(mods, package)):
                found = definition(mods, package, name)
                if found:
                    out.add(found)
    return out


def _count(args: ast.arguments, method: bool) -> int:
    n = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    n += bool(args.vararg) + bool(args.kwarg)
    first = (args.posonlyargs + args.args)[:1]
    return n - (method and bool(first) and first[0].arg in ("self", "cls"))


def long_private_functions(root: Path = ROOT) -> list[str]:
    """``module:line qualname (n parameters)`` for every function outside the public surface
    taking ``LONG`` parameters or more (positional, keyword-only, ``*args``, ``**kwargs``;
    ``self`` and ``cls`` not counted), nested functions included."""
    public = public_definitions(root)
    mods = module_names(root)
    out = []

    def walk(node: ast.AST, module: str, qual: str, cls: str | None, excepted: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                inside = f"{qual}{child.name}"
                walk(child, module, inside + ".", child.name, (module, inside) in public)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{qual}{child.name}"
                n = _count(child.args, method=cls is not None)
                if n >= LONG and not excepted and (module, name) not in public:
                    out.append(f"{module}:{child.lineno} {name} ({n} parameters)")
                walk(child, module, name + ".<locals>.", None, False)

    for module in sorted(mods):
        walk(_tree(mods, module), module, "", None, False)
    return out


def top_private_modules(root: Path = ROOT) -> list[str]:
    return sorted(
        p.name
        for p in root.iterdir()
        if p.name.startswith("_")
        and p.name not in ("__init__.py", "__main__.py", "__pycache__")
        and (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file()))
    )


def test_few_private_functions_take_eight_parameters_or_more():
    long = long_private_functions()
    assert len(long) <= MAX_LONG_PRIVATE, (
        f"{len(long)} private functions take {LONG} parameters or more (at most "
        f"{MAX_LONG_PRIVATE}): pass an options value (a dataclass of the settings that travel "
        "together) or split the function where its parameters fall in groups:\n" + "\n".join(long)
    )


def test_few_private_modules_sit_at_the_package_s_top():
    top = top_private_modules()
    assert len(top) <= MAX_TOP_PRIVATE, (
        f"{len(top)} private modules directly under gpucache/ (at most {MAX_TOP_PRIVATE}): "
        f"move a helper into the subpackage that uses it, or leaf helpers into gpucache/base/: "
        f"{top}"
    )


def test_the_bars_follow_re_exports_and_count_every_kind_of_parameter(tmp_path):
    pkg = tmp_path / "gpucache"
    (pkg / "_impl").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from ._impl import Public as Public\nfrom ._impl._f import shown as api\n"
        "__all__ = ['Public', 'api']\n"
    )
    (pkg / "_impl" / "__init__.py").write_text("from ._f import Public\n")
    eight = "a, b, /, c, *d, e, f, g, **h"  # 2 positional-only, 1 positional, *d, 3, **h
    (pkg / "_impl" / "_f.py").write_text(
        f"class Public:\n    def __init__(self, {eight}): pass\n"
        f"class _Hidden:\n    def method(self, {eight}): pass\n"
        f"    def seven(self, a, b, c, d, e, f, g): pass\n"
        f"def shown({eight}): pass\n"
        f"def hidden({eight}):\n    def inner({eight}): pass\n"
    )
    (pkg / "_other.py").write_text("")
    (pkg / "__main__.py").write_text("")
    assert public_definitions(pkg) == {
        ("gpucache._impl._f", "Public"),
        ("gpucache._impl._f", "shown"),
    }
    assert long_private_functions(pkg) == [
        "gpucache._impl._f:4 _Hidden.method (8 parameters)",
        "gpucache._impl._f:7 hidden (8 parameters)",
        "gpucache._impl._f:8 hidden.<locals>.inner (8 parameters)",
    ]
    assert top_private_modules(pkg) == ["_impl", "_other.py"]
