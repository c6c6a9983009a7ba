"""`kvhandoff demo --cluster`: the demo on a tier of workers, with a worker and a NATS node
killed midway.

Theory of operation. It starts three nats-servers clustered on loopback with JetStream
(worker.harness.natsserver.NatsCluster), three workers of one tier (`kvhandoff run --partitions 16
--data-dir DIR`, each with a data directory of its own and every node's URL), and the mock engines
and the load as the single demo does (worker.commands._demo). The load begins once the three workers
have announced themselves (worker.tier.members: Membership), so that each takes its share of the
partitions. When half the handoffs have ended, it SIGKILLs the first worker, then the node that
leads the input stream (as the nodes' monitoring endpoints say), and waits for another node to lead
it while the load goes on.

The node is not restarted: the second half of the load runs on the two nodes left, a bare
quorum of every three-replica stream and bucket, which is what such a failure leaves until an
operator acts. A node's rejoin is tests/cluster/test_cluster.py's.

After the load it waits (up to `WAIT_TIMEOUT_S`) until the surviving workers hold no open
handoff (their `kvhandoff_open_handoffs`): a worker's own `TimedOut` that crossed a success
reopens the cleanup after the load saw the handoff end (a failover can hold a handoff past its
deadline), and that cleanup's actions may be dropped and retried. Then it stops the engines
(which report leaks) and the surviving workers (each hands its partitions over and exits 0),
and reads each partition's `Claimed` records in the
replicated log (worker.tier.ownership.read_claims). From them:
- who owned what: each worker's partitions just before the kill (the last claim before it) and
  at the end (the last claim);
- the failover: for each partition the killed worker owned, the time from its SIGKILL to the
  first claim by another worker (the claimant's wall clock; all on this machine). A claim comes
  with the partition's first batch under a new pin, so it also says when the partition was
  served again. The failover time is the longest of these.
Then it reads every worker's partition files for the state of every handoff (a handoff's
rows are whole in the file of the owner that ended it; a later owner's file knows a handoff
that ended before its snapshot by its tombstone only, and a former owner's may hold as open
what the next owner ended), and runs `verify` (worker.commands.verify) on every data
directory.

Exit 0 when every handoff ended (the load saw a `Complete`, the logs hold none open or
quarantined), no engine leaked, every partition of the killed worker was claimed by another,
every data directory verifies and every process stopped cleanly; 1 otherwise.

The engines inject the single demo's faults, dropped actions included: the workers publish an
unanswered action again after a second (`--retry-interval 1s`, as the single demo's worker), and
so also one lost in flight as the NATS node died. The load gives up on a handoff after
`WAIT_TIMEOUT_S`, and the summary counts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from pathlib import Path
from uuid import UUID

import msgspec
from rich.console import Console
from rich.table import Table

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.commands import _demo
from kvhandoff.worker.commands.load import print_summary
from kvhandoff.worker.commands.verify import verify_log
from kvhandoff.worker.errors import BusError, ChildError
from kvhandoff.worker.harness.child import WorkerChild
from kvhandoff.worker.harness.natsserver import EmbeddedNats, NatsCluster
from kvhandoff.worker.loadgen.generator import LoadConfig, LoadProgress, LoadReport
from kvhandoff.worker.log.reader import PARTITION_FILE, open_log
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.tier.entries import Claimed
from kvhandoff.worker.tier.members import members
from kvhandoff.worker.tier.membership import TierSettings
from kvhandoff.worker.tier.ownership import read_claims

HANDOFFS = 600
WORKERS = ("w1", "w2", "w3")  # the first is killed
SETTINGS = TierSettings(partitions=16)  # the names and the count `kvhandoff run` uses
# Long enough for a failover (5 to 13 s on 2 cores), the handoffs it held up and their retries:
# a handoff still open then is one the tier did not end.
WAIT_TIMEOUT_S = 30.0
_WITHIN_S = 30.0  # what a step that takes a second may take on a busy machine
_POLL_S = 0.1  # a poll of the servers' or the members' state, within a deadline

# The engines' lease TTL here. The demo kills the NATS node that leads the input stream, and
# the lease bucket may be led from it too: renewals fail until a new leader is elected (4.5 s
# in one CI run), which outlasted the default TTL of 5 s and expired every engine's lease. This
# demo shows a worker's and a node's death, not an engine's (`kvhandoff demo --kill-engine`).
_ENGINE_LEASE = ["--lease-ttl", "20"]


class Share(msgspec.Struct, frozen=True):
    """One worker's partitions just before the kill and at the end."""

    worker: str
    pid: int
    killed: bool
    before: list[int]
    after: list[int]


class Takeover(msgspec.Struct, frozen=True):
    """A partition of the killed worker claimed by another, `after_s` after the SIGKILL."""

    partition: int
    by: str
    after_s: float


class Strike(msgspec.Struct, frozen=True):
    """What was killed midway: a worker, and a NATS node, which led the input stream or not;
    the node that leads it next, and how long after the node's SIGKILL it said so."""

    worker: str
    at_ms: int  # the worker's SIGKILL, on this machine's wall clock
    node: str
    node_led_input_stream: bool
    next_leader: str | None
    next_leader_after_s: float | None


class ClusterReport(msgspec.Struct, frozen=True):
    """The cluster demo's summary (`--json`)."""

    load: LoadReport
    strike: Strike | None  # None: the load ended before half of it had
    shares: list[Share]
    takeovers: list[Takeover]
    not_taken_over: list[int]  # partitions of the killed worker no other worker claimed
    failover_s: float | None  # the longest takeover
    # Handoffs by state over every worker's files: its end, if any file holds it ended (a
    # snapshot carries a handoff's rows to the next owner only while it is open).
    log_states: dict[str, int]
    open_in: dict[str, int]  # each file that holds handoffs that no file holds ended: how many
    verify_bad: dict[str, int]  # bad handoffs by data directory (by worker)
    ok: bool  # all of the above as it should be (the exit status: and every process stopped)


def run(args: argparse.Namespace, console: Console, folder: Path) -> int:
    """The cluster demo (module docstring), in `folder`; its exit status."""
    with contextlib.ExitStack() as children:
        cluster = children.enter_context(NatsCluster(store_dir=folder / "nats"))
        url = cluster.url
        console.print(
            f"NATS cluster at {url}; logs and data directories in {folder}", soft_wrap=True
        )
        workers: dict[str, WorkerChild] = {}
        for name in WORKERS:
            (folder / name).mkdir()
            # In sessions of their own, as in the single demo: Ctrl-C reaches only the demo.
            # The tier keeps its logs in the data directory; it never opens --db.
            worker = WorkerChild(
                url,
                folder / f"{name}.db",
                "--partitions",
                str(SETTINGS.partitions),
                "--data-dir",
                str(folder / name),
                "--retry-interval",
                "1s",
                log_path=folder / f"{name}.log",
                new_session=True,
            )
            worker.name = name
            workers[name] = children.enter_context(worker)
        engines = children.enter_context(
            _demo.engines_child(url, folder, args, [*_demo.faults(), *_ENGINE_LEASE])
        )
        for worker in workers.values():
            worker.start(_demo.READY_TIMEOUT_S)
        engines.start(_demo.READY_TIMEOUT_S)
        asyncio.run(_demo.engines_ready(url, engines, console, args.external_engine))
        names = asyncio.run(_members(url, workers))
        config = _demo.load_config(
            url, args, args.handoffs or HANDOFFS, wait_timeout_s=WAIT_TIMEOUT_S
        )
        report, strike = asyncio.run(_load_and_strike(config, args, console, cluster, workers))
        print_summary(report, console)
        _demo.print_external(report, args.external_engine, console)
        killed = None if strike is None else strike.worker
        survivors = [name for name in WORKERS if name != killed]
        asyncio.run(_settled([workers[name] for name in survivors]))
        engines_clean = engines.terminate() == 0
        unclean = [name for name in survivors if workers[name].terminate() != 0]
        claims = asyncio.run(_read_claims(url))
    summary = _summarize(report, strike, claims, names=names, workers=workers, folder=folder)
    _print(summary, console, folder)
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=2))
    if not engines_clean or unclean:
        console.print(f"a process did not stop cleanly; see the logs in {folder}")
    _demo.point_at_the_log(folder / survivors[0], console)
    return 0 if summary.ok and engines_clean and not unclean else 1


async def _members(url: str, workers: dict[str, WorkerChild]) -> dict[str, str]:
    """Each worker's name by its member instance (as its claims name it), once all three
    announced themselves; `ChildError` if one exits, or they do not announce in time."""
    by_pid = {worker.pid: name for name, worker in workers.items()}
    bus = await Bus.connect(NatsSettings(url=url), "kvhandoff-demo")
    try:
        deadline = time.monotonic() + _WITHIN_S
        while True:
            with contextlib.suppress(BusError):  # a cluster that still elects answers late
                live = await members(bus, SETTINGS.stream)
                names = {m.instance: by_pid[m.pid] for m in live if m.pid in by_pid}
                if set(names.values()) == set(workers):
                    return names
            for name, worker in workers.items():
                if not worker.running():
                    raise ChildError(f"worker {name} exited; see {worker.log_path}")
            if time.monotonic() > deadline:
                raise ChildError(
                    f"the workers did not all announce themselves within {_WITHIN_S:.0f}s; "
                    "see w1.log, w2.log, w3.log"
                )
            await asyncio.sleep(_POLL_S)
    finally:
        await bus.close()


async def _settled(survivors: list[WorkerChild]) -> None:
    """Return once no survivor holds an open handoff, or after `WAIT_TIMEOUT_S` (a handoff
    still open then is one the tier did not end: the summary reports it), or at once if one
    no longer answers (it did not stop cleanly: the summary reports that too)."""
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            held = [await asyncio.to_thread(w.metric, "kvhandoff_open_handoffs") for w in survivors]
        except OSError:
            return
        if not any(held):
            return
        await asyncio.sleep(_POLL_S)


async def _load_and_strike(
    config: LoadConfig,
    args: argparse.Namespace,
    console: Console,
    cluster: NatsCluster,
    workers: dict[str, WorkerChild],
) -> tuple[LoadReport, Strike | None]:
    """The load, with the strike once half the handoffs have ended."""
    midway = asyncio.Event()

    def watch(progress: LoadProgress) -> None:
        if progress.ended >= config.handoffs // 2:
            midway.set()

    load = asyncio.create_task(_demo.run_load(config, args, console, watch))
    cue = asyncio.create_task(midway.wait())
    try:
        await asyncio.wait([load, cue], return_when=asyncio.FIRST_COMPLETED)
        strike = await _strike(cluster, workers, console) if midway.is_set() else None
        return await load, strike
    finally:
        cue.cancel()
        load.cancel()  # it is done unless the strike failed


async def _strike(
    cluster: NatsCluster, workers: dict[str, WorkerChild], console: Console
) -> Strike:
    """SIGKILL the first worker, then the node that leads the input stream (the first node
    if none says it does); wait for another node to lead the stream."""
    name = WORKERS[0]
    at_ms = time.time_ns() // 1_000_000
    await asyncio.to_thread(workers[name].kill)
    leader = await asyncio.to_thread(cluster.stream_leader, SETTINGS.stream)
    node = leader or cluster.nodes[0]
    await asyncio.to_thread(node.stop, True)
    node_killed = time.monotonic()
    node_name = _node_name(node)
    console.print(
        f"midway: SIGKILL to worker {name} (pid {workers[name].pid}) and to NATS node "
        f"{node_name}, "
        + ("which led " if leader else "though none said it led ")
        + SETTINGS.stream
    )
    deadline = node_killed + _WITHIN_S
    while (successor := await asyncio.to_thread(cluster.stream_leader, SETTINGS.stream)) is None:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(_POLL_S)
    after_s = None if successor is None else time.monotonic() - node_killed
    return Strike(
        name,
        at_ms,
        node_name,
        leader is not None,
        None if successor is None else _node_name(successor),
        after_s,
    )


def _node_name(node: EmbeddedNats) -> str:
    assert node.seat is not None  # every node of a NatsCluster has its seat
    return node.seat.name


async def _read_claims(url: str) -> dict[int, list[Claimed]]:
    """Every partition's `Claimed` records, in log order."""
    bus = await Bus.connect(NatsSettings(url=url), "kvhandoff-demo")
    try:
        return {
            partition: await read_claims(bus, SETTINGS.log_stream, SETTINGS.prefix, partition)
            for partition in range(SETTINGS.partitions)
        }
    finally:
        await bus.close()


def _summarize(
    report: LoadReport,
    strike: Strike | None,
    claims: dict[int, list[Claimed]],
    *,
    names: dict[str, str],
    workers: dict[str, WorkerChild],
    folder: Path,
) -> ClusterReport:
    """Who owned what, the takeovers, the logs' states and their verification."""
    killed_at_ms = strike.at_ms if strike is not None else time.time_ns() // 1_000_000

    def owner(claim: Claimed) -> str:
        return names.get(claim.instance, claim.owner)

    before = {
        p: owner(earlier[-1])
        for p, chain in claims.items()
        if (earlier := [c for c in chain if c.at_ms < killed_at_ms])
    }
    after = {p: owner(chain[-1]) for p, chain in claims.items() if chain}
    shares = [
        Share(
            worker=name,
            pid=worker.pid,
            killed=strike is not None and name == strike.worker,
            before=sorted(p for p, o in before.items() if o == name),
            after=sorted(p for p, o in after.items() if o == name),
        )
        for name, worker in workers.items()
    ]
    takeovers, not_taken_over = [], []
    victim = None if strike is None else strike.worker
    for partition, was in sorted(before.items()):
        if was != victim:
            continue
        taken = next(
            (c for c in claims[partition] if c.at_ms >= killed_at_ms and owner(c) != victim),
            None,
        )
        if taken is None:
            not_taken_over.append(partition)
        else:
            after_s = (taken.at_ms - killed_at_ms) / 1000
            takeovers.append(Takeover(partition, owner(taken), after_s))
    states, open_in = _handoff_states(folder, list(workers))
    verify_bad = {}
    for name in workers:
        data_dir = folder / name
        if any(PARTITION_FILE.fullmatch(p.name) for p in data_dir.iterdir()):
            with open_log(data_dir) as log:
                verify_bad[name] = verify_log(log).bad
    failover_s = max((t.after_s for t in takeovers), default=None)
    ended = report.ok and not states.get("open") and not states.get("quarantined")
    ok = (
        ended
        and strike is not None
        and bool(takeovers)
        and not not_taken_over
        and not any(verify_bad.values())
    )
    return ClusterReport(
        report,
        strike,
        shares,
        takeovers,
        not_taken_over,
        failover_s,
        dict(states),
        open_in,
        verify_bad,
        ok,
    )


def _print(summary: ClusterReport, console: Console, folder: Path) -> None:
    table = Table(title="tier: partitions owned")
    for column in ("worker", "pid", "before the kill", "at the end"):
        table.add_column(column)
    for share in summary.shares:
        name = share.worker + (" (killed)" if share.killed else "")
        table.add_row(name, str(share.pid), _partitions(share.before), _partitions(share.after))
    console.print(table)
    strike = summary.strike
    if strike is None:
        console.print("nothing was killed: the load ended before half of it had")
    else:
        took = ", ".join(f"{t.partition}→{t.by} {t.after_s:.1f}s" for t in summary.takeovers)
        if summary.failover_s is not None:
            console.print(
                f"failover: {strike.worker}'s partitions claimed by the others within "
                f"{summary.failover_s:.1f} s of its SIGKILL ({took})",
                soft_wrap=True,
            )
        if summary.not_taken_over:
            console.print(
                f"NOT taken over: partitions {_partitions(summary.not_taken_over)} of "
                f"{strike.worker}"
            )
        led = "the input stream's leader" if strike.node_led_input_stream else "a node"
        next_leader = (
            f"{strike.next_leader} led it {strike.next_leader_after_s:.1f} s later"
            if strike.next_leader is not None and strike.next_leader_after_s is not None
            else "no node led it again"
        )
        console.print(f"NATS: {strike.node} ({led}) killed, not restarted; {next_leader}")
    states = ", ".join(f"{state} {count}" for state, count in sorted(summary.log_states.items()))
    console.print(f"handoffs in the logs (every worker's files): {states or 'none'}")
    for path, count in summary.open_in.items():
        console.print(f"  {count} open: kvhandoff stuck {path} --older-than 1s", soft_wrap=True)
    verified = ", ".join(f"{name} {bad} bad" for name, bad in summary.verify_bad.items())
    console.print(f"verify of the data directories: {verified}")
    console.print("ok" if summary.ok else f"NOT ok: see the summary above and the logs in {folder}")


def _handoff_states(folder: Path, names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Each handoff's state over the workers' partition files (`folder / name`): the state a
    file that holds it ended says, else open; and the files that hold those still open."""
    ended: dict[UUID, str] = {}
    open_at: dict[UUID, str] = {}
    for name in names:
        files = sorted(p for p in (folder / name).iterdir() if PARTITION_FILE.fullmatch(p.name))
        for path in files:
            with open_log(path) as log:
                for row in log.handoffs():
                    if row.state is HandoffState.OPEN:
                        open_at.setdefault(row.handoff_id, str(path))
                    else:
                        ended[row.handoff_id] = row.state_name
    still_open = {handoff: path for handoff, path in open_at.items() if handoff not in ended}
    states = Counter(ended.values())
    if still_open:
        states["open"] = len(still_open)
    return dict(states), dict(Counter(still_open.values()))


def _partitions(partitions: list[int]) -> str:
    return " ".join(map(str, partitions)) or "-"
