"""The client-side watch of pulls (worker.sim.pulls) is in place only for its block."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from kvhandoff.worker.bus.pull import Deliveries
from kvhandoff.worker.sim import pulls
from kvhandoff.worker.sim.history import History


def test_the_watch_patches_the_client_only_within_its_block() -> None:
    publish, process = Client.publish, Deliveries._process
    with pulls.watched(History()):
        assert Client.publish is not publish
        assert Deliveries._process is not process
    assert (Client.publish, Deliveries._process) == (publish, process)


def test_an_error_inside_still_takes_the_watch_out() -> None:
    publish, process = Client.publish, Deliveries._process
    with pytest.raises(KeyError), pulls.watched(History()):
        raise KeyError("boom")
    assert (Client.publish, Deliveries._process) == (publish, process)
