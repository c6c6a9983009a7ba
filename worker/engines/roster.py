"""The engine ids of a deployment, which the engines command and the load generator derive
from the same options: that is how the load generator knows where to route each handoff."""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.events.messages import EngineType
from kvhandoff.worker.errors import ConfigError

DEFAULT_ENGINE_TYPES: tuple[EngineType, ...] = tuple(EngineType)
DEFAULT_SOURCES = 2
DEFAULT_DESTINATIONS = 2


@dataclass(frozen=True)
class Roster:
    """For each engine type, `sources` prefill engines named `<type>-prefill-<i>` and
    `destinations` decode engines named `<type>-decode-<i>`. `ConfigError` if it is empty."""

    engine_types: tuple[EngineType, ...] = DEFAULT_ENGINE_TYPES
    sources: int = DEFAULT_SOURCES
    destinations: int = DEFAULT_DESTINATIONS

    def __post_init__(self) -> None:
        if not self.engine_types or len(set(self.engine_types)) != len(self.engine_types):
            raise ConfigError(f"engine types must be distinct and non-empty: {self.engine_types}")
        if self.sources < 1 or self.destinations < 1:
            raise ConfigError("each engine type needs at least one source and one destination")

    def source_ids(self, engine_type: EngineType) -> list[str]:
        return [f"{engine_type}-prefill-{i}" for i in range(self.sources)]

    def destination_ids(self, engine_type: EngineType) -> list[str]:
        return [f"{engine_type}-decode-{i}" for i in range(self.destinations)]

    def engine_ids(self) -> list[str]:
        """Every engine id, type by type, sources first."""
        return [
            engine_id
            for engine_type in self.engine_types
            for engine_id in (*self.source_ids(engine_type), *self.destination_ids(engine_type))
        ]
