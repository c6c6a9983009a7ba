"""The one way a person writes a span of time.

(The wall clock the worker stamps records, deadlines and ages with is `worker.ambient.now_ms`,
the port the simulation swaps.)

One duration grammar for every flag and environment variable that takes a span (`run
--retry-interval`, `stuck --older-than`, `load --wait-timeout`, ...): a sum of numbers, each
followed by one of the units `ms`, `s`, `m`, `h`, `d`, such as `250ms`, `30s`, `1h30m` or
`1d 12h`; or a bare number, which means seconds (`30` is `30s`). Numbers may have a fraction
(`0.5m`), never a sign or an exponent. Whitespace may stand around and between the parts.
`parse_duration` reads it as seconds, `parse_duration_ms` as whole milliseconds; both raise
`ConfigError` naming the text, and `duration_arg`/`duration_ms_arg` are the same parsers as
argparse types, which turn it into argparse's usage error.
"""

from __future__ import annotations

import argparse
import re

from kvhandoff.worker.errors import ConfigError

#: How a flag's help says what a duration is.
DURATION_HELP = (
    "a number with a unit, or a sum of them, such as 250ms, 30s, 5m or 1h30m;"
    " a bare number is seconds"
)

_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_NUMBER = r"\d+(?:\.\d+)?"
# `ms` before `m`, so that `5ms` is five milliseconds, not five minutes and a stray `s`.
_PART = re.compile(rf"\s*({_NUMBER})\s*(ms|s|m|h|d)")
_BARE = re.compile(rf"\s*({_NUMBER})\s*")


def _milliseconds(text: str) -> float:
    bare = _BARE.fullmatch(text)
    if bare is not None:
        return float(bare.group(1)) * _UNIT_MS["s"]
    total, position = 0.0, 0
    while (part := _PART.match(text, position)) is not None:
        total += float(part.group(1)) * _UNIT_MS[part.group(2)]
        position = part.end()
    if position == 0 or text[position:].strip():
        raise ConfigError(f"not a duration: {text!r} (a duration is {DURATION_HELP})")
    return total


def parse_duration(text: str) -> float:
    """A duration (module docstring) in seconds."""
    return _milliseconds(text) / 1_000


def parse_duration_ms(text: str) -> int:
    """A duration (module docstring) in whole milliseconds."""
    return round(_milliseconds(text))


def duration_arg(text: str) -> float:
    """`parse_duration` as an argparse type: a bad value is a usage error."""
    try:
        return parse_duration(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def duration_ms_arg(text: str) -> int:
    """`parse_duration_ms` as an argparse type: a bad value is a usage error."""
    try:
        return parse_duration_ms(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
