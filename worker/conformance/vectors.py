"""Reading the reference conformance vectors from their files, for `events.conformance`.

The vectors are JSONL, one case a line, gzip-compressed (`.gz`) or plain. The core checks
cases and does no IO, so the files are opened here, in the shell, and their cases streamed to
`events.conformance.check` one at a time (the reference set is 1,500 cases).
"""

from __future__ import annotations

import gzip
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvhandoff.events import conformance


def read_cases(path: Path) -> Iterator[dict[str, Any]]:
    """Cases from a JSONL file, gzip-compressed or plain."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as lines:
        for line in lines:
            if line.strip():
                yield msgspec.json.decode(line)


def run(paths: Iterable[Path], keep: int = 5) -> conformance.Report:
    """Check every case in the files; keep the first `keep` mismatches for display."""
    return conformance.check(itertools.chain.from_iterable(map(read_cases, paths)), keep)
