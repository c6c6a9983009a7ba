"""The JetStream model's streams: what one stream stores, refuses, expires and answers reads with.

A `Stream` holds its messages in sequence order (`Stored`, the shared record of `api`), an index
of them by subject, and the state the server keeps beside them: the last sequence it assigned
(which outlives the message: a stream whose messages all went keeps counting from it), the
message ids it saw within its duplicate window, and when each message expires. It decides a
publish as nats-server 2.15 does for a stream on one server (server/stream.go,
processJetStreamMsg), in that order:

1. The stream's subject transform rewrites the subject (`SubjectTransform`; `partition(n, i)`
   is the FNV-1a hash of the named tokens, modulo n, as server/subject_transform.go computes it).
2. `Nats-Expected-Stream` (10060), `Nats-TTL` on a stream without `allow_msg_ttl` (10166),
   `Nats-Expected-Last-Subject-Sequence` (10071, naming the subject's last sequence), then
   `Nats-Expected-Last-Sequence` (10071, naming the stream's).
3. `Nats-Msg-Id`: an id seen within the duplicate window is acknowledged again with the first
   message's sequence and `"duplicate": true`, and nothing is stored. A replicated stream's leader
   checks the id *before* the expectations of step 2 (server/jetstream_batching.go,
   checkMsgHeadersPreClusteredProposal), so there a retried compare-and-set append is answered as
   a duplicate, while on one server it is refused with 10071: `Stream(replicated=True)` models the
   former.
4. `Nats-Rollup` (`sub` or `all`) needs `allow_rollup_hdrs` and no `deny_purge` (10111).
5. Limits with `discard: new` refuse the message (10077); an invalid `Nats-TTL` is 10165.

Then it stores: the next sequence, the wall clock's time, and the effects: a roll-up removes
the subject's (or the stream's) earlier messages, `max_msgs`, `max_bytes` and
`max_msgs_per_subject` drop the oldest (with `discard: old`), and the message's expiry is noted.

Expiry runs on the loop's (virtual) clock, through a `Clock`: one timer, armed for the earliest
deadline (`max_age` after the store, or the message's own `Nats-TTL`, whichever is sooner). A
message that expires while it is the last of its subject, on a stream with
`subject_delete_marker_ttl`, is replaced by a delete marker (`Nats-Marker-Reason: MaxAge`,
`Nats-TTL`, `Nats-Rollup: sub`, no payload), stored as any message is, so a watch receives the
expiry; an expiring marker just goes. Wall time (`Stored.time_ns`) is what the answers show.

Invariants: sequences only grow; `first_seq()` is the lowest held message's, or one past the
last sequence when the stream holds none; the subject index holds exactly the held messages;
every held message with a deadline has one entry in the expiry heap (entries for messages
already gone are skipped when they come due).
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import datetime
import functools
import heapq
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvhandoff.worker import ambient
from kvhandoff.worker.sim.nats.jetstream.api import Stored

_NS = 1_000_000_000
_DEFAULT_DUPLICATE_WINDOW_NS = 120 * _NS
_FILTERS_KEPT = 256  # wildcard filters a stream keeps an index of (`Stream._by_filter`)
# Headers the server reads on a publish (server/stream.go).
MSG_ID = "Nats-Msg-Id"
EXPECTED_STREAM = "Nats-Expected-Stream"
EXPECTED_LAST_SEQ = "Nats-Expected-Last-Sequence"
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_LAST_SUBJECT_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
ROLLUP = "Nats-Rollup"
MSG_TTL = "Nats-TTL"
MARKER_REASON = "Nats-Marker-Reason"
_KV_OPERATION = "KV-Operation"
_NEVER = -1  # a `Nats-TTL: never`: the message outlives max_age too


# Subjects ----------------------------------------------------------------------------------


def subject_matches(subject: str, pattern: str) -> bool:
    """Whether the literal `subject` is one that `pattern` (with `*` and `>`) names."""
    tokens, wanted = subject.split("."), pattern.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or (token != "*" and token != tokens[index]):
            return False
    return len(tokens) == len(wanted)


def subjects_collide(first: str, second: str) -> bool:
    """Whether some literal subject matches both patterns (two streams may not both capture
    it: 10065)."""
    a, b = first.split("."), second.split(".")
    for index in range(max(len(a), len(b))):
        x = a[index] if index < len(a) else None
        y = b[index] if index < len(b) else None
        if x == ">" or y == ">":
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if "*" not in (x, y) and x != y:
            return False
    return True


@functools.lru_cache(maxsize=4096)
def is_literal(subject: str) -> bool:
    tokens = subject.split(".")
    return "*" not in tokens and ">" not in tokens


def partition(key: bytes, partitions: int) -> int:
    """The partition of `key` among `partitions`: 32-bit FNV-1a modulo the count, as the
    server's `{{partition(n, ...)}}` computes it."""
    if partitions == 0:
        return 0
    digest = 0x811C9DC5
    for byte in key:
        digest = ((digest ^ byte) * 0x01000193) & 0xFFFFFFFF
    return digest % partitions


_FUNCTION = re.compile(r"^\{\{\s*(\w+)\s*\((.*)\)\s*\}\}$")


class SubjectTransform:
    """A stream's subject transform (`{"src", "dest"}`): `{{wildcard(i)}}` (or `$i`) is the
    source's i-th wildcard token, `{{partition(n, i, ...)}}` the partition of those wildcard
    tokens concatenated (of the whole subject, tokens joined by dots, if none are named), a
    trailing `>` the source's remaining tokens. Other mapping functions are refused
    (`ValueError`): the tier uses none."""

    def __init__(self, src: str, dest: str) -> None:
        self.src = src or ">"
        self.dest = dest
        source = self.src.split(".")
        wildcards = [index for index, token in enumerate(source) if token == "*"]
        if (source[-1] == ">") != (dest.rsplit(".", maxsplit=1)[-1] == ">"):
            raise ValueError(f"{src!r} and {dest!r} must both end in '>' or neither")
        self._steps: list[tuple[str, int, tuple[int, ...], str]] = []
        for token in dest.split("."):
            self._steps.append(self._step(token, wildcards))

    @staticmethod
    def _step(token: str, wildcards: Sequence[int]) -> tuple[str, int, tuple[int, ...], str]:
        def positions(args: Iterable[str]) -> tuple[int, ...]:
            found = []
            for arg in args:
                number = int(arg.strip())
                if not 1 <= number <= len(wildcards):
                    raise ValueError(f"{token!r} names wildcard {number} of {len(wildcards)}")
                found.append(wildcards[number - 1])
            return tuple(found)

        if len(token) > 1 and token[0] == "$" and token[1:].isdigit():
            return ("wildcard", 0, positions([token[1:]]), "")
        function = _FUNCTION.match(token)
        if function is None:
            return ("literal", 0, (), token)
        name, args = function.group(1).lower(), function.group(2).split(",")
        if name == "wildcard" and len(args) == 1:
            return ("wildcard", 0, positions(args), "")
        if name == "partition" and args[0].strip():
            return ("partition", int(args[0].strip()), positions(args[1:]), "")
        raise ValueError(f"unsupported subject mapping {token!r}")

    def apply(self, subject: str) -> str | None:
        """The subject `subject` is stored as; None if it does not match the source."""
        if not subject_matches(subject, self.src):
            return None
        tokens = subject.split(".")
        out: list[str] = []
        for kind, count, positions, literal in self._steps:
            if kind == "literal":
                if literal == ">":
                    out.extend(tokens[len(self.src.split(".")) - 1 :])
                else:
                    out.append(literal)
            elif kind == "wildcard":
                out.append(tokens[positions[0]])
            elif positions:
                key = "".join(tokens[position] for position in positions)
                out.append(str(partition(key.encode(), count)))
            else:
                out.append(str(partition(subject.encode(), count)))
        return ".".join(out)


# Wire formats ------------------------------------------------------------------------------


def header_block(headers: Mapping[str, str] | None) -> bytes:
    """Headers as the protocol carries them (`NATS/1.0` and `Key: value` lines); empty if none."""
    if not headers:
        return b""
    lines = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
    return f"NATS/1.0\r\n{lines}\r\n".encode()


def rfc3339(time_ns: int) -> str:
    """A wall time as Go's RFC 3339 with nanoseconds (trailing zeros dropped), in UTC; the zero
    time for 0, as the server shows a stream that never held a message."""
    if time_ns == 0:
        return "0001-01-01T00:00:00Z"
    seconds, fraction = divmod(time_ns, _NS)
    text = datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if fraction:
        text += "." + f"{fraction:09d}".rstrip("0")
    return text + "Z"


def go_duration(seconds: int) -> str:
    """Whole seconds as Go prints a `time.Duration` ("2s", "1m30s", "1h0m0s")."""
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": _NS, "m": 60 * _NS}
_UNIT_NS["h"] = 3600 * _NS


def parse_ttl(text: str) -> int:
    """A `Nats-TTL` value as the server reads it: whole seconds, `_NEVER` for "never", 0 for
    none; `ValueError` if invalid (a duration under a second, or not a number)."""
    if text.lower() == "never":
        return _NEVER
    parts = _DURATION_PART.findall(text)
    if parts and "".join(number + unit for number, unit in parts) == text:
        total_ns = sum(float(number) * _UNIT_NS[unit] for number, unit in parts)
        if total_ns < _NS:
            raise ValueError(f"TTL {text!r} is under a second")
        return int(total_ns // _NS)
    if not text.isdigit():
        raise ValueError(f"TTL {text!r} is neither a duration nor whole seconds")
    return int(text)


def message_size(subject: str, headers: Mapping[str, str] | None, payload: bytes) -> int:
    """A message's size as the store counts it (the state's `bytes`)."""
    return len(subject) + len(header_block(headers)) + len(payload) + 16


def message_json(stored: Stored) -> dict[str, Any]:
    """A stored message as `STREAM.MSG.GET` answers it (nats-py's `RawStreamMsg`)."""
    body: dict[str, Any] = {"subject": stored.subject, "seq": stored.seq}
    if stored.headers:
        body["hdrs"] = base64.b64encode(header_block(stored.headers)).decode()
    if stored.payload:
        body["data"] = base64.b64encode(stored.payload).decode()
    body["time"] = rfc3339(stored.time_ns)
    return body


# Time --------------------------------------------------------------------------------------


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """The model's clocks: the loop's (virtual) time for expiry and the duplicate window, the
    wall clock for the times it shows, and timers on the loop's time."""

    def time(self) -> float: ...

    def wall_ns(self) -> int: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer: ...


class LoopClock:
    """The running loop's time and timers, and the wall clock of the `Ambient` that was current
    when it was made (the simulated server's, not that of whichever client published)."""

    def __init__(self) -> None:
        self._ambient = ambient.current()

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    def wall_ns(self) -> int:
        return self._ambient.wall_ns()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_at(when, callback)


# The stream --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A publish or request the stream refused: the API error it answers with."""

    code: int
    err_code: int
    description: str


@dataclass(frozen=True)
class Duplicate:
    """A publish whose `Nats-Msg-Id` the stream stored within its duplicate window."""

    seq: int


class Stream:
    """One stream (see the module docstring). `config` is its normalised API configuration;
    `on_stored` hears of every message it stores, a delete marker's included."""

    def __init__(
        self,
        config: Mapping[str, Any],
        clock: Clock,
        on_stored: Callable[[Stream, Stored], None],
        *,
        replicated: bool = False,
    ) -> None:
        self._clock = clock
        self._on_stored = on_stored
        self._replicated = replicated
        self.created_ns = clock.wall_ns()
        self._messages: dict[int, Stored] = {}  # in sequence order
        self._seqs: list[int] = []  # the held sequences, ascending
        self._by_subject: dict[str, list[int]] = {}  # each ascending
        # For each wildcard filter read so far, the held subjects it matches with their lists
        # (the very lists of `_by_subject`), kept as subjects come and go: a consumer's read
        # of the next message then costs a lookup, not a match against every held subject.
        self._by_filter: dict[str, dict[str, list[int]]] = {}
        self._bytes = 0
        self._last_seq = 0
        self._last_time_ns = 0
        self._msg_ids: dict[str, tuple[int, float]] = {}  # id: (seq, loop time), oldest first
        self._stored_at: dict[int, float] = {}  # loop time of each held message's store
        self._ttls: dict[int, int] = {}  # seconds, of held messages that carry one
        self._expiry: list[tuple[float, int]] = []  # (deadline, seq), a heap
        self._timer: Timer | None = None
        self._timer_at: float | None = None
        self._config: dict[str, Any] = {}
        self._transform: SubjectTransform | None = None
        self.reconfigure(config)

    # StreamView

    @property
    def name(self) -> str:
        name: str = self._config["name"]
        return name

    @property
    def config(self) -> Mapping[str, Any]:
        return self._config

    def first_seq(self) -> int:
        return self._seqs[0] if self._seqs else self._last_seq + 1

    def last_seq(self) -> int:
        return self._last_seq

    def get(self, seq: int) -> Stored | None:
        return self._messages.get(seq)

    def next_after(self, seq: int, filters: Sequence[str]) -> Stored | None:
        if not filters:
            index = bisect.bisect_right(self._seqs, seq)
            return self._messages[self._seqs[index]] if index < len(self._seqs) else None
        best: int | None = None
        for seqs in self._subject_lists(filters):
            index = bisect.bisect_right(seqs, seq)
            if index < len(seqs) and (best is None or seqs[index] < best):
                best = seqs[index]
        return None if best is None else self._messages[best]

    def count_after(self, seq: int, filters: Sequence[str]) -> int:
        if not filters:
            return len(self._seqs) - bisect.bisect_right(self._seqs, seq)
        return sum(
            len(seqs) - bisect.bisect_right(seqs, seq) for seqs in self._subject_lists(filters)
        )

    def remove(self, seq: int) -> bool:
        stored = self._messages.pop(seq, None)
        if stored is None:
            return False
        del self._seqs[bisect.bisect_left(self._seqs, seq)]
        seqs = self._by_subject[stored.subject]
        del seqs[bisect.bisect_left(seqs, seq)]
        if not seqs:
            del self._by_subject[stored.subject]
            for matching in self._by_filter.values():
                matching.pop(stored.subject, None)
        self._bytes -= message_size(stored.subject, stored.headers, stored.payload)
        self._stored_at.pop(seq, None)
        self._ttls.pop(seq, None)
        return True

    def _subject_lists(self, filters: Sequence[str]) -> list[list[int]]:
        """The sequence lists of the held subjects some filter matches, each once."""
        if len(filters) == 1:
            return list(self._matching(filters[0]).values())
        found: dict[str, list[int]] = {}
        for one in filters:
            found.update(self._matching(one))
        return list(found.values())

    def _matching(self, pattern: str) -> Mapping[str, list[int]]:
        """The held subjects `pattern` matches, with their sequence lists."""
        if is_literal(pattern):
            seqs = self._by_subject.get(pattern)
            return {} if seqs is None else {pattern: seqs}
        matching = self._by_filter.get(pattern)
        if matching is None:
            if len(self._by_filter) >= _FILTERS_KEPT:
                self._by_filter.clear()  # filters come from configurations: a bound, not a need
            matching = {
                subject: seqs
                for subject, seqs in self._by_subject.items()
                if subject_matches(subject, pattern)
            }
            self._by_filter[pattern] = matching
        return matching

    # Configuration

    def reconfigure(self, config: Mapping[str, Any]) -> None:
        """Take a new (normalised) configuration: its limits apply to what is held at once,
        its max age to every held message's expiry."""
        transform = config.get("subject_transform")
        self._transform = (
            None if not transform else SubjectTransform(transform["src"], transform["dest"])
        )
        self._config = dict(config)
        self._enforce_limits()
        self._expiry = [
            (deadline, seq) for seq in self._seqs if (deadline := self._deadline(seq)) is not None
        ]
        heapq.heapify(self._expiry)
        self._arm()

    def captures(self, subject: str) -> bool:
        return any(subject_matches(subject, mine) for mine in self._config["subjects"])

    def stored_subject(self, subject: str) -> str:
        """The subject a message published on `subject` is stored under."""
        if self._transform is None:
            return subject
        return self._transform.apply(subject) or subject

    # Publishing

    def check(
        self, subject: str, headers: Mapping[str, str] | None, *, in_batch: bool = False
    ) -> Refusal | Duplicate | None:
        """Whether the stream takes a message to be stored on `subject` (transformed already):
        None if it does, else how it answers instead (see the module docstring's order). In an
        atomic batch the caller checks message ids against the batch as well."""
        headers = headers or {}
        # In a batch the caller checks ids (a seen one refuses the whole batch).
        check_id = not in_batch
        if check_id and self._replicated and (duplicate := self._duplicate(headers)):
            return duplicate
        if (expected := headers.get(EXPECTED_STREAM)) and expected != self.name:
            return Refusal(400, 10060, "expected stream does not match")
        if MSG_TTL in headers and not self._config.get("allow_msg_ttl"):
            return Refusal(400, 10166, "per-message TTL is disabled")
        if (expected := headers.get(EXPECTED_LAST_SUBJECT_SEQ)) is not None:
            on = headers.get(EXPECTED_LAST_SUBJECT_SEQ_SUBJECT) or subject
            held = self.last_on(on)
            if _number(expected) != held:
                return Refusal(400, 10071, f"wrong last sequence: {held}")
        if (expected := headers.get(EXPECTED_LAST_SEQ)) is not None and (
            _number(expected) != self._last_seq
        ):
            return Refusal(400, 10071, f"wrong last sequence: {self._last_seq}")
        if check_id and not self._replicated and (duplicate := self._duplicate(headers)):
            return duplicate
        if (rollup := headers.get(ROLLUP)) is not None:
            if not self._config.get("allow_rollup_hdrs") or self._config.get("deny_purge"):
                return Refusal(500, 10111, "rollup not permitted")
            if rollup not in ("sub", "all"):
                return Refusal(500, 10111, f'rollup value invalid: "{rollup}"')
        refusal = self._over_limit(subject, headers)
        if refusal is not None:
            return refusal
        if (ttl := headers.get(MSG_TTL)) is not None:
            try:
                parse_ttl(ttl)
            except ValueError:
                return Refusal(400, 10165, "invalid per-message TTL")
        return None

    def _duplicate(self, headers: Mapping[str, str]) -> Duplicate | None:
        msg_id = headers.get(MSG_ID)
        if not msg_id:
            return None
        self._forget_old_ids()
        seen = self._msg_ids.get(msg_id)
        return None if seen is None else Duplicate(seen[0])

    def seen_id(self, msg_id: str) -> bool:
        """Whether `msg_id` was stored within the duplicate window."""
        self._forget_old_ids()
        return msg_id in self._msg_ids

    def _over_limit(self, subject: str, headers: Mapping[str, str]) -> Refusal | None:
        """The refusal of a stream with `discard: new` that is full."""
        if self._config.get("discard") != "new":
            return None
        max_msgs, max_bytes = self._config["max_msgs"], self._config["max_bytes"]
        if max_msgs > 0 and len(self._seqs) >= max_msgs:
            return Refusal(503, 10077, "maximum messages exceeded")
        if max_bytes > 0 and self._bytes + message_size(subject, headers, b"") > max_bytes:
            return Refusal(503, 10077, "maximum bytes exceeded")
        per_subject = self._config["max_msgs_per_subject"]
        if (
            self._config.get("discard_new_per_subject")
            and per_subject > 0
            and len(self._by_subject.get(subject, ())) >= per_subject
        ):
            return Refusal(503, 10077, "maximum messages per subject exceeded")
        return None

    def last_on(self, subject: str) -> int:
        """The sequence of the last message on `subject` (a literal); 0 if none."""
        seqs = self._by_subject.get(subject)
        return seqs[-1] if seqs else 0

    def store(self, subject: str, headers: Mapping[str, str] | None, payload: bytes) -> Stored:
        """Store a message that `check` passed (the subject transformed already), with its
        effects: roll-up, limits, the duplicate window, expiry."""
        held = dict(headers) if headers else None
        ttl = 0
        if held is not None and MSG_TTL in held:
            ttl = parse_ttl(held[MSG_TTL])
            marker_ttl = self._marker_ttl_s()
            if 0 < ttl < marker_ttl and self._config["max_msgs_per_subject"] != 1:
                # A marker must outlive any message of its subject (server/stream.go).
                ttl = marker_ttl
                del held[MSG_TTL]
                held[MSG_TTL] = str(ttl)
        seq = self._last_seq + 1
        stored = Stored(seq, subject, held, payload, self._clock.wall_ns())
        self._last_seq, self._last_time_ns = seq, stored.time_ns
        self._messages[seq] = stored
        self._seqs.append(seq)
        seqs = self._by_subject.get(subject)
        if seqs is None:
            seqs = self._by_subject[subject] = []
            for pattern, matching in self._by_filter.items():
                if subject_matches(subject, pattern):
                    matching[subject] = seqs
        seqs.append(seq)
        self._bytes += message_size(subject, held, payload)
        self._stored_at[seq] = self._clock.time()
        if ttl:
            self._ttls[seq] = ttl
        if held is not None and (msg_id := held.get(MSG_ID)):
            self._msg_ids[msg_id] = (seq, self._clock.time())
        rollup = None if held is None else held.get(ROLLUP)
        if rollup == "sub":
            for earlier in self._by_subject[subject][:-1]:
                self.remove(earlier)
        elif rollup == "all":
            for earlier in self._seqs[:-1]:
                self.remove(earlier)
        self._enforce_limits()
        if (deadline := self._deadline(seq)) is not None:
            heapq.heappush(self._expiry, (deadline, seq))
            self._arm()
        self._on_stored(self, stored)
        return stored

    def _enforce_limits(self) -> None:
        """Drop the oldest messages past the limits (a KV bucket's history, with `discard: new`
        too, unless `discard_new_per_subject` refused them instead)."""
        per_subject = self._config["max_msgs_per_subject"]
        if per_subject > 0:
            for seqs in list(self._by_subject.values()):
                for extra in seqs[: max(0, len(seqs) - per_subject)]:
                    self.remove(extra)
        if self._config.get("discard") == "new":
            return
        max_msgs, max_bytes = self._config["max_msgs"], self._config["max_bytes"]
        while max_msgs > 0 and len(self._seqs) > max_msgs:
            self.remove(self._seqs[0])
        while max_bytes > 0 and self._bytes > max_bytes and self._seqs:
            self.remove(self._seqs[0])

    def _forget_old_ids(self) -> None:
        window_s = self._config["duplicate_window"] / _NS
        now = self._clock.time()
        while self._msg_ids:  # oldest first: stop at the first still in the window
            msg_id, (_, at) = next(iter(self._msg_ids.items()))
            if now - at < window_s:
                return
            del self._msg_ids[msg_id]

    # Expiry

    def _marker_ttl_s(self) -> int:
        return int(self._config.get("subject_delete_marker_ttl", 0) // _NS)

    def _deadline(self, seq: int) -> float | None:
        ttl = self._ttls.get(seq, 0)
        if ttl == _NEVER:
            return None
        max_age_s = self._config["max_age"] / _NS
        ages = [age for age in (max_age_s, float(ttl)) if age > 0]
        return self._stored_at[seq] + min(ages) if ages else None

    def _arm(self) -> None:
        due = self._expiry[0][0] if self._expiry else None
        if due == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, due
        if due is not None:
            self._timer = self._clock.call_at(due, self._expire)

    def _expire(self) -> None:
        self._timer, self._timer_at = None, None
        now = self._clock.time()
        while self._expiry and self._expiry[0][0] <= now:
            deadline, seq = heapq.heappop(self._expiry)
            if seq not in self._messages or self._deadline(seq) != deadline:
                continue  # gone already, or its deadline moved (a new max age)
            stored = self._messages[seq]
            marker_ttl = self._marker_ttl_s()
            is_marker = bool(stored.headers) and (
                MARKER_REASON in (stored.headers or {})
                or (stored.headers or {}).get(_KV_OPERATION) == "PURGE"
            )
            if marker_ttl > 0 and not is_marker and self._by_subject[stored.subject] == [seq]:
                # The rollup removes the expired message as the marker is stored.
                marker = {
                    MARKER_REASON: "MaxAge",
                    MSG_TTL: go_duration(marker_ttl),
                    ROLLUP: "sub",
                }
                self.store(stored.subject, marker, b"")
            else:
                self.remove(seq)
        self._arm()

    def close(self) -> None:
        """The stream was deleted: its timer must not fire."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at, self._expiry = None, None, []

    # Administration

    def purge(self, filter_subject: str = "", up_to: int = 0, keep: int = 0) -> int:
        """Remove the messages on `filter_subject` (every one, if empty) below `up_to` (if not
        0), keeping the last `keep` of them (if not 0): how many went."""
        if filter_subject and filter_subject != ">":
            chosen = sorted(seq for seqs in self._subject_lists([filter_subject]) for seq in seqs)
        else:
            chosen = list(self._seqs)
        if up_to:
            chosen = [seq for seq in chosen if seq < up_to]
        if keep:
            chosen = chosen[: max(0, len(chosen) - keep)]
        for seq in chosen:
            self.remove(seq)
        return len(chosen)

    def last_matching(self, subject: str) -> Stored | None:
        """The last message whose subject matches `subject` (which may have wildcards)."""
        best = max((seqs[-1] for seqs in self._subject_lists([subject])), default=None)
        return None if best is None else self._messages[best]

    def state(self, subjects_filter: str = "") -> dict[str, Any]:
        """The stream's `StreamState` JSON, less `consumer_count` (the consumers know it); with
        `subjects_filter`, the count of each matching subject too."""
        first = self.first_seq()
        state: dict[str, Any] = {
            "messages": len(self._seqs),
            "bytes": self._bytes,
            "first_seq": first if self._last_seq else 0,
            "first_ts": rfc3339(self._messages[first].time_ns) if self._seqs else rfc3339(0),
            "last_seq": self._last_seq,
            "last_ts": rfc3339(self._last_time_ns),
        }
        if self._by_subject:
            state["num_subjects"] = len(self._by_subject)
        if subjects_filter:
            matching = self._subjects_matching(subjects_filter)
            if matching:
                state["subjects"] = matching
        if self._seqs and (deleted := self._last_seq - first + 1 - len(self._seqs)):
            state["num_deleted"] = deleted
        return state

    def _subjects_matching(self, subjects_filter: str) -> dict[str, int]:
        return {
            subject: len(seqs)
            for subject, seqs in sorted(self._by_subject.items())
            if subject_matches(subject, subjects_filter)
        }


def _number(text: str) -> int:
    """A header's sequence number; an unreadable one reads as 0, as the server parses it."""
    return int(text) if text.isdigit() else 0
