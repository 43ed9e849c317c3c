"""Helpers for tests that launch processes: a TCP port for their rendezvous (or an endpoint nothing answers), and the
one way a finished gloo run may still exit badly."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS's pick, released at once): free for a rendezvous, and
    refused to a client until something binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rare gloo/c10d teardown race on CPU: a non-zero rank can abort in a C++ destructor at interpreter exit, after
# everything was trained and saved. Tests accept it only in this exact form, with every rank's results on disk, or
# retry the run once.
EXIT_RACE = "terminate called without an active exception"
