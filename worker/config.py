"""The worker's settings, from flags with environment fallbacks, validated once at start.

Every setting has a flag; those an operator usually sets per deployment also read an
environment variable (named in the flag's help). An invalid combination is a `ConfigError`
naming the setting, raised before anything connects.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvhandoff.events.subjects import (
    DEFAULT_STREAM,
    done_stream_of,
    log_stream_of,
    rejections_stream_of,
)
from kvhandoff.worker.bus.settings import DEFAULT_NATS_URL, NatsSettings
from kvhandoff.worker.clock import DURATION_HELP, duration_arg
from kvhandoff.worker.errors import ConfigError

TIER_RETENTION_S = 7 * 24 * 3600.0
# How long a handoff that ended is remembered by its tombstone (`WorkerConfig.tombstone_ttl_s`).
TOMBSTONE_TTL_S = 300.0


def partition_path(data_dir: Path, partition: int) -> Path:
    """The local event log of one partition (the offline tools read `partition-*.db`)."""
    return data_dir / f"partition-{partition}.db"


_NAME = r"[A-Za-z0-9_-]+"  # a stream's or a consumer's name


@dataclass(frozen=True)
class TierConfig:
    """What every worker of a tier shares: the partition count, the streams and the consumers,
    and the consumers' timings. `WorkerConfig.tier` is the one `kvhandoff run` was given, and
    `worker.tier.membership.TierSettings` is a `TierConfig` with what a running tier adds to it
    (it is not here, nor held by `WorkerConfig`, because the client library imports this module
    for its NATS settings and may not load the tier)."""

    # Partitions of the input stream. Without a data directory the worker runs the one
    # partition whose file is `WorkerConfig.db_path`: the embedded default, a tier of one.
    partitions: int = 1
    stream: str = DEFAULT_STREAM
    consumer: str = "kvhandoff-worker"
    # Empty: the tier's, named after `stream` (`done_stream_of`, `log_stream_of`).
    done_stream: str = ""
    log_stream: str = ""  # the partitions' replicated logs (worker.tier.service)
    completion_ttl_s: float = 3600.0
    # The input consumers' ack wait: short, since a new owner is pinned only after it (see
    # worker.tier.membership.TierSettings); it also bounds how long an early input is deferred.
    ack_wait_s: float = 1.0
    priority_timeout_s: float = 3.0
    batch_size: int = 512  # inputs an owner pulls and appends at most at once

    def __post_init__(self) -> None:
        # Frozen: the derived names are set once, here, so every reader sees them.
        if not self.done_stream:
            object.__setattr__(self, "done_stream", done_stream_of(self.stream))
        if not self.log_stream:
            object.__setattr__(self, "log_stream", log_stream_of(self.stream))

    @property
    def rejections_stream(self) -> str:
        """The tier's rejection stream, named after its completion stream."""
        return rejections_stream_of(self.done_stream)

    def validate(self) -> None:
        if not 1 <= self.partitions <= 1024:
            raise ConfigError(f"--partitions: {self.partitions} is not in 1..1024")
        if not re.fullmatch(_NAME, self.stream):
            raise ConfigError(f"--stream: {self.stream!r} must be letters, digits, '-' or '_'")
        if not re.fullmatch(_NAME, self.consumer):
            raise ConfigError(f"--consumer: {self.consumer!r} must be letters, digits, '-' or '_'")
        if not re.fullmatch(_NAME, self.done_stream) or self.done_stream == self.stream:
            raise ConfigError(
                f"--done-stream: {self.done_stream!r} must be letters, digits, '-' or '_', and"
                " not the input stream"
            )
        if not re.fullmatch(_NAME, self.log_stream) or self.log_stream in {
            self.stream,
            self.done_stream,
        }:
            raise ConfigError(
                f"--log-stream: {self.log_stream!r} must be letters, digits, '-' or '_', and"
                " neither the input nor the completion stream"
            )
        if self.rejections_stream in {self.stream, self.log_stream}:
            raise ConfigError(
                f"--done-stream: {self.done_stream!r} names the rejection stream"
                f" {self.rejections_stream!r}, which is the input or the log stream"
            )
        if self.completion_ttl_s <= 0:
            raise ConfigError("--completion-ttl must be positive")
        if not 1 <= self.batch_size <= 10_000:
            raise ConfigError(f"--batch-size: {self.batch_size} is not in 1..10000")
        if self.ack_wait_s <= 0:
            raise ConfigError("--ack-wait must be positive")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    nats: NatsSettings
    db_path: Path
    tier: TierConfig = field(default_factory=TierConfig)
    retry_interval_s: float = 5.0
    synchronous: str = "FULL"
    retention_s: float | None = None
    # Loopback unless told otherwise: the endpoint has no authentication. The container image
    # sets KVHANDOFF_METRICS_HOST=0.0.0.0, because there the port is reached from outside.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    log_format: str = "text"
    log_level: str = "INFO"
    # The owned partitions' files (worker.tier.service); None: `db_path`, the one partition's.
    data_dir: Path | None = None
    # Snapshots of each partition's state in its replicated log (worker.tier.owner):
    # every this many entries, or this long with any; 0 entries: never.
    snapshot_every: int = 10_000
    snapshot_interval_s: float = 60.0
    # How long a handoff that ended is remembered by its tombstone, for a late input that
    # names it (worker.tier.planner): at least the longest deadline plus the bus's duplicate window.
    tombstone_ttl_s: float = TOMBSTONE_TTL_S
    # Engine leases (worker.tier.leases): reject a start naming an engine that holds none.
    require_leases: bool = False

    @property
    def tier_retention_s(self) -> float:
        """How long the files keep their completed handoffs and rejections: `--retention`, or a
        week. The replicated log has no age limit (worker.tier.service's "Retention")."""
        return TIER_RETENTION_S if self.retention_s is None else self.retention_s

    def validate(self) -> None:
        self.nats.validate()
        self.tier.validate()
        if self.data_dir is None and self.tier.partitions > 1:
            raise ConfigError(
                "--partitions above 1 needs --data-dir: one file per partition it owns"
            )
        if not self.db_path.parent.is_dir():
            raise ConfigError(f"--db: directory {self.db_path.parent} does not exist")
        if self.retry_interval_s <= 0:
            raise ConfigError("--retry-interval must be positive")
        if self.synchronous not in {"FULL", "NORMAL", "EXTRA"}:
            raise ConfigError(f"--synchronous: {self.synchronous!r} is not FULL, NORMAL or EXTRA")
        if self.retention_s is not None and self.retention_s <= 0:
            raise ConfigError("--retention must be positive")
        if self.snapshot_every < 0:
            raise ConfigError("--snapshot-every must be 0 (never) or more")
        if self.snapshot_interval_s <= 0:
            raise ConfigError("--snapshot-interval must be positive")
        if self.tombstone_ttl_s <= 0:
            raise ConfigError("--tombstone-ttl must be positive")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port: {self.metrics_port} is not a port")
        # The environment fallbacks bypass argparse's `choices`, so check here too.
        if self.log_format not in {"text", "json"}:
            raise ConfigError(f"--log-format: {self.log_format!r} is not text or json")
        if self.log_level not in logging.getLevelNamesMapping():
            raise ConfigError(f"--log-level: {self.log_level!r} is not a logging level")

    @property
    def locked_path(self) -> Path:
        """What `run` takes the writer lock of before anything else: `--db`, which is then
        partition 0's file, or the data directory (`DIR/worker.lock`)."""
        return self.db_path if self.data_dir is None else self.data_dir / "worker"

    def partition_file(self, partition: int) -> Path:
        """The local event log of one partition: `DIR/partition-<p>.db`, or `--db` at P = 1
        without a data directory (the offline tools read either)."""
        if self.data_dir is None:
            return self.db_path
        return partition_path(self.data_dir, partition)

    def make_data_dir(self) -> None:
        """Create the data directory if absent, with any missing parents, each of mode 0700
        (the partition files are the tier's history; nats-server makes its store directory
        the same way); `ConfigError` naming it if it cannot be used: a file in the way, no
        permission. `run` calls it before it takes the directory's writer lock."""
        if self.data_dir is None:
            return
        path = self.data_dir
        try:
            for missing in reversed([p for p in (path, *path.parents) if not p.is_dir()]):
                missing.mkdir(mode=0o700, exist_ok=True)
        except FileExistsError as exc:
            raise ConfigError(
                f"--data-dir: {exc.filename} is in the way of {path}: it is not a directory"
            ) from exc
        except OSError as exc:
            raise ConfigError(f"--data-dir: cannot create {path}: {exc.strerror}") from exc
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise ConfigError(f"--data-dir: {path} is not readable and writable by this user")


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    """The NATS connection flags, shared by every command that talks to the bus."""
    env = os.environ
    group = parser.add_argument_group("NATS")
    group.add_argument(
        "--nats-url",
        default=env.get("NATS_URL", DEFAULT_NATS_URL),
        help="server URL(s), comma-separated (env NATS_URL; default %(default)s)",
    )
    group.add_argument("--nats-user", default=env.get("NATS_USER"), help="(env NATS_USER)")
    group.add_argument(
        "--nats-password", default=env.get("NATS_PASSWORD"), help="(env NATS_PASSWORD)"
    )
    group.add_argument("--nats-token", default=env.get("NATS_TOKEN"), help="(env NATS_TOKEN)")
    group.add_argument(
        "--nats-creds", type=Path, default=env.get("NATS_CREDS"), help="creds file (env NATS_CREDS)"
    )
    group.add_argument(
        "--tls-ca", type=Path, default=env.get("NATS_TLS_CA"), help="(env NATS_TLS_CA)"
    )
    group.add_argument(
        "--tls-cert", type=Path, default=env.get("NATS_TLS_CERT"), help="(env NATS_TLS_CERT)"
    )
    group.add_argument(
        "--tls-key", type=Path, default=env.get("NATS_TLS_KEY"), help="(env NATS_TLS_KEY)"
    )
    group.add_argument(
        "--subject-prefix",
        default=env.get("KVHANDOFF_SUBJECT_PREFIX", "kvhandoff"),
        help="first token of every subject (env KVHANDOFF_SUBJECT_PREFIX; default %(default)s)",
    )


def nats_settings(args: argparse.Namespace) -> NatsSettings:
    settings = NatsSettings(
        url=args.nats_url,
        user=args.nats_user,
        password=args.nats_password,
        token=args.nats_token,
        creds=None if args.nats_creds is None else Path(args.nats_creds),
        tls_ca=None if args.tls_ca is None else Path(args.tls_ca),
        tls_cert=None if args.tls_cert is None else Path(args.tls_cert),
        tls_key=None if args.tls_key is None else Path(args.tls_key),
        subject_prefix=args.subject_prefix,
    )
    settings.validate()
    return settings


def _add_duration_option(
    group: argparse._ArgumentGroup, flag: str, env_var: str, default: str, help: str
) -> None:
    """A DURATION option that `env_var` sets when the flag is not given; the help ends by naming
    both the variable and the default. argparse runs the string default through `type`, so
    the option always arrives as seconds."""
    group.add_argument(
        flag,
        type=duration_arg,
        metavar="DURATION",
        default=os.environ.get(env_var, default),
        help=f"{help} (env {env_var}; default %(default)s)",
    )


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_arguments(parser)
    env = os.environ
    defaults = WorkerConfig(nats=NatsSettings(), db_path=Path("kvhandoff.db"))
    tier_defaults = defaults.tier
    group = parser.add_argument_group("worker", f"DURATION is {DURATION_HELP}.")
    group.add_argument(
        "--db",
        type=Path,
        default=Path(env.get("KVHANDOFF_DB", "kvhandoff.db")),
        help="SQLite event log (env KVHANDOFF_DB; default %(default)s)",
    )
    group.add_argument(
        "--stream",
        default=env.get("KVHANDOFF_STREAM", tier_defaults.stream),
        help="JetStream stream for inputs, created if absent (env KVHANDOFF_STREAM; "
        "default %(default)s)",
    )
    group.add_argument(
        "--consumer",
        default=env.get("KVHANDOFF_CONSUMER", tier_defaults.consumer),
        help="durable consumer name (env KVHANDOFF_CONSUMER; default %(default)s)",
    )
    group.add_argument(
        "--done-stream",
        default=env.get("KVHANDOFF_DONE_STREAM", ""),
        help="JetStream stream keeping each handoff's last completion, created if absent; "
        "its last rejection is kept in the stream named after it with _REJECTED for _DONE "
        f"(env KVHANDOFF_DONE_STREAM; default the input stream's name with _DONE for _IN: "
        f"{tier_defaults.done_stream})",
    )
    group.add_argument(
        "--log-stream",
        default=env.get("KVHANDOFF_LOG_STREAM", ""),
        help="JetStream stream of the partitions' replicated event logs, created if absent "
        f"(env KVHANDOFF_LOG_STREAM; default the input stream's name with _LOG for _IN: "
        f"{tier_defaults.log_stream})",
    )
    _add_duration_option(
        group,
        "--completion-ttl",
        "KVHANDOFF_COMPLETION_TTL",
        "1h",
        "how long the completion and rejection streams keep a handoff's completion or rejection",
    )
    group.add_argument(
        "--batch-size",
        type=int,
        default=tier_defaults.batch_size,
        help="most inputs per group commit (default %(default)s)",
    )
    _add_duration_option(
        group,
        "--retry-interval",
        "KVHANDOFF_RETRY_INTERVAL",
        f"{defaults.retry_interval_s}s",
        "republish an action with no outcome after this long",
    )
    group.add_argument(
        "--ack-wait",
        type=duration_arg,
        metavar="DURATION",
        default=f"{tier_defaults.ack_wait_s}s",
        help="JetStream redelivers an input not acknowledged in this time; --priority-timeout "
        "must exceed it by the pull's expiry, 1s (default %(default)s)",
    )
    group.add_argument(
        "--synchronous",
        default=env.get("KVHANDOFF_SYNCHRONOUS", defaults.synchronous),
        type=str.upper,
        help="SQLite synchronous: FULL survives power loss, NORMAL only crashes (default FULL)",
    )
    group.add_argument(
        "--retention",
        type=duration_arg,
        metavar="DURATION",
        default=env.get("KVHANDOFF_RETENTION"),
        help="delete completed handoffs and rejections older than this from the files, hourly "
        "(env KVHANDOFF_RETENTION; a week unless given)",
    )
    group.add_argument(
        "--metrics-host",
        default=env.get("KVHANDOFF_METRICS_HOST", defaults.metrics_host),
        help="address for /metrics and /healthz; 0.0.0.0 for all interfaces "
        "(env KVHANDOFF_METRICS_HOST; default %(default)s)",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        # A string default goes through `type`, so a bad value is a usage error, not a crash.
        default=env.get("KVHANDOFF_METRICS_PORT", str(defaults.metrics_port)),
        help="Prometheus /metrics and /healthz; 0 disables (env KVHANDOFF_METRICS_PORT)",
    )
    group.add_argument(
        "--log-format", choices=["text", "json"], default=env.get("KVHANDOFF_LOG_FORMAT", "text")
    )
    group.add_argument("--log-level", default=env.get("KVHANDOFF_LOG_LEVEL", "INFO"))
    tier = parser.add_argument_group(
        "tier", "Every worker is one of a tier; by default the only one, of one partition."
    )
    tier.add_argument(
        "--partitions",
        type=int,
        default=env.get("KVHANDOFF_PARTITIONS", str(tier_defaults.partitions)),
        help="partitions of the input stream, fixed when it is created; every worker of the "
        "tier gives the same (env KVHANDOFF_PARTITIONS; default %(default)s); above 1 it needs "
        "--data-dir",
    )
    tier.add_argument(
        "--data-dir",
        type=Path,
        default=env.get("KVHANDOFF_DATA_DIR"),
        help="directory of the owned partitions' event logs, partition-<p>.db, created (mode "
        "0700) if absent (env KVHANDOFF_DATA_DIR); replaces --db, which is the one partition's "
        "file without it",
    )
    _add_duration_option(
        tier,
        "--priority-timeout",
        "KVHANDOFF_PRIORITY_TIMEOUT",
        f"{tier_defaults.priority_timeout_s}s",
        "how long a partition's pin outlives its owner's last pull, and how long a vacant "
        "partition waits before it is claimed: most of a failover",
    )
    tier.add_argument(
        "--snapshot-every",
        type=int,
        metavar="ENTRIES",
        default=env.get("KVHANDOFF_SNAPSHOT_EVERY", str(defaults.snapshot_every)),
        help="snapshot a partition's state into its replicated log, replacing the entries "
        "before it, every this many entries (and after each claim and at a hand-over); 0: "
        "never, so that claims read the whole log (env KVHANDOFF_SNAPSHOT_EVERY; default "
        "%(default)s)",
    )
    _add_duration_option(
        tier,
        "--snapshot-interval",
        "KVHANDOFF_SNAPSHOT_INTERVAL",
        f"{defaults.snapshot_interval_s}s",
        "and at least this often while entries are appended",
    )
    _add_duration_option(
        tier,
        "--tombstone-ttl",
        "KVHANDOFF_TOMBSTONE_TTL",
        f"{defaults.tombstone_ttl_s}s",
        "how long an ended handoff's id is remembered after a snapshot dropped its rows, "
        "so that a late input for it is answered as a duplicate or rejected, not started anew",
    )
    tier.add_argument(
        "--require-leases",
        action="store_true",
        help="reject a start naming an engine that holds no lease (docs/leases.md); without "
        "it, such an engine's handoffs end at their deadline as before leases",
    )


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    # argparse runs string defaults through `type`, so durations arrive as seconds.
    config = WorkerConfig(
        nats=nats_settings(args),
        db_path=args.db,
        tier=TierConfig(
            partitions=args.partitions,
            stream=args.stream,
            consumer=args.consumer,
            done_stream=args.done_stream,
            log_stream=args.log_stream,
            completion_ttl_s=args.completion_ttl,
            ack_wait_s=args.ack_wait,
            priority_timeout_s=args.priority_timeout,
            batch_size=args.batch_size,
        ),
        retry_interval_s=args.retry_interval,
        synchronous=args.synchronous,
        retention_s=args.retention,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        log_format=args.log_format,
        log_level=args.log_level.upper(),
        data_dir=args.data_dir,
        snapshot_every=args.snapshot_every,
        snapshot_interval_s=args.snapshot_interval,
        tombstone_ttl_s=args.tombstone_ttl,
        require_leases=args.require_leases,
    )
    config.validate()
    return config
