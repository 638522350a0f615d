"""Sources: bytes and file objects, CSV lists, WebDataset shards, Hugging Face datasets, the CLI.

Every source is checked byte for byte: the store must hold exactly the encoded bytes it was given
(no decode, no re-encode), in order, with the right labels and names. Real components: tar shards
written here with tarfile, a real ``datasets.Dataset`` built locally, the real CLI entry point.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gpucache import JpegCache
from gpucache.cli import main as cli_main
from gpucache.testing import make_jpeg_bytes

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return [make_jpeg_bytes(48 + 8 * k, 40, seed=k, progressive=k == 3) for k in range(8)]


def _stored(cache: JpegCache) -> list[bytes]:
    return [bytes(cache[i]) for i in range(len(cache))]


# ------------------------------------------------------------------------- bytes and file objects
def test_from_files_takes_bytes_file_objects_and_paths(tmp_path, blobs):
    (tmp_path / "p.jpg").write_bytes(blobs[4])
    with open(tmp_path / "p.jpg", "rb") as f:
        items = [
            blobs[0],
            bytearray(blobs[1]),
            memoryview(blobs[2]),
            np.frombuffer(blobs[3], dtype=np.uint8),
            io.BytesIO(blobs[5]),
            f,
            str(tmp_path / "p.jpg"),
            tmp_path / "p.jpg",
        ]
        cache = JpegCache.from_files(items, [0, 1, 0, 1, 0, 1, 0, 1], progress=False)
    assert _stored(cache) == blobs[:4] + [blobs[5], blobs[4], blobs[4], blobs[4]]
    assert list(cache.labels) == [0, 1] * 4
    assert cache.paths[0] == "<bytes #0>" and cache.paths[5] == str(tmp_path / "p.jpg")
    with pytest.raises(TypeError, match="bytes-like objects"):
        JpegCache.from_files([blobs[0], 12], progress=False)


def test_bad_bytes_are_reported_by_index(blobs):
    cache = JpegCache.from_files([blobs[0], b"not a jpeg", blobs[1]], progress=False)
    assert _stored(cache) == blobs[:2]
    [bad] = cache.report.skipped
    assert bad.index == 1 and bad.path == "<bytes #1>"


# ----------------------------------------------------------------------------------------- CSV
def test_from_csv_relative_paths_class_names_and_metadata(tmp_path, blobs):
    (tmp_path / "imgs").mkdir()
    for k in range(4):
        (tmp_path / "imgs" / f"{k}.jpg").write_bytes(blobs[k])
    other = tmp_path / "elsewhere.jpg"
    other.write_bytes(blobs[5])
    csv_dir = tmp_path / "lists"
    csv_dir.mkdir()
    (csv_dir / "train.csv").write_text(
        "path,label,metadata\n"
        '../imgs/0.jpg,cat,"{""box"": [1, 2]}"\n'
        "../imgs/1.jpg,dog,b\n"
        f"{other},cat,c\n"
        "../imgs/missing.jpg,dog,d\n"
        "../imgs/3.jpg,,e\n"
    )
    cache = JpegCache.from_csv(csv_dir / "train.csv", progress=False)
    assert _stored(cache) == [blobs[0], blobs[1], blobs[5], blobs[3]]
    assert cache.classes == ["cat", "dog"] and list(cache.labels) == [0, 1, 0, -1]
    assert json.loads(cache.metadata[0]) == {"box": [1, 2]} and list(cache.metadata[1:]) == [
        "b",
        "c",
        "e",
    ]
    assert [s.path for s in cache.report.skipped] == [os.path.join(csv_dir, "../imgs/missing.jpg")]
    (csv_dir / "ints.csv").write_text("../imgs/2.jpg;3\n../imgs/0.jpg;1\n")
    ints = JpegCache.from_csv(csv_dir / "ints.csv", delimiter=";", progress=False)
    assert list(ints.labels) == [3, 1] and ints.classes == ["0", "1", "2", "3"]
    assert ints.metadata is None
    with pytest.raises(ValueError, match="not among classes"):
        JpegCache.from_csv(csv_dir / "train.csv", classes=["cat"], progress=False)


# ---------------------------------------------------------------------------------- WebDataset
def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    with tarfile.open(path, "w") as tf:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def test_from_webdataset_reads_members_in_place(tmp_path, blobs, caplog):
    a = write_shard(
        tmp_path / "shard-000.tar",
        [
            (
                f"train/s{k:03d}",
                {
                    "jpg": blobs[k],
                    "cls": str(k % 3).encode(),
                    "json": json.dumps({"k": k}).encode(),
                },
            )
            for k in range(5)
        ],
    )
    b = write_shard(
        tmp_path / "shard-001.tar",
        [
            ("s005", {"png": blobs[5]}),  # a JPEG named .png: sniffed, kept; no .cls: unlabeled
            ("s006", {"cls": b"1"}),  # no image member: left out with a warning
            ("s007", {"x.jpeg": blobs[7], "cls": b"2"}),  # the key ends at the first dot
        ],
    )
    mtimes = [os.stat(p).st_mtime_ns for p in (a, b)]
    cache = JpegCache.from_webdataset([a, b], metadata_ext="json", progress=False)
    assert _stored(cache) == blobs[:6] + [blobs[7]]
    assert list(cache.labels) == [0, 1, 2, 0, 1, -1, 2]
    assert cache.paths[0] == f"{a}/train/s000.jpg" and cache.paths[6] == f"{b}/s007.x.jpeg"
    assert json.loads(cache.metadata[4]) == {"k": 4} and cache.metadata[5] == ""
    assert "1 WebDataset samples have no image member" in caplog.text and "s006" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["shard-000.tar", "shard-001.tar"]  # nothing extracted
    assert [os.stat(p).st_mtime_ns for p in (a, b)] == mtimes
    gz = tmp_path / "c.tar.gz"
    with tarfile.open(gz, "w:gz") as tf:
        tf.add(a, arcname="x.jpg")
    with pytest.raises(ValueError, match="decompress"):
        JpegCache.from_webdataset(gz, progress=False)


# ------------------------------------------------------------------------ Hugging Face datasets
def hf_dataset(blobs: list[bytes], labels: list[int], names: list[str]):
    datasets = pytest.importorskip("datasets")
    feats = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=names)}
    )
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in blobs], "label": labels}, features=feats
    )


def test_from_hf_takes_bytes_as_stored(blobs, tmp_path):
    ds = hf_dataset(blobs, [k % 2 for k in range(len(blobs))], ["ant", "bee"])
    cache = JpegCache.from_hf(ds, progress=False)
    assert _stored(cache) == blobs and cache.classes == ["ant", "bee"]
    assert list(cache.labels) == [k % 2 for k in range(len(blobs))]
    assert cache.paths[2] == "hf[2]"
    assert ds.features["image"].decode  # the caller's dataset is left as it was
    sub = JpegCache.from_hf(ds.select([6, 1, 3]), progress=False)  # an indices mapping
    assert _stored(sub) == [blobs[6], blobs[1], blobs[3]] and list(sub.labels) == [0, 1, 1]
    saved = tmp_path / "hf"
    ds.save_to_disk(str(saved))
    import datasets

    on_disk = datasets.load_from_disk(str(saved))  # memory-mapped Arrow files
    assert _stored(JpegCache.from_hf(on_disk, progress=False)) == blobs
    with pytest.raises(ValueError, match="'img'"):
        JpegCache.from_hf(ds, image_column="img", progress=False)


# --------------------------------------------------------------------------------------- photos
def test_photos_through_every_source(tmp_path, photo_folder):
    files = sorted(photo_folder.rglob("*.jpg"))[:24]
    raw = [f.read_bytes() for f in files]
    labels = [int(f.parent.name == "bees") for f in files]
    shard = write_shard(
        tmp_path / "photos.tar",
        [
            (f"p{k:04d}", {"jpg": b, "cls": str(y).encode()})
            for k, (b, y) in enumerate(zip(raw, labels))
        ],
    )
    (tmp_path / "list.csv").write_text("".join(f"{f},{f.parent.name}\n" for f in files))
    caches = {
        "webdataset": JpegCache.from_webdataset(shard, progress=False),
        "csv": JpegCache.from_csv(tmp_path / "list.csv", progress=False),
        "bytes": JpegCache.from_files([io.BytesIO(b) for b in raw], labels, progress=False),
    }
    ds = hf_dataset(raw, labels, ["ants", "bees"])
    caches["hf"] = JpegCache.from_hf(ds, progress=False)
    for name, cache in caches.items():
        assert _stored(cache) == raw, name
        assert list(cache.labels) == labels, name


# ------------------------------------------------------------------------------------------ CLI
def test_cli_builds_each_source_kind(tmp_path, blobs, capsys):
    shard = write_shard(
        tmp_path / "s.tar", [(f"k{k}", {"jpg": b, "cls": b"0"}) for k, b in enumerate(blobs[:3])]
    )
    for k in range(3):
        (tmp_path / f"{k}.jpg").write_bytes(blobs[k])
    (tmp_path / "l.csv").write_text("".join(f"{k}.jpg,{k}\n" for k in range(3)))
    hf_dataset(blobs[:3], [0, 1, 0], ["a", "b"]).save_to_disk(str(tmp_path / "hf"))
    for kind, src in (
        ("--csv", tmp_path / "l.csv"),
        ("--webdataset", shard),
        ("--hf", tmp_path / "hf"),
    ):
        out = tmp_path / f"{kind[2:]}.gpucache"
        assert cli_main(["build", kind, str(src), "-o", str(out)]) == 0, kind
        assert _stored(JpegCache.open(out)) == blobs[:3], kind
    assert cli_main(["build", "-o", str(tmp_path / "x.gpucache")]) == 2
    assert "ImageFolder root or one of --csv" in capsys.readouterr().err


# ---------------------------------------------------------------------- one copy while building
_PEAK_CHILD = textwrap.dedent("""
    import sys
    from gpucache import JpegCache
    from gpucache.testing._memory import reset_peak_rss, status_bytes

    before = reset_peak_rss()  # the peak RSS (VmHWM) is now the current RSS
    cache = JpegCache.from_webdataset(sys.argv[1:], progress=False)
    print(status_bytes("VmHWM") - before, cache.nbytes)
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_webdataset_build_peaks_at_one_copy(tmp_path):
    """The build's peak memory is the data size, not twice it (no list of bytes)."""
    unit = [make_jpeg_bytes(640, 480, seed=k) for k in range(3)] * 8  # ~4 MB a shard
    shards = [
        write_shard(
            tmp_path / f"{s:03d}.tar", [(f"{s}-{k}", {"jpg": b}) for k, b in enumerate(unit)]
        )
        for s in range(10)
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, *map(str, shards)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak, data = map(int, proc.stdout.split())
    assert data > 30e6
    print(f"build peak memory / data: {peak / data:.3f} ({peak} / {data} bytes)")
    assert peak / data < 1.25, f"the build peaked at {peak / data:.2f}x the data"
