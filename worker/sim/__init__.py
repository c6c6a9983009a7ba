"""The deterministic simulation of the tier: its own code, many workers, one seed.

Layers, each built on the one before:

- `loop`: an asyncio event loop with a virtual clock, no selector and no threads, which picks
  the next ready callback by the seed and records what it ran (the trace, and its hash).
- `network`: in-memory connections between the loop's clients and simulated servers; the
  loop's `create_connection` hands them out, so nats-py connects to a simulated server as it
  connects to a real one, and runs unchanged.
- `nats`: a model of the NATS server the tier relies on (core pub/sub, JetStream streams,
  consumers, pins, KV), held to the real `nats-server` by one contract suite
  (tests/sim/contract).
"""
