"""Root's builds and saves attacked by a second local user of the node (``second_user``: a real
user made with useradd; each of her steps runs as that user in a child process).

Object storage: root builds ``s3://lua/v/`` (a real S3 server on 127.0.0.1) into a ``cache_dir``
whose path she can change: a folder of hers on the way, a world-writable non-sticky folder on the
way, or a link of hers. Anyone who can list the bucket can compute the store's key and the
spool's layout, so she prepares ``<key>.fetch`` and a ``<key>.fetched`` journal whose CRCs match
her own images (padded to the listed sizes). The moment root lists the bucket (after its folder
was checked, before the spool is opened: a hook of the server runs her step), she swaps the folder
for hers. Saving: root saves a store into a folder she can write; while the temporary file is
written (a hook on the writer), she swaps its name for a link to a private file of root's.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import tempfile
import zlib
from pathlib import Path

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from gpucache import JpegCache  # noqa: E402
from gpucache.store import _format  # noqa: E402
from gpucache.testing import make_jpeg_bytes  # noqa: E402
from tests.support.s3server import S3Server  # noqa: E402

URL = "s3://lua/v/"


def _padded(jpeg: bytes, size: int) -> bytes:
    """``jpeg`` made exactly ``size`` bytes long with COM segments after its SOI."""
    pad, segments = size - len(jpeg), b""
    assert pad >= 4, "the planted image must be smaller than the object it stands for"
    while pad:
        n = min(pad, 65537)
        n = n if pad - n == 0 or pad - n >= 4 else n - 4  # leave room for one more segment
        segments += b"\xff\xfe" + struct.pack(">H", n - 2) + b"\0" * (n - 4)
        pad -= n
    return jpeg[:2] + segments + jpeg[2:]


@pytest.fixture(scope="module")
def bucket():
    """The server, its environment set, root's 4 objects; the key and the spool she prepares."""
    import s3fs

    server = S3Server()
    server.start()
    probe = Path(tempfile.mkdtemp(prefix="gpucache-probe-"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env().items():
                mp.setenv(k, v)
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            fs.mkdir("lua")
            fs.pipe(
                {
                    f"lua/v/{c}/{i}.jpg": make_jpeg_bytes(96, 80, seed=10 * j + i)
                    for j, c in enumerate("ab")
                    for i in range(2)
                }
            )
            # what anyone who can list the bucket can compute: the key and the objects' sizes
            known = JpegCache.from_folder(URL, cache_dir=probe, progress=False)
            key = known.path.stem
            sizes = [len(known[i]) for i in range(len(known))]
            hers = [_padded(make_jpeg_bytes(16, 16, seed=90 + i), n) for i, n in enumerate(sizes)]
            journal = b"".join(struct.pack("<QI", i, zlib.crc32(b)) for i, b in enumerate(hers))
            server.reset_counts()
            try:
                yield {
                    "server": server,
                    "key": key,
                    "spool": b"".join(hers),
                    "journal": journal,
                    "hers": hers,
                    "theirs": [bytes(known[i]) for i in range(len(known))],
                }
            finally:  # moto keeps its buckets per process, past this server: the next finds none
                fs.rm("lua", recursive=True)
    finally:
        server.stop()
        shutil.rmtree(probe, ignore_errors=True)


@pytest.fixture
def place():
    """A fresh folder every user can traverse (pytest's tmp_path is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="gpucache-localuser-"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _plant(folder: Path, bucket: dict) -> str:
    """Her code that fills ``folder`` (hers) with the spool and journal of root's key."""
    return (
        f"from pathlib import Path; d = Path({str(folder)!r}); d.mkdir(exist_ok=True)\n"
        f"(d / '{bucket['key']}.fetch').write_bytes({bucket['spool']!r})\n"
        f"(d / '{bucket['key']}.fetched').write_bytes({bucket['journal']!r})\n"
    )


def _swap_folder(t: Path, bucket: dict) -> str:  # t/cache is root's: she renames it away
    return f"import os; os.rename({str(t / 'cache')!r}, {str(t / 'old')!r})\n" + _plant(
        t / "cache", bucket
    )


def _repoint_link(t: Path, bucket: dict) -> str:  # t/cache is her link: she points it at hers
    new, link = str(t / "new"), str(t / "cache")
    return _plant(t / "h", bucket) + (
        f"import os; os.symlink({str(t / 'h')!r}, {new!r}); os.rename({new!r}, {link!r})\n"
    )


@pytest.mark.parametrize("way", ["a folder of hers", "a world-writable folder", "a link of hers"])
def test_a_cache_dir_whose_path_she_can_change_is_refused_before_anything_is_fetched(
    bucket, place, second_user, way
):
    server, t = bucket["server"], place / "t"
    t.mkdir()
    if way == "a folder of hers":
        os.chown(t, second_user.uid, second_user.gid)
        attack, offender = _swap_folder(t, bucket), f"{t}, a directory"
    elif way == "a world-writable folder":
        os.chmod(t, 0o777)  # no sticky bit: anyone may rename what is in it
        attack, offender = _swap_folder(t, bucket), f"{t}, a directory"
    else:
        os.chmod(t, 0o1777)  # sticky, like /tmp: only the link is hers
        mine = place / "mine"
        mine.mkdir(mode=0o700)
        second_user.run(f"import os; os.symlink({str(mine)!r}, {str(t / 'cache')!r})")
        attack, offender = _repoint_link(t, bucket), f"{t / 'cache'}, a symbolic link"
    fired = []

    def her_step(path: str) -> None:  # root has checked its folder and now lists the bucket
        second_user.run(attack)
        fired.append(path)

    server.reset_counts()
    with server.faulty():
        server.fail("hook", lambda p: p.rstrip("/") == "/lua", times=1, hook=her_step)
        try:
            cache = JpegCache.from_folder(URL, cache_dir=t / "cache", progress=False)
            got, text = [bytes(cache[i]) for i in range(len(cache))], ""
        except PermissionError as err:
            got, text = None, str(err)
    fetched = sum(server.gets("/lua/v/").values())
    poisoned = got == bucket["hers"]
    assert not poisoned, f"her images in root's store, {fetched} objects fetched"
    assert "refusing the gpucache cache folder" in text and offender in text, text
    assert f"belongs to uid {second_user.uid}" in text or "mode 0777" in text, text
    assert "cache_dir=" in text  # the fix
    assert not fired and server.count("GET") == 0  # refused before the listing


def test_a_spool_of_hers_left_in_roots_folder_is_removed_and_fetched_anew(
    bucket, place, second_user, caplog
):
    folder = place / "cache"
    folder.mkdir()
    os.chmod(folder, 0o777)  # opened up once, long enough for her to leave her files...
    second_user.run(_plant(folder, bucket))
    os.chmod(folder, 0o700)  # ...then made private again: her files stay
    server = bucket["server"]
    server.reset_counts()
    cache = JpegCache.from_folder(URL, cache_dir=folder, progress=False)
    hers = [bytes(cache[i]) for i in range(len(cache))] == bucket["hers"]
    fetched = sum(server.gets("/lua/v/").values())
    assert not hers, f"her images in root's store, {fetched} objects fetched"  # before: 0 fetched
    assert [bytes(cache[i]) for i in range(len(cache))] == bucket["theirs"]
    assert fetched == len(cache)
    assert f"belongs to uid {second_user.uid}; fetching anew" in caplog.text
    assert sorted(p.suffix for p in folder.iterdir()) == [".gpucache", ".info"]  # no spool left


def test_save_into_a_folder_she_can_write_never_changes_another_file(
    place, second_user, monkeypatch
):
    store = JpegCache.from_files([make_jpeg_bytes(32, 24, seed=k) for k in range(3)])
    drop, secret = place / "drop", place / "secret.txt"
    drop.mkdir()
    os.chmod(drop, 0o777)  # world-writable, not sticky: she may rename anything in it
    secret.write_text("root's own\n")
    os.chmod(secret, 0o600)
    write, swapped = _format.write, []

    def written(f, *args, **kw):  # the temporary file is written: she swaps its name for a link
        size = write(f, *args, **kw)
        (name,) = [p for p in os.listdir(drop) if p.endswith(".tmp")]
        tmp = str(drop / name)
        assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o600  # unreadable to her while written
        second_user.run(
            f"import os; os.rename({tmp!r}, {tmp + '.hers'!r}); os.symlink({str(secret)!r}, {tmp!r})"
        )
        swapped.append(name)
        return size

    monkeypatch.setattr(_format, "write", written)
    target = drop / "s.gpucache"
    try:
        store.save(target, mode=0o644)
        text = ""
    except PermissionError as err:
        text = str(err)
    assert swapped
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600  # before: chmod'ed 0644 through the link
    assert secret.read_text() == "root's own\n"
    assert not target.is_symlink()  # before: her link to the secret saved as the store
    assert "renamed or replaced while the store was saved" in text and str(drop) in text, text
    assert "choose a folder that only you can write to" in text  # the fix
    assert not target.exists()
    monkeypatch.setattr(_format, "write", write)
    store.save(target, mode=0o644)  # unhindered, it lands, with the mode asked for
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o644 and len(JpegCache.open(target)) == 3


def test_every_link_on_the_way_is_checked_and_the_real_path_is_kept(place, second_user):
    from gpucache.node._dir import checked_dir

    mine, hers = place / "mine", place / "hers"
    mine.mkdir(mode=0o700)
    hers.mkdir()
    os.chown(hers, second_user.uid, second_user.gid)
    second_user.run(f"import os; os.symlink({str(mine)!r}, {str(hers / 'l2')!r})")
    os.symlink(hers / "l2", place / "l1")  # root's own link, to a link in her folder
    with pytest.raises(PermissionError, match=f"{hers}, a directory on the way"):
        checked_dir(place / "l1")  # before: accepted (its end, root's folder, was all checked)
    with pytest.raises(PermissionError, match=f"{hers}, a directory on the way"):
        checked_dir(hers / "sub")
    assert not (hers / "sub").exists()  # before: created in her folder, then accepted
    os.symlink("mine", place / "rel")  # root's own relative link: followed, the real path kept
    assert checked_dir(place / "rel") == mine
    assert checked_dir(f"{place}/rel/../rel/.") == mine
    new = checked_dir(place / "made" / "here")
    assert new == place / "made" / "here"
    assert os.stat(new.parent).st_mode & 0o022 == 0 and stat.S_IMODE(os.stat(new).st_mode) == 0o700
    os.symlink("loop", place / "loop")
    with pytest.raises(OSError, match="symbolic links"):
        checked_dir(place / "loop" / "x")
