"""A simulated NATS cluster: the core server and its JetStream model, on nodes of a network.

One model serves every node (`hosts`): the tier sees a three-node cluster (three URLs; a
client fails over between them), while the state a real cluster replicates with Raft is one
set of streams and consumers here. What a real cluster's replication lets clients see is
drawn as faults instead: a node lost (`node_down`: its clients' connections reset, and they
reconnect to another node), a leader election (`jetstream.faults.unavailable_until`: nothing
answered, as a stream without a leader), a publish whose ack was lost
(`jetstream.faults.lost_ack_rate`). The contract suite (tests/sim/contract) holds this model
to a real `nats-server`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvhandoff.worker import ambient
from kvhandoff.worker.sim.history import History
from kvhandoff.worker.sim.nats.jetstream.consumers import Consumers
from kvhandoff.worker.sim.nats.jetstream.model import JetStream
from kvhandoff.worker.sim.nats.server import NatsServer
from kvhandoff.worker.sim.network import Network
from kvhandoff.worker.sim.process import SimProcess

PORT = 4222


class SimCluster:
    """`nodes` nodes named n1, n2, ... on `network`'s hosts, serving one model of NATS."""

    def __init__(
        self,
        chance: random.Random,
        *,
        nodes: int = 3,
        origin: Callable[[], str] = lambda: "client",
    ) -> None:
        # Each part draws from its own stream, so that adding a draw to one does not shift
        # what the others draw for the same seed.
        self.network = Network(random.Random(chance.getrandbits(64)), origin=origin)
        self.server = NatsServer(random.Random(chance.getrandbits(64)))
        # JetStream stamps what it stores with the server's wall clock, on the simulation's
        # time: it takes the ambient current as it is made.
        self.process = SimProcess("nats", random.Random(chance.getrandbits(64)))
        with ambient.using(self.process):
            self.jetstream = JetStream(
                self.server, random.Random(chance.getrandbits(64)), replicated=nodes > 1
            )
        self.server.attach(self.jetstream)
        self.hosts = [f"n{number}" for number in range(1, nodes + 1)]
        for host in self.hosts:
            self.server.listen(self.network, host, PORT)

    def record(self, history: History) -> None:
        """Record into `history` every message stored, ack settled, client publish and
        connection reset."""
        self.network.on_reset = history.on_reset
        self.server.history = history
        self.jetstream.history = history
        self.consumers.history = history

    @property
    def consumers(self) -> Consumers:
        """The model's consumers, whose faults a run turns on."""
        return self.jetstream.consumers

    @property
    def url(self) -> str:
        """Every node's URL, as `NatsSettings.url` takes them."""
        return ",".join(f"nats://{host}:{PORT}" for host in self.hosts)

    def node_down(self, host: str) -> None:
        """The node crashed: its clients' connections reset, and connecting to it is refused."""
        self.network.down(host)

    def node_up(self, host: str) -> None:
        """The node is back."""
        self.network.up(host)
