"""Local WebDataset shard patterns, as WebDataset writes them: brace ranges and alternatives and
globs expand on disk as they do for URLs, through the Python builder and ``gpucache build``; a
pattern that matches nothing is an error naming it. Real tar shards written here."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from gpucache import JpegCache
from gpucache.cli import main as cli_main
from gpucache.testing import make_jpeg_bytes


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, list[bytes]]:
    """shards/train-000.tar .. train-002.tar (two JPEGs each, labels 0..5) and val-000.tar."""
    folder = tmp_path_factory.mktemp("wds") / "shards"
    folder.mkdir()
    blobs = [make_jpeg_bytes(40 + 8 * k, 32, seed=k) for k in range(8)]
    for name, ks in (("train-000", (0, 1)), ("train-001", (2, 3)), ("train-002", (4, 5))):
        _write(folder / f"{name}.tar", [(f"s{k}", blobs[k], k) for k in ks])
    _write(folder / "val-000.tar", [("v6", blobs[6], 6), ("v7", blobs[7], 7)])
    return folder, blobs


def _write(path: Path, samples: list[tuple[str, bytes, int]]) -> None:
    with tarfile.open(path, "w") as tf:
        for key, data, label in samples:
            for ext, body in (("jpg", data), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(body)
                tf.addfile(info, io.BytesIO(body))


def _stored(cache: JpegCache) -> list[bytes]:
    return [bytes(cache[i]) for i in range(len(cache))]


def test_brace_ranges_alternatives_and_globs_expand_for_local_paths(shards):
    folder, blobs = shards
    for pattern, want in (
        (f"{folder}/train-{{000..001}}.tar", [0, 1, 2, 3]),
        (f"{folder}/train-{{002..000}}.tar", [4, 5, 2, 3, 0, 1]),  # a range counts down too
        (f"{folder}/{{val,train}}-000.tar", [6, 7, 0, 1]),
        (f"{folder}/train-*.tar", [0, 1, 2, 3, 4, 5]),  # sorted
        (f"{folder}/{{train-00[12],val-*}}.tar", [2, 3, 4, 5, 6, 7]),  # a glob in each brace
    ):
        cache = JpegCache.from_webdataset(pattern, progress=False)
        assert _stored(cache) == [blobs[k] for k in want], pattern
        assert list(cache.labels) == want, pattern
    both = JpegCache.from_webdataset(  # a list of patterns, pathlib too
        [folder / "val-000.tar", f"{folder}/train-{{000..000}}.tar"], progress=False
    )
    assert list(both.labels) == [6, 7, 0, 1]
    assert both.paths[2] == f"{folder}/train-000.tar/s0.jpg"


def test_a_pattern_that_matches_nothing_names_it(shards, tmp_path):
    folder, _ = shards
    for pattern in (f"{folder}/test-*.tar", f"{folder}/test-{{000..003}}.tar"):
        with pytest.raises(FileNotFoundError, match="no file matches") as err:
            JpegCache.from_webdataset(pattern, progress=False)
        assert repr(pattern) in str(err.value)
    # a range that runs past the last shard: the missing one is a shard the report names
    cache = JpegCache.from_webdataset(f"{folder}/train-{{001..003}}.tar", progress=False)
    assert list(cache.labels) == [2, 3, 4, 5]
    assert cache.report is not None
    assert [s.path for s in cache.report.skipped] == [f"{folder}/train-003.tar"]


def test_a_file_named_like_a_pattern_is_taken_as_it_is(shards, tmp_path):
    _, blobs = shards
    odd = tmp_path / "odd-{0..1}[x].tar"
    _write(odd, [("a", blobs[0], 0)])
    cache = JpegCache.from_webdataset(str(odd), progress=False)
    assert _stored(cache) == [blobs[0]]


def test_cli_builds_from_a_quoted_local_pattern(shards, tmp_path, capsys):
    folder, blobs = shards
    out = tmp_path / "train.gpucache"
    pattern = f"{folder}/train-{{000..002}}.tar"  # as a user quotes it past the shell
    assert cli_main(["build", "--webdataset", pattern, "-o", str(out)]) == 0
    assert _stored(JpegCache.open(out)) == blobs[:6]
    glob_out = tmp_path / "val.gpucache"
    assert cli_main(["build", "--webdataset", f"{folder}/val-*.tar", "-o", str(glob_out)]) == 0
    assert _stored(JpegCache.open(glob_out)) == blobs[6:]
    capsys.readouterr()
    missing = f"{folder}/test-*.tar"
    assert cli_main(["build", "--webdataset", missing, "-o", str(tmp_path / "x.gpucache")]) == 2
    err = capsys.readouterr().err
    assert "no file matches the shard pattern" in err and missing in err, err
    assert not (tmp_path / "x.gpucache").exists()


def test_the_node_store_of_a_glob_is_keyed_on_the_shards_it_matches(shards, tmp_path):
    folder, blobs = shards
    local = tmp_path / "shards"
    local.mkdir()
    for name in ("train-000.tar", "train-001.tar"):
        (local / name).write_bytes((folder / name).read_bytes())
    cdir, pattern = tmp_path / "node", f"{local}/train-*.tar"
    first = JpegCache.from_webdataset(pattern, cache_dir=cdir, progress=False)
    again = JpegCache.from_webdataset(pattern, cache_dir=cdir, progress=False)
    assert again.path == first.path and list(again.labels) == [0, 1, 2, 3]
    (local / "train-002.tar").write_bytes((folder / "train-002.tar").read_bytes())
    grown = JpegCache.from_webdataset(pattern, cache_dir=cdir, progress=False)  # a new shard
    assert grown.path != first.path and _stored(grown) == blobs[:6]
