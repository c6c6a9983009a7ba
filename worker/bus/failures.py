"""How nats-py's failures read once translated: the words of the bus's one error seam.

Every module of `worker.bus` catches nats-py's exceptions where it calls nats-py and raises
`worker.errors.BusError` (or a subclass) `from` them, so nothing outside the package ever sees
a driver error; this module holds what those translations share: the text of a failure
(`why`), a JetStream API refusal read from a raw answer as nats-py would raise it
(`api_error`), which failures mean "no answer yet, ask again" (`RETRYABLE`), and the headers
in which the server reports a status instead of a message.
"""

from __future__ import annotations

from typing import Any

import nats.errors
import nats.js.errors

# JetStream does not answer while a stream is created or NATS reconnects: retried.
RETRYABLE = (
    TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
)
# A status message (a pull's 404/408/409, a request's 503) is headers only: these two.
STATUS = "Status"
DESCRIPTION = "Description"


def why(exc: BaseException) -> str:
    """An exception's message, or its type when it has none (nats-py's timeouts)."""
    return str(exc) or type(exc).__name__


def api_error(error: object) -> nats.js.errors.APIError:
    """The error of a JetStream API answer read by `worker.bus.streams.js_api`, as nats-py
    raises those it reads itself: one text for a refusal, whichever path asked."""
    fields: dict[Any, Any] = error if isinstance(error, dict) else {"description": str(error)}
    return nats.js.errors.APIError(
        code=fields.get("code"),
        err_code=fields.get("err_code"),
        description=fields.get("description"),
    )
