"""The node cache folder attacked by a second local user (uid 12345), as root runs setpriv.

Each attack gets its own world-writable, sticky TMPDIR (like /tmp), in which the attacker
prepares the predictable folder ``gpucache-<victim uid>`` (or a common ``cache_dir=``). Then one
victim process (uid 12346, two ranks of a node: LOCAL_WORLD_SIZE=2) builds or opens its store in
each place in turn (one process: torch is imported once), and every test checks one outcome.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpucache.testing import make_jpeg_folder

REPO = Path(__file__).resolve().parent.parent
ATTACKER, VICTIM = 12345, 12346
SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or SETPRIV is None,
    reason="runs a second uid with setpriv, as root",
)
DEADLINE = 300  # torch import on a loaded 2-core machine; a hang in open() would reach it

VICTIM_CODE = """
import json, sys, tempfile
from gpucache import JpegCache
for name, tmp, kw in json.loads(sys.argv[1]):
    tempfile.tempdir = tmp  # what TMPDIR says, per place
    try:
        c = JpegCache.from_folder(sys.argv[2], progress=False, **kw)
        out = ["OPENED", str(c.path)]
    except PermissionError as err:
        out = ["REFUSED", str(err)]
    print(json.dumps([name, out]), flush=True)
"""


def _as(uid: int, args: list[str], tmp: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "PYTHONPATH": str(REPO),
        "HOME": str(tmp),
    }
    return subprocess.Popen(
        [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp,
    )


def _done(p: subprocess.Popen) -> str:
    try:
        out, err = p.communicate(timeout=DEADLINE)
    finally:
        p.kill()
    assert p.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def attacks():
    """Every attack prepared, then the victim's outcome in each place: {name: (verdict, text)}."""
    from gpucache import JpegCache

    base = Path(tempfile.mkdtemp(prefix="gpucache-attack-"))
    os.chmod(base, 0o755)
    victim = make_jpeg_folder(base / "victim", 6, seed=1)
    # the victim's key: anyone who can read the listing computes it, e.g. by building it too
    key = JpegCache.from_folder(victim, cache_dir=base / "probe", progress=False).path.stem
    planted = base / "planted.gpucache"  # the attacker's own images, built anywhere
    theirs = make_jpeg_folder(base / "attacker", 6, seed=2)
    JpegCache.from_folder(theirs, progress=False).save(planted)
    os.chmod(planted, 0o644)
    precious = base / "victim-home" / "notes.txt"  # a file of the victim's
    precious.parent.mkdir()
    precious.write_text("precious\n")
    for p in (precious.parent, precious):
        os.chown(p, VICTIM, VICTIM)
    plants = {
        "planted-store": f"store.write_bytes(Path({str(planted)!r}).read_bytes())",
        "planted-store-cache_dir": f"store.write_bytes(Path({str(planted)!r}).read_bytes())",
        "lock-link": f"lock.symlink_to({str(precious)!r})",
        "fifo-store": "os.mkfifo(store, 0o666)",
        "held-lock": (
            "import fcntl, signal; f = open(lock, 'w'); os.chmod(lock, 0o666); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); signal.pause()"
        ),
        "private": None,  # no attack: the victim's own folder
    }
    places, holder = {}, None
    try:
        for name, plant in plants.items():
            tmp = base / name
            tmp.mkdir(mode=0o1777)
            os.chmod(tmp, 0o1777)
            folder = tmp / ("common" if name.endswith("cache_dir") else f"gpucache-{VICTIM}")
            places[name] = (str(tmp), {"cache_dir": str(folder)} if "cache_dir" in name else {})
            if plant is None:
                continue
            code = (
                f"import os; from pathlib import Path; folder = Path({str(folder)!r}); "
                "folder.mkdir(mode=0o777); os.chmod(folder, 0o777); "
                f"store, lock = folder / '{key}.gpucache', folder / '{key}.lock'\n{plant}"
            )
            p = _as(ATTACKER, ["-c", code], tmp)
            if name == "held-lock":  # keeps holding it while the victim runs
                holder = p
                assert p.stdout.readline().strip() == "locked", p.stderr.read()[-3000:]
            else:
                _done(p)
        out = _done(
            _as(
                VICTIM,
                [
                    "-c",
                    VICTIM_CODE,
                    json.dumps([[n, t, kw] for n, (t, kw) in places.items()]),
                    str(victim),
                ],
                base,
            )
        )
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    results = {name: tuple(r) for name, r in map(json.loads, out.splitlines())}
    yield {"results": results, "base": base, "precious": precious, "victim": victim}
    shutil.rmtree(base)


def _refused(attacks, name: str) -> None:
    verdict, text = attacks["results"][name]
    assert verdict == "REFUSED", text  # before: OPENED (or hung, or stalled)
    assert "refusing the gpucache cache folder" in text and "cache_dir=" in text
    assert f"belongs to uid {ATTACKER}" in text and "mode 0777" in text


@pytest.mark.parametrize("name", ["planted-store", "planted-store-cache_dir"])
def test_a_store_planted_under_the_victims_key_is_refused(attacks, name):
    _refused(attacks, name)  # before: the attacker's images trained on, no warning


def test_a_lock_planted_as_a_link_to_a_victims_file_leaves_the_file_alone(attacks):
    _refused(attacks, "lock-link")
    assert attacks["precious"].read_text() == "precious\n"  # before: truncated and overwritten


def test_a_fifo_under_the_stores_name_does_not_hang_the_victim(attacks):
    _refused(attacks, "fifo-store")  # before: blocked in open() until the deadline


def test_a_lock_held_by_another_user_does_not_stall_the_victim(attacks):
    _refused(attacks, "held-lock")  # before: waited an hour for the lock


def test_the_victims_store_and_folder_are_private(attacks):
    verdict, path = attacks["results"]["private"]
    assert verdict == "OPENED", path
    store = Path(path)
    folder = store.parent
    assert (os.lstat(folder).st_mode & 0o777, os.stat(store).st_mode & 0o777) == (0o700, 0o600)
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in folder.iterdir())
    os.chmod(folder, 0o711)  # even with the folder opened up, the store stays the victim's
    peek = _as(ATTACKER, ["-c", f"open({str(store)!r}, 'rb')"], folder.parent)
    _, err = peek.communicate(timeout=DEADLINE)
    assert "PermissionError" in err  # before: 0644, readable by every user
