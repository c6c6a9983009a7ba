"""Prometheus metrics and the health endpoint, served on one port from a daemon thread.

    /metrics   Prometheus text format
    /healthz   200 once the worker has recovered and is connected to NATS, else 503

Each worker owns its registry, so several workers (in tests) never collide. A worker of the
tier (worker.tier.service) adds `TierMetrics` to it: what its tier and partition owners did,
counted where it happens (worker.tier.membership, worker.tier.owner).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A claim reads the partition's whole replicated log and commits what the local file lacks.
_CATCH_UP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.inputs = Counter("kvhandoff_inputs", "Accepted inputs, by kind", ["kind"], registry=r)
        self.duplicates = Counter(
            "kvhandoff_duplicate_inputs", "Exact duplicates of logged inputs, dropped", registry=r
        )
        self.deferred = Counter(
            "kvhandoff_deferred_inputs", "Early inputs redelivered later (reordering)", registry=r
        )
        self.actions = Counter("kvhandoff_actions", "Issued actions, by kind", ["kind"], registry=r)
        self.republished = Counter(
            "kvhandoff_actions_republished", "Actions published again (no outcome yet)", registry=r
        )
        self.rejections = Counter(
            "kvhandoff_rejections", "Rejected inputs, by reason", ["reason"], registry=r
        )
        self.completed = Counter(
            "kvhandoff_handoffs_completed", "Completions, by kind", ["completion"], registry=r
        )
        self.open_handoffs = Gauge("kvhandoff_open_handoffs", "Handoffs in memory", registry=r)
        self.quarantined = Gauge(
            "kvhandoff_quarantined_handoffs",
            "Handoffs set aside because their log cannot be rebuilt",
            registry=r,
        )
        self.commit_failures = Counter(
            "kvhandoff_commit_failures",
            "Group commits that failed (and changed nothing)",
            registry=r,
        )
        self.batch_size = Histogram(
            "kvhandoff_commit_batch_size",
            "Inputs per group commit",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.commit_seconds = Histogram(
            "kvhandoff_commit_seconds",
            "Group commit latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.recovery_seconds = Gauge(
            "kvhandoff_recovery_seconds", "Time the last recovery took", registry=r
        )
        self.recovered = Gauge(
            "kvhandoff_recovered_handoffs", "Open handoffs the last recovery rebuilt", registry=r
        )

    @staticmethod
    def count(counter: Counter, tallies: Iterable[tuple[str, int]]) -> None:
        """Add a batch's tallies: one labelled increment per kind, not one per message."""
        for label, n in tallies:
            counter.labels(label).inc(n)


class TierMetrics:
    """A tier worker's ownership of partitions (worker.tier.membership, worker.tier.owner)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.owned = Gauge(
            "kvhandoff_owned_partitions", "Partitions this worker runs an owner for", registry=r
        )
        self.claims = Counter(
            "kvhandoff_partition_claims",
            "Partitions claimed, by what the log said of the previous owner: nothing (the "
            "first), handover (it handed over), takeover (it stopped without: a failover), "
            "reclaim (this worker, pinned anew or in doubt)",
            ["after"],
            registry=r,
        )
        self.fenced = Counter(
            "kvhandoff_fenced_appends",
            "Appends or claims refused because another worker claimed the partition (the "
            "owner drops it at once)",
            registry=r,
        )
        self.handovers = Counter(
            "kvhandoff_partition_handovers",
            "Partitions this worker handed over cleanly",
            registry=r,
        )
        self.catch_up_seconds = Histogram(
            "kvhandoff_catch_up_seconds",
            "Claim to ready: reading the partition's log and catching the local file up",
            buckets=_CATCH_UP_BUCKETS,
            registry=r,
        )
        self.catch_up_entries = Counter(
            "kvhandoff_catch_up_entries", "Entries of partition logs read at claims", registry=r
        )
        self.snapshots = Counter(
            "kvhandoff_snapshots",
            "Snapshots written: each replaced its partition's log before it (a fenced roll-up)",
            registry=r,
        )
        self.snapshot_bytes = Histogram(
            "kvhandoff_snapshot_bytes",
            "The partition state a snapshot holds, in bytes",
            buckets=(1e3, 1e4, 1e5, 1e6, 1e7, 1e8),
            registry=r,
        )


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not news."""


class MetricsServer:
    """Serves /metrics and /healthz until `close()`."""

    def __init__(self, metrics: Metrics, healthy: Callable[[], bool], host: str, port: int) -> None:
        metrics_app = make_wsgi_app(metrics.registry)

        def app(environ: dict[str, object], start_response: Callable[..., object]) -> list[bytes]:
            if environ.get("PATH_INFO") == "/healthz":
                ok = healthy()
                start_response(
                    "200 OK" if ok else "503 Service Unavailable",
                    [("Content-Type", "text/plain")],
                )
                return [b"ok\n" if ok else b"starting or disconnected\n"]
            body: list[bytes] = metrics_app(environ, start_response)
            return body

        self._server: WSGIServer = make_server(host, port, app, handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
