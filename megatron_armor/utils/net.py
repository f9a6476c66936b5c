"""Local networking helpers (standard library only, so light entry points can use them)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (the OS picks it; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
