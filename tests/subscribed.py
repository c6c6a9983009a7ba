"""Knowing in a test that the server has a nats-py client's subscriptions: `registered`.

Not `Client.flush()`: nats-py writes its PING straight to the socket, ahead of the SUB that
`subscribe` left in its write buffer (on the wire: `PING`, then `SUB`), so the PONG proves
nothing of the SUB. A server that reads the connection late routes what another client
publishes meanwhile to nobody (or answers it 503: no responders). `registered` is the tier's
barrier (worker.bus.publish, "The barrier") for a bare nats-py client: a message to an inbox of
its own, written behind every SUB before it; the server reads a connection's commands in order,
so once the message comes back it has them all.

In a cluster that proves it of the node the client is connected to: the other nodes learn of
the subscription over their routes, which that node writes to as it reads the SUB.
"""

from __future__ import annotations

from nats.aio.client import Client

from tests.eventually import WITHIN_S


async def registered(nc: Client, within: float = WITHIN_S) -> None:
    """Return once the server has every subscription `nc` made so far."""
    inbox = nc.new_inbox()
    echo = await nc.subscribe(inbox)
    try:
        await nc.publish(inbox, b"")
        await echo.next_msg(timeout=within)
    finally:
        await echo.unsubscribe()
