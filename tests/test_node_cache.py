"""The node cache folder in one process: `gpucache cache list | clean`, the size cap, a read-only
folder, and odd files (a FIFO, a link) where the cache expects its own."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpucache import JpegCache
from gpucache.cli import main
from gpucache.testing import make_jpeg_folder

REPO = Path(__file__).resolve().parent.parent


def _stores(cdir: Path) -> list[Path]:
    return sorted(cdir.glob("*.gpucache"))


def _age(path: Path, days: float) -> None:
    t = time.time() - days * 86400
    os.utime(path, (t, t))


@pytest.fixture
def two(tmp_path):
    """Two stores in one cache folder: ``kept`` still open (in use), ``old`` released."""
    cdir = tmp_path / "c"
    old = JpegCache.from_folder(
        make_jpeg_folder(tmp_path / "a", 4, seed=1), cache_dir=cdir, progress=False
    )
    old_path = old.path
    del old
    gc.collect()  # the store's shared flock goes with it
    kept = JpegCache.from_folder(
        make_jpeg_folder(tmp_path / "b", 4, seed=2), cache_dir=cdir, progress=False
    )
    _age(old_path, 3)
    return cdir, old_path, kept, tmp_path


def test_cache_list_shows_size_last_use_in_use_and_source(two, capsys):
    cdir, old_path, kept, tmp = two
    assert main(["cache", "list", "--dir", str(cdir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{cdir}: 2 stores, ")
    first, second = out[1:]  # most recently used first
    assert kept.path.stem in first and "IN USE" in first and str(tmp / "b") in first
    assert old_path.stem in second and "used   3.0d ago" in second and "IN USE" not in second
    assert str(tmp / "a") in second and "MiB" in second


def test_cache_clean_removes_old_stores_never_one_in_use(two, capsys):
    cdir, old_path, kept, _ = two
    _age(kept.path, 5)  # old too, but open
    assert main(["cache", "clean", "--dir", str(cdir), "--older-than", "1d", "--dry-run"]) == 0
    assert "would remove 1 store," in capsys.readouterr().out and len(_stores(cdir)) == 2
    assert main(["cache", "clean", "--dir", str(cdir), "--all"]) == 0
    assert "removed 1 store," in capsys.readouterr().out
    assert _stores(cdir) == [kept.path]
    assert sorted(p.suffix for p in cdir.iterdir()) == [".gpucache", ".info"]
    assert len(kept) == 4 and bytes(kept[0][:2]) == b"\xff\xd8"  # still mapped: a JPEG
    assert main(["cache", "clean", "--dir", str(cdir)]) == 2  # says what to give
    assert "--older-than" in capsys.readouterr().err


def test_cache_max_bytes_removes_the_least_recently_used_unused_stores(two):
    cdir, old_path, kept, tmp = two
    third = JpegCache.from_folder(
        make_jpeg_folder(tmp / "c3", 4, seed=3),
        cache_dir=cdir,
        progress=False,
        cache_max_bytes=int(2.5 * os.path.getsize(kept.path)),
    )
    assert old_path not in _stores(cdir)  # the least recently used, not in use
    assert set(_stores(cdir)) == {kept.path, third.path}  # in use: kept over the cap


def test_a_read_only_cache_folder_says_what_and_how_to_fix():
    ro = Path(tempfile.mkdtemp(prefix="gpucache-ro-"))  # reachable by a second uid when root
    try:
        root = make_jpeg_folder(ro / "imgs", 4, seed=4)
        code = (
            "import os; from gpucache import JpegCache\n"
            f"try:\n    JpegCache.from_folder({str(root)!r}, cache_dir={str(ro / 'c')!r}, "
            "progress=False)\n"
            "except OSError as err:\n    print(type(err).__name__, err)\n"
            # a store built before the folder became read-only opens, also for several ranks
            f"JpegCache.from_folder({str(root)!r}, cache_dir={str(ro / 'd')!r}, "
            "progress=False)\n"
            f"os.chmod({str(ro / 'd')!r}, 0o500); os.environ['LOCAL_WORLD_SIZE'] = '2'\n"
            f"c = JpegCache.from_folder({str(root)!r}, cache_dir={str(ro / 'd')!r}, "
            "progress=False)\nprint('OPENED', len(c))\n"
        )
        (ro / "c").mkdir(mode=0o500)
        (ro / "d").mkdir(mode=0o700)
        cmd = [sys.executable, "-c", code]
        if os.geteuid() == 0:  # root writes anywhere: run as a throwaway uid owning the folder
            if shutil.which("setpriv") is None:
                pytest.skip("as root, needs setpriv to run as another uid")
            os.chmod(ro, 0o755)
            os.chown(ro / "c", 12347, 12347)
            os.chown(ro / "d", 12347, 12347)
            cmd = ["setpriv", "--reuid=12347", "--regid=12347", "--clear-groups", *cmd]
        p = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ro,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.startswith("PermissionError"), p.stdout + p.stderr[-2000:]
        assert f"cannot create the lock file {ro / 'c'}" in p.stdout  # what, where
        assert "no permission to write" in p.stdout and "cache_dir=" in p.stdout  # why, the fix
        assert p.stdout.splitlines()[-1] == "OPENED 4"
    finally:
        shutil.rmtree(ro)


def test_a_fifo_and_a_link_in_the_cache_folder_are_replaced_not_followed(tmp_path, caplog):
    root = make_jpeg_folder(tmp_path / "imgs", 4, seed=5)
    key = JpegCache.from_folder(root, cache_dir=tmp_path / "probe", progress=False).path.stem
    cdir = tmp_path / "c"
    cdir.mkdir(mode=0o700)
    mine = tmp_path / "mine.txt"
    mine.write_text("mine\n")
    os.mkfifo(cdir / f"{key}.gpucache")
    (cdir / f"{key}.lock").symlink_to(mine)
    with caplog.at_level(logging.WARNING, logger="gpucache"):
        cache = JpegCache.from_folder(root, cache_dir=cdir, progress=False)  # no hang on the FIFO
    assert cache.path == cdir / f"{key}.gpucache" and len(cache) == 4
    assert cache.path.is_file() and mine.read_text() == "mine\n"  # the link was not followed
    assert "is not a regular file" in caplog.text and "is a symbolic link" in caplog.text


def test_cache_commands_refuse_a_folder_others_may_write(tmp_path, capsys):
    open_to_all = tmp_path / "open-to-all"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    assert main(["cache", "clean", "--dir", str(open_to_all), "--all"]) == 2
    assert "mode 0777, writable by group or others" in capsys.readouterr().err
    assert main(["cache", "list", "--dir", str(tmp_path / "none")]) == 0
    assert "no node cache folder" in capsys.readouterr().out


def _users_files(cdir: Path, tmp: Path) -> dict[str, bytes]:
    """Files a user keeps in a folder also named as cache_dir: none of them is the cache's."""
    files = {
        "poetry.lock": b"[[package]]\nname = 'torch'\n",
        "flake.lock": b'{"nodes": {}}\n',
        "notes.info": b'{"source": "mine", "samples": 1, "created": 0}\n',
        "photos.scan": b'{"key": "k", "written": 0, "nonce": "n"}\n',
        ".draft.tmp": b"half a letter",
        "model.gpucache.bak": b"GPUCACHE...",
        # key-shaped names whose content is not what the cache writes there
        "0123456789abcdef0123456789abcdef.lock": b"my lock notes\n",
        "0123456789abcdef0123456789abcdef.info": b"not json\n",
    }
    for name, data in files.items():
        (cdir / name).write_bytes(data)
    os.utime(cdir / "poetry.lock", (0, 0))  # very old
    mine = JpegCache.from_folder(make_jpeg_folder(tmp / "mine", 3, seed=9), progress=False)
    mine.save(cdir / "train.gpucache")  # a store saved there by hand is the user's file
    files["train.gpucache"] = (cdir / "train.gpucache").read_bytes()
    return files


def test_clean_and_the_size_cap_remove_only_the_node_caches_own_files(two, capsys):
    cdir, old_path, kept, tmp = two
    users = _users_files(cdir, tmp)
    key = old_path.stem
    orphan = "fedcba9876543210fedcba9876543210"  # the cache's own leftovers, no store needs them
    (cdir / f"{orphan}.info").write_bytes((cdir / f"{key}.info").read_bytes())
    (cdir / f"{orphan}.lock").write_bytes(
        b'{"pid": 1, "host": "h", "phase": "building", "done": 0}'.ljust(512)
    )
    (cdir / f".{orphan}.gpucache.abc_1234.tmp").write_bytes(b"GPUCACHE" + bytes(100))
    leftovers = {f"{orphan}.info", f"{orphan}.lock", f".{orphan}.gpucache.abc_1234.tmp"}

    JpegCache.from_folder(
        make_jpeg_folder(tmp / "c3", 4, seed=3),
        cache_dir=cdir,
        progress=False,
        cache_max_bytes=10**12,
    )  # the cap is never reached
    assert {n: (cdir / n).read_bytes() for n in users} == users
    assert not any((cdir / n).exists() for n in leftovers)  # the cap's tidy took those

    for name in leftovers:  # again, for the command line to report
        (cdir / name).write_bytes(
            (cdir / f"{key}.info").read_bytes()
            if name.endswith(".info")
            else b'{"pid": 1, "host": "h", "phase": "x"}'.ljust(512)
            if name.endswith(".lock")
            else b""
        )
    assert main(["cache", "list", "--dir", str(cdir)]) == 0
    listed = capsys.readouterr().out
    assert listed.startswith(f"{cdir}: 3 stores") and "train" not in listed
    assert main(["cache", "clean", "--dir", str(cdir), "--older-than", "30d"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "removed 0 stores, 0 B, 3 leftover files; 1 in use kept"
    assert all(f"removed {cdir / n} (" in out for n in leftovers)
    assert main(["cache", "clean", "--dir", str(cdir), "--all"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 stores" in out and old_path.exists() is False  # the third and the old
    assert {n: (cdir / n).read_bytes() for n in users} == users  # the user's files, untouched
    assert _stores(cdir) == sorted([kept.path, cdir / "train.gpucache"])
    assert len(JpegCache.open(cdir / "train.gpucache")) == 3


def test_one_folder_through_a_symlink_is_one_node_store(tmp_path, caplog):
    real = make_jpeg_folder(tmp_path / "photos", 4, seed=3)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    cdir = tmp_path / "c"
    with caplog.at_level(logging.WARNING, logger="gpucache"):
        first = JpegCache.from_folder(real, cache_dir=cdir, progress=False)
    assert len(_stores(cdir)) == 1
    made = [r.getMessage() for r in caplog.records if "node store" in r.getMessage()]
    assert len(made) == 1  # one line: where, how big, how to remove it
    assert str(first.path) in made[0] and " MB)" in made[0] and "4 samples" in made[0]
    assert f"gpucache cache clean --all --dir {cdir}" in made[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpucache"):
        again = JpegCache.from_folder(link, cache_dir=cdir, progress=False)
        relative = JpegCache.from_folder(os.path.relpath(link), cache_dir=cdir, progress=False)
    assert _stores(cdir) == [first.path] == [again.path] == [relative.path]
    assert not [r for r in caplog.records if "node store" in r.getMessage()]  # opened, not made
