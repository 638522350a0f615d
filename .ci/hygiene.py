"""The file checks of the pre-commit configuration that a regular expression cannot make.

    python .ci/hygiene.py large FILE...   # none over 500 KiB (a result chart is ~100 KiB)
    python .ci/hygiene.py yaml FILE...    # each parses (PyYAML, from mkdocs); tags taken as given
    python .ci/hygiene.py toml FILE...    # each parses (tomllib, Python 3.11+)

Exit status 1, with one line per file naming it and why, when any fails. Needs no network and
nothing beyond the test environment, so the hooks run where pre-commit cannot fetch its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_BYTES = 500 * 1024


def large(path: Path) -> str | None:
    size = path.stat().st_size
    return f"{size / 1024:,.0f} KiB, over {MAX_BYTES // 1024} KiB" if size > MAX_BYTES else None


def yaml_error(path: Path) -> str | None:
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml's !!python/name: tags are mkdocs' to resolve
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    try:
        list(yaml.load_all(path.read_text(encoding="utf-8"), Loader=Loader))
    except yaml.YAMLError as err:
        return f"not valid YAML: {err}"
    return None


def toml_error(path: Path) -> str | None:
    try:
        import tomllib
    except ImportError:  # Python 3.10: no parser in the standard library
        return None
    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        return f"not valid TOML: {err}"
    return None


CHECKS = {"large": large, "yaml": yaml_error, "toml": toml_error}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in CHECKS:
        print(f"usage: hygiene.py {{{','.join(CHECKS)}}} FILE...", file=sys.stderr)
        return 2
    check, failed = CHECKS[argv[0]], 0
    for name in argv[1:]:
        why = check(Path(name))
        if why:
            print(f"{name}: {why}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
