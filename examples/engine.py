"""A complete kvhandoff engine, written with the client alone: a prefill (source) or a decode
(destination) engine for one engine id.

    python examples/engine.py --nats-url nats://127.0.0.1:4222 source vllm-prefill-0

Put your engine's real work where the comments say; the rest is the protocol. The client runs
each action id once (a retried action gets the same outcome), publishes outcomes and facts
durably, and publishes a fact only after the outcome of the action it follows from. A handler
answers at once and starts the slow part (a prefill, a transfer) as a task of the engine,
which publishes the fact when it is done. SIGINT or SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from kvhandoff.client import Connection, Engine, Handlers
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    HandoffTransferTiming,
    KvTransferTimingMode,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    StartTransfer,
    SubmitPrefill,
)
from kvhandoff.worker.config import NatsSettings

PROMPT_TOKENS = 1024  # what your engine knows of the request
# Llama-3-8B in fp16 over a 25 GB/s link: the worker sizes the transfer delay from these.
TIMING = HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, PROMPT_TOKENS, 131_072, 25.0)


class Source:
    """A prefill engine: computes the KV blocks, holds them, sends them, frees them."""

    def __init__(self, connection: Connection, engine_id: str) -> None:
        self.held: set[HandoffId] = set()
        self.engine = Engine(
            connection,
            engine_id,
            Handlers(
                submit_prefill=self.submit_prefill,
                start_transfer=self.start_transfer,
                release_source=self.free,
                cancel_source=self.free,
            ),
        )

    async def submit_prefill(self, action: SubmitPrefill) -> Outcome:
        self.held.add(action.handoff_id)
        self.engine.spawn(self.prefill(action.handoff_id))
        return SUBMITTED

    async def prefill(self, handoff_id: HandoffId) -> None:
        await asyncio.sleep(0.01)  # your prefill runs here
        await self.engine.source_held(handoff_id, TIMING)

    async def start_transfer(self, action: StartTransfer) -> Outcome:
        self.engine.spawn(self.transfer(action.handoff_id, action.delay_ms))
        return SCHEDULED

    async def transfer(self, handoff_id: HandoffId, delay_ms: float) -> None:
        await asyncio.sleep(delay_ms / 1000)  # your KV transfer runs here
        await self.engine.transfer_completed(handoff_id)

    async def free(self, action: ReleaseSource | CancelSource) -> Outcome:
        if action.handoff_id not in self.held:
            return NOOP  # nothing held: a cleanup must never fail
        self.held.discard(action.handoff_id)  # your engine frees the blocks here
        return APPLIED


class Destination:
    """A decode engine: reserves room for the KV blocks, then decodes the request."""

    def __init__(self, connection: Connection, engine_id: str) -> None:
        self.reserved: set[HandoffId] = set()
        self.engine = Engine(
            connection,
            engine_id,
            Handlers(
                reserve_destination=self.reserve,
                activate_destination=self.activate,
                cancel_destination=self.cancel,
            ),
        )

    async def reserve(self, action: ReserveDestination) -> Outcome:
        self.reserved.add(action.handoff_id)  # your engine allocates the blocks here
        self.engine.spawn(self.engine.destination_reserved(action.handoff_id, PROMPT_TOKENS))
        return ACCEPTED

    async def activate(self, action: ActivateDestination) -> Outcome:
        self.reserved.discard(action.handoff_id)  # your decode starts here
        return APPLIED

    async def cancel(self, action: CancelDestination) -> Outcome:
        if action.handoff_id not in self.reserved:
            return NOOP
        self.reserved.discard(action.handoff_id)  # your engine frees the blocks here
        return APPLIED


async def serve(url: str, role: str, engine_id: str) -> None:
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    async with await Connection.open(NatsSettings(url=url), f"example-{engine_id}") as connection:
        engine = (Source if role == "source" else Destination)(connection, engine_id).engine
        await engine.start()
        logging.info("%s engine %s is listening", role, engine_id)
        await stop.wait()
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="A kvhandoff engine written with the client.")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("role", choices=["source", "destination"])
    parser.add_argument("engine_id")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(args.nats_url, args.role, args.engine_id))


if __name__ == "__main__":
    main()
