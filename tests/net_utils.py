"""Helpers for tests that launch processes: a TCP port for their rendezvous (or an endpoint nothing answers), the
one way a finished gloo run may still exit badly, and a stand-in Hub."""

from __future__ import annotations

import http.server
import json
import os
import random
import socket
import threading


# Rendezvous ports come from below the OS's ephemeral range, a block of its own for each xdist worker: two launches
# may run at once (one on each worker), and between picking a port and binding it a launch spends seconds
# importing; no connection the other launch's ranks open (the OS picks those in the ephemeral range) and no port the
# other worker picks can take it meanwhile.
PORT_BLOCK = 2000
FIRST_PORT = 20000


def ephemeral_start() -> int:
    """The first port the OS hands out for outgoing connections and `bind(0)` (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def worker_ports(worker: str, ephemeral: int) -> range:
    """The ports xdist worker `worker` (`gw0`, `gw1`, ...; `""` without xdist) picks from: a block below
    `ephemeral`, or an empty range when no block fits."""
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = FIRST_PORT + index * PORT_BLOCK
    return range(start, min(start + PORT_BLOCK, ephemeral))


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, from this worker's block ([`worker_ports`]; the OS's pick when
    every port there is taken), released at once: free for a rendezvous, and refused to a client until something
    binds it."""
    ports = worker_ports(os.environ.get("PYTEST_XDIST_WORKER", ""), ephemeral_start())
    for port in random.sample(ports, min(len(ports), 64)):
        if bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rare gloo/c10d teardown race on CPU: a non-zero rank can abort in a C++ destructor at interpreter exit, after
# everything was trained and saved. Tests accept it only in this exact form, with every rank's results on disk, or
# retry the run once.
EXIT_RACE = "terminate called without an active exception"


class StubHub:
    """A stand-in for the Hugging Face Hub on 127.0.0.1 (`HF_ENDPOINT=stub.endpoint`): every request is answered
    `200` with one JSON object naming the repo `local/test` (enough for `create_repo` and the model card's check), and
    kept in `requests` as `(method, path, body)`. Nothing is stored: an upload fails after it has read its files."""

    def __init__(self):
        self.requests: list[tuple[str, str, bytes]] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.requests.append((self.command, self.path, body))
                data = json.dumps({"url": f"{stub.endpoint}/local/test", "errors": [], "warnings": []}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_HEAD = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
