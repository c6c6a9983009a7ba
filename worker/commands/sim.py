"""`kvhandoff sim`: the deterministic simulation of the tier (worker.sim), seed by seed.

`--seeds N` runs seeds `--first-seed` to `--first-seed + N - 1` (on `--jobs` processes) and
stops at the first seed that breaks an invariant: it prints the seed, what broke, the faults the
seed drew, and the command that replays it, and exits 1. `--seed S` runs one seed and prints its
trace's hash on its last line: the same seed gives the same hash, on any machine, so a failure
is reproduced by running its seed again, and `--trace` prints the trace itself (one line per
callback the loop ran and per message the network carried); `--seeds N --hashes` prints every
seed's hash, so that two runs of many seeds can be compared line by line. `--plant NAME`
switches on a planted bug (worker.sim.plants), to see the simulation find it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

from kvhandoff.worker.clock import DURATION_HELP, duration_arg
from kvhandoff.worker.sim import faults
from kvhandoff.worker.sim.world import Outcome, Scenario, simulate

_DEFAULTS = Scenario(seed=0)


def configure(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed", type=int, help="run this one seed; print its trace's hash last")
    which.add_argument("--seeds", type=int, metavar="N", help="run N seeds, stop at a failure")
    parser.add_argument(
        "--first-seed", type=int, default=1, help="the first of --seeds (default 1)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes that run --seeds side by side (default: one per core)",
    )
    parser.add_argument("--trace", action="store_true", help="with --seed: print the trace")
    parser.add_argument(
        "--hashes",
        action="store_true",
        help="with --seeds: print each seed's trace hash as it passes (`seed S HASH`), to "
        "hold two runs, machines or commits to the same traces",
    )
    parser.add_argument("--plant", metavar="NAME", help="switch on a planted bug, by name")
    parser.add_argument("--workers", type=int, default=_DEFAULTS.workers)
    parser.add_argument("--partitions", type=int, default=_DEFAULTS.partitions)
    parser.add_argument(
        "--duration",
        type=duration_arg,
        default=_DEFAULTS.duration_s,
        help=f"virtual time of load and faults (default 60s): {DURATION_HELP}",
    )
    parser.add_argument(
        "--quiet",
        type=duration_arg,
        default=_DEFAULTS.quiet_s,
        help="virtual time after the faults heal for every handoff to end (default 30s)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=_DEFAULTS.rate_per_s,
        help="handoffs started per virtual second",
    )
    parser.add_argument("--no-faults", action="store_true", help="run without faults")
    parser.add_argument(
        "--faults",
        metavar="KINDS",
        type=_kinds,
        help="give every seed these fault kinds and no others, comma-separated (one of: "
        f"{', '.join(faults.KINDS)}); default: each seed draws its own",
    )


def execute(args: argparse.Namespace) -> int:
    if args.seed is not None:
        outcome = simulate(_scenario(args, args.seed), keep_trace=args.trace)
        if args.trace and outcome.trace is not None:
            for line in outcome.trace:
                print(line)
        _report(outcome, args)
        print(outcome.trace_hash)
        return 0 if outcome.ok else 1
    return _run_seeds(args)


def _scenario(args: argparse.Namespace, seed: int) -> Scenario:
    return Scenario(
        seed=seed,
        workers=args.workers,
        partitions=args.partitions,
        duration_s=args.duration,
        quiet_s=args.quiet,
        rate_per_s=args.rate,
        faults=not args.no_faults,
        plant=args.plant,
        fault_kinds=args.faults,
    )


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in faults.KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"no fault kind {', '.join(map(repr, unknown))}; the kinds are: "
            f"{', '.join(faults.KINDS)}"
        )
    return kinds


def _run_seeds(args: argparse.Namespace) -> int:
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    began = time.perf_counter()
    done = steps = 0
    virtual_s = 0.0
    for outcome in _outcomes(args, seeds):
        done += 1
        steps += outcome.steps
        virtual_s += outcome.virtual_s
        if not outcome.ok:
            _report(outcome, args)
            return 1
        if args.hashes:
            print(f"seed {outcome.seed} {outcome.trace_hash}", flush=True)
    wall_s = time.perf_counter() - began
    print(
        f"{done} seeds passed in {wall_s:.1f}s ({done / wall_s * 60:.0f} seeds/min on"
        f" {args.jobs} processes): {steps / wall_s:,.0f} steps/s,"
        f" {virtual_s / wall_s:.1f}x virtual to wall time"
    )
    return 0


def _outcomes(args: argparse.Namespace, seeds: range) -> Iterator[Outcome]:
    """Each seed's outcome, in seed order (so that the first failure reported is the lowest
    seed's), from `--jobs` processes."""
    scenarios = [_scenario(args, seed) for seed in seeds]
    if args.jobs <= 1:
        yield from map(simulate, scenarios)
        return
    with ProcessPoolExecutor(args.jobs) as pool:
        yield from pool.map(simulate, scenarios)


def _report(outcome: Outcome, args: argparse.Namespace) -> None:
    status = "ok" if outcome.ok else "FAILED"
    print(
        f"seed {outcome.seed}: {status}, {outcome.steps:,} steps,"
        f" {outcome.virtual_s:.1f} virtual s in {outcome.wall_s:.1f}s"
    )
    if outcome.ok:
        return
    for violation in outcome.violations:
        print(f"  broke: {violation}")
    for fault in outcome.faults:
        print(f"  fault: {fault}")
    print(f"  replay: {replay_command(args, outcome.seed)}", file=sys.stdout)


def replay_command(args: argparse.Namespace, seed: int) -> str:
    """The command that runs `seed` again as this run ran it."""
    parts = ["kvhandoff sim", f"--seed {seed}"]
    if args.plant:
        parts.append(f"--plant {args.plant}")
    if args.faults is not None:
        parts.append(f"--faults {','.join(args.faults)}")
    for flag, value, default in [
        ("--workers", args.workers, _DEFAULTS.workers),
        ("--partitions", args.partitions, _DEFAULTS.partitions),
        ("--duration", args.duration, _DEFAULTS.duration_s),
        ("--quiet", args.quiet, _DEFAULTS.quiet_s),
        ("--rate", args.rate, _DEFAULTS.rate_per_s),
    ]:
        if value != default:
            parts.append(f"{flag} {value:g}")
    if args.no_faults:
        parts.append("--no-faults")
    return " ".join(parts)
