"""A free TCP port on 127.0.0.1, for a rendezvous or a process group of the tests' own."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no one listens on now (the OS's choice; another process may take it after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
