"""`kvhandoff health`: exit 0 if the local worker reports healthy (for container healthchecks)."""

from __future__ import annotations

import argparse
import os

from kvhandoff.worker.harness.health import answers_ok, worker_healthz


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=worker_healthz(int(os.environ.get("KVHANDOFF_METRICS_PORT", "9464"))),
        help="health endpoint (default %(default)s)",
    )


def execute(args: argparse.Namespace) -> int:
    healthy = answers_ok(args.url, timeout_s=3)
    print("healthy" if healthy else f"unhealthy: {args.url} did not answer 200")
    return 0 if healthy else 1
