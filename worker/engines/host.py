"""The process host: every mock engine of one process, on one client `Connection`.

It builds the engines of the roster, subscribes them, follows the completions (`Complete` on
`<prefix>.done.>`) so each engine can tell a leak from a handoff still running, and answers
report requests on `<prefix>.engines.report` with one `EnginesReport`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from kvhandoff.client import Connection
from kvhandoff.client.connection import Watch
from kvhandoff.client.lease import DEFAULT_LEASE_TTL_S
from kvhandoff.events.codec import encode
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import Complete
from kvhandoff.worker import ambient
from kvhandoff.worker.engines.engines import DestinationEngine, MockEngine, SourceEngine
from kvhandoff.worker.engines.faults import Faults
from kvhandoff.worker.engines.model import EngineModel
from kvhandoff.worker.engines.report import EnginesReport
from kvhandoff.worker.engines.roster import Roster
from kvhandoff.worker.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnginesConfig:
    roster: Roster = field(default_factory=Roster)
    model: EngineModel = field(default_factory=EngineModel)
    faults: Faults = field(default_factory=Faults)
    # Engine ids of the roster that another process serves (`kvhandoff demo --external-engine`).
    left_out: frozenset[str] = frozenset()
    # How many completed handoffs each engine remembers (to answer repeats and to spot leaks);
    # older ones that hold nothing are forgotten, so a long run has bounded memory.
    retain_completed: int = 100_000
    # Each engine's lease (client.lease); None: the engines take none (today's engines).
    lease_ttl_s: float | None = DEFAULT_LEASE_TTL_S

    def __post_init__(self) -> None:
        unknown = sorted(self.left_out - set(self.roster.engine_ids()))
        if unknown:
            raise ConfigError(f"--leave-out: {', '.join(unknown)} not in the roster")


class MockEngines:
    """Every engine of one process, on one `Connection` (which the caller opens and closes) and
    one event loop."""

    def __init__(self, connection: Connection, config: EnginesConfig) -> None:
        self.config = config
        self.process = f"{ambient.host()}-{ambient.pid()}-{ambient.new_id()[:8]}"
        self._connection = connection
        self.engines: dict[str, MockEngine] = {}
        roster = config.roster
        for engine_type in roster.engine_types:
            for kind, ids in (
                (SourceEngine, roster.source_ids(engine_type)),
                (DestinationEngine, roster.destination_ids(engine_type)),
            ):
                for index, engine_id in enumerate(ids):
                    if engine_id in config.left_out:
                        continue
                    self.engines[engine_id] = kind(
                        connection,
                        engine_id,
                        engine_type=engine_type,
                        index=index,
                        model=config.model,
                        faults=config.faults,
                        remember=config.retain_completed,
                        lease_ttl_s=config.lease_ttl_s,
                    )
        self._completed: OrderedDict[HandoffId, None] = OrderedDict()
        self._watches: list[Watch] = []

    async def start(self) -> None:
        """Subscribe every engine; returns once the server has registered the subscriptions."""
        for engine in self.engines.values():
            await engine.start()
        connection = self._connection
        self._watches = [
            await connection.watch_completions(self._on_complete),
            await connection.answer(
                connection.subjects.engines_report, lambda: encode(self.report())
            ),
        ]
        await connection.flush()
        logger.info("%d mock engines listening: %s", len(self.engines), ", ".join(self.engines))

    def heal(self) -> None:
        """Drop every engine's faults (`MockEngine.heal`)."""
        for engine in self.engines.values():
            engine.heal()

    async def stop(self) -> EnginesReport:
        """Stop listening, report, and cancel in-flight work. The report is taken first, so a
        decode cut short by the stop is not mistaken for a leak."""
        watches, self._watches = self._watches, []
        for watch in watches:
            await watch.close()
        report = self.report()
        for engine in self.engines.values():
            await engine.stop()
        return report

    def report(self) -> EnginesReport:
        return EnginesReport(
            process=self.process,
            engines=[engine.status() for engine in self.engines.values()],
            leaks=[leak for engine in self.engines.values() for leak in engine.leaks()],
        )

    async def _on_complete(self, complete: Complete) -> None:
        handoff_id = complete.handoff_id
        for engine in self.engines.values():
            engine.saw_complete(handoff_id)
        self._completed[handoff_id] = None
        self._completed.move_to_end(handoff_id)
        if len(self._completed) > self.config.retain_completed:
            oldest, _ = self._completed.popitem(last=False)
            for engine in self.engines.values():
                engine.forget(oldest)
