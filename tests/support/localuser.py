"""A second local user of this machine, for the attacks another user of a node could make.

``create()`` adds a system user with ``useradd`` (no home, its own group) for the test session and
``remove()`` takes it away; ``run(code)`` runs Python code as that user in a child process
(``subprocess`` with ``user=``/``group=``, no supplementary groups, the first Python the user may
start), isolated from the test's environment (``-I``, an environment of ``PATH`` only), and
returns its output.
Creating a user needs root and ``useradd``; where either is missing, :class:`Unavailable` says why.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass

_SBIN = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
DEADLINE_S = 120  # a Python start-up on a loaded machine; an attack step that hangs reaches it


class Unavailable(Exception):
    """No second user can be made here (the reason is the message)."""


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int
    python: str = sys.executable  # an interpreter this user may run (see :func:`create`)

    def run(self, code: str, *, cwd: str = "/") -> str:
        """``code`` run as this user; its stdout. AssertionError with its stderr if it fails."""
        done = subprocess.run(
            [self.python, "-I", "-c", code],
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
        assert done.returncode == 0, f"the step run as {self.name} failed:\n{done.stderr[-3000:]}"
        return done.stdout

    def remove(self) -> None:
        subprocess.run(
            [shutil.which("userdel", path=_SBIN) or "userdel", self.name],
            capture_output=True,
            timeout=DEADLINE_S,
        )


def create(name: str) -> LocalUser:
    """A new system user ``name`` (its group of the same name, no home directory)."""
    if not sys.platform.startswith("linux"):
        raise Unavailable("a second local user is made with useradd, on Linux only")
    if os.geteuid() != 0:
        raise Unavailable("creating a second local user (useradd) needs root")
    useradd = shutil.which("useradd", path=_SBIN)
    if not useradd:
        raise Unavailable("useradd is not installed (the passwd package)")
    done = subprocess.run(
        [useradd, "--system", "--no-create-home", "--user-group", name],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    if done.returncode != 0:
        raise Unavailable(f"useradd {name} failed: {done.stderr.strip()}")
    pw = pwd.getpwnam(name)
    user = LocalUser(name, pw.pw_uid, pw.pw_gid)
    # the test's interpreter may lie in a folder only root can enter (a venv in /root): take the
    # first Python the new user can start; the attacks need only the standard library
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]):
        try:
            LocalUser(name, user.uid, user.gid, python).run("pass")
        except (OSError, AssertionError):
            continue
        return LocalUser(name, user.uid, user.gid, python)
    user.remove()
    raise Unavailable(f"no Python interpreter that the user {name} may run")
