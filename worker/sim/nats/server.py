"""The core of the simulated NATS server: the client protocol, subscriptions and routing.

Theory of operation. `NatsServer` is one model of a whole cluster: it `listen`s on any number
of addresses of a `Network` (the three nodes of a cluster share it), and each connection to
any of them is a `_Client` speaking the NATS client protocol
(https://docs.nats.io/reference/reference-protocols/nats-protocol), as nats-server 2.12 does:
on connect the server sends `INFO`, then it reads `CONNECT`, `PING`, `PONG`, `SUB`, `UNSUB`,
`PUB` and `HPUB` and sends `MSG`, `HMSG`, `PONG`, `+OK` (in verbose mode) and `-ERR`. Losing
a node is losing its connections (`Network.down`): subscriptions live as long as the
connection that made them, and from the moment it is lost they take nothing (a queue group's
message goes to a member still connected).

Routing. A published message goes to every subscription whose subject matches (`*` matches
one token, `>` one or more at the end) and, for each queue group among them, to one member
drawn from the server's `chance`. Deliveries happen in the order the subscriptions were made
(a global counter), so a seed fixes them. A client that said `echo: false` gets none of its
own messages. A subscription with a maximum (`UNSUB sid max`) goes when it has had that many.
Then the message goes to the `Extension` (JetStream), which answers API requests, settles
acks and stores messages through the `Hub` (`send`, `has_interest`), and says whether it took
the message (worker.sim.nats.hub).

No responders. A request (a publish with a reply subject) that no subscription and no
JetStream took is answered, if its client asked for `no_responders` (which requires
`headers`), with a status message on the reply subject through the client's own subscription
that matches it: `NATS/1.0 503` with a `Nats-Subject` header naming the subject, as
nats-server's `processInboundClientMsg` does. nats-py turns it into `NoRespondersError`.

Headers. An `HPUB`'s header block travels to subscribers byte for byte. For the extension it
is parsed into a dict (`Key: Value` lines after `NATS/1.0`); a key given twice keeps its last
value. A client that did not say `headers: true` gets messages without their headers, as the
server strips them.

Errors, with nats-server's texts: an unknown operation or a malformed line is `-ERR 'Unknown
Protocol Operation'`, a payload over `max_payload` `-ERR 'Maximum Payload Violation'`, a
control line over 4096 bytes `-ERR 'Maximum Control Line Exceeded'`; each closes the
connection, as the real server's parser does. A malformed subscription subject is `-ERR
'Invalid Subject'` and the connection stays.

Not modelled: authentication, TLS, the server's own pings (it never declares a client stale),
slow consumers, `connect_urls` discovery, lame-duck mode.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhandoff.worker.sim.nats.hub import Extension
from kvhandoff.worker.sim.network import Network

if TYPE_CHECKING:
    from kvhandoff.worker.sim.history import History

VERSION = "2.12.0"
MAX_CONTROL_LINE = 4096
_CRLF = b"\r\n"


class NatsServer:
    """A model of a NATS cluster's core: the `Hub` the JetStream model delivers through."""

    def __init__(self, chance: random.Random, *, max_payload: int = 1024 * 1024) -> None:
        self._chance = chance
        self.max_payload = max_payload
        self._extension: Extension | None = None
        self._next_client_id = 1
        self._next_order = 1
        # Keyed by the subscription's order: iteration follows the order they were made.
        self._literal: dict[str, dict[int, _Subscription]] = {}
        # The wildcard subscriptions by their literal prefix (the tokens before the first
        # wildcard, joined by dots: "_INBOX.abc" for "_INBOX.abc.*"), then by order: a subject
        # can only match those filed under one of its own prefixes, and the prefixes have few
        # lengths (a reply inbox's is two tokens), so finding them reads a bucket or two, not
        # every wildcard subscription (tens of reply inboxes).
        self._wildcard: dict[str, dict[int, _Subscription]] = {}
        # How many wildcard subscriptions have a prefix of each length, in tokens.
        self._prefix_lengths: dict[int, int] = {}
        # The wildcard subscriptions matching a subject, by subject, as the server's sublist
        # caches them: most messages go to subjects seen before, and wildcard subscriptions
        # change rarely (each client's reply inbox, each pull's). Dropped when they change.
        self._wild_cache: dict[str, list[_Subscription]] = {}
        self.history: History | None = None  # records every client's publish (worker.sim.history)

    def listen(self, network: Network, host: str, port: int, *, name: str = "") -> None:
        """Serve clients on (host, port) of `network`; the node is called `name` (its host,
        by default) in the `INFO` its clients read."""
        node = _Node(host=host, port=port, name=name or host)
        network.listen(host, port, lambda: _Client(self, node))

    def attach(self, extension: Extension) -> None:
        """Let `extension` (the JetStream model) see every client's publishes."""
        self._extension = extension

    # The Hub.

    def send(
        self,
        subject: str,
        payload: bytes = b"",
        *,
        reply: str = "",
        headers: Mapping[str, str] | None = None,
        status: str = "",
        as_subject: str = "",
    ) -> None:
        """Deliver a message to the subscriptions on `subject` (see `Hub.send`)."""
        header = None
        if headers is not None or status:
            header = encode_header(headers or {}, status)
        self._route(subject, reply, header, payload, publisher=None, shown=as_subject)

    def has_interest(self, subject: str) -> bool:
        """Whether any subscription matches `subject`."""
        return any(s.client.alive for s in self._matching(subject))

    # Subscriptions and routing.

    def _subscribe(self, client: _Client, subject: str, queue: str, sid: str) -> _Subscription:
        """Add a subscription of `client`'s; it is routed to after all earlier ones."""
        subscription = _Subscription(client, subject, subject.split("."), queue, sid)
        subscription.order = self._next_order
        self._next_order += 1
        if _is_literal(subscription.tokens):
            self._literal.setdefault(subject, {})[subscription.order] = subscription
        else:
            prefix = _prefix(subscription.tokens)
            self._wildcard.setdefault(".".join(prefix), {})[subscription.order] = subscription
            self._prefix_lengths[len(prefix)] = self._prefix_lengths.get(len(prefix), 0) + 1
            self._wild_cache.clear()
        return subscription

    def _unsubscribe(self, subscription: _Subscription) -> None:
        """Remove a subscription (again: nothing happens)."""
        if subscription.client.subscriptions.get(subscription.sid) is subscription:
            del subscription.client.subscriptions[subscription.sid]
        if _is_literal(subscription.tokens):
            literal = self._literal.get(subscription.subject)
            if literal is not None:
                literal.pop(subscription.order, None)
                if not literal:
                    del self._literal[subscription.subject]
            return
        prefix = _prefix(subscription.tokens)
        key = ".".join(prefix)
        bucket = self._wildcard.get(key)
        if bucket is not None and bucket.pop(subscription.order, None) is not None:
            if not bucket:
                del self._wildcard[key]
            self._prefix_lengths[len(prefix)] -= 1
            if not self._prefix_lengths[len(prefix)]:
                del self._prefix_lengths[len(prefix)]
            self._wild_cache.clear()

    def _new_client_id(self) -> int:
        """A number for a new connection, as `INFO`'s `client_id`."""
        client_id = self._next_client_id
        self._next_client_id += 1
        return client_id

    def _publish(
        self, client: _Client, subject: str, reply: str, header: bytes | None, payload: bytes
    ) -> None:
        """Route a client's publish, let JetStream see it, and answer a request nobody took."""
        if self.history is not None:
            self.history.on_published(subject, reply, header, payload, publisher=client.host)
        delivered = self._route(subject, reply, header, payload, publisher=client)
        taken = False
        if self._extension is not None:
            headers = None if header is None else decode_header(header)
            taken = self._extension.on_publish(subject, reply, headers, payload)
        if reply and not delivered and not taken and client.no_responders:
            client.send_no_responders(subject, reply)

    def _matching(self, subject: str) -> list[_Subscription]:
        found = list(self._literal.get(subject, {}).values())
        wild = self._wild_cache.get(subject)
        if wild is None:
            if len(self._wild_cache) >= _WILD_CACHE_SIZE:
                self._wild_cache.clear()
            wild = self._wild_matching(subject)
            self._wild_cache[subject] = wild
        if wild:
            found = sorted(found + wild, key=lambda s: s.order) if found else wild
        return found

    def _wild_matching(self, subject: str) -> list[_Subscription]:
        """The wildcard subscriptions matching `subject`, in the order they were made."""
        tokens = subject.split(".")
        found: list[_Subscription] = []
        for length in self._prefix_lengths:
            # A wildcard stands for one token at least: a prefix is shorter than the subject.
            bucket = self._wildcard.get(".".join(tokens[:length])) if length < len(tokens) else None
            if bucket is not None:
                found += [s for s in bucket.values() if _matches(s.tokens, tokens)]
        if len(self._prefix_lengths) > 1:
            found.sort(key=_by_order)
        return found

    def _route(
        self,
        subject: str,
        reply: str,
        header: bytes | None,
        payload: bytes,
        *,
        publisher: _Client | None,
        shown: str = "",
    ) -> bool:
        """Deliver to the matching subscriptions, under `shown` if given (`Hub.send`'s
        `as_subject`) else `subject`; whether any took the message."""
        chosen: list[_Subscription] = []
        groups: dict[str, list[_Subscription]] = {}
        for subscription in self._matching(subject):
            if not subscription.client.alive:
                continue  # lost: its subscriptions go when its connection_lost runs
            if publisher is not None and subscription.client is publisher and not publisher.echo:
                continue
            if subscription.queue:
                groups.setdefault(subscription.queue, []).append(subscription)
            else:
                chosen.append(subscription)
        if groups:
            chosen.extend(self._chance.choice(members) for members in groups.values())
            chosen.sort(key=lambda s: s.order)
        delivered = False
        for subscription in chosen:
            if subscription.client.deliver(subscription, shown or subject, reply, header, payload):
                delivered = True
                subscription.delivered += 1
                if subscription.max and subscription.delivered >= subscription.max:
                    self._unsubscribe(subscription)
        return delivered


@dataclass(frozen=True)
class _Node:
    """One address the server listens on: a node of the cluster."""

    host: str
    port: int
    name: str


@dataclass(eq=False)
class _Subscription:
    client: _Client
    subject: str
    tokens: list[str]
    queue: str
    sid: str
    order: int = 0
    max: int = 0  # 0: no maximum
    delivered: int = 0


@dataclass
class _Options:
    """What the client said in `CONNECT`."""

    verbose: bool = False
    headers: bool = False
    no_responders: bool = False
    echo: bool = True


@dataclass
class _Pending:
    """A `PUB` or `HPUB` whose payload has not all arrived."""

    subject: str
    reply: str
    header_size: int  # -1: a PUB, without headers
    total_size: int


class _Client(asyncio.Protocol):
    """One client connection: its protocol parser, options and subscriptions."""

    def __init__(self, server: NatsServer, node: _Node) -> None:
        self._server = server
        self._node = node
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._pending: _Pending | None = None
        self._options = _Options()
        self._closed = False
        self.client_id = server._new_client_id()
        self.subscriptions: dict[str, _Subscription] = {}

    @property
    def alive(self) -> bool:
        """Whether the connection is up and not closing."""
        return not self._closed and self._transport is not None and not self._transport.is_closing()

    @property
    def echo(self) -> bool:
        return self._options.echo

    @property
    def no_responders(self) -> bool:
        return self._options.no_responders

    # The transport's side.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername") or ("", 0)
        self.host: str = peer[0]  # the client's host: on the simulated network, its process
        info = {
            "server_id": "NSIM" + self._node.name.upper().replace("-", ""),
            "server_name": self._node.name,
            "version": VERSION,
            "proto": 1,
            "go": "go1.24.0",
            "host": self._node.host,
            "port": self._node.port,
            "headers": True,
            "jetstream": True,
            "max_payload": self._server.max_payload,
            "client_id": self.client_id,
            "client_ip": str(peer[0]),
        }
        self._write(b"INFO " + json.dumps(info, separators=(",", ":")).encode() + _CRLF)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._parse()

    def eof_received(self) -> bool:
        return False  # the client closed: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._transport = None
        for subscription in list(self.subscriptions.values()):
            self._server._unsubscribe(subscription)

    # Sending.

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def deliver(
        self,
        subscription: _Subscription,
        subject: str,
        reply: str,
        header: bytes | None,
        payload: bytes,
    ) -> bool:
        """Send a message to one of this client's subscriptions; whether it could."""
        if not self.alive or self._transport is None:
            return False
        sid = subscription.sid
        reply_part = f" {reply}" if reply else ""
        if header is not None and self._options.headers:
            size = len(header) + len(payload)
            line = f"HMSG {subject} {sid}{reply_part} {len(header)} {size}\r\n"
            self._transport.write(line.encode() + header + payload + _CRLF)
        else:
            line = f"MSG {subject} {sid}{reply_part} {len(payload)}\r\n"
            self._transport.write(line.encode() + payload + _CRLF)
        return True

    def send_no_responders(self, subject: str, reply: str) -> None:
        """Tell this client nobody took its request, through its subscription on `reply`."""
        tokens = reply.split(".")
        for subscription in self.subscriptions.values():
            if not subscription.queue and _matches(subscription.tokens, tokens):
                header = f"NATS/1.0 503\r\nNats-Subject: {subject}\r\n\r\n".encode()
                n = len(header)
                line = f"HMSG {reply} {subscription.sid} {n} {n}\r\n".encode()
                self._write(line + header + _CRLF)
                return

    def _refuse(self, error: str, *, close: bool) -> None:
        self._write(f"-ERR '{error}'\r\n".encode())
        if close:
            self._closed = True
            if self._transport is not None:
                self._transport.close()

    def _ok(self) -> None:
        if self._options.verbose:
            self._write(b"+OK\r\n")

    # Reading.

    def _parse(self) -> None:
        buffer = self._buffer
        start = 0
        while not self._closed:
            pending = self._pending
            if pending is not None:
                end = start + pending.total_size
                if len(buffer) < end + 2:
                    break
                if buffer[end : end + 2] != _CRLF:
                    self._refuse("Unknown Protocol Operation", close=True)
                    break
                message = bytes(buffer[start:end])
                start = end + 2
                self._pending = None
                self._publish(pending, message)
                continue
            newline = buffer.find(_CRLF, start)
            if newline < 0:
                if len(buffer) - start > MAX_CONTROL_LINE:
                    self._refuse("Maximum Control Line Exceeded", close=True)
                break
            line = bytes(buffer[start:newline]).decode("utf-8", "replace")
            start = newline + 2
            self._control(line)
        del buffer[:start]

    def _control(self, line: str) -> None:
        op, *tail = line.split(None, 1) or [""]  # fields are split by spaces or tabs
        rest = tail[0] if tail else ""
        args = rest.split()
        match op.upper():
            case "PING":
                self._write(b"PONG\r\n")
            case "PONG":
                pass
            case "CONNECT":
                self._connect(rest)
            case "SUB" if len(args) in (2, 3):
                self._subscribe(args)
            case "UNSUB" if len(args) in (1, 2):
                self._unsubscribe(args)
            case "PUB" if len(args) in (2, 3):
                self._begin_publish(args[0], args[1:-1], -1, args[-1])
            case "HPUB" if len(args) in (3, 4):
                self._begin_publish(args[0], args[1:-2], _size(args[-2]), args[-1])
            case _:
                self._refuse("Unknown Protocol Operation", close=True)

    def _connect(self, text: str) -> None:
        try:
            options = json.loads(text)
        except ValueError:
            options = None
        if not isinstance(options, dict):
            self._refuse("Unknown Protocol Operation", close=True)
            return
        self._options = _Options(
            verbose=bool(options.get("verbose", False)),
            headers=bool(options.get("headers", False)),
            no_responders=bool(options.get("no_responders", False)),
            echo=bool(options.get("echo", True)),
        )
        if self._options.no_responders and not self._options.headers:
            self._refuse("no responders requires headers support", close=True)
            return
        self._ok()

    def _subscribe(self, args: list[str]) -> None:
        subject, sid = args[0], args[-1]
        queue = args[1] if len(args) == 3 else ""
        if not _valid_subscription(subject) or (queue and not _valid_queue(queue)):
            self._refuse("Invalid Subject", close=False)
            return
        if sid in self.subscriptions:
            self._ok()  # the server keeps the first subscription under a sid
            return
        self.subscriptions[sid] = self._server._subscribe(self, subject, queue, sid)
        self._ok()

    def _unsubscribe(self, args: list[str]) -> None:
        subscription = self.subscriptions.get(args[0])
        limit = _size(args[1]) if len(args) == 2 else 0
        if len(args) == 2 and limit < 0:
            self._refuse("Unknown Protocol Operation", close=True)
            return
        if subscription is not None:
            if limit > subscription.delivered:
                subscription.max = limit
            else:
                self._server._unsubscribe(subscription)
        self._ok()

    def _begin_publish(self, subject: str, reply: list[str], header_size: int, total: str) -> None:
        total_size = _size(total)
        if total_size < 0 or (header_size != -1 and not 0 <= header_size <= total_size):
            self._refuse("Unknown Protocol Operation", close=True)
            return
        if total_size > self._server.max_payload:
            self._refuse("Maximum Payload Violation", close=True)
            return
        self._pending = _Pending(subject, reply[0] if reply else "", header_size, total_size)

    def _publish(self, pending: _Pending, message: bytes) -> None:
        header: bytes | None = None
        payload = message
        if pending.header_size >= 0:
            header = message[: pending.header_size]
            payload = message[pending.header_size :]
        self._ok()
        self._server._publish(self, pending.subject, pending.reply, header, payload)


def encode_header(headers: Mapping[str, str], status: str = "") -> bytes:
    """A header block as the server writes one: `NATS/1.0[ status]`, the lines, a blank line."""
    first = "NATS/1.0" + (f" {status}" if status else "")
    lines = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
    return f"{first}\r\n{lines}\r\n".encode()


def decode_header(header: bytes) -> dict[str, str]:
    """A header block's `Key: Value` lines as a dict; a key given twice keeps its last value.
    The status line (`NATS/1.0 503`) is not a key: JetStream reads only a client's headers."""
    headers: dict[str, str] = {}
    lines = header.decode("utf-8", "replace").split("\r\n")
    for line in lines[1:]:
        key, colon, value = line.partition(":")
        if colon and key.strip():
            headers[key.strip()] = value.strip()
    return headers


def _size(text: str) -> int:
    """A protocol size field; -1 if it is not a non-negative integer."""
    return int(text) if text.isdigit() else -1


_WILD_CACHE_SIZE = 4096


def _by_order(subscription: _Subscription) -> int:
    return subscription.order


def _prefix(tokens: list[str]) -> list[str]:
    """A wildcard subscription's literal prefix: its tokens before the first wildcard."""
    return tokens[: next(i for i, token in enumerate(tokens) if token in ("*", ">"))]


def _is_literal(tokens: list[str]) -> bool:
    return "*" not in tokens and ">" not in tokens


def _matches(pattern: list[str], tokens: list[str]) -> bool:
    """Whether a subscription's tokens match a subject's."""
    for i, token in enumerate(pattern):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or (token != "*" and token != tokens[i]):
            return False
    return len(pattern) == len(tokens)


def _valid_subscription(subject: str) -> bool:
    tokens = subject.split(".")
    if any(not token for token in tokens):
        return False
    return ">" not in tokens[:-1]


def _valid_queue(queue: str) -> bool:
    return bool(queue) and not any(c.isspace() for c in queue)
