"""`kvhandoff export LOG HANDOFF [-o FILE [--force]]`: one handoff's log as self-contained JSONL.

A header line (format name and version, the handoff's id and its `handoffs` row), then one
line per event: seq, at_ms, when it was published, and the record as JSON. Attach the file to
a bug report; `kvhandoff replay FILE.jsonl` (and `verify`, `list`, `stuck`) read it anywhere.

`-o FILE` never overwrites anything unless `--force` says so, and never, even then, the log it
reads (nor its -wal, -shm or -journal file), however it is named: through a symlink, a hard
link or another spelling of the path. When LOG is a partitioned worker's data directory, that
holds for each of its partition files, and no file is added to the directory under a partition
file's name, which the next read of the directory would take for a partition's log. The export
is written to a temporary file beside FILE and then renamed over it, so FILE is either the
whole export or what it was before; a symlink at FILE is replaced, not followed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from kvhandoff.worker.commands import _offline, _text
from kvhandoff.worker.log.reader import PARTITION_FILE, open_log, write_jsonl
from kvhandoff.worker.log.rows import HandoffLog

# The files beside a SQLite database that hold part of it.
_SQLITE_SIBLINGS = ("", "-wal", "-shm", "-journal")


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser)
    parser.add_argument("handoff", help="handoff id or a unique prefix")
    parser.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="write here instead of stdout"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace FILE if it exists (never the log itself)"
    )


@_offline.offline_command("export")
def execute(args: argparse.Namespace) -> int:
    output: Path | None = args.output
    if output is not None:
        if (clash := _source_file(args.log, output)) is not None:
            return _offline.fail("export", f"{output} is {clash}: refusing to write over the log")
        if os.path.lexists(output) and not args.force:
            return _offline.fail("export", f"{output} exists (--force replaces it)")
    with open_log(args.log) as log:
        handoff = log.load(log.resolve(args.handoff))
    if output is None:
        write_jsonl(handoff, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return _offline.EXIT_OK
    try:
        _write(handoff, output, replace=args.force)
    except FileExistsError:
        return _offline.fail("export", f"{output} exists (--force replaces it)")
    except OSError as exc:
        return _offline.fail("export", f"cannot write {output}: {exc.strerror}")
    events = _text.count(len(handoff.events), "event")
    print(f"wrote {events} of handoff {handoff.handoff.handoff_id} to {output}", file=sys.stderr)
    return _offline.EXIT_OK


def _source_file(log: Path, output: Path) -> str | None:
    """Which file of the log `output` names, if it names one (following every symlink)."""
    if not log.is_dir():
        match _sqlite_file(log, output):
            case None:
                return None
            case "":
                return "the log"
            case suffix:
                return f"the log's {suffix[1:]} file"
    for partition in sorted(log.iterdir()):
        if not PARTITION_FILE.fullmatch(partition.name):
            continue
        if (suffix := _sqlite_file(partition, output)) is not None:
            return f"the log's {partition.name}{suffix}"
    if PARTITION_FILE.fullmatch(output.name) and _same(output.parent, log):
        return "a partition log's name in the data directory it reads"
    return None


def _sqlite_file(log: Path, output: Path) -> str | None:
    """Which file of one SQLite log `output` names, if it names one: "" for the database,
    else the suffix of its sibling ("-wal", ...)."""
    for suffix in _SQLITE_SIBLINGS:
        if _same(output, Path(os.path.realpath(log) + suffix)):
            return suffix
    return None


def _same(path: Path, other: Path) -> bool:
    """Whether the two paths name one file (following every symlink)."""
    if os.path.realpath(path) == os.path.realpath(other):
        return True
    # A hard link, or a path realpath cannot see through (a bind mount): same inode.
    with contextlib.suppress(OSError):
        return os.path.samefile(path, other)
    return False


def _write(handoff: HandoffLog, output: Path, *, replace: bool) -> None:
    """Write beside `output`, then move into place: replacing it, or only if there is none."""
    fd, temporary = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private; give it the mode open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as out:
            write_jsonl(handoff, out)
            out.flush()
            os.fsync(out.fileno())
        if replace:
            os.replace(temporary, output)
        else:
            # link() refuses to replace anything, even a file created since the check above.
            os.link(temporary, output)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
