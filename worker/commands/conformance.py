"""`kvhandoff conformance FILE...`: the reference vectors, run through the coordinator."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvhandoff.worker.commands import _offline
from kvhandoff.worker.conformance import vectors


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, help="JSONL vector files (.gz or plain)")
    parser.add_argument("--show", type=int, default=5, help="mismatches to print (default 5)")


def execute(args: argparse.Namespace) -> int:
    report = vectors.run(args.files, keep=args.show)
    with _offline.printing():  # the status is the run's, whether or not all of it was read
        for mismatch in report.mismatches:
            print(mismatch)
        print(report.summary())
    return 0 if report.failed == 0 else 1
