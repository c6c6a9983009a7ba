"""A real, small filesystem for tests that need a full disk: a tmpfs mounted under the test's
`tmp_path`. A full tmpfs fails writes with ENOSPC exactly as a full disk does, so SQLite reports
SQLITE_FULL ("database or disk is full") through its ordinary code paths.

Mounting needs root (the test machines run as root); elsewhere the test is skipped and says why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(tmp_path: Path, size_kib: int) -> Iterator[Path]:
    """Mount a tmpfs of `size_kib` KiB (rounded up to whole pages) and yield its directory.

    It is unmounted at exit even when files on it are still open (a lazy unmount), so that a
    failing test cannot leave a mount behind inside pytest's temporary directories.
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for a full-disk test needs root")
    mountpoint = tmp_path / f"tmpfs-{size_kib}k"
    mountpoint.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(mountpoint)],
        check=True,
        capture_output=True,
    )
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "--lazy", str(mountpoint)], check=True, capture_output=True)


def fill(directory: Path) -> Path:
    """Write a file in `directory` until its filesystem has no space left; return the file.

    Deleting the file frees the space again.
    """
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as out:
        block = b"\0" * 4096
        while True:
            try:
                out.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return filler
