"""Asking an HTTP health endpoint (the worker's /healthz, NATS's monitoring /healthz) whether
it is healthy: it is when it answers 200."""

from __future__ import annotations

import urllib.error
import urllib.request


def worker_healthz(port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{port}/healthz"


def answers_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True if `url` answers 200 within the timeout; False for any other answer or none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False
