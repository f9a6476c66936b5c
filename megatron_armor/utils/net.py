"""Local networking helpers (standard library only, so light entry points can use them)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (the OS picks it; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_address_towards(url: str) -> str:
    """This host's address on the route to `url` (what a peer there must dial to reach us); no packet is sent."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parts.hostname, parts.port or 80))
        return probe.getsockname()[0]


def on_this_host(url: str) -> bool:
    """Whether `url` names this host: a loopback address, or the address this host reaches it from."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(urlsplit(url).hostname or ""))
        return address.is_loopback or local_address_towards(url) == str(address)
    except (OSError, ValueError):  # unresolvable or unroutable: not a host we can share memory with
        return False
