"""The whole stack in containers, built from this checkout: NATS, the worker, the mock engines
and the load generator, each in its own container on one network, as deployed.

Handoffs complete end to end; and they still all end, with no engine left holding blocks, when
the worker is SIGKILLed mid-load and a new worker container starts on the same log, when NATS
restarts mid-load, and when the worker is cut off the network and reconnected. Each load run
is judged three ways: the load generator (every handoff ended with a `Complete`, no leak, the
engines settled), the engines process itself on stop (no leak), and the worker's event log read
from the host (every handoff closed, and the log re-derives exactly what was logged). Where the
load generator sees every `Complete`, the log's states are also the final states it reports.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from kvhandoff.worker.commands.verify import verify_log
from kvhandoff.worker.harness.containers import (
    KvhandoffWorkerContainer,
    MockEnginesContainer,
    NatsContainer,
)
from kvhandoff.worker.loadgen.generator import LoadReport
from kvhandoff.worker.log.reader import open_log
from tests.containers.conftest import (
    Loads,
    Workers,
    completed_handoffs,
    handoff_states,
    recovered_open_handoffs,
    wait_until,
)

pytestmark = pytest.mark.containers

HANDOFFS = 300
CONCURRENCY = ("--concurrency", "32")
# A handoff takes well under a second here, a few seconds across a worker restart or a NATS
# restart: a lost Complete (see the NATS restart) should not cost a minute.
WAIT_TIMEOUT = ("--wait-timeout", "30")
# The worker's log message when it finds that NATS does not answer (worker.tier.service,
# worker.bus).
BUS_TROUBLE = ("publishing failed", "fetch failed", "disconnected from NATS")


def assert_every_handoff_ended(report: LoadReport) -> None:
    assert report.ok, f"not every handoff ended, or engines leak: {report}"
    assert report.timed_out == report.rejected == 0, report
    assert report.engines_settled, f"engines still hold blocks: {report}"


def assert_engines_leak_nothing(engines: MockEnginesContainer) -> None:
    code = engines.terminate()
    assert code == 0, f"the engines report leaks (exit {code}):\n{engines.logs()[-6000:]}"


def assert_log_closed(worker: KvhandoffWorkerContainer, handoffs: int) -> None:
    """Drain the worker, then read its log on the host: every handoff closed, and replaying
    each one's inputs re-derives exactly the actions that were logged."""
    assert worker.terminate() == 0, worker.logs()[-4000:]
    states = handoff_states(worker.db_path)
    assert states["open"] == 0, f"open handoffs left in the log: {states}"
    assert states.total() == handoffs, f"the log holds {states}, not {handoffs} handoffs"
    with open_log(worker.db_path) as log:
        verified = verify_log(log)
    assert verified.handoffs == handoffs
    assert not verified.diverged, verified.diverged[:3]


def assert_log_holds_the_final_states(worker: KvhandoffWorkerContainer, report: LoadReport) -> None:
    """Like with like: each handoff's state in the log against the state the load generator
    saw it left in (after a success that a frontend cancel reopened, that is canceled)."""
    states = handoff_states(worker.db_path)
    logged = (states["succeeded"], states["canceled"])
    assert logged == (report.final.succeeded, report.final.canceled), (states, report)


def test_handoffs_complete_end_to_end(
    worker: KvhandoffWorkerContainer, engines: MockEnginesContainer, loads: Loads
) -> None:
    # Cancels spread over a handoff's whole life (a few hundred ms here), so that some cross
    # its success and reopen it: the race that a load report has to get right.
    cancels = ("--cancel-share", "0.3", "--cancel-within-ms", "300")
    load = loads.start(HANDOFFS, *CONCURRENCY, *WAIT_TIMEOUT, *cancels)
    report = loads.finish(load)

    assert_every_handoff_ended(report)
    assert report.completed > 0 and report.canceled > 0, report
    # These engines inject no faults, so only a frontend cancel reopens a success, and a
    # handoff the frontend canceled ends at the canceled completion: how each handoff ended is
    # the state it is left in.
    assert (report.final.succeeded, report.final.canceled) == (report.completed, report.canceled)
    assert_engines_leak_nothing(engines)
    assert_log_closed(worker, HANDOFFS)
    assert_log_holds_the_final_states(worker, report)


def test_worker_killed_mid_load_and_restarted_on_the_same_log(
    workers: Workers, engines: MockEnginesContainer, loads: Loads
) -> None:
    first = workers.start()
    load = loads.start(HANDOFFS, *CONCURRENCY, *WAIT_TIMEOUT, "--cancel-share", "0.1")
    wait_until(
        lambda: completed_handoffs(first) >= HANDOFFS // 3,
        "a third of the handoffs completed",
        context=first.logs,
    )
    first.kill()  # SIGKILL: no drain, whatever the worker was doing
    second = workers.start()  # a new container on the same data directory

    assert recovered_open_handoffs(second) > 0, "the kill was not mid-load"
    report = loads.finish(load)
    assert_every_handoff_ended(report)
    assert_engines_leak_nothing(engines)
    assert_log_closed(second, HANDOFFS)
    # Recovery publishes the Completes the killed worker logged and had not published.
    assert_log_holds_the_final_states(second, report)


def test_nats_restarted_mid_load(
    nats: NatsContainer,
    worker: KvhandoffWorkerContainer,
    engines: MockEnginesContainer,
    loads: Loads,
) -> None:
    load = loads.start(HANDOFFS, *CONCURRENCY, *WAIT_TIMEOUT)
    wait_until(
        lambda: completed_handoffs(worker) >= HANDOFFS // 3,
        "a third of the handoffs completed",
        context=worker.logs,
    )
    nats.restart()  # the JetStream store is on the container's volume and survives

    report = loads.finish(load)
    assert "disconnected from NATS" in worker.logs(), "the worker never lost NATS"
    # `<prefix>.done.<id>` is core NATS: a Complete that the worker published while the load
    # generator was still reconnecting is lost to it, which it counts as a timeout. The worker's
    # log is the judge of those: every handoff must be closed there.
    assert report.rejected == 0, report
    assert report.completed + report.canceled + report.timed_out == HANDOFFS, report
    assert report.leaks == 0 and report.engines_settled, report
    assert_engines_leak_nothing(engines)
    assert_log_closed(worker, HANDOFFS)


def inputs_unacknowledged(nats: NatsContainer) -> int:
    """Inputs in the stream that the worker has not acknowledged (logged) yet."""
    with urllib.request.urlopen(f"{nats.monitoring_url}/jsz?streams=true", timeout=5) as r:
        jsz = json.load(r)
    return sum(
        stream["state"]["messages"]
        for account in jsz.get("account_details", [])
        for stream in account.get("stream_detail", [])
    )


def test_worker_cut_off_the_network_and_reconnected(
    nats: NatsContainer,
    worker: KvhandoffWorkerContainer,
    engines: MockEnginesContainer,
    loads: Loads,
) -> None:
    # The handoffs caught by the cut wait for all of it, and for the worker to find its
    # connection again: allow more than the handoff deadline (30 s), which cancels them.
    load = loads.start(HANDOFFS, *CONCURRENCY, "--wait-timeout", "90")
    wait_until(
        lambda: completed_handoffs(worker) >= HANDOFFS // 3,
        "a third of the handoffs completed",
        context=worker.logs,
    )
    network = worker.get_docker_client().client.networks.get(nats.network.name)
    network.disconnect(worker.get_container_id())
    # Cut off until the worker itself has found that NATS no longer answers (a flush times
    # out after 5 s): a partition, not a blip that TCP hides.
    wait_until(
        lambda: any(trouble in worker.logs() for trouble in BUS_TROUBLE),
        "the cut-off worker noticing that NATS does not answer",
        context=worker.logs,
    )
    load.reload()
    assert load.status == "running", "the load ended during the cut"
    network.connect(worker.get_container_id())
    worker.wait_ready()  # /healthz again, on a newly mapped port

    # /healthz only says that the client believes it is connected: ask for progress.
    at_reconnect = completed_handoffs(worker)
    wait_until(
        lambda: completed_handoffs(worker) > min(at_reconnect, HANDOFFS - 1),
        "the reconnected worker completing handoffs again",
        context=lambda: (
            f"{inputs_unacknowledged(nats)} inputs unacknowledged; worker log:\n" + worker.logs()
        ),
    )
    report = loads.finish(load)
    assert_every_handoff_ended(report)
    assert_engines_leak_nothing(engines)
    assert_log_closed(worker, HANDOFFS)


def test_the_worker_container_exposes_its_log_on_the_host(
    worker: KvhandoffWorkerContainer, tmp_path: Path
) -> None:
    """The helper's contract for downstream tests: db_path is the live log, on the host."""
    assert worker.healthy()
    assert worker.db_path == tmp_path / "worker" / "kvhandoff.db"
    assert worker.db_path.is_file()
    assert "kvhandoff_open_handoffs" in worker.metrics()
    assert worker.terminate() == 0
    assert handoff_states(worker.db_path).total() == 0
