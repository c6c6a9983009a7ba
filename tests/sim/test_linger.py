"""The simulated frontend listens on until the log ends every handoff (worker.sim.world
`_until_logged_ended`): a late terminal fact can reopen a success after the frontend's wait
ended at its first `Complete`, and the reopened cleanup ends later (a dropped cancel waits for
its retry). Seed 213 found it, when the run stopped the workers before that retry; under the
tier since, no seed of 1-60 or 200-330 (nor 1-49 of its drawn kinds) takes that path, so the
wait is shown here on a history written by hand, on the simulation's own loop.
"""

from __future__ import annotations

import asyncio
from uuid import UUID

from kvhandoff.worker.log.rows import Batch, HandoffRow
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.sim import world
from kvhandoff.worker.sim.checks import Names
from kvhandoff.worker.sim.history import History, StoredMessage
from kvhandoff.worker.sim.loop import SimLoop
from kvhandoff.worker.tier.entries import Appended, LoggedRows, encode_entry

HANDOFF = UUID(int=7, version=4)
LOG = Names().log_stream


def _row(state: HandoffState) -> HandoffRow:
    return HandoffRow(HANDOFF, "vllm", "prefill-0", "decode-0", 0, 10_000, state, None, 0, 0)


def _store(history: History, state: HandoffState) -> None:
    """Log one entry whose row of the handoff is in `state`."""
    batch = Batch()
    batch.upsert_handoff(_row(state))
    rows = encode_entry(LoggedRows.of([], batch, [], []))
    seq = len(history.stored) + 1
    at = asyncio.get_running_loop().time()
    entry = encode_entry(Appended(epoch=1, inputs=[], records=rows))
    history.stored.append(StoredMessage(seq, at, LOG, "kvhandoff.log.0", seq, {"x": "1"}, entry))


def _linger(end_at_s: float | None, until_s: float) -> float:
    """How long (virtual s) the frontend listens on after a handoff logged open, which the log
    ends at `end_at_s` (None: never)."""
    loop = SimLoop(1)

    async def main() -> float:
        history = History()
        _store(history, HandoffState.OPEN)
        if end_at_s is not None:
            loop.call_later(end_at_s, _store, history, HandoffState.CANCELED)
        await world._until_logged_ended(history, until_s=until_s)
        return loop.time()

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_the_frontend_listens_until_the_log_ends_the_handoff() -> None:
    assert 5.0 <= _linger(end_at_s=5.0, until_s=30.0) < 5.0 + 2 * world._LINGER_POLL_S


def test_and_no_longer_than_the_quiet_phase() -> None:
    assert 30.0 <= _linger(end_at_s=None, until_s=30.0) < 30.0 + 2 * world._LINGER_POLL_S
