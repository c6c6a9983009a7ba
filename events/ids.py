"""Identifiers and the constraints on every value a message carries.

The constraints are msgspec `Meta` annotations, so they are enforced when a message is decoded
from the wire, and cost nothing when the core constructs messages itself. They appear in the
JSON Schema (`kvhandoff schema`) with the reason for each, and the Messages section of
`docs/handoff.md` lists them.

Why every value is bounded: a message that decodes is logged, digested, re-encoded, stored in
SQLite and turned into timers. A value that any of those cannot hold (an integer past int64, a
deadline past the clock, a non-finite float) used to pass decoding and crash the worker later,
on every restart, because the input was never acknowledged. So the bounds are what every
consumer can hold, and strings that tools print carry no terminal control characters.

The log is history: `events.codec.decode_record` reads a stored record even when its values
lie outside these bounds (they were written before the bounds existed).
"""

from __future__ import annotations

import sys
from typing import Annotated
from uuid import UUID

from msgspec import Meta

#: The largest integer any message carries: every JSON peer reads it exactly (an IEEE double,
#: which is all JavaScript has, holds integers up to 2**53 exactly), and msgpack and SQLite
#: (int64) hold it with room to add to it.
MAX_EXACT_INT = 2**53 - 1

#: The longest deadline or delay, in ms: 2**31 - 1, about 24.8 days. Far beyond any real
#: handoff, it keeps `now_ms + deadline_ms` inside int64 for any clock, and it is the largest
#: delay a signed 32-bit millisecond timer (JavaScript's `setTimeout`, many others) can arm.
MAX_TIMER_MS = 2**31 - 1

#: The highest KV transfer bandwidth, in GB/s: 1 PB/s, hundreds of times any interconnect.
MAX_BANDWIDTH_GB_S = 1e6

#: The longest free-text reason, in characters: enough for a sentence naming the engine and the
#: cause, short enough for a log line and a terminal row.
MAX_REASON_LENGTH = 1024

# C0 controls, DEL and C1 controls: ESC and CSI (0x9b) drive terminals, NUL truncates C strings.
_CONTROL = r"\x00-\x1f\x7f-\x9f"
# The end of the string. `$` would also match before a final newline in Python's `re` (which
# msgspec uses), letting "id\n" through; `\Z` means something else in ECMA-262, the dialect of
# JSON Schema's `pattern`. A lookahead for "no character at all" means the same in both.
_END = r"(?![\s\S])"

#: One prefill-to-decode handoff attempt. Chosen by whoever starts the handoff.
HandoffId = UUID

#: The per-handoff action counter: 0, 1, 2, ... in the order the coordinator issued them.
ActionId = Annotated[
    int,
    Meta(
        ge=0,
        le=MAX_EXACT_INT,
        description="per-handoff action counter, from 0; at most 2**53 - 1 (exact in JSON)",
    ),
]

#: An engine's name, used verbatim as one token of a NATS subject, hence no '.', '*', '>'
#: or whitespace; and printed by the log tools, hence no control characters.
EngineId = Annotated[
    str,
    Meta(
        pattern=rf"^[^.*>\s{_CONTROL}]+{_END}",
        min_length=1,
        max_length=128,
        description=(
            "NATS-subject-safe token: no '.', '*', '>', whitespace or control characters "
            "(U+0000-U+001F, U+007F-U+009F)"
        ),
    ),
]

#: Free text that the tools print, such as why an engine failed an action.
Reason = Annotated[
    str,
    Meta(
        pattern=rf"^[^{_CONTROL}]*{_END}",
        max_length=MAX_REASON_LENGTH,
        description=(
            "free text for people, printed by the tools: at most 1024 characters, "
            "no control characters (U+0000-U+001F, U+007F-U+009F)"
        ),
    ),
]

#: How many of something an engine counts: blocks, slots, receipts, handoffs.
Count = Annotated[
    int, Meta(ge=0, le=MAX_EXACT_INT, description="a count; at most 2**53 - 1 (exact in JSON)")
]
TokenCount = Annotated[
    int, Meta(ge=0, le=MAX_EXACT_INT, description="tokens; at most 2**53 - 1 (exact in JSON)")
]
ByteCount = Annotated[
    int, Meta(ge=0, le=MAX_EXACT_INT, description="bytes; at most 2**53 - 1 (exact in JSON)")
]
BandwidthGBs = Annotated[
    float,
    Meta(
        ge=0.0,
        le=MAX_BANDWIDTH_GB_S,
        description="GB/s, finite, at most 1e6 (1 PB/s); 0 means no bandwidth model",
    ),
]
Milliseconds = Annotated[
    float,
    Meta(
        ge=0.0,
        le=float(MAX_TIMER_MS),
        description="ms, finite, at most 2**31 - 1 (about 24.8 days, the longest timer)",
    ),
]
PositiveMilliseconds = Annotated[
    int,
    Meta(
        gt=0,
        le=MAX_TIMER_MS,
        description=(
            "ms from the start, at most 2**31 - 1 (about 24.8 days): now + deadline fits "
            "int64 and a 32-bit millisecond timer"
        ),
    ),
]
#: A delay the coordinator computed from the source's timing: not capped, since the reference
#: semantics accept any finite delay, but never negative, infinite or NaN.
TransferDelay = Annotated[
    float,
    Meta(
        ge=0.0,
        le=sys.float_info.max,
        description="ms, finite and >= 0 (computed by the coordinator from the source's timing)",
    ),
]
