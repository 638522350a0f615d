"""Every builder takes the same keyword-only build options, documented once (from_folder), and
from_csv / from_webdataset build once per cache folder as from_folder / from_files do."""

from __future__ import annotations

import inspect
import io
import tarfile

import pytest

from gpucache import JpegCache
from gpucache.node import _builders
from gpucache.store._store import BUILD_OPTIONS, OBJECT_STORE_OPTIONS
from gpucache.testing import make_jpeg_bytes

BUILDERS = ("from_folder", "from_files", "from_csv", "from_webdataset", "from_hf")
OPTIONS = BUILD_OPTIONS + OBJECT_STORE_OPTIONS


def _options(name: str) -> dict:
    params = inspect.signature(getattr(JpegCache, name)).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), name
    return {k: (p.kind, p.default) for k, p in params.items() if k in OPTIONS}


def test_every_builder_takes_the_same_keyword_only_build_options():
    want = _options("from_folder")
    assert set(want) == set(OPTIONS)
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for kind, _ in want.values())
    for name in BUILDERS:
        got = _options(name)
        if name == "from_hf":  # a Hugging Face dataset, not paths or URLs
            assert set(want) - set(got) == set(OBJECT_STORE_OPTIONS), got
            want = {k: v for k, v in want.items() if k in BUILD_OPTIONS}
        assert got == want, name
    doc = JpegCache.from_folder.__doc__
    for name in OPTIONS:
        assert name in doc, name


def test_each_builder_is_implemented_with_its_classmethods_signature():
    # the classmethods hand their arguments on by name: the node layer's builders must take
    # the same parameters, in the same order, with the same defaults
    for name in BUILDERS:
        public = inspect.signature(getattr(JpegCache, name)).parameters
        impl = inspect.signature(getattr(_builders, name)).parameters
        shape = [(k, p.kind, p.default) for k, p in impl.items()]
        assert shape[0][0] == "cls", name
        assert shape[1:] == [(k, p.kind, p.default) for k, p in public.items()], name


def _files(tmp_path, n=4):
    paths = []
    for i in range(n):
        p = tmp_path / "img" / f"{i}.jpg"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(make_jpeg_bytes(40 + i, 30, seed=i))
        paths.append(p)
    return paths


def test_from_csv_builds_once_in_a_cache_dir(tmp_path):
    paths = _files(tmp_path)
    csv = tmp_path / "list.csv"
    csv.write_text("".join(f"img/{p.name},{i % 2}\n" for i, p in enumerate(paths)))
    cdir = tmp_path / "cache"
    first = JpegCache.from_csv(csv, cache_dir=cdir, progress=False)
    stores = sorted(cdir.glob("*.gpucache"))
    assert len(stores) == 1 and len(first) == 4
    again = JpegCache.from_csv(csv, cache_dir=cdir, progress=False)
    assert sorted(cdir.glob("*.gpucache")) == stores
    assert again.labels.tolist() == first.labels.tolist() == [0, 1, 0, 1]
    plain = JpegCache.from_csv(csv, progress=False, max_side=None)  # in memory, as before
    assert plain.labels.tolist() == [0, 1, 0, 1]


def test_from_webdataset_builds_once_in_a_cache_dir(tmp_path):
    shard = tmp_path / "shard-0.tar"
    with tarfile.open(shard, "w") as tf:
        for i in range(3):
            for ext, data in (("jpg", make_jpeg_bytes(32, 24, seed=i)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"k{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    cdir = tmp_path / "cache"
    first = JpegCache.from_webdataset(shard, cache_dir=cdir, progress=False)
    assert len(list(cdir.glob("*.gpucache"))) == 1 and first.labels.tolist() == [0, 1, 2]
    again = JpegCache.from_webdataset([shard], cache_dir=cdir, progress=False)
    assert len(list(cdir.glob("*.gpucache"))) == 1 and len(again) == 3


def test_from_hf_refuses_a_cache_dir_with_the_fix(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": make_jpeg_bytes(20, 20), "path": None}], "label": [0]}
    ).cast_column("image", datasets.Image())
    with pytest.raises(ValueError, match="cache.save"):
        JpegCache.from_hf(ds, cache_dir=tmp_path)
    assert len(JpegCache.from_hf(ds, progress=False)) == 1


def test_cli_build_uses_the_python_names_and_takes_the_source_options(tmp_path, capsys):
    from gpucache.cli import main

    paths = _files(tmp_path)
    csv = tmp_path / "list.csv"
    csv.write_text("".join(f"img/{p.name};{i % 2}\n" for i, p in enumerate(paths)))
    out, cdir = tmp_path / "s.gpucache", tmp_path / "cache"
    for threads in (["--num-threads", "2"], ["--threads", "2"], ["-j", "2"]):
        assert (
            main(
                [
                    "build",
                    "--csv",
                    str(csv),
                    "--delimiter",
                    ";",
                    "-o",
                    str(out),
                    "--cache-dir",
                    str(cdir),
                    "--max-pixels",
                    "none",
                    *threads,
                ]
            )
            == 0
        )
        assert JpegCache.open(out).labels.tolist() == [0, 1, 0, 1]
    assert len(list(cdir.glob("*.gpucache"))) == 1  # built once, then reused
    assert main(["verify", str(out), "--num-threads", "1", "--no-decode"]) == 0
    with pytest.raises(SystemExit):
        main(["build", "--csv", str(csv), "-o", str(out), "--max-pixels", "0"])
