"""`kvhandoff health`: exit 0 if the local worker reports healthy (for container healthchecks)."""

from __future__ import annotations

import argparse
import os
import urllib.error
import urllib.request


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:{}/healthz".format(
            os.environ.get("KVHANDOFF_METRICS_PORT", "9464")
        ),
        help="health endpoint (default %(default)s)",
    )


def execute(args: argparse.Namespace) -> int:
    try:
        with urllib.request.urlopen(args.url, timeout=3) as response:
            healthy: bool = response.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {exc}")
        return 1
    print("healthy" if healthy else "unhealthy")
    return 0 if healthy else 1
