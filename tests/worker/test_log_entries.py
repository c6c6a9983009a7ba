"""The replicated log's entries on the wire (worker.tier.entries): the golden bytes of every
kind of this version, and what this build does with a newer build's entries.

`golden/entries-v1.json` holds, for each tag, the bytes of `INSTANCES[tag]` as version 1 writes
them, in hex. It was written once from `INSTANCES` and is frozen: a change to how any entry is
written fails `test_each_kind_is_written_as_its_golden_bytes`, and every later build must still
read these bytes (`test_golden_bytes_read_as_their_instance`). A new version keeps this file and
adds its own.

A newer build's entries are made here as that build would write them: the golden bytes,
decoded as plain msgpack, with what the newer build adds. What the reading rule says of each:
a new field is ignored; a later version, an unknown kind, handoff state or record type are refused
with `NewerLogVersion`, before a claim appends anything; nothing of it is `StoreCorrupt`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import msgspec
import nats
import pytest

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.errors import BusError, NewerLogVersion
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.rows import HandoffRow, Tombstone
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.tier.entries import (
    ENTRY_KINDS,
    LOG_VERSION,
    RECORD_KINDS,
    Appended,
    Claimed,
    HandedOver,
    LoggedRows,
    LoggedState,
    Snapshot,
    SnapshotPart,
    decode_entry,
    decode_rows,
    decode_state,
    encode_entry,
)
from kvhandoff.worker.tier.membership import TierSettings
from kvhandoff.worker.tier.ownership import PartitionLog, read_entries
from kvhandoff.worker.tier.streams import open_partition_log
from tests.worker.conftest import WorkerProcess

GOLDEN = Path(__file__).parent / "golden" / "entries-v1.json"
BEFORE_SNAPSHOTS = Path(__file__).parent / "golden" / "log-before-snapshots.msgpack"

AT_MS = 1_796_600_000_000  # 2026-12-06
OPEN_ID = UUID("00000000-0000-4000-8000-0000000000e2")
DONE_ID = UUID("00000000-0000-4000-8000-00000000d011")
# Every field of each kind but `version` (1, so not on the wire) holds a value other than its
# default, so that each is on the wire.
ROW = HandoffRow(
    OPEN_ID,
    "vllm",
    "prefill-0",
    "decode-0",
    AT_MS,
    AT_MS + 60_000,
    HandoffState.OPEN,
    None,
    1,
    AT_MS + 5,
)
TOMBSTONE = Tombstone(DONE_ID, "succeeded", AT_MS + 9, [b"\x01\x02\x03\x04"])
CLAIMED = Claimed(epoch=3, owner="host-a:1/instance-a", at_ms=AT_MS)
INSTANCES: dict[str, Any] = {
    "claimed": CLAIMED,
    "appended": Appended(epoch=3, inputs=[1001, 1002], records=b"rows"),
    "handed_over": HandedOver(epoch=3, owner="host-a:1/instance-a", at_ms=AT_MS + 20),
    "snapshot": Snapshot(
        epoch=3,
        owner="host-a:1/instance-a",
        at_ms=AT_MS + 10,
        applied=[1002],
        records=b"state",
        claims=[CLAIMED],
    ),
    "snapshot_part": SnapshotPart(index=0, count=2, data=b"\x85\xa5entry"),
    "rows": LoggedRows(
        inputs=[1001, 1002],
        events=[(str(OPEN_ID), 0, 1, AT_MS, b"input"), (str(OPEN_ID), 1, 9, AT_MS + 1, b"act")],
        handoffs=[ROW],
        rejections=[
            (AT_MS + 2, None, "undecodable", b"\xff"),
            (AT_MS + 3, str(DONE_ID), "ended", b"x"),
        ],
        quarantined=[(AT_MS + 4, str(DONE_ID))],
        published=[(OPEN_ID, 1, AT_MS + 5)],
        ended=[TOMBSTONE],
    ),
    "state": LoggedState(
        mark=1001,
        handoffs=[ROW],
        marks=[(OPEN_ID, 1, AT_MS + 5), (DONE_ID, -1, None)],
        events=[(str(OPEN_ID), 0, 1, AT_MS, b"input")],
        tombstones=[TOMBSTONE],
    ),
}
TAGS = sorted(INSTANCES)


def golden() -> dict[str, bytes]:
    return {tag: bytes.fromhex(data) for tag, data in json.loads(GOLDEN.read_text()).items()}


def decode(tag: str, data: bytes) -> object:
    """`data` read as the log's reader reads an entry of that tag."""
    where = f"the golden {tag}"
    if tag == "rows":
        return decode_rows(data, where)
    if tag == "state":
        return decode_state(data, where)
    return decode_entry(data, where)


def newer(tag: str, change: Callable[[dict[str, Any]], object]) -> bytes:
    """The golden entry of `tag` as a newer build writes it: `change` edits it in place."""
    entry = msgspec.msgpack.decode(golden()[tag])
    change(entry)
    return msgspec.msgpack.encode(entry)


def test_there_is_a_golden_entry_of_each_kind_of_this_version() -> None:
    tags = {str(kind.__struct_config__.tag) for kind in (*ENTRY_KINDS, *RECORD_KINDS)}
    assert tags == set(INSTANCES) == set(golden())
    # A new version keeps these goldens, which its build must still read, and adds its own.
    assert LOG_VERSION == 1


@pytest.mark.parametrize("tag", TAGS)
def test_each_kind_is_written_as_its_golden_bytes(tag: str) -> None:
    assert encode_entry(INSTANCES[tag]) == golden()[tag]


@pytest.mark.parametrize("tag", TAGS)
def test_golden_bytes_read_as_their_instance(tag: str) -> None:
    read = decode(tag, golden()[tag])
    assert read == INSTANCES[tag]
    assert read.version == 1  # type: ignore[attr-defined]


def test_a_log_from_before_versions_reads_as_version_1_and_is_written_alike() -> None:
    """Version 1 is not on the wire: this build writes the bytes the builds before versions
    wrote, which read them."""
    log = msgspec.msgpack.decode(BEFORE_SNAPSHOTS.read_bytes(), type=list[bytes])
    for data in log:
        entry = decode_entry(data, "an entry from before versions")
        assert entry.version == 1
        assert encode_entry(entry) == data
        if isinstance(entry, Appended):
            rows = decode_rows(entry.records, "rows from before versions")
            assert rows.version == 1
            assert encode_entry(rows) == entry.records


@pytest.mark.parametrize("tag", TAGS)
def test_a_newer_field_is_ignored(tag: str) -> None:
    def add_fields(entry: dict[str, Any]) -> None:
        entry["priority"] = {"class": "gold", "weight": [1, 2]}
        for nested in (*entry.get("handoffs", []), *entry.get("ended", [])):
            nested["region"] = "eu-west"
        for claim in entry.get("claims", []):
            claim["zone"] = 2

    assert decode(tag, newer(tag, add_fields)) == INSTANCES[tag]


@pytest.mark.parametrize("tag", TAGS)
def test_an_entry_of_a_newer_version_is_refused(tag: str) -> None:
    data = newer(tag, lambda entry: entry.update(version=2))
    with pytest.raises(NewerLogVersion, match="of log version 2: a newer build wrote it, and "):
        decode(tag, data)


@pytest.mark.parametrize("tag", TAGS)
def test_a_newer_version_is_refused_even_where_it_changed_a_field(tag: str) -> None:
    """What a newer version wrote need not decode as this build's type: it is still refused as
    newer, not read as corrupt."""

    def change(entry: dict[str, Any]) -> None:
        entry.update(version=2)
        first = next(name for name in entry if name not in ("entry", "kind", "version"))
        entry[first] = {"now": "a map"}

    with pytest.raises(NewerLogVersion, match=re.escape("up to version 1. Upgrade this worker")):
        decode(tag, newer(tag, change))


def test_an_entry_of_an_unknown_kind_is_refused() -> None:
    data = msgspec.msgpack.encode({"entry": "sealed", "epoch": 4, "owner": "new/one"})
    with pytest.raises(NewerLogVersion, match="entry of kind 'sealed', which this build lacks"):
        decode_entry(data, "entry 9")
    rows = newer("rows", lambda entry: entry.update(kind="columns"))
    with pytest.raises(NewerLogVersion, match="records of kind 'columns'"):
        decode_rows(rows, "entry 9")


@pytest.mark.parametrize("tag", ["rows", "state"])
def test_a_handoff_in_a_state_this_build_lacks_is_refused(tag: str) -> None:
    """Even from a newer build that did not bump the version, as it should have."""
    data = newer(tag, lambda entry: entry["handoffs"][0].update(state="paused"))
    with pytest.raises(NewerLogVersion, match=f"handoff {OPEN_ID} in state 'paused'"):
        decode(tag, data)


@pytest.mark.parametrize("tag", ["rows", "state"])
def test_an_event_of_a_record_type_this_build_lacks_is_refused(tag: str) -> None:
    """A newer coordinator's message: read as a corrupt record, it would quarantine a handoff."""
    data = newer(tag, lambda entry: entry["events"][0].__setitem__(2, 200))
    with pytest.raises(NewerLogVersion, match=f"event 0 of handoff {OPEN_ID} of record type 200"):
        decode(tag, data)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never used in msgpack
        msgspec.msgpack.encode(["claimed", 3]),
        msgspec.msgpack.encode({"entry": "claimed", "owner": "a/b", "at_ms": 1}),  # no epoch
        msgspec.msgpack.encode({"entry": "claimed", "epoch": 1, "version": "2"}),
    ],
)
def test_what_is_no_entry_is_corrupt_not_newer(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_entry(data, "entry 9")


def test_reading_a_log_refuses_its_first_newer_entry_and_still_names_a_corrupt_one() -> None:
    subject = "kvhandoff.log.4"
    claimed = golden()["claimed"]
    appended = newer("appended", lambda entry: entry.update(version=2))
    with pytest.raises(
        NewerLogVersion, match=re.escape(f"partition 4: entry 8 of {subject} is of log version 2")
    ):
        read_entries(4, subject, [(7, claimed), (8, appended), (9, b"\xc1")])
    with pytest.raises(BusError, match=re.escape(f"entry 9 of {subject} is not a log entry")):
        read_entries(4, subject, [(7, claimed), (9, b"\xc1")])


def test_a_snapshot_of_a_newer_version_in_parts_is_refused() -> None:
    snapshot = newer("snapshot", lambda entry: entry.update(version=2))
    half = len(snapshot) // 2
    parts = [
        (5, encode_entry(SnapshotPart(0, 2, snapshot[:half]))),
        (6, encode_entry(SnapshotPart(1, 2, snapshot[half:]))),
    ]
    with pytest.raises(
        NewerLogVersion, match=re.escape("entry 6 of kvhandoff.log.0 (a snapshot's last part)")
    ):
        read_entries(0, "kvhandoff.log.0", parts)


async def test_a_claim_of_a_newer_log_appends_nothing(nats_server: EmbeddedNats) -> None:
    """An older worker that meets a newer log must not fence the newer owner."""
    settings = TierSettings(partitions=1)
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test-log-entries")
    nc = await nats.connect(nats_server.url)
    try:
        await open_partition_log(bus, settings.log_stream, settings.prefix)
        js = nc.jetstream()
        subject = f"{settings.prefix}.log.0"
        await js.publish(subject, newer("claimed", lambda entry: entry.update(version=2)))
        log = PartitionLog(bus, settings.log_stream, settings.prefix, 0, "older/one")
        with pytest.raises(
            NewerLogVersion, match=re.escape("entry 1 of kvhandoff.log.0 is of log version 2")
        ):
            await log.claim()
        assert (await js.stream_info(settings.log_stream)).state.last_seq == 1
    finally:
        await nc.close()
        await bus.close()


async def test_a_worker_that_meets_a_newer_log_stops_with_exit_2(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """The tier stops the worker rather than claim the partition again every round."""
    settings = TierSettings(partitions=1)
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test-log-entries")
    nc = await nats.connect(nats_server.url)
    try:
        await open_partition_log(bus, settings.log_stream, settings.prefix)
        js = nc.jetstream()
        await js.publish(
            f"{settings.prefix}.log.0", newer("appended", lambda e: e.update(version=3))
        )
        with WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db") as worker:
            worker.launch()  # never healthy: it claims the vacant partition, and stops
            assert worker.process is not None
            assert worker.process.wait(timeout=60) == 2, worker.logs()
        assert "is of log version 3" in worker.logs()
        assert "Upgrade this worker" in worker.logs()
        assert (await js.stream_info(settings.log_stream)).state.last_seq == 1
    finally:
        await nc.close()
        await bus.close()
