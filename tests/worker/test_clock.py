"""The one duration grammar (`worker.clock`): what it reads, what it refuses, and that every flag
that takes a duration reads it the same way."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvhandoff.worker.cli import build_parser
from kvhandoff.worker.clock import parse_duration, parse_duration_ms
from kvhandoff.worker.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7_200.0),
        ("7d", 604_800.0),
        ("1.5", 1.5),
        ("30", 30.0),
        ("0.5m", 30.0),
        (" 10 s ", 10.0),
        ("0", 0.0),
        ("1h30m", 5_400.0),
        ("1h 30m", 5_400.0),
        ("1m30s250ms", 90.25),
        ("5ms", 0.005),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    assert parse_duration_ms(text) == round(seconds * 1000)


@pytest.mark.parametrize(
    "text",
    ["", "s", "soon", "5x", "-1s", "1e3", "5mm", "1,5s", "5 m s", "1m30", "30 30", "h1"],
)
def test_parse_duration_rejects_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(ConfigError, match=f"not a duration: {re.escape(repr(text))}"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run"], "retry_interval"),
        (["run"], "completion_ttl"),
        (["run"], "retention"),
        (["load", "--handoffs", "1"], "wait_timeout"),
        (["stuck"], "older_than"),
        (["compact"], "older_than"),
    ],
)
@pytest.mark.parametrize(("text", "seconds"), [("1h30m", 5_400), ("30", 30), ("250ms", 0.25)])
def test_every_duration_flag_reads_the_one_grammar(
    argv: list[str], flag: str, text: str, seconds: float
) -> None:
    option = "--" + flag.replace("_", "-")
    args = build_parser(argv).parse_args([*argv, option, text])
    # The worker's flags are in seconds, the offline tools' in milliseconds.
    unit = 1000 if argv[0] in ("stuck", "compact") else 1
    assert getattr(args, flag) == pytest.approx(seconds * unit)


def test_the_help_says_what_a_duration_is() -> None:
    for command in ("run", "load", "stuck", "compact"):
        result = subprocess.run(
            [sys.executable, "-m", "kvhandoff.worker.cli", command, "--help"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "a bare number is seconds" in " ".join(result.stdout.split()), command
