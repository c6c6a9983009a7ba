"""kvhandoff's client library: write an engine or a frontend against this package alone.

    from kvhandoff.client import Connection, Engine, Frontend, Handlers

- `Connection`: one NATS connection with the shared `--nats-*`/`--tls-*` settings
  (`worker.bus.settings.NatsSettings`); engines and a frontend of one process can share it.
- `Engine` (`client.engine`): subscribes to an engine id's actions, dispatches each kind to a
  typed handler (`Handlers`), runs each action id once and answers a repeated id with the
  stored outcome, and stores outcomes and facts durably (`source_held`,
  `destination_reserved`, `transfer_completed`, `failed`).
- `Frontend` (`client.frontend`): `start` a handoff, `wait` for the `Complete` that ends it with
  no window in which one can be missed, `cancel` it, read its `state`.

Every error is a `ClientError` (`client.errors` draws the tree). All NATS traffic goes through
`worker.bus`, the project's one NATS package; this package imports `events` (the wire
vocabulary) and, of the worker, only the bus and its settings and errors.
"""

from kvhandoff.client.connection import Connection
from kvhandoff.client.engine import Engine, EngineStats, Handlers, HandoffFacts, Interference
from kvhandoff.client.errors import (
    BusUnavailable,
    ClientError,
    CompletionTimeout,
    HandoffRejected,
    OutcomeLogFailed,
    Refused,
)
from kvhandoff.client.frontend import CompletionStatus, Frontend

__all__ = [
    "BusUnavailable",
    "ClientError",
    "CompletionStatus",
    "CompletionTimeout",
    "Connection",
    "Engine",
    "EngineStats",
    "Frontend",
    "Handlers",
    "HandoffFacts",
    "HandoffRejected",
    "Interference",
    "OutcomeLogFailed",
    "Refused",
]
