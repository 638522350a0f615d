"""The suite stands alone: no test reads data beside the checkout (the photos a development
machine keeps in ../shared); tests make their own data (tests/conftest.py)."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTSIDE = ("../shared", "shared/data", "parents[2]", "hymenoptera", "/work/")


def test_no_test_reads_outside_the_repository():
    found = []
    for path in sorted(HERE.rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [
                f"{path.relative_to(HERE)}:{n}: {line.strip()}"
                for needle in OUTSIDE
                if needle in line
            ]
    assert not found, "tests reach outside the repository:\n" + "\n".join(found)
