"""GpuCachedLoader documents every argument it takes (the API page is made from docstrings)."""

import inspect

from gpucache import GpuCachedLoader


def test_every_loader_argument_is_documented_once():
    params = [n for n in inspect.signature(GpuCachedLoader.__init__).parameters if n != "self"]
    doc = inspect.getdoc(GpuCachedLoader) or ""
    args = doc.split("Args:", 1)[1]
    entries = [
        line.split(":", 1)[0].strip()
        for line in args.splitlines()
        if line.startswith("    ") and not line.startswith("        ") and ":" in line
    ]
    assert sorted(entries) == sorted(params), set(params) ^ set(entries)
