"""A misbehaving engine, as a process of its own: floods the input stream with `failed` facts.

    python -m tests.worker.flooder NATS_URL IDS_FILE

It connects, prints `ready`, waits for a line on stdin, then publishes one `failed` fact per
handoff id in IDS_FILE (one a line) with JetStream, as fast as the stream takes them, and prints
how many seconds that took. A process apart, so that the flood costs the test's own event loop
(where the scripted engines and the frontend run) nothing.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from uuid import UUID

import nats

from kvhandoff.events import codec
from kvhandoff.events.messages import Failed
from kvhandoff.events.subjects import Subjects

_IN_FLIGHT = 500  # publishes awaiting their ack at once


async def flood(url: str, ids: list[UUID]) -> float:
    subjects = Subjects()
    facts = [(subjects.input(h), codec.encode(Failed(h))) for h in ids]
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        began = time.monotonic()
        for first in range(0, len(facts), _IN_FLIGHT):
            chunk = facts[first : first + _IN_FLIGHT]
            await asyncio.gather(*(js.publish(s, p, timeout=30) for s, p in chunk))
        return time.monotonic() - began
    finally:
        await nc.close()


def main(argv: list[str]) -> int:
    url, ids_file = argv
    ids = [UUID(line) for line in Path(ids_file).read_text().split()]
    elapsed = asyncio.run(flood(url, ids))
    print(f"{elapsed:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
