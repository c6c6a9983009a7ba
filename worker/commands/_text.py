"""How the offline log commands print for people: rich tables on a terminal, plain aligned
columns otherwise (stable, and easy to grep, cut and awk), and one compact spelling of times,
durations, inputs, actions and state values that every command shares.

Every string taken from a log (engine ids, reasons, states, error messages that quote them)
goes through `printable` before it is printed as text, so that a log cannot drive the terminal
that shows it: control characters (C0, DEL, C1) print as `\\xNN`. JSON output is data, and
keeps every string as logged (the encoder escapes C0 characters).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from msgspec import Struct
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvhandoff.events.messages import Action, ActionOutcome, Failed
from kvhandoff.events.replay import Change
from kvhandoff.worker.log.rows import HandoffRow

# C0 (including tab and newline: a log string must not break a line or a column), DEL, and C1.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def printable(text: str) -> str:
    """`text` with every control character (C0, DEL, C1) spelled `\\xNN`."""
    return text.translate(_CONTROL)


def console() -> Console:
    """A console on the current stdout; rich decides from it whether stdout is a terminal."""
    return Console(file=sys.stdout, highlight=False)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table: drawn by rich on a terminal, plain aligned text otherwise."""
    out = console()
    if out.is_terminal:
        table = Table(*columns)
        for row in rows:
            # Text, not markup: values such as "[submit_prefill(0)]" must print as they are.
            table.add_row(*map(Text, row))
        out.print(table)
        return
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    for line in (columns, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())


def print_fields(pairs: Sequence[tuple[str, str]], indent: int = 2) -> None:
    """Labelled lines, the labels padded to one width."""
    if not pairs:
        return
    width = max(len(label) for label, _ in pairs)
    for label, value in pairs:
        print(f"{' ' * indent}{label.ljust(width)}  {value}")


def state(handoff: HandoffRow) -> str:
    """A handoff's state; one this build does not know as written, marked `(unknown)`."""
    if handoff.state is not None:
        return handoff.state.value
    return f"{printable(handoff.state_name)}(unknown)"


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def instant(ms: int | None) -> str:
    """Epoch milliseconds as ISO 8601 UTC with milliseconds."""
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def duration(ms: int | None) -> str:
    """A duration in its two largest units: 850ms, 12.3s, 4m05s, 3h02m, 12d04h."""
    if ms is None:
        return "-"
    sign, ms = ("-", -ms) if ms < 0 else ("", ms)
    if ms < 1_000:
        text = f"{ms}ms"
    elif ms < 60_000:
        text = f"{ms / 1000:.1f}s"
    elif ms < 3_600_000:
        text = f"{ms // 60_000}m{ms // 1000 % 60:02d}s"
    elif ms < 86_400_000:
        text = f"{ms // 3_600_000}h{ms // 60_000 % 60:02d}m"
    else:
        text = f"{ms // 86_400_000}d{ms // 3_600_000 % 24:02d}h"
    return sign + text


def action(a: Action) -> str:
    """`kind(id)` and any further fields: `start_transfer(2) delay_ms=21.47483648`."""
    extra = [
        f"{name}={value(getattr(a, name))}"
        for name in a.__struct_fields__
        if name not in ("handoff_id", "action_id")
    ]
    return " ".join([f"{_tag(a)}({a.action_id})", *extra])


def actions(items: Sequence[Action]) -> str:
    return ", ".join(action(a) for a in items) or "-"


def message(m: Struct) -> str:
    """An input: its kind and fields, without the handoff id that every input repeats."""
    if isinstance(m, ActionOutcome):
        outcome = m.outcome
        fields = _fields(outcome, skip=())
        by = ["by the tier (engine lease gone)"] if m.by_tier else []
        return " ".join([f"{_tag(m)}({m.action_id}) {_tag(outcome)}", *fields, *by])
    return " ".join([_tag(m), *_fields(m, skip=("handoff_id",))])


def brief(m: Struct) -> str:
    """An input's kind alone, or for an outcome, which action and what it answered, and who:
    an outcome the tier gave for an engine whose lease was gone says so, as does a `Failed`
    that carries the tier's reason."""
    if isinstance(m, ActionOutcome):
        by = " by the tier (engine lease gone)" if m.by_tier else ""
        return f"{_tag(m)}({m.action_id}) {_tag(m.outcome)}{by}"
    if isinstance(m, Failed) and m.reason is not None:
        return f"{_tag(m)} ({printable(m.reason)})"
    return _tag(m)


def value(v: object) -> str:
    """One value, compactly: enums by value, Structs by kind and fields, tuples as lists."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, Action):
        return action(v)
    if isinstance(v, Struct):
        inner = " ".join(_fields(v, skip=("handoff_id",)))
        tag = v.__struct_config__.tag
        return f"{tag} {inner}".strip() if isinstance(tag, str) else "{" + inner + "}"
    if isinstance(v, tuple | list):
        if len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], Struct):
            return f"{v[0]}:{value(v[1])}"  # one (action id, outcome) of `outcomes`
        return "[" + ", ".join(value(item) for item in v) + "]"
    return printable(str(v))


def change(c: Change) -> str:
    """One changed state field; for the action and outcome lists, what was added or removed."""
    if isinstance(c.before, tuple) and isinstance(c.after, tuple):
        added = [value(i) for i in c.after if i not in c.before]
        removed = [value(i) for i in c.before if i not in c.after]
        return f"{c.field} " + " ".join([*(f"+{a}" for a in added), *(f"-{r}" for r in removed)])
    return f"{c.field} {value(c.before)} → {value(c.after)}"


def _tag(s: Struct) -> str:
    tag = s.__struct_config__.tag
    return tag if isinstance(tag, str) else type(s).__name__


def _fields(s: Struct, skip: Sequence[str]) -> list[str]:
    return [f"{name}={value(getattr(s, name))}" for name in s.__struct_fields__ if name not in skip]
