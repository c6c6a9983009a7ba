"""What the JetStream model's streams and consumers share: stored messages and API answers.

JetStream's API is JSON over request/reply (`$JS.API.<...>`); an answer that failed carries
`{"error": {"code", "err_code", "description"}}`, which nats-py turns into its `APIError`
subclasses by `code` and `err_code`. The model answers with the codes the real server uses
(server/jetstream_errors_generated.go), since the tier's bus tells refusals apart by them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvhandoff.worker.sim.nats.hub import Hub

_encode = msgspec.json.encode


@dataclass(frozen=True)
class Stored:
    """One message in a stream, as the stream stored it."""

    seq: int
    subject: str
    headers: Mapping[str, str] | None
    payload: bytes
    time_ns: int  # the wall clock when it was stored (`Nats-Time-Stamp`, the ack's metadata)


class StreamView(Protocol):
    """What a consumer reads of its stream."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> Mapping[str, Any]:
        """The stream's configuration, as the API's `StreamConfig` JSON."""
        ...

    def first_seq(self) -> int: ...

    def last_seq(self) -> int: ...

    def get(self, seq: int) -> Stored | None:
        """The message at `seq`, or None if there is none (never stored, or removed)."""
        ...

    def next_after(self, seq: int, filters: Sequence[str]) -> Stored | None:
        """The first message after `seq` whose subject matches one of `filters` (all, if
        `filters` is empty)."""
        ...

    def count_after(self, seq: int, filters: Sequence[str]) -> int:
        """How many messages after `seq` match `filters` (a consumer's `num_pending`)."""
        ...

    def remove(self, seq: int) -> bool:
        """Remove the message at `seq` (a work-queue stream's acknowledged message); whether
        there was one."""
        ...


def answer(hub: Hub, reply: str, body: Mapping[str, Any]) -> None:
    """Send an API answer to the request's reply subject (none: nobody asked for one)."""
    if reply:
        hub.send(reply, _encode(body))


def refuse(hub: Hub, reply: str, code: int, err_code: int, description: str) -> None:
    """Send an API error, as the server's: `code` is the HTTP-like status, `err_code` the
    JetStream error code (10059 stream not found, 10014 consumer not found, 10071 wrong last
    sequence, ...)."""
    answer(
        hub,
        reply,
        {"error": {"code": code, "err_code": err_code, "description": description}},
    )
