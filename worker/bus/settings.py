"""How a process reaches NATS: the URLs, the credentials and TLS files, and the subject prefix.

The worker, the engines, the frontends and the load generator all connect with these settings
(`worker.bus.connection.Bus.connect`); the worker's flags fill them in (`worker.config`), a
library user builds them directly. `validate` checks them before anything connects, naming the
flag of whatever cannot work.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvhandoff.worker.errors import ConfigError

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True, slots=True)
class NatsSettings:
    """How to reach NATS; shared by the worker, the engines and the load generator."""

    url: str = DEFAULT_NATS_URL
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    subject_prefix: str = "kvhandoff"

    def validate(self) -> None:
        for url in self.url.split(","):
            parts = urlsplit(url.strip())
            if parts.scheme not in {"nats", "tls", "ws", "wss"} or not parts.hostname:
                raise ConfigError(f"--nats-url: {url!r} is not a nats://, tls://, ws:// URL")
            try:
                parts.port  # noqa: B018  # urlsplit checks the port only when asked
            except ValueError as exc:
                raise ConfigError(f"--nats-url: {url!r}: {exc}") from exc
        if (self.user is None) != (self.password is None):
            raise ConfigError("--nats-user and --nats-password go together")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        for name, path in [
            ("--nats-creds", self.creds),
            ("--tls-ca", self.tls_ca),
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
        ]:
            if path is not None and not path.is_file():
                raise ConfigError(f"{name}: no such file {path}")
        # nats-py signs with the optional nkeys package only once it connects, and then fails
        # with an ImportError deep in its connect loop.
        if self.creds is not None and importlib.util.find_spec("nkeys") is None:
            raise ConfigError("--nats-creds needs the nkeys package: pip install nkeys")
        if not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", self.subject_prefix):
            raise ConfigError(f"--subject-prefix: {self.subject_prefix!r} is not a subject prefix")

    @property
    def uses_tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None or self.url.startswith("tls")
