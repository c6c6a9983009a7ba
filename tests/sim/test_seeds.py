"""The simulation's seeds in CI: each a whole run of the tier under faults, checked.

`test_the_seeds_break_no_invariant` runs `kvhandoff sim --seeds N` as a user would (on both
cores), so a failure prints what the command prints: the seed, what broke, the faults it drew,
and the command that replays it. `KVHANDOFF_SIM_SEEDS` sets N (a developer runs more).

`test_a_seed_replays_byte_for_byte` holds the simulation to its promise: one seed gives one
trace, in this process and in another, whatever Python's hash seed.
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvhandoff.worker.sim.world import Scenario, simulate

SEEDS = int(os.environ.get("KVHANDOFF_SIM_SEEDS", "24"))


def short(seed: int) -> Scenario:
    """A shorter run than the default, for the replay test: determinism shows in seconds."""
    return Scenario(seed, duration_s=15.0, quiet_s=15.0, rate_per_s=2.0)


def _sim(*args: str, hash_seed: str = "0") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvhandoff.worker.cli", "sim", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
        check=False,
    )


def test_the_seeds_break_no_invariant() -> None:
    done = _sim("--seeds", str(SEEDS), "--jobs", "2", "--hashes")
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{SEEDS} seeds passed" in done.stdout
    # Each seed's hash, in seed order, as `--seed` alone gives it (in another process).
    hashes = [line.split() for line in done.stdout.splitlines() if line.startswith("seed ")]
    assert [int(seed) for _, seed, _ in hashes] == list(range(1, SEEDS + 1))
    alone = _sim("--seed", str(SEEDS), hash_seed="3")
    assert alone.stdout.splitlines()[-1] == hashes[-1][2], alone.stdout + alone.stderr


def _hashes(done: subprocess.CompletedProcess[str]) -> dict[int, str]:
    """The trace hash of each seed that `--seeds N --hashes` printed."""
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("seed ")]
    return {int(seed): trace_hash for _, seed, trace_hash in lines}


def test_a_seed_replays_byte_for_byte() -> None:
    first, again, other = simulate(short(7)), simulate(short(7)), simulate(short(8))
    assert first.faults, "the seed drew no fault: pick one that does"
    assert first.trace_hash == again.trace_hash and first.steps == again.steps
    assert other.trace_hash != first.trace_hash
    # In other processes, with other hash seeds, after other seeds, each seed gives the same
    # trace. Seeds 1 and 11 once did not: the tier answered for two gone engines in a set's
    # order, which is the hash seed's. And a few did not after some seeds: tasks were cancelled
    # in a set's order, which is their addresses', and so the process's history.
    args = ["--seeds", "12", "--duration", "15", "--quiet", "15", "--rate", "2", "--hashes"]
    one, two = (_hashes(_sim(*args, "--jobs", jobs, hash_seed=jobs)) for jobs in ("1", "2"))
    assert one == two and len(one) == 12
    assert one[7] == first.trace_hash
