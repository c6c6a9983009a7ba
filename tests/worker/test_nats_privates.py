"""The nats-py internals that `worker.bus` patches or reads are there, with the shapes it uses.

The lean pull takes every message from nats-py's parser by putting itself in front of
`Client._process_msg` on its own client, parses status headers with `Client._process_headers`,
tells a message's subscription by `Subscription._id`, and `Bus.clustered` reads
`Client._server_info` (worker.bus.pull: `Deliveries`; worker.bus.connection). None of them is
nats-py's API, so pyproject.toml pins the releases read (2.15 to 2.16); this test says which
one is missing or changed when another release is installed, instead of a pull that silently
receives nothing. It checks attributes and signatures, not the version string.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.protocol.parser import Parser

INSTALLED = f"nats-py {version('nats-py')}"


def _parameters(function: object) -> list[str]:
    assert callable(function)
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_the_parser_hands_each_message_to_the_clients_own_process_msg() -> None:
    process_msg = getattr(Client, "_process_msg", None)
    assert inspect.iscoroutinefunction(process_msg), (
        f"{INSTALLED} has no coroutine Client._process_msg: worker.bus.pull.Deliveries "
        "cannot take deliveries from the parser"
    )
    assert _parameters(process_msg) == ["sid", "subject", "reply", "data", "headers"], (
        f"{INSTALLED} changed Client._process_msg's parameters; Deliveries._process passes "
        "(sid, subject, reply, data, headers)"
    )
    # Deliveries replaces the method on the client instance: the parser must look it up there.
    assert "self.nc._process_msg(" in inspect.getsource(Parser.parse), (
        f"{INSTALLED}'s parser no longer calls `self.nc._process_msg`: a Pull would receive nothing"
    )


def test_status_headers_are_parsed_by_the_clients_process_headers() -> None:
    process_headers = getattr(Client, "_process_headers", None)
    assert inspect.iscoroutinefunction(process_headers), (
        f"{INSTALLED} has no coroutine Client._process_headers, which Deliveries uses to "
        "parse a pull's status messages"
    )
    assert _parameters(process_headers) == ["headers"], (
        f"{INSTALLED} changed Client._process_headers's parameters"
    )


def test_a_subscription_keeps_its_sid_in_id() -> None:
    subscription = Subscription(Client(), id=7, subject="kvhandoff.test")
    assert getattr(subscription, "_id", None) == 7, (
        f"{INSTALLED}'s Subscription keeps its sid elsewhere than `_id`: Deliveries routes by it"
    )


def test_a_client_keeps_the_servers_info_in_server_info() -> None:
    assert isinstance(getattr(Client(), "_server_info", None), dict), (
        f"{INSTALLED}'s Client has no `_server_info` dict: Bus.clustered reads the server's "
        "INFO there"
    )
