"""Whether this process can reach the Hugging Face Hub, decided once, and offline mode when it cannot.

Many training clusters have no route to the Hub. Left alone, transformers and datasets find that out by retrying every
file they look up (tens of seconds per file, with a log line per retry). The launch scripts and `safe-trainers check`
instead decide once, before anything is loaded: a `HF_HUB_OFFLINE` the user set is honoured as given; otherwise one
TCP connection to the Hub's endpoint (or to the HTTPS proxy, when one is configured) is tried for at most
`PROBE_TIMEOUT` seconds. When it fails, one line says so and the libraries are switched to offline mode in this
process: models and datasets then come from local paths and the local cache only, at once. A run whose models and
datasets are all local paths never asks (nothing it loads is on the Hub).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.request
from dataclasses import dataclass
from functools import cache
from urllib.parse import urlsplit


PROBE_TIMEOUT = 1.5  # seconds for the one connection attempt, DNS lookup included
TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})  # what huggingface_hub reads as true
FALSE_VALUES = frozenset({"0", "OFF", "NO", "FALSE"})


@dataclass(frozen=True)
class HubAccess:
    """The decision about the Hub for this process.

    Args:
        online (`bool`): whether models and datasets may be looked up on the Hub.
        reason (`str`): why, for the one line that says so (`""` when online because the Hub answered).
    """

    online: bool
    reason: str = ""

    def announcement(self, program: str) -> str | None:
        """The one line that tells the user the run goes on offline, or `None` when online."""
        if self.online:
            return None
        return (
            f"{program}: {self.reason}, so working offline: models and datasets come from local paths and the local "
            "Hugging Face cache only."
        )


def decide(user_offline: str | None, address: tuple[str, int], reached: bool | None) -> HubAccess:
    """The decision from what the user set and, where it was needed, the probe's answer. Pure.

    Args:
        user_offline (`str`, *optional*): the `HF_HUB_OFFLINE` the user set (`None` when unset).
        address (`tuple[str, int]`): the host and port that were (or would be) tried.
        reached (`bool`, *optional*): the probe's answer; `None` when no probe was made.
    """
    if user_offline is not None and user_offline.strip().upper() in TRUE_VALUES:
        return HubAccess(False, "`HF_HUB_OFFLINE` is set")
    if user_offline is not None and user_offline.strip().upper() in FALSE_VALUES:
        return HubAccess(True)  # the user asked for the Hub: no probe, the libraries' own errors apply
    if reached is None or reached:
        return HubAccess(True)
    host, port = address
    return HubAccess(False, f"the Hugging Face Hub cannot be reached from this machine (no connection to "
                            f"{host}:{port} within {PROBE_TIMEOUT:g} s)")  # fmt: skip


def hub_address(endpoint: str, proxies: dict[str, str], bypass: bool) -> tuple[str, int]:
    """The first hop to the Hub: the HTTPS proxy when one applies to the endpoint's host, else the endpoint. Pure."""
    target = endpoint
    proxy = proxies.get("https" if endpoint.startswith("https") else "http") or proxies.get("all")
    if proxy and not bypass:
        target = proxy if "://" in proxy else f"http://{proxy}"
    parts = urlsplit(target)
    default_port = 443 if parts.scheme == "https" else 80
    return parts.hostname or "huggingface.co", parts.port or default_port


def reachable(address: tuple[str, int], timeout: float = PROBE_TIMEOUT) -> bool:
    """One TCP connection to `address`, DNS lookup included, bounded by `timeout` seconds in all."""
    answer: list[bool] = []

    def attempt() -> None:
        try:
            with socket.create_connection(address, timeout=timeout):
                answer.append(True)
        except OSError:
            answer.append(False)

    worker = threading.Thread(target=attempt, name="safe-trainers-hub-probe", daemon=True)
    worker.start()
    worker.join(timeout)  # a stuck DNS lookup is abandoned (daemon thread), not waited for
    return bool(answer and answer[0])


def current_address() -> tuple[str, int]:
    """The first hop to the configured Hub endpoint (`HF_ENDPOINT`, huggingface.co by default) from here."""
    from huggingface_hub import constants

    host = urlsplit(constants.ENDPOINT).hostname or ""
    return hub_address(constants.ENDPOINT, urllib.request.getproxies(), bool(urllib.request.proxy_bypass(host)))


@cache
def hub_access() -> HubAccess:
    """Decide once per process whether the Hub can be used; switch the libraries to offline mode when not."""
    user_offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or None  # "" = unset
    address = current_address()
    probe_needed = user_offline is None
    access = decide(user_offline, address, reachable(address) if probe_needed else None)
    if not access.online:
        go_offline()
    return access


def go_offline() -> None:
    """Switch huggingface_hub (and so transformers) and datasets to offline mode in this process.

    Both read their offline flag at call time from their config modules; `HF_HUB_OFFLINE` is set too, for the
    libraries imported later and for the processes this one starts (dataloader workers, compile workers).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True


__all__ = ["HubAccess", "PROBE_TIMEOUT", "decide", "go_offline", "hub_access", "hub_address", "reachable"]
