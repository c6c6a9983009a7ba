"""The JetStream model: the `Extension` the simulated core hands every publish to.

Routing (`JetStream.on_publish`). `$JS.API.INFO`, `$JS.API.STREAM.*` and `$JS.API.DIRECT.GET.*`
are the streams' API, answered here; `$JS.API.CONSUMER.*`, `$JS.ACK.*` and `$JS.FC.*` go to
the consumers (`Consumers`, worker.sim.nats.jetstream.consumers), which read the streams through
`StreamView` and hear of every stored message (`on_stored`) and deleted stream
(`on_stream_deleted`). Any other subject that a stream captures is a publish to it: stored and
acknowledged with a `PubAck` (`{"stream", "seq", "duplicate"?}`), or refused with the server's
error, on the reply subject if there is one (streams.py says in what order it checks). A
message with `Nats-Batch-Id` is part of an atomic batch (ADR-50, server/stream.go
processJetStreamAtomicBatchMsg): held until its commit (`Nats-Batch-Commit: 1`, or `eob`, whose
own message is not stored), then checked as a whole and stored as a whole, or not at all; each
message before the commit is answered with an empty message if it asked, the commit with the
PubAck of its last message and `"batch"`, `"count"`. A batch idle for 10 s is abandoned, as the
server's cleanup timer does (here noticed when its next message comes).

What it returns is whether JetStream took the message, as the core needs to know to answer an
unanswered request with 503 no responders (worker.sim.nats.hub): the whole API is taken (as the
server subscribes `$JS.API.>`), except a direct get from a stream without `allow_direct`, which
the real server does not subscribe to; a stream's subjects are taken; so are the consumers'
(a request to a consumer that is gone gets their 503).

Answers are shaped as nats-server 2.15's, so that nats-py's dataclasses
(`StreamInfo.from_response`, `RawStreamMsg`, `PubAck`) parse them as they parse the real ones; a
configuration is normalised as the server does (its defaults filled in; -1 for no limit; the
duplicate window two minutes, or the max age if shorter), so creating a stream again with the
same configuration is accepted, and with another refused (10058). Not modelled: mirrors,
sources, republish, counters, schedules, interest retention (kept as limits), sealing, the
account's limits, the `_nats.*` metadata the server adds.

Faults (`Faults`, consulted on every publish): while `unavailable_until` (loop time) has not
passed, JetStream takes every message on its subjects and answers none and stores none (a
stream's leader election, as a client sees it: its requests time out); and with
`lost_ack_rate`, a stored message's acknowledgement is dropped by chance (the publish landed,
its ack did not). An attached history hears of each message stored and each `PubAck` sent (a
stored message's or a duplicate's), so that a check can tell an acknowledged publish from one
whose ack was dropped.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhandoff.worker.sim.nats.hub import Hub
from kvhandoff.worker.sim.nats.jetstream.api import Stored, answer, refuse
from kvhandoff.worker.sim.nats.jetstream.consumers import Consumers
from kvhandoff.worker.sim.nats.jetstream.streams import (
    MSG_ID,
    Clock,
    Duplicate,
    LoopClock,
    Refusal,
    Stream,
    SubjectTransform,
    message_json,
    rfc3339,
    subjects_collide,
)

if TYPE_CHECKING:
    from kvhandoff.worker.sim.history import History

_NS = 1_000_000_000
_API = "$JS.API."
_CONSUMERS = ("$JS.API.CONSUMER.", "$JS.ACK.", "$JS.FC.")  # the consumers' subjects
_TYPE = "io.nats.jetstream.api.v1."
_NAMES_LIMIT = 1024
_LIST_LIMIT = 256
_BATCH_ID = "Nats-Batch-Id"
_BATCH_SEQUENCE = "Nats-Batch-Sequence"
_BATCH_COMMIT = "Nats-Batch-Commit"
_EXPECTED_LAST_MSG_ID = "Nats-Expected-Last-Msg-Id"
_EXPECTED_LAST_SEQ = "Nats-Expected-Last-Sequence"
_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
_MAX_BATCH = 1000
_MAX_BATCH_ID = 64
_BATCH_IDLE_S = 10.0
_DEFAULT_DUPLICATE_WINDOW_NS = 120 * _NS
# The configuration the server fills in for what a request leaves out (or sets to 0).
_DEFAULTS: dict[str, Any] = {
    "retention": "limits",
    "max_consumers": -1,
    "max_msgs": -1,
    "max_bytes": -1,
    "max_age": 0,
    "max_msgs_per_subject": -1,
    "max_msg_size": -1,
    "discard": "old",
    "storage": "file",
    "num_replicas": 1,
    "duplicate_window": 0,
    "compression": "none",
    "allow_direct": False,
    "mirror_direct": False,
    "sealed": False,
    "deny_delete": False,
    "deny_purge": False,
    "allow_rollup_hdrs": False,
    "consumer_limits": {},
    "allow_msg_ttl": False,
}
_NO_LIMIT = ("max_consumers", "max_msgs", "max_bytes", "max_msgs_per_subject", "max_msg_size")
_FORBIDDEN_IN_NAMES = frozenset(".*> \t\\/")


@dataclass
class Faults:
    """The faults the simulation turns on (see the module docstring); none by default."""

    unavailable_until: float = 0.0  # loop time until which JetStream answers nothing
    lost_ack_rate: float = 0.0  # the chance that a stored message's ack is lost


@dataclass
class _Batch:
    """An atomic batch being published: its messages so far, as published."""

    messages: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    touched_at: float = 0.0


class JetStream:
    """The JetStream model of one simulated server (or cluster). `replicated`: its streams
    check message ids before expectations, as a replicated stream's leader does (streams.py)."""

    def __init__(
        self,
        hub: Hub,
        chance: random.Random,
        *,
        clock: Clock | None = None,
        replicated: bool = False,
    ) -> None:
        self._hub = hub
        self._chance = chance
        self._clock: Clock = clock or LoopClock()
        self._replicated = replicated
        self._streams: dict[str, Stream] = {}
        self._batches: dict[tuple[str, str], _Batch] = {}  # (stream, batch id)
        self._api_total = 0
        self._api_errors = 0
        self.faults = Faults()
        # They read the streams through this live view: a stream made later is theirs too.
        self.consumers = Consumers(hub, chance, self._streams)
        self.history: History | None = None  # records what is stored and acked (worker.sim.history)

    @property
    def streams(self) -> Mapping[str, Stream]:
        return self._streams

    def on_publish(
        self, subject: str, reply: str, headers: Mapping[str, str] | None, payload: bytes
    ) -> bool:
        """Answer, settle or store a client's publish; whether JetStream took it."""
        if subject.startswith(_CONSUMERS):
            if not self._unavailable():
                self.consumers.on_publish(subject, reply, headers, payload)
            return True
        if subject.startswith(_API):
            return self._on_api(subject[len(_API) :], reply, payload)
        stream = self._capturing(subject)
        if stream is None:
            return False
        if self._unavailable():
            return True
        if headers and _BATCH_ID in headers:
            self._on_batch_message(stream, subject, reply, headers, payload)
        else:
            self._on_message(stream, subject, reply, headers, payload)
        return True

    def _unavailable(self) -> bool:
        return self._clock.time() < self.faults.unavailable_until

    def _capturing(self, subject: str) -> Stream | None:
        return next((s for s in self._streams.values() if s.captures(subject)), None)

    def _stored(self, stream: Stream, stored: Stored) -> None:
        if self.history is not None:
            self.history.on_stored(stream.name, stored)
        self.consumers.on_stored(stream, stored)

    # Publishing

    def _on_message(
        self,
        stream: Stream,
        subject: str,
        reply: str,
        headers: Mapping[str, str] | None,
        payload: bytes,
    ) -> None:
        subject = stream.stored_subject(subject)
        outcome = stream.check(subject, headers)
        if isinstance(outcome, Refusal):
            self._refuse_publish(stream, reply, outcome)
        elif isinstance(outcome, Duplicate):
            if self.history is not None and reply:
                self.history.on_pub_acked(reply, stream.name, outcome.seq, duplicate=True)
            answer(self._hub, reply, {"stream": stream.name, "seq": outcome.seq, "duplicate": True})
        else:
            stored = stream.store(subject, headers, payload)
            self._ack(reply, {"stream": stream.name, "seq": stored.seq})

    def _ack(self, reply: str, body: Mapping[str, Any]) -> None:
        """Acknowledge a stored message, unless the fault of a lost ack drops it (the history
        hears of the acks sent)."""
        if self.faults.lost_ack_rate and self._chance.random() < self.faults.lost_ack_rate:
            return
        if self.history is not None and reply:
            self.history.on_pub_acked(reply, body["stream"], body["seq"], duplicate=False)
        answer(self._hub, reply, body)

    def _refuse_publish(self, stream: Stream, reply: str, refusal: Refusal) -> None:
        error = {
            "code": refusal.code,
            "err_code": refusal.err_code,
            "description": refusal.description,
        }
        answer(self._hub, reply, {"error": error, "stream": stream.name, "seq": 0})

    def _on_batch_message(
        self, stream: Stream, subject: str, reply: str, headers: Mapping[str, str], payload: bytes
    ) -> None:
        batch_id = headers[_BATCH_ID]
        key = (stream.name, batch_id)
        if not stream.config.get("allow_atomic"):
            self._refuse_publish(stream, reply, Refusal(400, 10174, "atomic publish is disabled"))
            return
        if len(batch_id) > _MAX_BATCH_ID:
            self._refuse_publish(
                stream, reply, Refusal(400, 10179, "atomic publish batch ID is invalid")
            )
            return
        sequence = headers.get(_BATCH_SEQUENCE, "")
        if not sequence.isdigit():
            self._refuse_publish(
                stream, reply, Refusal(400, 10175, "atomic publish sequence is missing")
            )
            return
        commit = headers.get(_BATCH_COMMIT)
        incomplete = Refusal(400, 10176, "atomic publish batch is incomplete")
        now = self._clock.time()
        batch = self._batches.get(key)
        if batch is not None and now - batch.touched_at > _BATCH_IDLE_S:
            del self._batches[key]  # abandoned: its cleanup ran
            self._refuse_publish(stream, reply, incomplete)
            return
        if batch is None:
            if int(sequence) != 1:
                self._refuse_publish(stream, reply, incomplete)
                return
            batch = self._batches[key] = _Batch()
        if commit is not None and commit not in ("1", "eob"):
            del self._batches[key]
            self._refuse_publish(
                stream, reply, Refusal(400, 10200, "atomic publish batch commit is invalid")
            )
            return
        if int(sequence) != len(batch.messages) + 1 or (commit == "eob" and sequence == "1"):
            del self._batches[key]
            self._refuse_publish(stream, reply, incomplete)
            return
        size = int(sequence) - (1 if commit == "eob" else 0)
        if size > _MAX_BATCH:
            del self._batches[key]
            self._refuse_publish(
                stream,
                reply,
                Refusal(400, 10199, f"atomic publish batch is too large: {_MAX_BATCH}"),
            )
            return
        batch.touched_at = now
        if commit != "eob":
            batch.messages.append((subject, dict(headers), payload))
        if commit is None:
            answer_empty = reply != ""
            if answer_empty:
                self._hub.send(reply, b"")
            return
        del self._batches[key]
        self._commit(stream, batch_id, reply, batch.messages)

    def _commit(
        self,
        stream: Stream,
        batch_id: str,
        reply: str,
        messages: list[tuple[str, dict[str, str], bytes]],
    ) -> None:
        """Check every message of a batch against the stream and the batch, then store them
        all; or store none and answer the first refusal."""
        written: set[str] = set()
        ids: set[str] = set()
        checked: list[tuple[str, dict[str, str], bytes]] = []
        for index, (published_on, headers, payload) in enumerate(messages):
            subject = stream.stored_subject(published_on)
            refusal: Refusal | None = None
            if _EXPECTED_LAST_MSG_ID in headers:
                refusal = Refusal(
                    400, 10177, f"atomic publish unsupported header used: {_EXPECTED_LAST_MSG_ID}"
                )
            elif (msg_id := headers.get(MSG_ID)) and (msg_id in ids or stream.seen_id(msg_id)):
                refusal = Refusal(400, 10201, "atomic publish batch contains duplicate message id")
            elif (_EXPECTED_LAST_SEQ in headers and index > 0) or (
                _EXPECTED_LAST_SUBJECT_SEQ in headers and subject in written
            ):
                # Only the first message may expect the stream's last sequence, and none may
                # expect a subject's that the batch itself wrote to.
                refusal = Refusal(400, 10164, "wrong last sequence")
            else:
                outcome = stream.check(subject, headers, in_batch=True)
                refusal = outcome if isinstance(outcome, Refusal) else None
            if refusal is not None:
                self._refuse_publish(stream, reply, refusal)
                return
            if msg_id:
                ids.add(msg_id)
            written.add(subject)
            checked.append((subject, headers, payload))
        last = 0
        for subject, headers, payload in checked:
            last = stream.store(subject, headers, payload).seq
        body = {"stream": stream.name, "seq": last, "batch": batch_id, "count": len(checked)}
        self._ack(reply, body)

    # The API

    def _on_api(self, request: str, reply: str, payload: bytes) -> bool:
        tokens = request.split(".")
        if tokens[0] == "DIRECT" and len(tokens) >= 3 and tokens[1] == "GET":
            stream = self._streams.get(tokens[2])
            if stream is None or not stream.config.get("allow_direct"):
                return False  # the server subscribes only where direct gets are allowed
            if not self._unavailable():
                self._direct_get(stream, ".".join(tokens[3:]), reply, payload)
            return True
        handler = self._handler(tokens)
        if handler is None:
            return False
        if self._unavailable():
            return True
        self._api_total += 1
        try:
            body = json.loads(payload) if payload.strip() else {}
        except ValueError as exc:
            self._api_refuse(reply, 400, 10025, f"invalid JSON: {exc}")
            return True
        if not isinstance(body, dict):
            self._api_refuse(reply, 400, 10025, "invalid JSON: not an object")
            return True
        handler(tokens[-1], reply, body)
        return True

    def _handler(self, tokens: list[str]) -> Callable[[str, str, dict[str, Any]], None] | None:
        if tokens == ["INFO"]:
            return self._account_info
        if tokens[0] != "STREAM" or len(tokens) < 2:
            return None
        if tokens[1] == "NAMES" and len(tokens) == 2:
            return self._names
        if tokens[1] == "LIST" and len(tokens) == 2:
            return self._list
        if tokens[1] == "MSG" and len(tokens) == 4:
            return {"GET": self._msg_get, "DELETE": self._msg_delete}.get(tokens[2])
        if len(tokens) == 3:
            return {
                "CREATE": self._create,
                "UPDATE": self._update,
                "INFO": self._info,
                "DELETE": self._delete,
                "PURGE": self._purge,
            }.get(tokens[1])
        return None

    def _api_refuse(self, reply: str, code: int, err_code: int, description: str) -> None:
        self._api_errors += 1
        refuse(self._hub, reply, code, err_code, description)

    def _stream_or_refuse(self, name: str, reply: str) -> Stream | None:
        stream = self._streams.get(name)
        if stream is None:
            self._api_refuse(reply, 404, 10059, "stream not found")
        return stream

    def _account_info(self, _: str, reply: str, body: dict[str, Any]) -> None:
        memory = sum(s.state()["bytes"] for s in self._streams.values() if _in_memory(s))
        storage = sum(s.state()["bytes"] for s in self._streams.values() if not _in_memory(s))
        limits = dict.fromkeys(
            (
                "max_memory",
                "max_storage",
                "max_streams",
                "max_consumers",
                "max_ack_pending",
                "memory_max_stream_bytes",
                "storage_max_stream_bytes",
            ),
            -1,
        )
        answer(
            self._hub,
            reply,
            {
                "type": _TYPE + "account_info_response",
                "memory": memory,
                "storage": storage,
                "reserved_memory": 0,
                "reserved_storage": 0,
                "streams": len(self._streams),
                "consumers": sum(self.consumers.consumer_count(n) for n in self._streams),
                "limits": limits | {"max_bytes_required": False},
                # API level 2: the newest features modelled (atomic batches) came with it.
                "api": {"level": 2, "total": self._api_total, "errors": self._api_errors},
            },
        )

    def _stream_info(self, stream: Stream, subjects_filter: str = "") -> dict[str, Any]:
        state = stream.state(subjects_filter)
        state["consumer_count"] = self.consumers.consumer_count(stream.name)
        return {
            "config": dict(stream.config),
            "created": rfc3339(stream.created_ns),
            "state": state,
            "ts": rfc3339(self._clock.wall_ns()),
        }

    def _create(self, name: str, reply: str, body: dict[str, Any]) -> None:
        config = self._normalised(name, reply, body)
        if config is None:
            return
        held = self._streams.get(name)
        if held is not None:
            if _comparable(held.config) != _comparable(config):
                self._api_refuse(
                    reply, 400, 10058, "stream name already in use with a different configuration"
                )
                return
        elif self._overlaps(name, config, reply):
            return
        else:
            held = self._streams[name] = Stream(
                config, self._clock, self._stored, replicated=self._replicated
            )
        info = self._stream_info(held)
        answer(self._hub, reply, {"type": _TYPE + "stream_create_response"} | info)

    def _update(self, name: str, reply: str, body: dict[str, Any]) -> None:
        if name not in self._streams:
            self._api_refuse(reply, 404, 10059, "stream not found")
            return
        config = self._normalised(name, reply, body)
        if config is None or self._overlaps(name, config, reply):
            return
        stream = self._streams[name]
        stream.reconfigure(config)
        info = self._stream_info(stream)
        answer(self._hub, reply, {"type": _TYPE + "stream_update_response"} | info)

    def _normalised(self, name: str, reply: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The configuration in `body`, as the server fills it in; None if refused (answered)."""
        given = body.get("name") or name
        if given != name:
            self._api_refuse(reply, 400, 10056, "stream name in subject does not match request")
            return None
        if not name or _FORBIDDEN_IN_NAMES & set(name):
            self._api_refuse(
                reply,
                500,
                10052,
                "stream name is required and can not contain '.', '*', '>', '\\', '/'",
            )
            return None
        config = _DEFAULTS | {k: v for k, v in body.items() if v is not None} | {"name": name}
        for limit in _NO_LIMIT:
            if config[limit] == 0 or config[limit] < -1:
                config[limit] = -1
        config["num_replicas"] = config["num_replicas"] or 1
        config["subjects"] = list(config.get("subjects") or [name])
        if config["retention"] not in ("limits", "interest", "workqueue"):
            self._api_refuse(reply, 500, 10052, "invalid retention")
            return None
        if config["discard"] not in ("old", "new"):
            self._api_refuse(reply, 500, 10052, "invalid discard policy")
            return None
        if config["max_age"] < 0:
            self._api_refuse(reply, 500, 10052, "max age can not be negative")
            return None
        if config["duplicate_window"] == 0:
            window = _DEFAULT_DUPLICATE_WINDOW_NS
            config["duplicate_window"] = min(window, config["max_age"] or window)
        if config.get("subject_delete_marker_ttl"):
            config |= {"allow_msg_ttl": True, "allow_rollup_hdrs": True, "deny_purge": False}
        else:
            config.pop("subject_delete_marker_ttl", None)
        transform = config.get("subject_transform")
        if transform:
            try:
                SubjectTransform(transform.get("src", ""), transform.get("dest", ""))
            except ValueError as exc:
                self._api_refuse(reply, 400, 10156, f"stream transform: {exc}")
                return None
        return config

    def _overlaps(self, name: str, config: Mapping[str, Any], reply: str) -> bool:
        """Whether another stream captures any subject `config` would (refused, answered)."""
        for other in self._streams.values():
            if other.name != name and any(
                subjects_collide(mine, theirs)
                for mine in config["subjects"]
                for theirs in other.config["subjects"]
            ):
                self._api_refuse(reply, 400, 10065, "subjects overlap with an existing stream")
                return True
        return False

    def _info(self, name: str, reply: str, body: dict[str, Any]) -> None:
        stream = self._stream_or_refuse(name, reply)
        if stream is None:
            return
        subjects_filter = str(body.get("subjects_filter") or "")
        info = self._stream_info(stream, subjects_filter)
        total = len(info["state"].get("subjects", {}))
        paging = {"total": total, "offset": 0, "limit": 100_000 if subjects_filter else 0}
        answer(self._hub, reply, {"type": _TYPE + "stream_info_response"} | paging | info)

    def _delete(self, name: str, reply: str, body: dict[str, Any]) -> None:
        stream = self._stream_or_refuse(name, reply)
        if stream is None:
            return
        stream.close()
        del self._streams[name]
        for key in [key for key in self._batches if key[0] == name]:
            del self._batches[key]
        self.consumers.on_stream_deleted(name)
        answer(self._hub, reply, {"type": _TYPE + "stream_delete_response", "success": True})

    def _purge(self, name: str, reply: str, body: dict[str, Any]) -> None:
        stream = self._stream_or_refuse(name, reply)
        if stream is None:
            return
        if stream.config.get("deny_purge"):
            self._api_refuse(reply, 500, 10110, "stream purge not permitted")
            return
        purged = stream.purge(
            str(body.get("filter") or ""), int(body.get("seq") or 0), int(body.get("keep") or 0)
        )
        answer(
            self._hub,
            reply,
            {"type": _TYPE + "stream_purge_response", "success": True, "purged": purged},
        )

    def _names(self, _: str, reply: str, body: dict[str, Any]) -> None:
        subject = str(body.get("subject") or "")
        names = [
            name
            for name, stream in sorted(self._streams.items())
            if not subject or any(subjects_collide(subject, s) for s in stream.config["subjects"])
        ]
        offset = int(body.get("offset") or 0)
        answer(
            self._hub,
            reply,
            {
                "type": _TYPE + "stream_names_response",
                "total": len(names),
                "offset": offset,
                "limit": _NAMES_LIMIT,
                "streams": names[offset : offset + _NAMES_LIMIT] or None,
            },
        )

    def _list(self, _: str, reply: str, body: dict[str, Any]) -> None:
        offset = int(body.get("offset") or 0)
        streams = [stream for _, stream in sorted(self._streams.items())]
        answer(
            self._hub,
            reply,
            {
                "type": _TYPE + "stream_list_response",
                "total": len(streams),
                "offset": offset,
                "limit": _LIST_LIMIT,
                "streams": [self._stream_info(s) for s in streams[offset : offset + _LIST_LIMIT]],
            },
        )

    def _find(self, stream: Stream, body: Mapping[str, Any]) -> Stored | Refusal | None:
        """The message a get request names: by `seq`, `last_by_subj`, or `next_by_subj` from
        `seq` on; a refusal for a request that names none or two ways."""
        seq = int(body.get("seq") or 0)
        last_by, next_by = body.get("last_by_subj") or "", body.get("next_by_subj") or ""
        if (seq and last_by) or (last_by and next_by) or not (seq or last_by or next_by):
            return Refusal(400, 10003, "bad request")
        if last_by:
            return stream.last_matching(last_by)
        if next_by:
            return stream.next_after(seq - 1 if seq else 0, [next_by])
        return stream.get(seq)

    def _msg_get(self, name: str, reply: str, body: dict[str, Any]) -> None:
        stream = self._stream_or_refuse(name, reply)
        if stream is None:
            return
        found = self._find(stream, body)
        if isinstance(found, Refusal):
            self._api_refuse(reply, found.code, found.err_code, found.description)
        elif found is None:
            self._api_refuse(reply, 404, 10037, "no message found")
        else:
            response = {"type": _TYPE + "stream_msg_get_response", "message": message_json(found)}
            answer(self._hub, reply, response)

    def _msg_delete(self, name: str, reply: str, body: dict[str, Any]) -> None:
        stream = self._stream_or_refuse(name, reply)
        if stream is None:
            return
        if stream.config.get("deny_delete"):
            self._api_refuse(reply, 500, 10057, "message delete not permitted")
            return
        seq = int(body.get("seq") or 0)
        if not stream.remove(seq):
            self._api_refuse(reply, 400, 10043, f"sequence {seq} not found")
            return
        answer(self._hub, reply, {"type": _TYPE + "stream_msg_delete_response", "success": True})

    def _direct_get(self, stream: Stream, subject: str, reply: str, payload: bytes) -> None:
        """A direct get: the message itself, with the stream's headers, or a 404 status."""
        if subject:
            found: Stored | Refusal | None = stream.last_matching(subject)
        elif not payload.strip():
            self._hub.send(reply, status="408 Empty Request")
            return
        else:
            try:
                body = json.loads(payload)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                self._hub.send(reply, status="408 Malformed Request")
                return
            found = self._find(stream, body)
        if isinstance(found, Refusal):
            self._hub.send(reply, status="408 Bad Request")
            return
        if found is None:
            self._hub.send(reply, status="404 Message Not Found")
            return
        headers = dict(found.headers or {}) | {
            "Nats-Stream": stream.name,
            "Nats-Subject": found.subject,
            "Nats-Sequence": str(found.seq),
            "Nats-Time-Stamp": rfc3339(found.time_ns),
        }
        self._hub.send(reply, found.payload, headers=headers)


def _in_memory(stream: Stream) -> bool:
    return bool(stream.config.get("storage") == "memory")


def _comparable(config: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration less what does not tell two apart: unset fields, the server's metadata."""
    kept = {key: value for key, value in config.items() if value not in (None, False, 0, "", {})}
    metadata = {k: v for k, v in (config.get("metadata") or {}).items() if not k.startswith("_")}
    kept.pop("metadata", None)
    if metadata:
        kept["metadata"] = metadata
    return kept
