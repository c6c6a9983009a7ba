"""Identifiers and numeric constraints shared by every message.

The constraints are msgspec `Meta` annotations, so they are enforced when a message is decoded
from the wire or the log, and cost nothing when the core constructs messages itself.
"""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

from msgspec import Meta

#: One prefill-to-decode handoff attempt. Chosen by whoever starts the handoff.
HandoffId = UUID

#: The per-handoff action counter: 0, 1, 2, ... in the order the coordinator issued them.
ActionId = Annotated[int, Meta(ge=0, description="per-handoff action counter, from 0")]

#: An engine's name, used verbatim as one token of a NATS subject, hence no '.', '*', '>'
#: or whitespace.
EngineId = Annotated[
    str,
    Meta(
        pattern=r"^[^.*>\s]+$",
        min_length=1,
        max_length=128,
        description="NATS-subject-safe token: no '.', '*', '>' or whitespace",
    ),
]

TokenCount = Annotated[int, Meta(ge=0)]
ByteCount = Annotated[int, Meta(ge=0)]
Milliseconds = Annotated[float, Meta(ge=0.0)]
PositiveMilliseconds = Annotated[int, Meta(gt=0)]
