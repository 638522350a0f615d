"""Every builder takes every build option (``BuildOptions``'s fields) as a documented keyword-only
argument with the option's default and hands it on in one ``BuildOptions``; the options that
change the store key the node cache; from_csv / from_webdataset build once per cache folder as
from_folder / from_files do."""

from __future__ import annotations

import inspect
import io
import tarfile
from dataclasses import fields

import pytest

from gpucache import JpegCache
from gpucache.ingest._options import BuildOptions
from gpucache.node import _builders
from gpucache.testing import make_jpeg_bytes

BUILDERS = ("from_folder", "from_files", "from_csv", "from_webdataset", "from_hf")
OBJECT_STORE = {"storage_options", "requests_in_flight"}  # paths and URLs only: not from_hf
#: a valid value other than the default, for each option
CHANGED = dict(
    on_error="raise",
    num_threads=3,
    progress=False,
    max_pixels=None,
    cache_dir="/nonexistent/cache",
    cache_max_bytes=1 << 30,
    restart_markers=True,
    max_side=512,
    jpeg_quality=80,
    storage_options={"anon": True},
    requests_in_flight=4,
    shard="node",
)


def _taken(name: str) -> list[str]:
    return [n for n in BuildOptions.names() if name != "from_hf" or n not in OBJECT_STORE]


def test_every_option_is_a_documented_keyword_of_every_builder():
    assert set(CHANGED) == set(BuildOptions.names())
    for name in BUILDERS:
        method = getattr(JpegCache, name)
        params = inspect.signature(method).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), name
        for f in fields(BuildOptions):
            if f.metadata.get("internal"):
                assert f.name not in params, (name, f.name)
                continue
            if f.name not in _taken(name):
                assert f.name not in params, (name, f.name)
                continue
            p = params[f.name]
            assert p.kind is p.KEYWORD_ONLY, (name, f.name)
            assert p.default == f.default and p.annotation == f.type, (name, f.name)
        # the options come last, in the object's order, after the source's own arguments
        assert list(params)[-len(_taken(name)) :] == _taken(name), name
    doc = JpegCache.from_folder.__doc__
    assert doc is not None
    for option in BuildOptions.names():
        assert f"``{option}``" in doc, option
    for name in BUILDERS[1:]:
        assert "from_folder" in (getattr(JpegCache, name).__doc__ or ""), name


@pytest.mark.parametrize("name", BUILDERS)
def test_each_builder_hands_every_option_on_in_one_object(name, monkeypatch):
    got = []
    monkeypatch.setattr(_builders, name, lambda cls, *args: got.append((cls, args)))
    given = {k: v for k, v in CHANGED.items() if k in _taken(name)}
    getattr(JpegCache, name)(["a.jpg"] if name == "from_files" else "src", **given)
    [(cls, args)] = got
    assert cls is JpegCache and args[-1] == BuildOptions(**given)


def test_the_options_that_change_the_store_are_the_keyed_ones():
    # the node cache's key holds these (and the source, labels and classes), no others: the
    # store is reused across thread counts, progress bars, cache caps and storage clients
    keyed = [f.name for f in fields(BuildOptions) if f.metadata.get("keyed")]
    assert keyed == ["on_error", "max_pixels", "restart_markers", "max_side", "jpeg_quality"]
    assert BuildOptions(**CHANGED).keyed() == ("raise", None, True, 512, 80)
    assert "anon" not in repr(BuildOptions(**CHANGED))  # storage options may hold credentials


def test_on_error_is_checked_once_in_the_words_of_the_caller(tmp_path, capsys):
    from gpucache.cli import main

    with pytest.raises(ValueError, match="on_error='skip'"):
        JpegCache.from_files([tmp_path / "a.jpg"], on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        main(["build", str(tmp_path), "-o", str(tmp_path / "s"), "--on-error", "ignore"])
    assert "pass --on-error skip" in capsys.readouterr().err


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
