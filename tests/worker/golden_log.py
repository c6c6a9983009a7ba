"""Writes the golden replicated log of a tier from before snapshots, deterministically.

    python -m tests.worker.golden_log tests/worker/golden/log-before-snapshots.msgpack

The file is the payloads of one partition's log subject, in order, as a msgpack list of bytes:
the `Claimed` of an owner of that version, then one `Appended` per batch, each holding the
`LoggedRows` of the batch as that version's `worker.tier.service` encoded them. Two handoffs:
`DONE`, whose every input was applied (it succeeded, its actions marked published), and
`OPEN`, of which only the start was (its `SubmitPrefill` is outstanding, published but not
marked: its mark would ride a next batch). Ids and times are fixed.

The file is frozen: it is what a tier of that version left in NATS, and every later build
must take such a log over (tests/worker/test_upgrade.py). This generator is kept to say how it
was made, not to be run again.
"""

from __future__ import annotations

import sys
from pathlib import Path
from uuid import UUID

import msgspec

from kvhandoff.events.codec import encode
from kvhandoff.events.messages import EngineType, Input, StartHandoff
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.tier.entries import Appended, Claimed, LoggedRows
from kvhandoff.worker.tier.planner import Planner
from tests.worker.test_planner import Delivery, success_inputs

AT_MS = 1_796_600_000_000  # 2026-12-06
DONE = StartHandoff(
    UUID("00000000-0000-4000-8000-00000000d011"),
    EngineType.VLLM,
    "prefill-0",
    "decode-0",
    60_000,
)
# The longest deadline there is (about 24.8 days): open while the test is young, timed out
# by the new owner once the file is older than that; it ends either way.
OPEN = StartHandoff(
    UUID("00000000-0000-4000-8000-0000000000e2"),
    EngineType.VLLM,
    "prefill-0",
    "decode-0",
    2**31 - 1,
)


def entries() -> list[bytes]:
    subjects = Subjects()
    planner = Planner(subjects, 8, 1.0)
    encoder = msgspec.msgpack.Encoder()
    log = [encoder.encode(Claimed(epoch=1, owner="old-host:1/old-instance", at_ms=AT_MS))]
    batches: list[list[Input]] = [[DONE], success_inputs(DONE, cancel_at=None)[1:], [OPEN]]
    # The old input stream's sequences, long past: a new stream's first inputs are not these.
    seq = 1_000_000
    marks: list[tuple[UUID, int, int]] = []  # confirmed publishes ride the next batch
    for batch in batches:
        deliveries = []
        for message in batch:
            seq += 1
            deliveries.append(Delivery(encode(message), subjects.input(message.handoff_id), 1, seq))
        plan = planner.plan(deliveries, planner.decode(deliveries), {}, AT_MS, AT_MS / 1000)
        inputs = [d.stream_seq for d in deliveries]
        rows = LoggedRows.of(inputs, plan.batch, marks, [])
        marks = [(action.handoff_id, n, AT_MS) for _, n, action in plan.publish]
        appended = Appended(epoch=1, inputs=inputs, records=encoder.encode(rows))
        log.append(encoder.encode(appended))
    return log


if __name__ == "__main__":
    Path(sys.argv[1]).write_bytes(msgspec.msgpack.encode(entries()))
