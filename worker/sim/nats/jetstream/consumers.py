"""The JetStream model's consumers: what nats-server's server/consumer.go does, on virtual time.

What it answers. `Consumers.on_publish` takes every `$JS.API.CONSUMER.*` request (CREATE,
DURABLE.CREATE, INFO, DELETE, NAMES, LIST, MSG.NEXT, UNPIN), every settle published to a
delivery's `$JS.ACK...` reply subject and every flow-control reply (`$JS.FC...`);
`on_stored` wakes the consumers of a stream that stored a message; `on_stream_deleted` drops
a deleted stream's consumers. Answers and deliveries go out through the `Hub`.

A consumer's state, as the real server's:
- `sseq`, the next stream sequence it has not yet looked at, and `dseq`, the next delivery
  (consumer) sequence; `delivered` is (dseq - 1, the last stream sequence first delivered).
- `pending`: what was delivered and is not yet acknowledged (explicit acks), by stream
  sequence, each with its first delivery sequence and its ack deadline (loop time);
  `redelivered`: how many times each sequence was delivered again; `rdq`: the redelivery
  queue, served before any new message.
- The ack floor (`adflr`, `asflr`): below it everything is acknowledged. It moves only when
  the lowest pending delivery is acknowledged, up to just below the next one still pending
  (server/consumer.go `moveAckFloor`); with nothing pending, up to what was delivered.

Redelivery. One timer per consumer fires at the earliest ack deadline of what is pending and
not already queued; everything whose deadline has passed by then goes to the back of `rdq`,
in stream order among themselves (the server sorts each batch: `checkPending`). So messages
come back in the order their ack waits ran out, not in stream order, and before new ones.
`-NAK` queues at once; `-NAK {"delay": ns}` moves the deadline to now + delay; `+WPI`
restarts the ack wait; `+TERM` settles like an ack; `+NXT` acks and asks for more. A message
delivered `max_deliver` times is dropped from `pending` when its wait runs out (the floor
moves past it). An ack for a sequence not pending (acked already, or past) changes nothing
but still gets its reply; one past what the consumer ever delivered gets no reply.

Pull requests. `MSG.NEXT` requests wait in a queue, served in turn: each message goes to
the oldest request with room, which then moves to the back if it wants more (the server's
`waitQueue.pop`). A request whose reply subject lost its interest (`Hub.has_interest`) is
dropped when its turn comes. The statuses, on the request's reply subject, are the server's:
`100 Idle Heartbeat` each `idle_heartbeat` without a delivery to it, `404 No Messages` and
`408 Requests Pending` for `no_wait`, `408 Request Timeout` at expiry with
`Nats-Pending-Messages`/`Nats-Pending-Bytes`, `409 Message Size Exceeds MaxBytes`,
`409 Batch Completed`, `409 Exceeded MaxWaiting` (not sent to a request with heartbeats),
`409 Consumer Deleted`, `400 Bad Request - ...`, `423 Nats-Pin-Id mismatch` and
`423 Nats-Wrong-Pin-Id`, and `503` for a consumer that does not exist (no responders).

Pins (ADR-42, priority policy `pinned_client`). While nobody is pinned, the first request
that a message is delivered to is pinned: it gets a new pin id (from `chance`) in the
`Nats-Pin-Id` header of every message, and the pin timer starts. While a pin is held, a
request with another id is refused at once (423 Nats-Pin-Id mismatch), one without an id
waits (skipped, never served), one with the pin's id is served and restarts the pin timer.
The pin is dropped when the timer runs out (`priority_timeout` after the pin was given or
the pinned client's last request arrived: the server restarts it on requests, not while one
waits) or on `CONSUMER.UNPIN`; the next message then pins the first waiting request without
an id, and a waiting request that still carries the old id gets 423 Nats-Wrong-Pin-Id.

Push consumers (`deliver_subject`: nats-py's `js.subscribe`, the KV watch's ordered
consumer). They deliver whenever the deliver subject has interest; the model has no word of
a new subscription, so an idle push consumer without interest looks again after 1 ms,
doubling to 1 s. With `flow_control`, once more than half the window (2 MiB at first, as the
server's `setMaxPendingBytes(32 MiB)`) is unanswered, a `100 FlowControl Request` goes out
with a `$JS.FC...` reply subject and deliveries stop past the window until that is
answered; `idle_heartbeat` sends `100 Idle Heartbeat` with `Nats-Last-Consumer` and
`Nats-Last-Stream` (and `Nats-Consumer-Stalled` while flow control waits) when nothing was
delivered for that long, which nats-py's ordered consumer checks against what it received.

Inactivity. A consumer with `inactive_threshold` (an ephemeral gets 5 s by default) is
deleted once it was idle that long: a pull consumer without waiting requests since its last
request or delivery (and past the ack wait of what it holds), a push consumer whose deliver
subject has had no interest. Pull consumers add 0.1 to 1 s of jitter, from `chance`.

Faults (`Faults`, switched by the simulation; off, the model keeps the documented promise):
- `late_acks_accepted`: the real server settles an ack however late it comes, even from a
  delivery whose ack wait ran out and which was delivered again since (nats-server#4786).
  Off, such an ack (of a delivery that is not the latest, or whose wait ran out) is ignored
  and the message is redelivered; on, it settles the message as the real server does.
- `pin_overlap_s`: ADR-42 gives no exclusivity guarantee. For this long after a pin is
  dropped, requests carrying the old id are still served as if pinned (stamped with their
  own id), so two clients briefly both receive.

Not modelled: `deliver_group`, `headers_only`, `rate_limit_bps`, `backoff`, replay
`original`, `by_start_time`, the `overflow` and `prioritized` priority policies, pause,
reset, and clustering (advisories neither). A create asking for one is refused as a bad
request that names it. Time is the running loop's (`loop.time()`: virtual in the
simulation); wall-clock stamps come from `kvhandoff.worker.ambient`; chance from `chance`.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvhandoff.worker import ambient
from kvhandoff.worker.sim.nats.hub import Hub
from kvhandoff.worker.sim.nats.jetstream.api import Stored, StreamView, answer, refuse

if TYPE_CHECKING:
    from random import Random

    from kvhandoff.worker.sim.history import History

_API = "$JS.API.CONSUMER."
_ACK = "$JS.ACK."
_FC = "$JS.FC."
_NS = 1_000_000_000
_SERVER_VERSION = "2.15.1"
_API_LEVEL = "5"
_DEFAULT_ACK_WAIT_NS = 30 * _NS
_DEFAULT_MAX_ACK_PENDING = 1000
_DEFAULT_MAX_WAITING = 512
_DEFAULT_PRIORITY_TIMEOUT_NS = 120 * _NS
_EPHEMERAL_INACTIVE_NS = 5 * _NS
_NAMES_LIMIT = 1024
_LIST_LIMIT = 256
_FLOW_CONTROL_LIMIT = 32 * 1024 * 1024
_INTEREST_POLL_FIRST_S = 0.001
_INTEREST_POLL_MAX_S = 1.0
_ID_ALPHABET = string.ascii_letters + string.digits
_VALID_GROUP = re.compile(r"^[a-zA-Z0-9/_=-]{1,16}$")
_ZERO_TIME = "0001-01-01T00:00:00Z"
_PENDING_MESSAGES = "Nats-Pending-Messages"
_PENDING_BYTES = "Nats-Pending-Bytes"
_PIN_ID = "Nats-Pin-Id"

_decode = msgspec.json.decode


@dataclass
class Faults:
    """Ways the real server is weaker than its documentation (see "Faults" above)."""

    late_acks_accepted: bool = False
    pin_overlap_s: float = 0.0


class _Status(Exception):
    """A pull request refused with a status line, such as "400 Bad Request - ..."."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


class _Refused(Exception):
    """An API request refused: the HTTP-like code, the JetStream error code, why."""

    def __init__(self, code: int, err_code: int, description: str) -> None:
        super().__init__(description)
        self.code, self.err_code, self.description = code, err_code, description


def _bad(description: str) -> _Refused:
    return _Refused(400, 10003, f"bad request: {description}")


@dataclass
class _Pending:
    """A delivered, unacknowledged message: its first delivery sequence, when its ack wait
    runs out, and whether it did (so it is queued for redelivery)."""

    dseq: int
    deadline: float
    expired: bool = False


@dataclass(eq=False)
class _Request:
    """A waiting pull request (the server's `waitingRequest`)."""

    reply: str
    n: int  # messages still wanted
    b: int  # bytes still allowed (0: no limit)
    expires: float | None  # loop time
    no_wait: bool
    heartbeat_s: float
    group: str
    pin_id: str
    min_pending: int
    min_ack_pending: int
    d: int = 0  # delivered to it
    expiry: asyncio.TimerHandle | None = None
    beat: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        for timer in (self.expiry, self.beat):
            if timer is not None:
                timer.cancel()
        self.expiry = self.beat = None


def _rfc3339(wall_ns: int) -> str:
    seconds, nanos = divmod(wall_ns, _NS)
    stamp = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return f"{stamp:%Y-%m-%dT%H:%M:%S}.{nanos:09d}Z"


def _new_id(chance: Random, length: int) -> str:
    return "".join(chance.choice(_ID_ALPHABET) for _ in range(length))


def _overlap(a: str, b: str) -> bool:
    """Whether some subject matches both subject filters."""
    left, right = a.split("."), b.split(".")
    for x, y in zip(left, right, strict=False):
        if x == ">" or y == ">":
            return True
        if "*" not in (x, y) and x != y:
            return False
    return len(left) == len(right)


def _filters(config: Mapping[str, Any]) -> list[str]:
    """The consumer's subject filters; [] for every subject."""
    found = list(config.get("filter_subjects") or [])
    if config.get("filter_subject"):
        found.append(config["filter_subject"])
    return [f for f in found if f != ">"]


def _status_headers(n: int, b: int) -> dict[str, str]:
    return {_PENDING_MESSAGES: str(n), _PENDING_BYTES: str(b)}


_UNMODELLED = {
    "deliver_group": "deliver groups",
    "headers_only": "headers-only delivery",
    "rate_limit_bps": "rate limits",
    "backoff": "backoff",
    "pause_until": "pausing",
    "opt_start_time": "start times",
    "sample_freq": "ack sampling",
}
# The fields an existing consumer's config may not change (server `checkNewConsumerConfig`).
_FIXED = {
    "deliver_policy": "deliver policy",
    "mem_storage": "storage type",
    "opt_start_seq": "start sequence",
    "ack_policy": "ack policy",
    "replay_policy": "replay policy",
    "idle_heartbeat": "heart beats",
    "flow_control": "flow control",
    "max_waiting": "max waiting",
}


def _normalize(raw: Mapping[str, Any], *, durable: bool, push: bool) -> dict[str, Any]:
    """The config as the server keeps it: its defaults filled in, empty fields left out
    (Go's `omitempty`), the metadata without the server's dynamic keys. `_Refused` names a
    config the server refuses or the model does not implement."""
    config = {k: v for k, v in raw.items() if v not in (None, "", 0, False, [], {})}
    for key, what in _UNMODELLED.items():
        if key in config:
            raise _bad(f"the JetStream model does not implement {what} ({key})")
    config.setdefault("deliver_policy", "all")
    config.setdefault("ack_policy", "none")
    config.setdefault("replay_policy", "instant")
    config["num_replicas"] = int(raw.get("num_replicas") or 0)
    if config["replay_policy"] != "instant":
        raise _bad("the JetStream model replays instantly only (replay_policy)")
    ack = config["ack_policy"]
    if ack not in ("none", "all", "explicit"):
        raise _Refused(400, 10181, "consumer ack policy invalid")
    if config.get("max_deliver", 0) <= 0:
        config["max_deliver"] = -1
    if ack != "none":
        config.setdefault("ack_wait", _DEFAULT_ACK_WAIT_NS)
        if config.get("max_ack_pending", 0) == 0:
            config["max_ack_pending"] = _DEFAULT_MAX_ACK_PENDING
    if config.get("max_ack_pending", 0) < 0:
        config["max_ack_pending"] = -1
    if push:
        if "max_waiting" in config:
            raise _Refused(400, 10080, "consumer in push mode can not set max waiting")
        if any(c in config["deliver_subject"] for c in "*> "):
            raise _Refused(400, 10079, "consumer deliver subject has wildcards")
        if config.get("priority_policy", "none") != "none":
            raise _bad("a push consumer cannot have priority groups")
    else:
        if "idle_heartbeat" in config:
            raise _Refused(400, 10088, "consumer idle heartbeat requires a push based consumer")
        if "flow_control" in config:
            raise _Refused(400, 10089, "consumer flow control requires a push based consumer")
        config.setdefault("max_waiting", _DEFAULT_MAX_WAITING)
    if config.get("flow_control") and not config.get("idle_heartbeat"):
        raise _bad("consumer with flow control also needs heartbeats")
    if not durable:
        config.setdefault("inactive_threshold", _EPHEMERAL_INACTIVE_NS)
    if "filter_subject" in config and "filter_subjects" in config:
        raise _bad("consumer config has both filter_subject and filter_subjects")
    filters = _filters(config)
    for i, one in enumerate(filters):
        if any(_overlap(one, other) for other in filters[i + 1 :]):
            raise _Refused(400, 10138, "consumer subject filters cannot overlap")
    _check_deliver_policy(config, filters)
    _check_priority(config)
    metadata = dict(config.get("metadata") or {})
    metadata.pop("_nats.ver", None)
    metadata.pop("_nats.level", None)
    pinned = config.get("priority_policy", "none") != "none"
    metadata["_nats.req.level"] = "1" if pinned else "0"
    config["metadata"] = metadata
    return config


def _check_deliver_policy(config: Mapping[str, Any], filters: list[str]) -> None:
    policy = config["deliver_policy"]
    if policy not in ("all", "last", "new", "by_start_sequence", "last_per_subject"):
        raise _bad(f"the JetStream model does not implement deliver policy {policy!r}")
    if policy == "by_start_sequence":
        if not config.get("opt_start_seq"):
            raise _Refused(
                400,
                10094,
                "consumer delivery policy is deliver by start sequence, but optional start "
                "sequence is not set",
            )
    elif config.get("opt_start_seq"):
        raise _Refused(
            400,
            10094,
            f"consumer delivery policy is deliver {policy.replace('_', ' ')}, but optional "
            "start sequence is also set",
        )
    if policy == "last_per_subject" and not filters:
        raise _Refused(
            400,
            10094,
            "consumer delivery policy is deliver last per subject, but optional filter "
            "subject is not set",
        )


def _check_priority(config: dict[str, Any]) -> None:
    policy = config.get("priority_policy", "none")
    groups = config.get("priority_groups") or []
    if policy == "none":
        if groups:
            raise _bad("priority groups need a priority policy")
        if config.get("priority_timeout"):
            raise _bad("priority_timeout needs the pinned_client priority policy")
        config.pop("priority_policy", None)
        return
    if policy != "pinned_client":
        raise _bad(f"the JetStream model does not implement priority policy {policy!r}")
    if not groups:
        raise _Refused(
            400, 10159, "Setting PriorityPolicy requires at least one PriorityGroup to be set"
        )
    if not all(_VALID_GROUP.match(g) for g in groups):
        raise _Refused(
            400,
            10162,
            "Valid priority group name must match A-Z, a-z, 0-9, -_/=)+ and may not exceed "
            "16 characters",
        )
    config.setdefault("priority_timeout", _DEFAULT_PRIORITY_TIMEOUT_NS)


class _Consumer:
    """One consumer of one stream: its state (see the module docstring) and its timers."""

    def __init__(
        self,
        owner: Consumers,
        stream: StreamView,
        name: str,
        config: dict[str, Any],
        durable: bool,
    ) -> None:
        self._owner = owner
        self._hub = owner._hub
        self.stream = stream
        self.name = name
        self.config = config
        self.durable = durable
        self.created_ns = self._owner.ambient.wall_ns()
        self.filters = _filters(config)
        self.push = bool(config.get("deliver_subject"))
        self.closed = False
        self.dseq = 1
        self.sseq = 1
        self.delivered_stream = 0
        self.adflr = 0
        self.asflr = 0
        self.pending: dict[int, _Pending] = {}
        self.redelivered: dict[int, int] = {}
        self.rdq: list[int] = []
        self.skip: list[int] = []  # last_per_subject: the sequences still to deliver
        self.resume = 0  # ... and the last stream sequence when they were chosen
        self.waiting: list[_Request] = []
        self.pin = ""
        self.pinned_ns = 0
        self.old_pin = ""
        self.old_pin_until = 0.0
        self._pin_timer: asyncio.TimerHandle | None = None
        self._ack_timer: asyncio.TimerHandle | None = None
        self._ack_timer_at = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._heartbeat_timer: asyncio.TimerHandle | None = None
        self._poll_timer: asyncio.TimerHandle | None = None
        self._poll_s = _INTEREST_POLL_FIRST_S
        self.last_active = self._now()
        self.inactive_since: float | None = None
        # Push flow control: bytes delivered and not yet answered for, the window, the
        # outstanding request's reply subject and the bytes it answers for.
        self.pbytes = 0
        self.maxpb = _FLOW_CONTROL_LIMIT // 16
        self.fcid = ""
        self.fcsz = 0
        self._select_start()
        threshold_ns = config.get("inactive_threshold", 0)
        jitter_s = 0.0 if self.push else 0.1 + owner._chance.randrange(900) / 1000
        self.idle_after_s = threshold_ns / _NS + jitter_s if threshold_ns else 0.0
        if self.idle_after_s:
            self._idle_timer = self._later(self.idle_after_s, self._check_idle)
        if self.push and config.get("idle_heartbeat"):
            self._heartbeat_timer = self._later(self._heartbeat_s(), self._push_heartbeat)

    # -- time ------------------------------------------------------------------------------

    @staticmethod
    def _loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def _now(self) -> float:
        return self._loop().time()

    def _later(self, delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop().call_later(delay_s, callback)

    def _heartbeat_s(self) -> float:
        return float(self.config.get("idle_heartbeat", 0)) / _NS

    @property
    def ack_wait_s(self) -> float:
        return float(self.config.get("ack_wait", 0)) / _NS

    # -- where delivery starts -------------------------------------------------------------

    def _select_start(self) -> None:
        stream, policy = self.stream, self.config["deliver_policy"]
        first, last = max(stream.first_seq(), 1), stream.last_seq()
        if policy == "all":
            self.sseq = first
        elif policy == "new":
            self.sseq = last + 1
        elif policy == "by_start_sequence":
            self.sseq = max(int(self.config["opt_start_seq"]), 1)
        else:
            lasts: dict[str, int] = {}
            found = stream.next_after(first - 1, self.filters)
            while found is not None:
                lasts[found.subject] = found.seq
                found = stream.next_after(found.seq, self.filters)
            if policy == "last":
                self.sseq = max(lasts.values(), default=last + 1)
            elif lasts:
                self.skip = sorted(lasts.values())
                self.resume = last
                self.sseq = self.skip[0]
            else:
                self.sseq = last + 1
        # Nothing before the start counts as delivered or pending.
        self.asflr = self.sseq - 1
        self.delivered_stream = self.sseq - 1

    def num_pending(self) -> int:
        """Messages not yet delivered (the server's `npc`)."""
        if self.skip:
            return len(self.skip) + self.stream.count_after(self.resume, self.filters)
        return self.stream.count_after(self.sseq - 1, self.filters)

    # -- the info ---------------------------------------------------------------------------

    def config_json(self) -> dict[str, Any]:
        shown = dict(self.config)
        shown["metadata"] = {
            **self.config["metadata"],
            "_nats.ver": _SERVER_VERSION,
            "_nats.level": _API_LEVEL,
        }
        return shown

    def info(self) -> dict[str, Any]:
        self._drop_uninterested()
        now_ns = self._owner.ambient.wall_ns()
        info: dict[str, Any] = {
            "stream_name": self.stream.name,
            "name": self.name,
            "created": _rfc3339(self.created_ns),
            "config": self.config_json(),
            "delivered": {"consumer_seq": self.dseq - 1, "stream_seq": self.delivered_stream},
            "ack_floor": {"consumer_seq": self.adflr, "stream_seq": self.asflr},
            "num_ack_pending": len(self.pending),
            "num_redelivered": 0 if self.config["max_deliver"] == 1 else len(self.redelivered),
            "num_waiting": len(self.waiting),
            "num_pending": self.num_pending(),
            "ts": _rfc3339(now_ns),
        }
        if self.push and self._hub.has_interest(self.config["deliver_subject"]):
            info["push_bound"] = True
        groups = self.config.get("priority_groups") or []
        if groups:
            group: dict[str, Any] = {"group": groups[0], "pinned_ts": _ZERO_TIME}
            if self.pin:
                group |= {"pinned_client_id": self.pin, "pinned_ts": _rfc3339(self.pinned_ns)}
            info["priority_groups"] = [group]
        return info

    # -- pull requests ----------------------------------------------------------------------

    def on_next_request(self, reply: str, payload: bytes) -> None:
        """A `MSG.NEXT` request (server `processNextMsgRequest`)."""
        if not reply:
            return
        if self.push:
            self._status(reply, "409 Consumer is push based")
            return
        try:
            request = self._parse_request(reply, payload)
        except _Status as refused:
            self._status(reply, refused.status)
            return
        if request is None:
            return
        self.last_active = self._now()
        if len(self.waiting) >= self.config["max_waiting"]:
            self._process_waiting(eos=False)
        if request.no_wait:
            in_hand = self.num_pending() + len(self.rdq)
            if in_hand == 0 and request.expires is None:
                self._status(reply, "404 No Messages")
                return
            if in_hand and in_hand < sum(r.n for r in self.waiting):
                self._status(reply, "408 Requests Pending")
                return
        if len(self.waiting) >= self.config["max_waiting"]:
            if not request.heartbeat_s:
                self._status(reply, "409 Exceeded MaxWaiting")
            return
        self.waiting.append(request)
        if request.expires is not None:
            request.expiry = self._loop().call_at(request.expires, lambda: self._expire(request))
        self._arm_heartbeat(request)
        self.pump()

    def _parse_request(self, reply: str, payload: bytes) -> _Request | None:
        """The request, or None if it was answered already (423); `_Status` carries the
        status a malformed or unacceptable request gets."""
        body = payload.strip()
        fields: dict[str, Any] = {}
        if body.startswith(b"{"):
            try:
                decoded = _decode(body)
            except msgspec.DecodeError as exc:
                raise _Status(f"400 Bad Request - {exc}") from exc
            if not isinstance(decoded, dict):
                raise _Status("400 Bad Request - the request is not a JSON object")
            fields = decoded
        elif body.isdigit():
            fields = {"batch": int(body)}
        expires_ns = int(fields.get("expires") or 0)
        heartbeat_ns = int(fields.get("idle_heartbeat") or 0)
        if heartbeat_ns and heartbeat_ns * 2 > expires_ns:
            raise _Status("400 Bad Request - heartbeat value too large")
        batch = int(fields.get("batch") or 1)
        max_bytes = int(fields.get("max_bytes") or 0)
        limit = self.config.get("max_batch", 0)
        if limit and batch > limit:
            raise _Status(f"409 Exceeded MaxRequestBatch of {limit}")
        limit = self.config.get("max_expires", 0)
        if limit and expires_ns > limit:
            raise _Status(f"409 Exceeded MaxRequestExpires of {limit / _NS:g}s")
        limit = self.config.get("max_bytes", 0)
        if limit and max_bytes > limit:
            raise _Status(f"409 Exceeded MaxRequestMaxBytes of {limit}")
        group = str(fields.get("group") or "")
        pin_id = str(fields.get("id") or "")
        min_pending = int(fields.get("min_pending") or 0)
        min_ack_pending = int(fields.get("min_ack_pending") or 0)
        policy = self.config.get("priority_policy", "none")
        if fields:
            if min_pending or min_ack_pending:
                raise _Status("400 Bad Request - Not a Overflow Priority consumer")
            if pin_id and policy != "pinned_client":
                raise _Status("400 Bad Request - Not a Pinned Client Priority consumer")
        if policy != "none":
            if not group:
                raise _Status("400 Bad Request - Priority Group missing")
            if group not in self.config["priority_groups"]:
                raise _Status("400 Bad Request - Invalid Priority Group")
            if self.pin:
                if pin_id == self.pin:
                    self._arm_pin_timer()
                elif pin_id and not self._overlapping(pin_id):
                    self._status(reply, "423 Nats-Pin-Id mismatch")
                    return None
        now = self._now()
        return _Request(
            reply=reply,
            n=batch,
            b=max_bytes,
            expires=now + expires_ns / _NS if expires_ns else None,
            no_wait=bool(fields.get("no_wait")),
            heartbeat_s=heartbeat_ns / _NS,
            group=group,
            pin_id=pin_id,
            min_pending=min_pending,
            min_ack_pending=min_ack_pending,
        )

    def _status(self, reply: str, status: str, headers: Mapping[str, str] | None = None) -> None:
        self._hub.send(reply, b"", headers=headers, status=status)

    def _arm_heartbeat(self, request: _Request) -> None:
        """The request's next heartbeat is an interval from now (it was just made, heard
        from, or delivered to)."""
        if not request.heartbeat_s:
            return
        if request.beat is not None:
            request.beat.cancel()

        def beat() -> None:
            request.beat = None
            if request not in self.waiting:
                return
            if not self._hub.has_interest(request.reply):
                self._remove(request)
                return
            self._status(request.reply, "100 Idle Heartbeat", self._last_headers())
            self._arm_heartbeat(request)

        request.beat = self._later(request.heartbeat_s, beat)

    def _last_headers(self) -> dict[str, str]:
        headers = {"Nats-Last-Consumer": str(self.dseq - 1), "Nats-Last-Stream": str(self.sseq - 1)}
        if self.fcid:
            headers["Nats-Consumer-Stalled"] = self.fcid
        return headers

    def _expire(self, request: _Request) -> None:
        if request in self.waiting:
            self._remove(request)
            self._status(
                request.reply, "408 Request Timeout", _status_headers(request.n, request.b)
            )

    def _remove(self, request: _Request) -> None:
        self.waiting.remove(request)
        request.cancel()

    def _drop_uninterested(self) -> None:
        for request in list(self.waiting):
            if not self._hub.has_interest(request.reply):
                self._remove(request)

    def _process_waiting(self, eos: bool) -> None:
        """Expire and drop what is done (server `processWaiting`): at the end of what there
        is to deliver, a `no_wait` request that got something, or has no expiry, ends 404."""
        now = self._now()
        for request in list(self.waiting):
            if request.expires is not None and now >= request.expires:
                self._expire(request)
            elif eos and request.no_wait and (request.expires is None or request.d > 0):
                self._remove(request)
                self._status(request.reply, "404 No Messages")
            elif not self._hub.has_interest(request.reply):
                self._remove(request)

    # -- pins -------------------------------------------------------------------------------

    def _overlapping(self, pin_id: str) -> bool:
        """Whether `pin_id` is a dropped pin still served (the `pin_overlap_s` fault)."""
        return bool(pin_id) and pin_id == self.old_pin and self._now() < self.old_pin_until

    def _arm_pin_timer(self) -> None:
        if self._pin_timer is not None:
            self._pin_timer.cancel()
        timeout_s = float(self.config["priority_timeout"]) / _NS
        self._pin_timer = self._later(timeout_s, self.unpin)

    def _assign_pin(self, request: _Request) -> None:
        self.pin = _new_id(self._owner._chance, 22)
        self.pinned_ns = self._owner.ambient.wall_ns()
        request.pin_id = self.pin
        self._arm_pin_timer()

    def unpin(self) -> None:
        """Drop the pin (its timer ran out, or `CONSUMER.UNPIN`); the next message pins anew."""
        if self._pin_timer is not None:
            self._pin_timer.cancel()
            self._pin_timer = None
        if self.pin:
            overlap_s = self._owner.faults.pin_overlap_s
            if overlap_s > 0:
                self.old_pin, self.old_pin_until = self.pin, self._now() + overlap_s
            self.pin, self.pinned_ns = "", 0
        self.pump()

    def _next_waiting(self, size: int) -> _Request | None:
        """The request the next message (of `size` bytes) goes to (server `nextWaiting`),
        taking one off what it wants; pins the request if nobody is pinned."""
        pinned_policy = self.config.get("priority_policy") == "pinned_client"
        need_pin = pinned_policy and not self.pin
        cycled = 0
        while self.waiting:
            request = self.waiting[0]
            if request.expires is not None and self._now() >= request.expires:
                self._expire(request)
                continue
            assigned = False
            if need_pin:
                if request.pin_id and not self._overlapping(request.pin_id):
                    self._remove(request)
                    self._status(
                        request.reply,
                        "423 Nats-Wrong-Pin-Id",
                        _status_headers(request.n, request.b),
                    )
                    continue
                if not request.pin_id:
                    self._assign_pin(request)
                    assigned = True
            elif pinned_policy and request.pin_id != self.pin:
                if request.pin_id and not self._overlapping(request.pin_id):
                    self._remove(request)
                    self._status(
                        request.reply,
                        "423 Nats-Wrong-Pin-Id",
                        _status_headers(request.n, request.b),
                    )
                    continue
                if not request.pin_id:
                    # Waits for the pin to be dropped.
                    self.waiting.append(self.waiting.pop(0))
                    cycled += 1
                    if cycled >= len(self.waiting):
                        return None
                    continue
            if request.b:
                if size > request.b:
                    self._remove(request)
                    self._status(
                        request.reply,
                        "409 Message Size Exceeds MaxBytes",
                        _status_headers(request.n, request.b),
                    )
                    if assigned:
                        self.pin, self.pinned_ns = "", 0
                        if self._pin_timer is not None:
                            self._pin_timer.cancel()
                    continue
                request.b -= size
                if request.b == 0:
                    request.n = 1
            if not self._hub.has_interest(request.reply):
                self._remove(request)
                continue
            request.n -= 1
            request.d += 1
            self.waiting.pop(0)
            if request.n > 0:
                self.waiting.append(request)
            else:
                request.cancel()
            return request
        return None

    # -- delivery ---------------------------------------------------------------------------

    def pump(self) -> None:
        """Deliver what there is to whoever may take it (server `loopAndGatherMsgs`)."""
        if self.closed:
            return
        if self.push:
            self._pump_push()
            return
        eos = True
        while self.waiting:
            mark = (self.sseq, len(self.skip))
            found = self._next_message()
            if found is None:
                eos = not self._at_max_ack_pending()
                break
            stored, dc = found
            ack_reply = self._ack_reply(stored, dc)
            size = len(stored.subject) + len(ack_reply) + len(stored.payload)
            size += sum(len(k) + len(v) + 4 for k, v in (stored.headers or {}).items())
            request = self._next_waiting(size)
            if request is None:
                self._put_back(stored.seq, dc, mark)
                break
            headers = dict(stored.headers or {})
            if self.config.get("priority_policy") == "pinned_client":
                headers[_PIN_ID] = request.pin_id if self._overlapping(request.pin_id) else self.pin
            self._deliver(request.reply, stored, dc, ack_reply, headers or None)
            if request.n <= 0 and request.b > 0:
                self._status(request.reply, "409 Batch Completed", _status_headers(0, request.b))
            elif request.n > 0:
                self._arm_heartbeat(request)
        self._process_waiting(eos)

    def _pump_push(self) -> None:
        subject = self.config["deliver_subject"]
        if not self._hub.has_interest(subject):
            if self.inactive_since is None:
                self.inactive_since = self._now()
            if self._poll_timer is None:
                self._poll_timer = self._later(self._poll_s, self._poll)
            return
        self.inactive_since = None
        self._poll_s = _INTEREST_POLL_FIRST_S
        while not (self.config.get("flow_control") and self.pbytes > self.maxpb):
            found = self._next_message()
            if found is None:
                return
            stored, dc = found
            ack_reply = self._ack_reply(stored, dc)
            self._deliver(subject, stored, dc, ack_reply, stored.headers)
            if self._heartbeat_timer is not None:
                self._heartbeat_timer.cancel()
                self._heartbeat_timer = self._later(self._heartbeat_s(), self._push_heartbeat)
            if self.config.get("flow_control"):
                self.pbytes += len(stored.subject) + len(ack_reply) + len(stored.payload)
                if not self.fcid and self.pbytes > self.maxpb // 2:
                    token = _new_id(self._owner._chance, 4)
                    self.fcid = f"{_FC}{self.stream.name}.{self.name}.{token}"
                    self.fcsz = self.pbytes
                    self._hub.send(subject, b"", reply=self.fcid, status="100 FlowControl Request")

    def _poll(self) -> None:
        self._poll_timer = None
        self._poll_s = min(self._poll_s * 2, _INTEREST_POLL_MAX_S)
        self.pump()

    def _push_heartbeat(self) -> None:
        subject = self.config["deliver_subject"]
        if self._hub.has_interest(subject):
            self._status(subject, "100 Idle Heartbeat", self._last_headers())
        self._heartbeat_timer = self._later(self._heartbeat_s(), self._push_heartbeat)

    def on_flow_control(self, subject: str) -> None:
        """The subscriber answered a flow-control request (server `processFlowControl`)."""
        if subject != self.fcid:
            return
        self.maxpb = min(self.maxpb * 2, _FLOW_CONTROL_LIMIT)
        self.pbytes = max(0, self.pbytes - self.fcsz)
        self.fcid, self.fcsz = "", 0
        self.pump()

    def _at_max_ack_pending(self) -> bool:
        limit = int(self.config.get("max_ack_pending", -1))
        return self.config["ack_policy"] != "none" and 0 < limit <= len(self.pending)

    def _next_message(self) -> tuple[Stored, int] | None:
        """The next message to deliver and its delivery count (server `getNextMsg`), taken
        off the redelivery queue or, below `max_ack_pending`, from the stream; `_put_back`
        returns it if nobody takes it."""
        max_deliver = self.config["max_deliver"]
        while self.rdq:
            seq = self.rdq.pop(0)
            dc = self.redelivered.get(seq, 0) + 2
            self.redelivered[seq] = dc - 1
            pending = self.pending.get(seq)
            if 0 < max_deliver < dc:
                if pending is not None:
                    del self.pending[seq]
                    self._move_ack_floor(pending.dseq, seq)
                continue
            stored = self.stream.get(seq)
            if stored is None:
                # Removed from the stream meanwhile: settle it as the server's term does.
                if pending is not None:
                    del self.pending[seq]
                    self._move_ack_floor(pending.dseq, seq)
                continue
            return stored, dc
        if self._at_max_ack_pending():
            return None
        if self.skip:
            seq = self.skip.pop(0)
            self.sseq = seq + 1 if self.skip else self.resume + 1
            stored = self.stream.get(seq)
            return (stored, 1) if stored is not None else self._next_message()
        stored = self.stream.next_after(self.sseq - 1, self.filters)
        if stored is None:
            return None
        self.sseq = stored.seq + 1
        return stored, 1

    def _put_back(self, seq: int, dc: int, mark: tuple[int, int]) -> None:
        """Undo `_next_message`: `mark` is (`sseq`, the skip list's length) before it."""
        if dc == 1:
            self.sseq = mark[0]
            if len(self.skip) < mark[1]:
                self.skip.insert(0, seq)
        else:
            self.redelivered[seq] = dc - 2
            if self.redelivered[seq] == 0:
                del self.redelivered[seq]
            self.rdq.insert(0, seq)

    def _ack_reply(self, stored: Stored, dc: int) -> str:
        return (
            f"{_ACK}{self.stream.name}.{self.name}.{dc}.{stored.seq}.{self.dseq}."
            f"{stored.time_ns}.{self.num_pending()}"
        )

    def _deliver(
        self,
        to: str,
        stored: Stored,
        dc: int,
        ack_reply: str,
        headers: Mapping[str, str] | None,
    ) -> None:
        dseq = self.dseq
        self.dseq += 1
        if dc == 1:
            self.delivered_stream = max(self.delivered_stream, stored.seq)
        self.last_active = self._now()
        if self.config["ack_policy"] == "none":
            self.adflr, self.asflr = dseq, stored.seq
        else:
            deadline = self._now() + self.ack_wait_s
            pending = self.pending.get(stored.seq)
            if pending is None:
                self.pending[stored.seq] = _Pending(dseq, deadline)
            else:
                pending.deadline, pending.expired = deadline, False
            self._arm_ack_timer()
        self._hub.send(
            to, stored.payload, reply=ack_reply, headers=headers, as_subject=stored.subject
        )

    # -- acks -------------------------------------------------------------------------------

    def on_ack(self, subject: str, reply: str, payload: bytes) -> None:
        """A settle published to a delivery's ack subject (server `processAck`)."""
        tokens = subject.split(".")
        at = 4 if len(tokens) == 9 else 6
        try:
            dc, sseq, dseq = (int(t) for t in tokens[at : at + 3])
        except ValueError:
            return
        body = payload.strip()
        kind = body[:4]
        if body and kind not in (b"+ACK", b"-NAK", b"+WPI", b"+NXT", b"+TER"):
            kind = b"+ACK" if body == b"+OK" else b""
        if not body:
            kind = b"+ACK"
        if not kind:
            return
        if self._late(sseq, dc):
            # The documented promise: an ack after the ack wait settles nothing.
            if reply and kind != b"+NXT":
                self._hub.send(reply, b"")
            return
        answered = True
        if kind in (b"+ACK", b"+TER"):
            answered = self._settle(sseq, dseq)
        elif kind == b"+NXT":
            self._settle(sseq, dseq)
            self.on_next_request(reply, body[4:])
            answered = False
        elif kind == b"-NAK":
            self._nak(sseq, dseq, body[4:])
        else:
            pending = self.pending.get(sseq)
            if pending is not None:
                pending.deadline = self._now() + self.ack_wait_s
                self._arm_ack_timer()
        if answered and reply:
            self._hub.send(reply, b"")
        self.pump()

    def _late(self, sseq: int, dc: int) -> bool:
        """Whether this settle comes from a delivery whose ack wait ran out, or one that was
        not the latest (and the `late_acks_accepted` fault is off)."""
        pending = self.pending.get(sseq)
        if pending is None or self._owner.faults.late_acks_accepted:
            return False
        return pending.expired or dc != self.redelivered.get(sseq, 0) + 1

    def _settle(self, sseq: int, dseq: int) -> bool:
        """Acknowledge `sseq` (and, with ack policy `all`, everything pending below it);
        False if it is past what the consumer delivered (nothing is answered then)."""
        if sseq >= self.sseq and not self.skip:
            return False
        if self.config["ack_policy"] == "all":
            settled = sorted(s for s in self.pending if s <= sseq)
            if dseq > self.adflr and sseq > self.asflr:
                self.adflr, self.asflr = dseq, sseq
            for seq in settled:
                del self.pending[seq]
        else:
            settled = [sseq]
            pending = self.pending.get(sseq)
            if pending is not None:
                del self.pending[sseq]
                self._move_ack_floor(pending.dseq, sseq)
        for seq in settled:
            self.redelivered.pop(seq, None)
            if seq in self.rdq:
                self.rdq.remove(seq)
            removed = self.stream.config.get("retention") == "workqueue" and self.stream.remove(seq)
            if self._owner.history is not None:
                self._owner.history.on_acked(self.stream.name, self.name, seq, removed=removed)
        self._arm_ack_timer()
        return True

    def _move_ack_floor(self, dseq: int, sseq: int) -> None:
        """Server `moveAckFloor`: with nothing pending, up to what was delivered; else, if
        the lowest pending delivery was settled, up to just below the next one pending."""
        if not self.pending:
            self.adflr, self.asflr = self.dseq - 1, self.sseq - 1
            if self.skip:
                self.asflr = min(self.asflr, self.skip[0] - 1)
        elif dseq == self.adflr + 1:
            self.adflr, self.asflr = dseq, sseq
            above = [s for s in self.pending if s > sseq]
            if above:
                nearest = min(above)
                self.adflr, self.asflr = self.pending[nearest].dseq - 1, nearest - 1

    def _nak(self, sseq: int, dseq: int, argument: bytes) -> None:
        if dseq <= self.adflr or dseq > self.dseq:
            return
        pending = self.pending.get(sseq)
        if pending is None:
            return
        if self._owner.history is not None:
            self._owner.history.on_naked(self.stream.name, self.name, sseq)
        argument = argument.strip()
        if argument.startswith(b"{"):
            try:
                delay_ns = int(_decode(argument).get("delay") or 0)
            except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
                delay_ns = -1  # the server treats a bad delay as a plain nak
            if delay_ns >= 0:
                if sseq in self.rdq:
                    self.rdq.remove(sseq)
                pending.deadline, pending.expired = self._now() + delay_ns / _NS, False
                self._arm_ack_timer()
                return
        if sseq not in self.rdq:
            self.rdq.append(sseq)

    def _arm_ack_timer(self) -> None:
        """One timer, at the earliest ack deadline of what is pending and not yet queued."""
        waiting = [p.deadline for p in self.pending.values() if not p.expired]
        if not waiting:
            if self._ack_timer is not None:
                self._ack_timer.cancel()
                self._ack_timer = None
            return
        at = min(waiting)
        if self._ack_timer is not None:
            if self._ack_timer_at == at:
                return
            self._ack_timer.cancel()
        self._ack_timer_at = at
        self._ack_timer = self._loop().call_at(at, self._check_pending)

    def _check_pending(self) -> None:
        """The ack waits that ran out: those messages go to the back of the redelivery
        queue, in stream order among themselves (server `checkPending`)."""
        self._ack_timer = None
        now = self._now()
        max_deliver = self.config["max_deliver"]
        expired = sorted(
            seq for seq, p in self.pending.items() if not p.expired and p.deadline <= now
        )
        for seq in expired:
            pending = self.pending[seq]
            if 0 < max_deliver <= self.redelivered.get(seq, 0) + 1:
                del self.pending[seq]
                self._move_ack_floor(pending.dseq, seq)
                continue
            pending.expired = True
            if seq not in self.rdq:
                self.rdq.append(seq)
        self._arm_ack_timer()
        self.pump()

    # -- lifetime ---------------------------------------------------------------------------

    def _check_idle(self) -> None:
        """Delete the consumer once it was idle for its inactive threshold (server
        `deleteNotActive`); else look again when it could be."""
        now = self._now()
        if self.push:
            if self._hub.has_interest(self.config["deliver_subject"]):
                self.inactive_since = None
            elif self.inactive_since is None:
                self.inactive_since = now
            since = self.inactive_since
            wait_s = self.idle_after_s if since is None else since + self.idle_after_s - now
        else:
            self._drop_uninterested()
            # Idle since its last request or delivery, and past the ack wait of what it
            # holds: the client may still be working on that.
            quiet_at = (
                max([self.last_active] + [p.deadline for p in self.pending.values()])
                + self.idle_after_s
            )
            wait_s = self.idle_after_s if self.waiting else quiet_at - now
        if wait_s > 0:
            self._idle_timer = self._later(wait_s, self._check_idle)
            return
        self._owner._delete(self)

    def close(self) -> None:
        """Stop: every waiting request hears that the consumer is gone."""
        self.closed = True
        for timer in (
            self._pin_timer,
            self._ack_timer,
            self._idle_timer,
            self._heartbeat_timer,
            self._poll_timer,
        ):
            if timer is not None:
                timer.cancel()
        for request in self.waiting:
            request.cancel()
            self._status(request.reply, "409 Consumer Deleted")
        self.waiting.clear()


class Consumers:
    """Every consumer of every stream, and the API that makes, reads and removes them."""

    def __init__(self, hub: Hub, chance: Random, streams: Mapping[str, StreamView]) -> None:
        self._hub = hub
        self._chance = chance
        self._streams = streams
        self._by_stream: dict[str, dict[str, _Consumer]] = {}
        self.faults = Faults()
        self.history: History | None = None  # records every ack and nak (worker.sim.history)
        # The server's wall clock, not that of whichever client's publish is being served.
        self.ambient = ambient.current()

    def _consumer(self, stream: str, name: str) -> _Consumer | None:
        return self._by_stream.get(stream, {}).get(name)

    def on_publish(
        self, subject: str, reply: str, headers: Mapping[str, str] | None, payload: bytes
    ) -> None:
        """An API request, a settle (`$JS.ACK...`) or a flow-control reply (`$JS.FC...`)."""
        if subject.startswith(_ACK):
            tokens = subject.split(".")
            at = 2 if len(tokens) == 9 else 4
            if len(tokens) >= 9 and (found := self._consumer(*tokens[at : at + 2])):
                found.on_ack(subject, reply, payload)
        elif subject.startswith(_FC):
            tokens = subject.split(".")
            if len(tokens) >= 5 and (found := self._consumer(tokens[2], tokens[3])):
                found.on_flow_control(subject)
        elif subject.startswith(_API):
            self._on_api(subject.removeprefix(_API).split("."), reply, payload)

    def on_stored(self, stream: StreamView, stored: Stored) -> None:
        """A new message in `stream`: its consumers deliver it if someone waits for it."""
        for consumer in list(self._by_stream.get(stream.name, {}).values()):
            consumer.pump()

    def consumer_count(self, stream: str) -> int:
        """How many consumers `stream` has (its info's `consumer_count`)."""
        return len(self._by_stream.get(stream, {}))

    def on_stream_deleted(self, name: str) -> None:
        for consumer in list(self._by_stream.pop(name, {}).values()):
            consumer.close()

    def _delete(self, consumer: _Consumer) -> None:
        held = self._by_stream.get(consumer.stream.name, {})
        if held.get(consumer.name) is consumer:
            del held[consumer.name]
        consumer.close()

    # -- the API ----------------------------------------------------------------------------

    def _on_api(self, tokens: list[str], reply: str, payload: bytes) -> None:
        verb = tokens[0]
        if verb == "MSG" and len(tokens) == 4 and tokens[1] == "NEXT":
            found = self._consumer(tokens[2], tokens[3])
            if found is None:
                if reply:
                    self._hub.send(reply, b"", status="503")
            else:
                found.on_next_request(reply, payload)
            return
        try:
            body = self._api(verb, tokens[1:], payload)
        except _Refused as refused:
            refuse(self._hub, reply, refused.code, refused.err_code, refused.description)
            return
        answer(self._hub, reply, body)

    def _api(self, verb: str, args: list[str], payload: bytes) -> dict[str, Any]:
        request = self._json(payload)
        if verb == "CREATE" and args:
            name = args[1] if len(args) > 1 else ""
            filtered = ".".join(args[2:])
            return self._create(args[0], name, filtered, request, legacy_durable=False)
        if verb == "DURABLE" and args[:1] == ["CREATE"]:
            if len(args) != 3:
                raise _Refused(
                    400,
                    10016,
                    "consumer expected to be durable but no durable name set in subject",
                )
            return self._create(args[1], args[2], "", request, legacy_durable=True)
        if verb in ("INFO", "DELETE", "UNPIN") and len(args) == 2:
            consumer = self._find(args[0], args[1])
            if verb == "INFO":
                return {"type": "io.nats.jetstream.api.v1.consumer_info_response"} | consumer.info()
            if verb == "DELETE":
                self._delete(consumer)
                return {
                    "type": "io.nats.jetstream.api.v1.consumer_delete_response",
                    "success": True,
                }
            return self._unpin(consumer, request)
        if verb in ("NAMES", "LIST") and len(args) == 1:
            return self._names(args[0], request, listed=verb == "LIST")
        raise _bad(f"the JetStream model does not answer $JS.API.CONSUMER.{verb}")

    @staticmethod
    def _json(payload: bytes) -> dict[str, Any]:
        if not payload.strip():
            return {}
        try:
            decoded = _decode(payload)
        except msgspec.DecodeError as exc:
            raise _Refused(400, 10025, f"invalid JSON: {exc}") from exc
        if not isinstance(decoded, dict):
            raise _Refused(400, 10025, "invalid JSON: the request is not an object")
        return decoded

    def _stream(self, name: str) -> StreamView:
        stream = self._streams.get(name)
        if stream is None:
            raise _Refused(404, 10059, "stream not found")
        return stream

    def _find(self, stream: str, name: str) -> _Consumer:
        self._stream(stream)
        found = self._consumer(stream, name)
        if found is None:
            raise _Refused(404, 10014, "consumer not found")
        return found

    def _create(
        self,
        stream_name: str,
        name: str,
        filtered: str,
        request: Mapping[str, Any],
        *,
        legacy_durable: bool,
    ) -> dict[str, Any]:
        """Server `jsConsumerCreateRequest` and `addConsumerWithAssignment`: create, or keep
        (the same config), or update (a config that changes only what may change)."""
        if request.get("stream_name") != stream_name:
            raise _Refused(400, 10056, "stream name in subject does not match request")
        raw = dict(request.get("config") or {})
        durable_name = raw.get("durable_name") or ""
        if legacy_durable:
            if not durable_name:
                raise _Refused(
                    400, 10018, "consumer expected to be durable but a durable name was not set"
                )
            if durable_name != name:
                raise _Refused(
                    400, 10017, "consumer name in subject does not match durable name in request"
                )
            raw["name"] = name
        elif name:
            if durable_name and durable_name != name:
                raise _Refused(
                    400, 10017, "consumer name in subject does not match durable name in request"
                )
            raw["name"] = name
        elif durable_name:
            raise _Refused(
                400,
                10020,
                "consumer expected to be ephemeral but a durable name was set in request",
            )
        if filtered and raw.get("filter_subjects"):
            raise _Refused(
                400, 10137, "consumer with multiple subject filters cannot use subject based API"
            )
        if filtered and raw.get("filter_subject") != filtered:
            raise _Refused(
                400,
                10131,
                "Consumer create request did not match filtered subject from create subject",
            )
        for given in (raw.get("name"), durable_name):
            if given and any(c in given for c in ".*>/\\ "):
                raise _Refused(400, 10103, "durable name can not contain '.', '*', '>', '\\', '/'")
        stream = self._stream(stream_name)
        durable = bool(durable_name)
        config = _normalize(raw, durable=durable, push=bool(raw.get("deliver_subject")))
        consumer_name = raw.get("name") or durable_name
        held = self._by_stream.setdefault(stream_name, {})
        action = request.get("action") or ""
        existing = held.get(consumer_name) if consumer_name else None
        if existing is not None:
            if config != existing.config:
                if action == "create":
                    raise _Refused(400, 10148, "consumer already exists")
                self._update(existing, config)
            return self._created(existing)
        if action == "update":
            raise _Refused(400, 10149, "consumer does not exist")
        if stream.config.get("retention") == "workqueue":
            self._check_work_queue(stream, config, held)
        if not consumer_name:
            consumer_name = _new_id(self._chance, 8)
            config["name"] = consumer_name
        created = _Consumer(self, stream, consumer_name, config, durable)
        held[consumer_name] = created
        answer = self._created(created)
        created.pump()  # a push consumer delivers what is there, once someone listens
        return answer

    @staticmethod
    def _created(consumer: _Consumer) -> dict[str, Any]:
        return {"type": "io.nats.jetstream.api.v1.consumer_create_response"} | consumer.info()

    @staticmethod
    def _update(consumer: _Consumer, config: dict[str, Any]) -> None:
        for key, what in _FIXED.items():
            if config.get(key) != consumer.config.get(key):
                raise _Refused(500, 10012, f"{what} can not be updated")
        if config.get("deliver_subject") != consumer.config.get("deliver_subject"):
            if not consumer.push or not config.get("deliver_subject"):
                raise _Refused(500, 10012, "can not update between push and pull consumers")
            if consumer._hub.has_interest(consumer.config["deliver_subject"]):
                raise _Refused(400, 10013, "consumer name already in use")
        if _filters(config) != consumer.filters:
            consumer.filters = _filters(config)
        consumer.config = config
        consumer.pump()

    @staticmethod
    def _check_work_queue(
        stream: StreamView, config: Mapping[str, Any], held: Mapping[str, _Consumer]
    ) -> None:
        if config["ack_policy"] != "explicit":
            raise _Refused(400, 10098, "workqueue stream requires explicit ack")
        if config["deliver_policy"] != "all":
            raise _Refused(400, 10101, "consumer must be deliver all on workqueue stream")
        if not held:
            return
        filters = _filters(config)
        if not filters:
            raise _Refused(
                400, 10099, "multiple non-filtered consumers not allowed on workqueue stream"
            )
        for other in held.values():
            theirs = other.filters or [">"]
            if any(_overlap(mine, their) for mine in filters for their in theirs):
                raise _Refused(400, 10100, "filtered consumer not unique on workqueue stream")

    def _unpin(self, consumer: _Consumer, request: Mapping[str, Any]) -> dict[str, Any]:
        group = request.get("group") or ""
        if not group:
            raise _Refused(400, 10025, "invalid JSON: consumer group not specified")
        if not _VALID_GROUP.match(group):
            raise _Refused(
                400,
                10162,
                "Valid priority group name must match A-Z, a-z, 0-9, -_/=)+ and may not "
                "exceed 16 characters",
            )
        if group not in (consumer.config.get("priority_groups") or []):
            raise _Refused(400, 10160, "Provided priority group does not exist for this consumer")
        consumer.unpin()
        return {"type": "io.nats.jetstream.api.v1.consumer_unpin_response"}

    def _names(self, stream: str, request: Mapping[str, Any], *, listed: bool) -> dict[str, Any]:
        self._stream(stream)
        held = self._by_stream.get(stream, {})
        offset = max(int(request.get("offset") or 0), 0)
        names = sorted(held)[offset:]
        limit = _LIST_LIMIT if listed else _NAMES_LIMIT
        page = names[:limit]
        kind = "list" if listed else "names"
        return {
            "type": f"io.nats.jetstream.api.v1.consumer_{kind}_response",
            "total": len(held),
            "offset": offset,
            "limit": limit,
            "consumers": [held[n].info() for n in page] if listed else page,
        }
