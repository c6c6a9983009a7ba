"""The simulated server's core (worker.sim.nats.server), spoken to by nats-py itself.

The tests run on asyncio's standard loop whose `create_connection` is the simulated network's:
nats-py connects to `nats://sim-a:4222` and talks to the model as it would to a server. The
protocol's corners nats-py never reaches (it checks the payload limit itself, and it drops
messages over a subscription's maximum on its own side) are driven with raw protocol lines
over `asyncio.open_connection`.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError

from kvhandoff.worker.sim.nats.server import NatsServer
from kvhandoff.worker.sim.network import Network

Connect = Callable[..., Awaitable[Client]]


@pytest.fixture
async def network(monkeypatch: pytest.MonkeyPatch) -> Network:
    network = Network(random.Random(7))
    monkeypatch.setattr(asyncio.get_running_loop(), "create_connection", network.create_connection)
    return network


@pytest.fixture
async def server(network: Network) -> NatsServer:
    server = NatsServer(random.Random(11))
    server.listen(network, "sim-a", 4222)
    server.listen(network, "sim-b", 4222)
    return server


@pytest.fixture
async def connect(server: NatsServer) -> AsyncIterator[Connect]:
    """Connect nats-py to the model (sim-a by default); every client is closed at the end."""
    clients: list[Client] = []

    async def connect(*servers: str, **options: Any) -> Client:
        options.setdefault("allow_reconnect", False)
        client = await nats.connect(list(servers) or ["nats://sim-a:4222"], **options)
        clients.append(client)
        return client

    yield connect
    for client in clients:
        await client.close()


async def barrier(client: Client) -> None:
    """Return once the server has read all `client` sent before, and `client` all the server
    sent it before that. nats-py's `flush` is not enough: it writes its PING at once, ahead
    of publishes still in its buffer (its flusher task writes those), so the PONG can come
    back before they were routed. A message to itself goes through the same buffer and
    cannot overtake them (worker.bus.publish's barrier does the same)."""
    inbox = client.new_inbox()
    echo = await client.subscribe(inbox, max_msgs=1)
    await client.publish(inbox, b"")
    await echo.next_msg(5)


class Raw:
    """A connection that speaks the protocol line by line."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, **connect: Any) -> tuple[Raw, dict[str, Any]]:
        """Connect, read INFO, send CONNECT with `connect`'s options; the INFO."""
        reader, writer = await asyncio.open_connection("sim-a", 4222)
        raw = cls(reader, writer)
        op, _, info = (await raw.line()).partition(" ")
        assert op == "INFO"
        raw.send("CONNECT " + json.dumps({"verbose": False, **connect}))
        return raw, json.loads(info)

    def send(self, *lines: str) -> None:
        self.writer.write("".join(line + "\r\n" for line in lines).encode())

    async def line(self) -> str:
        line = await asyncio.wait_for(self.reader.readline(), 5)
        assert line.endswith(b"\r\n"), f"the connection ended: {line!r}"
        return line[:-2].decode()

    async def lines_until_pong(self) -> list[str]:
        """Send PING; every line the server sent before its PONG."""
        self.send("PING")
        lines = []
        while (line := await self.line()) != "PONG":
            lines.append(line)
        return lines

    async def closed_by_server(self) -> bool:
        """Whether the server closed the connection, having sent nothing more; closes ours."""
        rest = await asyncio.wait_for(self.reader.read(), 5)
        self.close()
        return rest == b""

    def close(self) -> None:
        self.writer.close()


async def test_info_says_what_a_2_12_server_says_and_verbose_clients_get_ok(
    server: NatsServer,
) -> None:
    raw, info = await Raw.open(verbose=True, headers=True, no_responders=True)
    assert info["version"] == "2.12.0"
    assert info["server_name"] == "sim-a"
    assert (info["host"], info["port"], info["proto"]) == ("sim-a", 4222, 1)
    assert info["headers"] is True and info["jetstream"] is True
    assert info["max_payload"] == 1024 * 1024
    assert isinstance(info["client_id"], int)
    raw.send("SUB greet 1", "PUB greet 2", "hi", "UNSUB 1")
    assert await raw.lines_until_pong() == ["+OK", "+OK", "+OK", "MSG greet 1 2", "hi", "+OK"]
    raw.send("sub\ttabs\t2", "pub tabs 1", "t")  # operations in any case, fields split by tabs
    assert await raw.lines_until_pong() == ["+OK", "+OK", "MSG tabs 2 1", "t"]
    raw.close()


async def test_messages_reach_the_subscriptions_whose_subjects_match(connect: Connect) -> None:
    client = await connect()
    patterns = [
        "shop.orders.*",
        "shop.orders.>",
        "shop.orders.eu",
        "shop.>",
        "*.orders.eu",
        "shop.orders.*.paid",
        "shop.shipments.*",
    ]
    subscriptions = {pattern: await client.subscribe(pattern) for pattern in patterns}
    for subject in ["shop.orders.eu", "shop.orders.us.paid", "shop.orders", "shop.shipments.eu"]:
        await client.publish(subject, subject.encode())
    await barrier(client)

    got = {}
    for pattern, subscription in subscriptions.items():
        got[pattern] = [
            (await subscription.next_msg(1)).subject for _ in range(subscription.pending_msgs)
        ]
    assert got == {
        "shop.orders.*": ["shop.orders.eu"],
        "shop.orders.>": ["shop.orders.eu", "shop.orders.us.paid"],
        "shop.orders.eu": ["shop.orders.eu"],
        "shop.>": ["shop.orders.eu", "shop.orders.us.paid", "shop.orders", "shop.shipments.eu"],
        "*.orders.eu": ["shop.orders.eu"],
        "shop.orders.*.paid": ["shop.orders.us.paid"],
        "shop.shipments.*": ["shop.shipments.eu"],
    }


async def test_deliveries_follow_the_order_the_subscriptions_were_made(
    server: NatsServer,
) -> None:
    raw, _ = await Raw.open()
    raw.send("SUB a.* 1", "SUB a.b 2", "SUB > 3", "SUB a.b 4", "PUB a.b 1", "x")
    lines = await raw.lines_until_pong()
    assert lines[::2] == ["MSG a.b 1 1", "MSG a.b 2 1", "MSG a.b 3 1", "MSG a.b 4 1"]
    raw.close()


async def test_each_queue_group_gets_each_message_once(connect: Connect) -> None:
    publisher = await connect()
    members = []
    clients = [await connect() for _ in range(3)]
    for client in clients:
        members.append(await client.subscribe("jobs", queue="workers"))
        await barrier(client)
    other_group = await publisher.subscribe("jobs", queue="auditors")
    plain = await publisher.subscribe("jobs")
    for n in range(60):
        await publisher.publish("jobs", b"%d" % n)
    await barrier(publisher)
    for client in clients:
        await barrier(client)  # each member has what the server sent it

    counts = [member.pending_msgs for member in members]
    assert sum(counts) == 60
    assert sum(1 for count in counts if count) > 1, "the group's members all take a share"
    assert other_group.pending_msgs == 60
    assert plain.pending_msgs == 60


def queue_choices(seed: int) -> list[str]:
    """Which member of a queue group took each of 40 messages, with the server's seed."""

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        network = Network(random.Random(1))
        loop.create_connection = network.create_connection  # type: ignore[method-assign,assignment]
        server = NatsServer(random.Random(seed))
        server.listen(network, "sim-a", 4222)
        raw, _ = await Raw.open()
        raw.send(*(f"SUB jobs workers {sid}" for sid in "abcd"))
        raw.send(*(line for n in range(40) for line in ("PUB jobs 1", str(n % 10))))
        lines = await raw.lines_until_pong()
        raw.close()
        return [line.split()[2] for line in lines[::2]]

    return asyncio.run(run())


def test_the_same_seed_picks_the_same_queue_members() -> None:
    first = queue_choices(3)
    assert len(first) == 40
    assert queue_choices(3) == first
    assert queue_choices(4) != first


async def test_a_request_and_its_reply_carry_their_headers(connect: Connect) -> None:
    responder = await connect()
    requester = await connect()
    seen: list[Msg] = []

    async def answer(msg: Msg) -> None:
        seen.append(msg)
        await responder.publish(msg.reply, b"pong:" + msg.data, headers={"Answer-By": "sim"})

    await responder.subscribe("svc.ping", cb=answer)
    await barrier(responder)
    reply = await requester.request("svc.ping", b"1", timeout=2, headers={"Trace-Id": "t-1"})
    assert reply.data == b"pong:1"
    assert reply.headers == {"Answer-By": "sim"}
    assert seen[0].headers == {"Trace-Id": "t-1"}


async def test_a_request_nobody_takes_is_answered_no_responders(connect: Connect) -> None:
    client = await connect()
    with pytest.raises(NoRespondersError):
        await client.request("nobody.home", b"?", timeout=2)


async def test_without_no_responders_a_request_nobody_takes_gets_nothing(
    server: NatsServer,
) -> None:
    raw, _ = await Raw.open(headers=True)
    raw.send("SUB inbox.1 9", "PUB nobody.home inbox.1 1", "?")
    assert await raw.lines_until_pong() == []
    raw.close()
    raw, _ = await Raw.open(headers=True, no_responders=True)
    raw.send("SUB inbox.* 9", "PUB nobody.home inbox.1 1", "?")
    header = "NATS/1.0 503\r\nNats-Subject: nobody.home\r\n\r\n"
    assert await raw.lines_until_pong() == [
        f"HMSG inbox.1 9 {len(header)} {len(header)}",
        "NATS/1.0 503",
        "Nats-Subject: nobody.home",
        "",
        "",
    ]
    raw.close()


class JetStreamStandIn:
    """An extension that takes `$JS.API.>` and answers `$JS.API.INFO` only, recording what
    it saw."""

    def __init__(self, server: NatsServer) -> None:
        self._server = server
        self.seen: list[tuple[str, str, Mapping[str, str] | None, bytes]] = []

    def on_publish(
        self, subject: str, reply: str, headers: Mapping[str, str] | None, payload: bytes
    ) -> bool:
        self.seen.append((subject, reply, headers, payload))
        if subject == "$JS.API.INFO":
            self._server.send(reply, b'{"type":"io.nats.jetstream.api.v1.account_info_response"}')
        return subject.startswith("$JS.API.")


async def test_what_the_extension_takes_is_no_request_nobody_took(
    server: NatsServer, connect: Connect
) -> None:
    extension = JetStreamStandIn(server)
    server.attach(extension)
    client = await connect()
    answer = await client.request("$JS.API.INFO", b"", timeout=2)
    assert b"account_info_response" in answer.data
    with pytest.raises(nats.errors.TimeoutError):  # taken, never answered: no 503
        await client.request("$JS.API.CONSUMER.INFO.S.C", b"", timeout=0.2)
    with pytest.raises(NoRespondersError):
        await client.request("$JS.ACK.S.C.1.1.1.0.0", b"+ACK", timeout=2)
    await client.publish("orders.eu", b"o", headers={"Nats-Msg-Id": "m-1", "Other": "x"})
    await barrier(client)
    headers = {"Nats-Msg-Id": "m-1", "Other": "x"}
    assert [seen for seen in extension.seen if seen[0] == "orders.eu"] == [
        ("orders.eu", "", headers, b"o")
    ]


async def test_a_key_given_twice_reaches_the_extension_with_its_last_value(
    server: NatsServer,
) -> None:
    extension = JetStreamStandIn(server)
    server.attach(extension)
    raw, _ = await Raw.open(headers=True)
    header = "NATS/1.0\r\nKey: first\r\nKey: last\r\n\r\n"
    raw.send("SUB s 1", f"HPUB s {len(header)} {len(header) + 1}", header + "p")
    lines = await raw.lines_until_pong()
    assert lines[0] == f"HMSG s 1 {len(header)} {len(header) + 1}"  # subscribers get it whole
    assert lines[1:4] == ["NATS/1.0", "Key: first", "Key: last"]
    assert extension.seen == [("s", "", {"Key": "last"}, b"p")]
    raw.close()


async def test_the_hub_sends_status_messages_as_the_server_does(
    server: NatsServer, connect: Connect
) -> None:
    client = await connect()
    inbox = await client.subscribe("_INBOX.pull.1")
    await barrier(client)
    assert server.has_interest("_INBOX.pull.1")
    assert not server.has_interest("_INBOX.pull.2")
    server.send("_INBOX.pull.1", status="404 No Messages", headers={"Nats-Pending-Messages": "1"})
    server.send("_INBOX.pull.1", b"data", reply="$JS.ACK.S.C.1.2.2.0.0")
    status = await inbox.next_msg(1)
    assert status.headers == {
        "Status": "404",
        "Description": "No Messages",
        "Nats-Pending-Messages": "1",
    }
    assert status.data == b""
    message = await inbox.next_msg(1)
    assert (message.data, message.reply, message.headers) == (
        b"data",
        "$JS.ACK.S.C.1.2.2.0.0",
        None,
    )


async def test_a_subscription_with_a_maximum_goes_after_that_many(
    server: NatsServer, connect: Connect
) -> None:
    client = await connect()
    subscription = await client.subscribe("tick")
    await subscription.unsubscribe(limit=2)
    for n in range(5):
        await client.publish("tick", b"%d" % n)
    await barrier(client)
    assert not server.has_interest("tick")
    assert [(await subscription.next_msg(1)).data for _ in range(2)] == [b"0", b"1"]

    raw, _ = await Raw.open()  # the server's count, without nats-py's own
    raw.send("SUB tock 1", "PUB tock 1", "a", "UNSUB 1 3")
    raw.send(*(line for n in range(4) for line in ("PUB tock 1", str(n))))
    lines = await raw.lines_until_pong()
    assert lines[1::2] == ["a", "0", "1"]
    raw.send("SUB tock 2", "UNSUB 2 0", "PUB tock 1", "z")
    assert await raw.lines_until_pong() == []
    raw.close()


async def test_unsubscribing(server: NatsServer, connect: Connect) -> None:
    client = await connect()
    subscription = await client.subscribe("news.>")
    await barrier(client)
    assert server.has_interest("news.today")
    await subscription.unsubscribe()
    await barrier(client)
    assert not server.has_interest("news.today")


async def test_a_flush_returns_after_what_the_server_sent_before_its_pong(
    server: NatsServer, connect: Connect
) -> None:
    client = await connect()
    subscription = await client.subscribe("feed")
    await barrier(client)
    for n in range(3):
        server.send("feed", b"%d" % n)
    await client.flush()
    assert subscription.pending_msgs == 3


async def test_a_client_without_echo_does_not_get_its_own_messages(connect: Connect) -> None:
    quiet = await connect(no_echo=True)
    listener = await connect()
    own = await quiet.subscribe("room")
    theirs = await listener.subscribe("room")
    await barrier(listener)  # its SUB is on the server (quiet's goes before its PUB)
    await quiet.publish("room", b"hello")
    assert (await theirs.next_msg(1)).data == b"hello"  # the server has routed it
    await quiet.flush()  # with nothing left in its buffer, the PING comes after the routing
    assert own.pending_msgs == 0


async def test_a_payload_over_the_maximum_is_refused(network: Network, connect: Connect) -> None:
    small = NatsServer(random.Random(1), max_payload=1024)
    small.listen(network, "sim-small", 4222)
    client = await connect("nats://sim-small:4222")
    with pytest.raises(MaxPayloadError):  # nats-py read the limit from INFO
        await client.publish("big", b"x" * 1025)
    await client.publish("fits", b"x" * 1024)
    await barrier(client)

    raw, _ = await Raw.open()
    raw.send("PUB big 2000000")
    assert await raw.line() == "-ERR 'Maximum Payload Violation'"
    assert await raw.closed_by_server()


async def test_protocol_errors_are_refused_with_the_servers_texts(server: NatsServer) -> None:
    raw, _ = await Raw.open()
    raw.send("SUB bad..subject 1", "SUB a.>.b 2")
    assert await raw.lines_until_pong() == ["-ERR 'Invalid Subject'"] * 2  # and it stays
    raw.send("HELLO there")
    assert await raw.line() == "-ERR 'Unknown Protocol Operation'"
    assert await raw.closed_by_server()

    raw, _ = await Raw.open()
    raw.send("PUB subject-without-size")
    assert await raw.line() == "-ERR 'Unknown Protocol Operation'"
    assert await raw.closed_by_server()

    raw, _ = await Raw.open(no_responders=True)  # no headers
    assert await raw.line() == "-ERR 'no responders requires headers support'"
    assert await raw.closed_by_server()


async def test_a_node_going_down_makes_nats_py_reconnect_to_another(
    network: Network, server: NatsServer, connect: Connect
) -> None:
    disconnected = asyncio.Event()
    reconnected = asyncio.Event()

    async def on_disconnect() -> None:
        disconnected.set()

    async def on_reconnect() -> None:
        reconnected.set()

    client = await connect(
        "nats://sim-a:4222",
        "nats://sim-b:4222",
        allow_reconnect=True,
        dont_randomize=True,
        reconnect_time_wait=0.05,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    subscription = await client.subscribe("alerts")
    await barrier(client)
    network.down("sim-a")
    await asyncio.wait_for(disconnected.wait(), 5)
    await asyncio.wait_for(reconnected.wait(), 5)
    assert client.connected_url is not None
    assert client.connected_url.hostname == "sim-b"

    await barrier(client)  # nats-py sent its subscriptions again, before this
    assert server.has_interest("alerts")
    publisher = await connect("nats://sim-b:4222")
    await publisher.publish("alerts", b"still here")
    await barrier(publisher)
    assert (await subscription.next_msg(1)).data == b"still here"


async def test_a_client_whose_node_went_down_gets_nothing_more(
    network: Network, server: NatsServer, connect: Connect
) -> None:
    """Its queue group's messages go to the members still connected, from the moment the
    node went down."""
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    doomed = await connect("nats://sim-a:4222", closed_cb=on_closed)
    await doomed.subscribe("updates", queue="q")
    await barrier(doomed)
    survivor = await connect("nats://sim-b:4222")
    kept = await survivor.subscribe("updates", queue="q")
    await barrier(survivor)
    network.down("sim-a")
    for n in range(20):
        server.send("updates", b"%d" % n)
    await asyncio.wait_for(closed.wait(), 5)
    await barrier(survivor)
    assert kept.pending_msgs == 20
