"""The command line as a user meets it: the help pages (in-process), and run as a subprocess the
build's notice about skipped files, verify's libjpeg notes, and bench's plan before anything is
timed (their words go through the logging the script sets up)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from gpucache.testing import make_jpeg_folder, natural_image

ROOT = Path(__file__).resolve().parents[1]


def _gpucache(
    *args: str, cwd: Path, env: dict | None = None, merge: bool = False
) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full.get("PYTHONPATH")) if p)
    main = "import sys; from gpucache.cli import main; sys.exit(main())"  # the `gpucache` script
    return subprocess.run(
        [sys.executable, "-c", main, *args],
        cwd=cwd,
        env=full,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        timeout=300,
    )


def _damaged_jpeg(seed: int) -> bytes:
    """A JPEG whose scan has a stray restart marker: libjpeg decodes it anyway, with a warning."""
    buf = io.BytesIO()
    Image.fromarray(natural_image(96, 64, seed=seed)).save(buf, "JPEG", quality=90)
    b = bytearray(buf.getvalue())
    b[len(b) // 2 : len(b) // 2 + 2] = b"\xff\xd3"
    return bytes(b)


@pytest.fixture(scope="module")
def odd_folder(tmp_path_factory) -> Path:
    """An ImageFolder with one damaged (decodable) JPEG and one truncated file."""
    root = make_jpeg_folder(tmp_path_factory.mktemp("cli") / "imgs", 6, classes=("a", "b"), seed=4)
    (root / "a" / "damaged.jpg").write_bytes(_damaged_jpeg(1))
    (root / "b" / "truncated.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a whole JPEG")
    return root


def _help(capsys, *args: str) -> str:
    """What ``gpucache ARGS --help`` prints (in-process: argparse prints and exits 0)."""
    from gpucache.cli import main

    with pytest.raises(SystemExit) as stop:
        main([*args, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_command_in_plain_text(capsys):
    top = _help(capsys)
    assert "`" not in top  # no reStructuredText markup in a terminal
    for command in ("build", "info", "verify", "bench", "cache"):
        assert re.search(rf"^\s+{command}\s+\S", top, re.M), (command, top)
    build = _help(capsys, "build")
    for option in ("--on-error", "--hf-split", "--hf-image-column", "--threads", "--output"):
        block = build[build.index(option) :].split("\n  -", 1)[0]  # the option's help entry
        assert len(block.split()) > 3, f"{option} has no help: {block!r}"


def test_build_and_verify_name_every_sample_they_report(odd_folder, tmp_path):
    store = tmp_path / "odd.gpucache"
    built = _gpucache("build", str(odd_folder), "-o", str(store), cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert "cache.report" not in built.stderr.replace("cache.report in Python", "")
    assert "gpucache info --skipped" in built.stderr and "truncated.jpg" in built.stderr
    checked = _gpucache("verify", str(store), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    lines = checked.stderr.strip().splitlines()
    assert lines, "the damaged sample is named"
    for line in lines:  # each libjpeg note with its store, sample index and path
        assert re.match(
            rf"{re.escape(str(store))}: sample \d+ \(.*damaged\.jpg\): libjpeg: "
            r"Corrupt JPEG data",
            line,
        ), line
    assert "1 with corrupt data that libjpeg decoded anyway" in checked.stdout


def test_bench_prints_its_plan_and_estimate_before_timing(tmp_path):
    run = _gpucache(
        "bench",
        "--synthetic",
        "8",
        "--contenders",
        "pil",
        "--epochs",
        "1",
        "--workers",
        "0",
        "--no-memory",
        "--batch-size",
        "4",
        cwd=tmp_path,
        env={"TMPDIR": str(tmp_path)},
        merge=True,
    )  # synthetic photos kept there
    assert run.returncode == 0, run.stdout
    out = run.stdout
    # what runs, in numbers (not its wording): 1 contender, 1 warm-up + 1 measured epoch of 8
    # images, batch 4, 0 workers
    plan = re.search(r"^plan: .*$", out, re.M)
    assert plan and "pil" in plan[0], out
    assert re.findall(r"\d+", plan[0]) == ["1", "1", "1", "8", "4", "0"], plan[0]
    assert re.search(r"estimated time: about \d+ (s|min)", out)
    assert plan.start() < out.index("estimated time") < out.index("warm-up pil")


def _commands(parser) -> dict[str, object]:
    """``{"build": parser, ..., "cache list": parser}``: every command's own parser."""
    import argparse

    out: dict[str, object] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = _commands(sub)
                out.update({f"{name} {k}": v for k, v in inner.items()} if inner else {name: sub})
    return out


def test_the_cli_reference_synopsis_lists_every_option_of_every_command():
    from gpucache.cli import make_parser

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    block = page.split("```\n", 2)[1]  # the page's first code block: the synopsis
    documented: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        text = line.split("  #")[0]
        m = re.match(r"gpucache (cache \w+|\w+)", text)
        if m:
            current = m[1]
        assert current is not None, line
        documented.setdefault(current, set()).update(re.findall(r"(?<![\w-])--?[a-z][\w-]*", text))
    commands = _commands(make_parser())
    assert set(documented) == set(commands)
    for name, sub in commands.items():
        options = [a.option_strings for a in sub._actions if a.option_strings and a.dest != "help"]
        missing = [o[-1] for o in options if not documented[name] & set(o)]
        assert not missing, f"gpucache {name}: the synopsis lacks {missing}"
        known = {o for strings in options for o in strings}
        assert documented[name] <= known, f"gpucache {name}: no such {documented[name] - known}"


# ------------------------------------------------------- the words a newcomer meets first, in-process
def test_on_error_raise_on_the_command_line_names_the_command_lines_option(
    odd_folder, tmp_path, capsys
):
    from gpucache.cli import main

    out = tmp_path / "x.gpucache"
    assert main(["build", str(odd_folder), "-o", str(out), "--on-error", "raise"]) == 1
    err = capsys.readouterr().err
    assert "--on-error skip" in err and "on_error=" not in err, err
    assert "truncated.jpg" in err and not out.exists()  # the report still names the file


def test_a_store_file_or_a_flat_folder_given_as_an_imagefolder_says_what_takes_it(tmp_path, capsys):
    from gpucache import JpegCache
    from gpucache.cli import main
    from gpucache.testing import make_jpeg_bytes

    flat = tmp_path / "flat"
    flat.mkdir()
    for k in range(3):
        (flat / f"{k}.jpg").write_bytes(make_jpeg_bytes(32, 24, seed=k))
    with pytest.raises(FileNotFoundError, match="no class folders") as info:
        JpegCache.from_folder(flat, progress=False)
    assert "JpegCache.from_files" in str(info.value) and "--csv" in str(info.value)
    store = tmp_path / "x.gpucache"
    JpegCache.from_files(sorted(flat.glob("*.jpg")), progress=False).save(store)  # the hint
    with pytest.raises(NotADirectoryError, match=r"store file.*JpegCache\.open"):
        JpegCache.from_folder(store, progress=False)
    assert main(["build", str(store), "-o", str(tmp_path / "y.gpucache")]) == 2
    assert f"gpucache info {store}" in capsys.readouterr().err
    with pytest.raises(NotADirectoryError, match="0.jpg.*not a folder"):  # not a store
        JpegCache.from_folder(flat / "0.jpg", progress=False)


def test_an_unlabeled_store_says_unlabeled_and_counts_agree_in_number(tmp_path, capsys):
    from gpucache import JpegCache
    from gpucache.cli import main
    from gpucache.testing import make_jpeg_bytes

    paths = []
    for k in range(2):
        paths.append(tmp_path / f"{k}.jpg")
        paths[-1].write_bytes(make_jpeg_bytes(32, 24, seed=k))
    unlabeled = JpegCache.from_files(paths, progress=False)
    assert "unlabeled" in repr(unlabeled) and "0 classes" not in repr(unlabeled)
    assert "1 class," in repr(JpegCache.from_files(paths, [0, 0], progress=False))
    (tmp_path / "list.csv").write_text("0.jpg\n1.jpg\n")  # paths alone: no labels
    out = tmp_path / "u.gpucache"
    assert main(["build", "--csv", str(tmp_path / "list.csv"), "-o", str(out)]) == 0
    assert "unlabeled" in capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    assert "unlabeled" in capsys.readouterr().out
    cdir = tmp_path / "node"
    kept = JpegCache.from_files(paths[:1], cache_dir=cdir, progress=False)  # one file, one store
    assert main(["cache", "list", "--dir", str(cdir)]) == 0
    listed = capsys.readouterr().out
    assert f"{cdir}: 1 store, " in listed and f"1 file, first {paths[0]}" in listed, listed
    del kept
