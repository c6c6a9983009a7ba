"""The wire vocabulary: every message that crosses the bus, as frozen msgspec Structs.

Three tagged unions, each decoded by one typed decoder (see `events.codec`):

- `Input`: what goes *into* a handoff's coordinator, on `kvhandoff.in.<handoff_id>`: the
  `StartHandoff` command, the six facts, and `ActionOutcome` (an engine's answer to an action).
- `Action`: what comes *out*, on the executing engine's subject: seven engine actions plus
  `Complete` for the frontend.
- `Outcome`: the result an engine reports for one action id.

Tags are explicit strings and never change: they are stored in the event log, so renaming a
class must never orphan a record. New fields get defaults; a change of meaning is a new Struct
with a new tag. Unknown fields are ignored, so an older worker can read a newer engine's message.
Every number, engine id and reason is bounded by the constraints of `events.ids`, checked on
decode, so a message that decodes can be digested, logged, stored and timed.
"""

from __future__ import annotations

import enum
from typing import ClassVar

from msgspec import Struct

from kvhandoff.events.ids import (
    ActionId,
    BandwidthGBs,
    ByteCount,
    EngineId,
    HandoffId,
    Milliseconds,
    PositiveMilliseconds,
    Reason,
    TokenCount,
    TransferDelay,
)


class HandoffOrder(enum.StrEnum):
    """Which side of the handoff is set up first."""

    SOURCE_FIRST = "source_first"
    DESTINATION_FIRST = "destination_first"


class EngineType(enum.StrEnum):
    """The serving engine, which fixes the handoff order."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"

    @property
    def order(self) -> HandoffOrder:
        # vLLM and TRT-LLM prefill first and then look for a decode slot; SGLang reserves the
        # decode slot first so the prefill can stream straight into it.
        if self is EngineType.SGLANG:
            return HandoffOrder.DESTINATION_FIRST
        return HandoffOrder.SOURCE_FIRST


class KvTransferTimingMode(enum.StrEnum):
    """Which token count the transfer delay is computed from."""

    FULL_PROMPT = "full_prompt"
    DESTINATION_MISSING = "destination_missing"


class HandoffCompletion(enum.StrEnum):
    SUCCESS = "success"
    CANCELED = "canceled"


class Role(enum.StrEnum):
    """Who executes an action."""

    SOURCE = "source"
    DESTINATION = "destination"
    FRONTEND = "frontend"


class HandoffTransferTiming(Struct, frozen=True):
    """What the source knows about the KV transfer once it holds the prefilled blocks."""

    mode: KvTransferTimingMode
    full_prompt_tokens: TokenCount
    kv_bytes_per_token: ByteCount | None = None
    bandwidth_gb_s: BandwidthGBs | None = None


# --- Inputs ---------------------------------------------------------------------------------


class _Input(Struct, frozen=True, tag_field="type"):
    handoff_id: HandoffId


class StartHandoff(_Input, frozen=True, tag="start_handoff"):
    """The frontend's command that opens a handoff."""

    engine_type: EngineType
    source: EngineId
    destination: EngineId
    deadline_ms: PositiveMilliseconds
    fallback_delay_ms: Milliseconds = 0.0


class SourceHeld(_Input, frozen=True, tag="source_held"):
    """The source engine finished prefill and holds the KV blocks."""

    timing: HandoffTransferTiming


class DestinationReserved(_Input, frozen=True, tag="destination_reserved"):
    """The destination engine reserved room for the tokens it is missing."""

    transferable_prompt_tokens: TokenCount


class TransferCompleted(_Input, frozen=True, tag="transfer_completed"):
    """The KV blocks arrived at the destination."""


class Failed(_Input, frozen=True, tag="failed", omit_defaults=True):
    """An engine lost the request; the handoff must be cleaned up. `reason` says why when the
    tier says it for an engine (its lease expired: `events.leases`); the coordinator reads no
    reason. Omitted when None, so a reason-less `Failed` encodes, and digests, as before."""

    reason: Reason | None = None


class TimedOut(_Input, frozen=True, tag="timed_out"):
    """The handoff's deadline passed (appended by the worker)."""


class Canceled(_Input, frozen=True, tag="canceled"):
    """The frontend gave up on the request."""


class _Outcome(Struct, frozen=True, tag_field="kind"):
    pass


class Submitted(_Outcome, frozen=True, tag="submitted"):
    pass


class Accepted(_Outcome, frozen=True, tag="accepted"):
    pass


class Scheduled(_Outcome, frozen=True, tag="scheduled"):
    pass


class Applied(_Outcome, frozen=True, tag="applied"):
    pass


class Noop(_Outcome, frozen=True, tag="noop"):
    pass


class ActionFailed(_Outcome, frozen=True, tag="failed"):
    """The engine could not carry out the action."""

    reason: Reason


Outcome = Submitted | Accepted | Scheduled | Applied | Noop | ActionFailed

# The reason-less outcomes carry no data, so one instance of each serves everyone.
SUBMITTED = Submitted()
ACCEPTED = Accepted()
SCHEDULED = Scheduled()
APPLIED = Applied()
NOOP = Noop()


class ActionOutcome(_Input, frozen=True, tag="action_outcome", omit_defaults=True):
    """An engine's answer to one action, quoting its action id. `by_tier` marks an answer the
    tier gave on the engine's behalf once the engine's lease expired (`events.leases`); omitted
    when false, so an engine's answer encodes, and digests, as before."""

    action_id: ActionId
    outcome: Outcome
    by_tier: bool = False


Fact = SourceHeld | DestinationReserved | TransferCompleted | Failed | TimedOut | Canceled
Input = StartHandoff | Fact | ActionOutcome

# --- Actions --------------------------------------------------------------------------------


class _Action(Struct, frozen=True, tag_field="type"):
    handoff_id: HandoffId
    action_id: ActionId

    executor: ClassVar[Role]


class SubmitPrefill(_Action, frozen=True, tag="submit_prefill"):
    executor = Role.SOURCE


class ReserveDestination(_Action, frozen=True, tag="reserve_destination"):
    executor = Role.DESTINATION


class StartTransfer(_Action, frozen=True, tag="start_transfer"):
    executor = Role.SOURCE
    delay_ms: TransferDelay


class ActivateDestination(_Action, frozen=True, tag="activate_destination"):
    executor = Role.DESTINATION


class ReleaseSource(_Action, frozen=True, tag="release_source"):
    executor = Role.SOURCE


class CancelSource(_Action, frozen=True, tag="cancel_source"):
    executor = Role.SOURCE


class CancelDestination(_Action, frozen=True, tag="cancel_destination"):
    executor = Role.DESTINATION


class Complete(_Action, frozen=True, tag="complete"):
    executor = Role.FRONTEND
    completion: HandoffCompletion


Action = (
    SubmitPrefill
    | ReserveDestination
    | StartTransfer
    | ActivateDestination
    | ReleaseSource
    | CancelSource
    | CancelDestination
    | Complete
)

# --- Bus-only messages ----------------------------------------------------------------------


class Rejection(Struct, frozen=True, tag="rejection", tag_field="type"):
    """Published when the worker refuses an input; the input changed nothing."""

    handoff_id: HandoffId | None
    reason: str
    payload: str
