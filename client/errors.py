"""The client's exceptions, rooted at one class. `worker.bus`'s errors are translated into these
at one seam, `client.connection.Connection`, and SQLite's at another, `client.outcomes`, with
`raise ... from exc`, so that a user of the client catches the client's errors alone.

    ClientError
    ├── BusUnavailable       NATS or JetStream failed, or did not answer in time
    │   └── Refused          NATS refused our credentials or TLS: retrying cannot help
    ├── HandoffRejected      the worker rejected the `StartHandoff` the frontend waits on
    ├── CompletionTimeout    `Frontend.wait` saw no final `Complete` within its timeout
    └── OutcomeLogFailed     an engine's outcome log (SQLite) could not be opened or written
"""

from __future__ import annotations


class ClientError(Exception):
    """Root of every error the client raises."""


class BusUnavailable(ClientError):
    """NATS or JetStream failed or did not answer; the message says which operation."""


class Refused(BusUnavailable):
    """NATS refused the connection for good (authentication or TLS); the message names the
    setting to check."""


class HandoffRejected(ClientError):
    """The worker rejected the handoff's `StartHandoff`; the message quotes its reason."""


class CompletionTimeout(ClientError):
    """No final `Complete` for the handoff within the wait's timeout. The handoff may still
    complete: `Frontend.state` reads its state later."""


class OutcomeLogFailed(ClientError):
    """An engine's outcome log could not be opened (or belongs to another engine), read or
    written; the message names the file."""
