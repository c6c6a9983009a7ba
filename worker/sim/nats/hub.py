"""The seam between the simulated server's core (`server`) and its JetStream model.

The core routes every published message to the subscriptions that match it and hands it to
the `Extension` (JetStream) too, as a real server's JetStream sees the publishes on the
subjects it listens on. The extension answers and delivers through the `Hub`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Hub(Protocol):
    """What JetStream may ask of the core."""

    def send(
        self,
        subject: str,
        payload: bytes = b"",
        *,
        reply: str = "",
        headers: Mapping[str, str] | None = None,
        status: str = "",
        as_subject: str = "",
    ) -> None:
        """Deliver a message to every subscription on `subject` (none: it is dropped).
        `status` is a status line's code and text, such as "404 No Messages": the message
        then carries `NATS/1.0 404 No Messages` as its header line, as the server's do.
        `as_subject`, if given, is the subject the subscribers see instead of `subject`: a
        JetStream delivery goes to a pull request's inbox (or a push consumer's deliver
        subject) but carries its stream message's own subject, as the server's `MSG` does."""
        ...

    def has_interest(self, subject: str) -> bool:
        """Whether any subscription matches `subject` (a pull request's reply inbox is gone
        when its client disconnected or unsubscribed)."""
        ...


class Extension(Protocol):
    """What the core tells JetStream."""

    def on_publish(
        self, subject: str, reply: str, headers: Mapping[str, str] | None, payload: bytes
    ) -> bool:
        """A client published: JetStream answers an API request, settles an ack, or stores
        the message in the stream that captures `subject`. Called after the core routed it.

        Returns whether JetStream took the message: whether it listens on `subject`, as a
        real server's JetStream holds subscriptions there (its API, `$JS.API.>`, whether it
        answers now, later or never; a live consumer's `$JS.API.CONSUMER.MSG.NEXT.<stream>.
        <consumer>` and ack subjects, which only that consumer listens on; a stream's
        subjects). A request (a publish with a reply subject) that no subscription and no
        JetStream took gets the 503 no-responders status: a pull request to a consumer that
        does not exist, or an acknowledgement with a reply to a deleted consumer's message."""
        ...
