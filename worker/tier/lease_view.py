"""What a worker last knew of the engines' leases, in a small file beside its event log, so that
the offline tools (`kvhandoff stuck`), which never reach NATS, can say whether an engine that a
handoff waits on held a live lease.

`worker.tier.leases.EngineLeases` writes it whenever an engine's lease state changes (not at every
renewal): `<db>.leases.json` beside a one-partition worker's file, `DIR/leases.json` in a data
directory. It is a view, not a record: the lease bucket is the truth, and the file is as old as
its `at_ms` says (a stopped worker's file keeps what it last knew).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)


class LeaseView(msgspec.Struct, frozen=True):
    """Engine id -> `live` or `expired`, as of `at_ms`."""

    at_ms: int
    engines: dict[str, str]


_DECODER = msgspec.json.Decoder(LeaseView)


def view_path(log: Path) -> Path:
    """Where the view of the log at `log` (a file, or a data directory) lives."""
    return log / "leases.json" if log.is_dir() else log.with_name(f"{log.name}.leases.json")


def write_view(path: Path, view: LeaseView) -> None:
    """Replace the file whole (a reader never sees half of it); a failure is logged only: the
    view is for people, and the tier's behaviour does not depend on it."""
    partial = path.with_name(f"{path.name}.tmp")
    try:
        partial.write_bytes(msgspec.json.encode(view))
        os.replace(partial, path)
    except OSError as exc:
        logger.warning("could not write the lease view %s: %s", path, exc)


def read_view(log: Path) -> LeaseView | None:
    """The view beside the log at `log`, or None if there is none or it does not read."""
    try:
        return _DECODER.decode(view_path(log).read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
