"""Seeded fault injection for the mock engines. Injected delays are wall-clock, not divided by
the model's speedup, since they act against the worker's wall-clock retry interval and deadlines.

Every fault decision is a pure function of the seed and of what it concerns (engine id, handoff
id, action id, receipt number, or the message's bytes), so a seed gives the same decisions
however the messages interleave:

- fail: a forward action (`SubmitPrefill`, `StartTransfer`, `ReserveDestination`,
  `ActivateDestination`) fails, in one of two forms drawn with equal odds: its outcome is
  `ActionFailed` (the engine keeps what it already held, the cleanup frees it), or it succeeds
  and the engine later loses the request, frees its blocks and publishes `Failed` (the
  cleanup then finds nothing: `Noop`). Cleanups never fail: the protocol reads a failed cleanup
  as ambiguous ownership.
- drop: an incoming action is ignored as if it never arrived. Drawn per receipt, so the worker's
  retry of the same action id gets a fresh draw and eventually gets through.
- duplicate: an outcome or fact is published twice.
- delay: every receipt waits a uniform random 0..delay_ms before it is executed or answered.
- silent: the first `silent` engines of each engine type and role (indexes 0..silent-1) stop
  answering for `silent_ms`, counted from the first action they receive: every action in that
  window is ignored. Handoffs routed to them run into their deadline and are cleaned up, and
  when the engine recovers the worker's retries of the cleanup actions are answered (`Noop`, as
  the engine never took anything), so every handoff still completes and a demo ends cleanly.

An invalid configuration raises `ConfigError`.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from kvhandoff.events.ids import HandoffId
from kvhandoff.worker.errors import ConfigError


class FailureForm(enum.StrEnum):
    OUTCOME = "outcome"  # the action is answered `ActionFailed`
    FACT = "fact"  # the action succeeds, then the engine loses the request: `Failed`


@dataclass(frozen=True)
class Faults:
    """Seeded fault injection; see the module docstring for what each fault does."""

    seed: int = 0
    fail_rate: float = 0.0
    drop_rate: float = 0.0
    duplicate_rate: float = 0.0
    delay_ms: float = 0.0
    silent: int = 0
    silent_ms: float = 10_000.0

    def __post_init__(self) -> None:
        for name in ("fail_rate", "drop_rate", "duplicate_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ConfigError(f"{name} must be within [0, 1], got {rate}")
        if self.drop_rate == 1.0:
            raise ConfigError("drop_rate 1 would drop every retry too: nothing could ever finish")
        if self.delay_ms < 0 or self.silent < 0 or self.silent_ms < 0:
            raise ConfigError("delay_ms, silent and silent_ms must be >= 0")

    def failure(self, engine_id: str, handoff_id: HandoffId, action_id: int) -> FailureForm | None:
        if self._draw("fail", engine_id, handoff_id, action_id) >= self.fail_rate:
            return None
        if self._draw("fail-form", engine_id, handoff_id, action_id) < 0.5:
            return FailureForm.OUTCOME
        return FailureForm.FACT

    def drops(self, engine_id: str, handoff_id: HandoffId, action_id: int, receipt: int) -> bool:
        return self._draw("drop", engine_id, handoff_id, action_id, receipt) < self.drop_rate

    def duplicates(self, engine_id: str, payload: bytes) -> bool:
        return self._draw("duplicate", engine_id, payload) < self.duplicate_rate

    def delay_s(self, engine_id: str, handoff_id: HandoffId, action_id: int, receipt: int) -> float:
        draw = self._draw("delay", engine_id, handoff_id, action_id, receipt)
        return draw * self.delay_ms / 1000.0

    def silences(self, index: int) -> bool:
        return index < self.silent

    def _draw(self, *key: object) -> float:
        """A uniform number in [0, 1) determined by the seed and the key."""
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64
