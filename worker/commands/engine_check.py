"""`kvhandoff engine-check ENGINE_ID`: hold an engine on the bus to the wire contract, rule by
rule (the scenarios are `worker.conformance.engine_check`'s). Exit 0 only if every rule passes."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvhandoff.events.messages import Role
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.config import add_nats_arguments, nats_settings
from kvhandoff.worker.conformance.engine_check import (
    DEFAULT_QUIET_S,
    DEFAULT_WAIT_S,
    RULES,
    EngineCheck,
    Verdict,
    role_of,
)
from kvhandoff.worker.errors import BusError, BusRefused, ConfigError

CONNECT_TIMEOUT_S = 10.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine_id", help="the engine to check; nothing else may serve it")
    parser.add_argument(
        "--role",
        choices=[Role.SOURCE.value, Role.DESTINATION.value],
        help="the engine's role (default: from the id, <type>-prefill-<i> or <type>-decode-<i>)",
    )
    parser.add_argument(
        "--rule",
        action="append",
        choices=RULES,
        help="run only this rule (repeatable; default: all)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=DEFAULT_WAIT_S,
        help="seconds to wait for an answer or a fact (default %(default)s)",
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=DEFAULT_QUIET_S,
        help="seconds to watch that nothing more comes; above the engine's prefill and "
        "reservation time (default %(default)s)",
    )
    add_nats_arguments(parser)


def execute(args: argparse.Namespace) -> int:
    role = Role(args.role) if args.role else role_of(args.engine_id)
    if role is None:
        print(
            f"kvhandoff engine-check: say --role: {args.engine_id} names no role "
            "(<type>-prefill-<i> or <type>-decode-<i>)",
            file=sys.stderr,
        )
        return 2
    try:
        settings = nats_settings(args)
    except ConfigError as exc:
        print(f"kvhandoff engine-check: {exc}", file=sys.stderr)
        return 2
    try:
        verdicts = asyncio.run(_check(settings, args, role))
    except BusError as exc:
        print(f"kvhandoff engine-check: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, BusRefused) else 1
    for verdict in verdicts:
        print(verdict.line())
    failed = sum(not verdict.passed for verdict in verdicts)
    print(f"{args.engine_id} ({role}): {len(verdicts) - failed} passed, {failed} failed")
    return 0 if verdicts and not failed else 1


async def _check(settings: NatsSettings, args: argparse.Namespace, role: Role) -> list[Verdict]:
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            bus = await Bus.connect(settings, "kvhandoff-engine-check")
    except TimeoutError as exc:
        # Bus.connect waits for a server that may start later; a check has nothing to wait for.
        waited = f"{CONNECT_TIMEOUT_S:g}s"
        raise BusError(f"NATS at {settings.url} did not answer within {waited}") from exc
    try:
        check = EngineCheck(
            bus,
            Subjects(settings.subject_prefix),
            args.engine_id,
            role,
            wait_s=args.wait,
            quiet_s=args.quiet,
        )
        return await check.run(set(args.rule) if args.rule else None)
    finally:
        await bus.close()
