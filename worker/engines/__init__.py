"""Mock prefill (source) and decode (destination) engines that play the engines of Dynamo's
mocker on the bus. They are the first user of the engine client (`client.Engine`), which keeps
the contract every engine keeps; this package has no NATS code of its own and imports nothing
of the worker but its configuration errors.

One module per job:

    roster     the engine ids of a deployment, shared with the load generator
    model      a request's prompt length, KV blocks and timings
    capacity   one engine's KV blocks and slots, granted first come, first served
    faults     seeded fault injection (fail, drop, duplicate, delay, silence)
    report     the scatter-gather that collects the engines' reports (`events.reports`)
    engines    the source and destination engines, on `client.Engine`
    host       every engine of one process on one connection (`MockEngines`)

Errors. A roster, model or fault configuration that cannot work raises the worker's
`ConfigError` as it is built; the bus fails with the client's errors:

    worker.errors.WorkerError
    └── ConfigError              Roster, EngineModel, Faults: the message names the setting
    client.errors.ClientError
    └── BusUnavailable           MockEngines.start/stop, request_reports: NATS failed
        └── Refused              NATS refused our credentials or TLS (at connect)

An outcome or fact that the input stream would not store is logged, not raised: the worker
republishes the action and gets the stored outcome again, and a lost fact is recovered by the
handoff's deadline.
"""

from kvhandoff.worker.engines.capacity import KvCapacity
from kvhandoff.worker.engines.engines import (
    DestinationEngine,
    EnginePhase,
    MockEngine,
    SourceEngine,
)
from kvhandoff.worker.engines.faults import FailureForm, Faults
from kvhandoff.worker.engines.host import EnginesConfig, MockEngines
from kvhandoff.worker.engines.model import EngineModel, prompt_tokens
from kvhandoff.worker.engines.report import (
    EngineCounters,
    EnginesReport,
    EngineStatus,
    Leak,
    request_reports,
    settled,
)
from kvhandoff.worker.engines.roster import (
    DEFAULT_DESTINATIONS,
    DEFAULT_ENGINE_TYPES,
    DEFAULT_SOURCES,
    Roster,
)

__all__ = [
    "DEFAULT_DESTINATIONS",
    "DEFAULT_ENGINE_TYPES",
    "DEFAULT_SOURCES",
    "DestinationEngine",
    "EngineCounters",
    "EngineModel",
    "EnginePhase",
    "EngineStatus",
    "EnginesConfig",
    "EnginesReport",
    "FailureForm",
    "Faults",
    "KvCapacity",
    "Leak",
    "MockEngine",
    "MockEngines",
    "Roster",
    "SourceEngine",
    "prompt_tokens",
    "request_reports",
    "settled",
]
