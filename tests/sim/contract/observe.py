"""What the contracts read of the server besides what the tier's functions return, and how
they take messages from a `Pull`.

State is read through the raw JetStream API (`worker.bus.streams.js_api`), the wire that both
backends answer, never through a backend's insides: a stream's state and subjects, a
consumer's info. Every wait here is on the bus (a fetch's timeout) or through
`tests.eventually.until`, bounded by `WITHIN_S` of the running loop's clock.
"""

from __future__ import annotations

from typing import Any

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound, Pull
from kvhandoff.worker.bus.streams import js_api

# The bound of a wait for what should take milliseconds: generous, since a busy machine (the
# real backend shares two cores) is slow, never wrong.
WITHIN_S = 10.0


async def stream_state(bus: Bus, stream: str, subjects: str | None = None) -> dict[str, Any]:
    """The stream's `state` (messages, first_seq, last_seq, ...); with `subjects`, a filter,
    its `subjects` too: each stored subject that matches, with its count."""
    request: dict[str, Any] = {} if subjects is None else {"subjects_filter": subjects}
    info = await js_api(bus, f"$JS.API.STREAM.INFO.{stream}", request, f"info of {stream}")
    state: dict[str, Any] = info["state"]
    return state


async def stored_subjects(bus: Bus, stream: str) -> dict[str, int]:
    """Every subject the stream holds a message on, with how many."""
    subjects: dict[str, int] = (await stream_state(bus, stream, ">")).get("subjects") or {}
    return subjects


async def consumer_info(bus: Bus, stream: str, consumer: str) -> dict[str, Any]:
    return await js_api(
        bus, f"$JS.API.CONSUMER.INFO.{stream}.{consumer}", {}, f"info of {stream} / {consumer}"
    )


async def take(pull: Pull, count: int, within: float = WITHIN_S) -> list[Inbound]:
    """The next `count` messages of `pull`, fetched until they came; fails if one does not
    come within `within` seconds of the one before."""
    got: list[Inbound] = []
    while len(got) < count:
        batch = await pull.fetch(count - len(got), timeout_s=within)
        assert batch, f"only {len(got)} of {count} messages within {within:g}s"
        got += batch
    return got


def seqs(inbounds: list[Inbound]) -> list[tuple[int, int]]:
    """(stream sequence, deliveries) of each message, as the contracts compare them."""
    return [(inbound.stream_seq, inbound.deliveries) for inbound in inbounds]
