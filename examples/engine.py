"""A complete kvhandoff engine, written with the client alone: a prefill (source) or a decode
(destination) engine for one engine id.

    python examples/engine.py --nats-url nats://127.0.0.1:4222 source vllm-prefill-0

Put your engine's real work where the comments say; the rest is the protocol. The client runs
each action id once (a retried action gets the same outcome), publishes outcomes and facts
durably, and publishes a fact only after the outcome of the action it follows from. A handler
answers at once and starts the slow part (a prefill, a transfer) as a task of the engine,
which publishes the fact when it is done; a cancel drops that work, and a forward action for a
handoff already cleaned up here is refused. It answers report requests, so the demo counts its
leaks. `kvhandoff engine-check ENGINE_ID` holds it to the contract (docs/contract.md). SIGINT
or SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from kvhandoff.client import Connection, Engine, Handlers
from kvhandoff.events.codec import encode
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    ActionFailed,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    Complete,
    EngineType,
    HandoffTransferTiming,
    KvTransferTimingMode,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    Role,
    StartTransfer,
    SubmitPrefill,
)
from kvhandoff.events.reports import EnginesReport, EngineStatus, Leak
from kvhandoff.worker.bus.settings import NatsSettings

PROMPT_TOKENS = 1024  # what your engine knows of the request
# Llama-3-8B in fp16 over a 25 GB/s link: the worker sizes the transfer delay from these.
TIMING = HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, PROMPT_TOKENS, 131_072, 25.0)


class Source:
    """A prefill engine: computes the KV blocks, holds them, sends them, frees them."""

    def __init__(self, connection: Connection, engine_id: str) -> None:
        self.held: set[HandoffId] = set()
        # Handoffs cleaned up here. A forward action for one (the worker's retry of a first copy
        # that was lost) would take ownership that nothing would ever free; a real engine keeps
        # this as long as the client keeps outcomes (`remember`).
        self.ended: set[HandoffId] = set()
        self.work: dict[HandoffId, asyncio.Task[None]] = {}
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
        if action.handoff_id in self.ended:
            return ActionFailed("the handoff was cleaned up here")
        self.held.add(action.handoff_id)
        self.work[action.handoff_id] = self.engine.spawn(self.prefill(action.handoff_id))
        return SUBMITTED

    async def prefill(self, handoff_id: HandoffId) -> None:
        await asyncio.sleep(0.01)  # your prefill runs here
        await self.engine.source_held(handoff_id, TIMING)

    async def start_transfer(self, action: StartTransfer) -> Outcome:
        if action.handoff_id not in self.held:
            return ActionFailed("no KV blocks held for the handoff")
        work = self.transfer(action.handoff_id, action.delay_ms)
        self.work[action.handoff_id] = self.engine.spawn(work)
        return SCHEDULED

    async def transfer(self, handoff_id: HandoffId, delay_ms: float) -> None:
        await asyncio.sleep(delay_ms / 1000)  # your KV transfer runs here
        await self.engine.transfer_completed(handoff_id)

    async def free(self, action: ReleaseSource | CancelSource) -> Outcome:
        self.ended.add(action.handoff_id)
        work = self.work.pop(action.handoff_id, None)
        if work is not None:
            work.cancel()  # a cancel mid-prefill or mid-transfer drops the work and its fact
        if action.handoff_id not in self.held:
            return NOOP  # nothing held: a cleanup must never fail
        self.held.discard(action.handoff_id)  # your engine frees the blocks here
        return APPLIED


class Destination:
    """A decode engine: reserves room for the KV blocks, then decodes the request."""

    def __init__(self, connection: Connection, engine_id: str) -> None:
        self.held: set[HandoffId] = set()  # reserved, not yet decoding
        self.ended: set[HandoffId] = set()  # cleaned up here (see `Source.ended`)
        self.work: dict[HandoffId, asyncio.Task[None]] = {}
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
        if action.handoff_id in self.ended:
            return ActionFailed("the handoff was cleaned up here")
        self.held.add(action.handoff_id)  # your engine allocates the blocks here
        work = self.engine.destination_reserved(action.handoff_id, PROMPT_TOKENS)
        self.work[action.handoff_id] = self.engine.spawn(work)
        return ACCEPTED

    async def activate(self, action: ActivateDestination) -> Outcome:
        if action.handoff_id not in self.held:
            return ActionFailed("nothing reserved for the handoff")
        self.held.discard(action.handoff_id)  # your decode starts here
        return APPLIED

    async def cancel(self, action: CancelDestination) -> Outcome:
        self.ended.add(action.handoff_id)
        work = self.work.pop(action.handoff_id, None)
        if work is not None:
            work.cancel()  # a cancel mid-reservation drops it and its fact
        if action.handoff_id not in self.held:
            return NOOP  # your engine ends a running decode here
        self.held.discard(action.handoff_id)  # your engine frees the blocks here
        return APPLIED


async def serve(url: str, role: Role, engine_id: str, engine_type: EngineType) -> None:
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    async with await Connection.open(NatsSettings(url=url), f"example-{engine_id}") as connection:
        served = (Source if role is Role.SOURCE else Destination)(connection, engine_id)
        # Leak accounting: what is still held for a handoff whose `Complete` went out.
        completed: set[HandoffId] = set()

        async def on_complete(complete: Complete) -> None:
            completed.add(complete.handoff_id)

        def report() -> bytes:
            leaks = [Leak(engine_id, h, "held") for h in sorted(served.held & completed)]
            status = EngineStatus(engine_id, engine_type, role)
            return encode(EnginesReport(f"example-{engine_id}", [status], leaks))

        watches = [
            await connection.watch_completions(on_complete),
            await connection.answer(connection.subjects.engines_report, report),
        ]
        await served.engine.start()
        logging.info("%s engine %s is listening", role, engine_id)
        await stop.wait()
        for watch in watches:
            await watch.close()
        await served.engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="A kvhandoff engine written with the client.")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("role", choices=[Role.SOURCE.value, Role.DESTINATION.value])
    parser.add_argument("engine_id")
    parser.add_argument(
        "--engine-type",
        choices=list(EngineType),
        help="for the engine's report (default: the id's first part, as in vllm-prefill-0)",
    )
    args = parser.parse_args()
    engine_type = args.engine_type or args.engine_id.split("-", 1)[0]
    if engine_type not in set(EngineType):
        parser.error(f"say --engine-type: {args.engine_id} does not begin with one")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(args.nats_url, Role(args.role), args.engine_id, EngineType(engine_type)))


if __name__ == "__main__":
    main()
