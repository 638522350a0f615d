"""The package's version, written once: ``version`` in ``pyproject.toml``.

An installed package reads it from its distribution's metadata (``gpucache-loader``); a plain
checkout on ``PYTHONPATH``, never installed, reads the ``pyproject.toml`` beside the package.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "gpucache-loader"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
UNKNOWN = "0+unknown"  # neither installed nor a checkout (a copied folder): still a valid version


def read_version(distribution: str = DISTRIBUTION, pyproject: Path = PYPROJECT) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        pass
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return UNKNOWN
    # the [project] table's own `version = "..."` line (tomllib is Python 3.11+; 3.10 is supported)
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, flags=re.M | re.S)
    found = project and re.search(r'^version\s*=\s*"([^"]+)"', project[1], flags=re.M)
    return found[1] if found else UNKNOWN
