"""`--log-format json`: one JSON object per line, with the handoff id and other extras as data."""

from __future__ import annotations

import json
import logging
import sys

from kvhandoff.worker.logging_setup import JsonFormatter


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    made = logging.getLogger("kvhandoff.worker.tier.service").makeRecord(
        "kvhandoff.worker.tier.service",
        logging.WARNING,
        __file__,
        1,
        message,
        args,
        None,
        extra=extra,
    )
    return made


def test_a_line_is_one_json_object_with_the_message_formatted() -> None:
    line = JsonFormatter().format(record("handoff %s: rejected input: %s", "h-1", "why"))
    entry = json.loads(line)
    assert entry["msg"] == "handoff h-1: rejected input: why"
    assert entry["level"] == "warning"
    assert entry["logger"] == "kvhandoff.worker.tier.service"
    assert entry["ts"].endswith("Z")
    assert "\n" not in line


def test_extras_become_fields_and_exceptions_are_kept() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        made = record("commit failed", handoff_id="h-2")
        made.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(made))
    assert entry["handoff_id"] == "h-2"
    assert "ValueError: boom" in entry["exc"]
    assert "args" not in entry and "msecs" not in entry  # standard attributes stay out
