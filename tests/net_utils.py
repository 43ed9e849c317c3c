"""Helpers for tests that launch processes: a TCP port for their rendezvous (or an endpoint nothing answers), the
one way a finished gloo run may still exit badly, and a stand-in Hub."""

from __future__ import annotations

import http.server
import json
import socket
import threading


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
