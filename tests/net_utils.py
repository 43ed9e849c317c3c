"""Helpers for tests that need a TCP port: a rendezvous for launched processes, or an endpoint nothing answers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS's pick, released at once): free for a rendezvous, and
    refused to a client until something binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
