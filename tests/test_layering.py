"""The dependency rules, checked on the source: the core imports only the standard library and
msgspec, and of the standard library nothing that does IO; the planner imports neither the log
nor the bus; the log and the bus never import each other; the `worker.bus` package is the one
part of the worker, the client (and the load benchmark) that imports nats, and it is the
transport and nothing else (no tier rules, no log, no worker config); the client reaches the
worker only through the bus, its errors and the ambient port; the offline commands never reach
nats.

Imports are read with `ast`, not by importing, so a rule holds for every import statement,
including those inside functions that a test run might never execute. One check imports for
real, in fresh interpreters, because `sys.modules` is the final word on what gets loaded.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The folders that install as kvhandoff.<folder> (through the links in kvhandoff/).
FOLDERS = ("events", "worker", "client")

# The commands that read the log file alone, and the reader they share.
OFFLINE_COMMANDS = [
    f"kvhandoff.worker.commands.{name}"
    for name in ("list", "stuck", "replay", "verify", "export", "compact", "conformance", "schema")
]
OFFLINE = [*OFFLINE_COMMANDS, "kvhandoff.worker.log.reader"]
# The one package that talks to nats-py: connecting, the barrier, durable publishing and the
# pull exist once, and every nats-py error is translated there.
NATS_SEAM = "kvhandoff.worker.bus"
# What the transport must not know: the tier's rules, the log, the worker's settings.
BUS_MUST_NOT_IMPORT = {"kvhandoff.worker.tier", "kvhandoff.worker.log", "kvhandoff.worker.config"}
# What the client may use of the worker: the NATS seam (with the settings it connects with),
# the errors it translates, and the ambient port (clocks, ids, chance), which the client reads
# like the tier so that the simulation runs engines and frontends on its virtual clock and
# seeded ids (tests/test_ambient.py). Never the tier, the log, the worker's config or the
# commands.
CLIENT_MAY_IMPORT = {NATS_SEAM, "kvhandoff.worker.errors", "kvhandoff.worker.ambient"}


@dataclass(frozen=True)
class Import:
    """One imported module name, where it is imported, and whether it runs at import time."""

    importer: str
    module: str
    line: int
    type_checking_only: bool

    def __str__(self) -> str:
        return f"{self.importer} imports {self.module} (line {self.line})"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(["kvhandoff", *parts] if parts[0] in FOLDERS else parts)


def source_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] == "kvhandoff" and len(parts) > 1:
        parts = parts[1:]  # the folder the link kvhandoff/<folder> points to
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def modules_of(package: str) -> list[str]:
    return sorted(module_name(path) for path in (ROOT / package).rglob("*.py"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """Every module an import statement anywhere in `module` names, module level or not.

    `from a import b` names `a`, and also `a.b` when that is a module of ours.
    """
    path = source_file(module)
    assert path is not None, f"no source for {module}"
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for statement in node.body:
                visit(statement, True)
            for statement in node.orelse:
                visit(statement, type_checking)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, alias.name, node.lineno, type_checking))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # Relative: resolve against the importing package.
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                assert node.module is not None
                base = node.module
            found.append(Import(module, base, node.lineno, type_checking))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if source_file(submodule) is not None:
                    found.append(Import(module, submodule, node.lineno, type_checking))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return tuple(found)


def top(name: str) -> str:
    return name.partition(".")[0]


def package(name: str) -> str:
    """What a module belongs to: `kvhandoff.<folder>` for ours, else its top-level name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "kvhandoff" else parts[0]


def within(module: str, packages: set[str]) -> bool:
    """Whether `module` is one of `packages` or inside one of them."""
    return any(module == p or module.startswith(f"{p}.") for p in packages)


def bus_modules() -> list[str]:
    return [m for m in modules_of("worker") if within(m, {NATS_SEAM})]


def violations(modules: list[str], forbidden: set[str]) -> Iterator[str]:
    """Imports of a forbidden module or package (`worker.bus` forbids `worker.bus.x` too)."""
    for module in modules:
        for imp in imports_of(module):
            if within(imp.module, forbidden):
                yield str(imp)


def test_the_module_discovery_sees_the_code() -> None:
    # Guards the other tests against passing vacuously on an empty or misread tree.
    assert {"kvhandoff.events", "kvhandoff.events.coordinator", "kvhandoff.events.codec"} <= set(
        modules_of("events")
    )
    assert {
        "kvhandoff.worker.log.store",
        "kvhandoff.worker.bus",
        "kvhandoff.worker.commands.run",
    } <= set(modules_of("worker"))
    # The users of the bus that once had their own nats-py code.
    assert {
        "kvhandoff.worker.engines",
        "kvhandoff.worker.loadgen.generator",
        "kvhandoff.worker.harness.containers",
        "kvhandoff.worker.commands.engines",
        "kvhandoff.worker.commands.demo",
    } <= set(modules_of("worker"))
    assert source_file("bench.load") is not None
    assert {"kvhandoff.worker.bus.connection", "kvhandoff.worker.bus.pull"} <= set(bus_modules())
    assert any(top(i.module) == "nats" for m in bus_modules() for i in imports_of(m))
    assert any(
        i.module == "kvhandoff.worker.log.store"
        for i in imports_of("kvhandoff.worker.commands.run")
    )


def test_the_core_imports_only_the_standard_library_and_msgspec() -> None:
    allowed = set(sys.stdlib_module_names) | {"msgspec", "kvhandoff.events"}
    bad = [
        f"{imp}: events/ may import only the standard library, msgspec and kvhandoff.events.*"
        for module in modules_of("events")
        for imp in imports_of(module)
        if package(imp.module) not in allowed
    ]
    assert not bad, "\n".join(bad)


# What the core may not import even of the standard library: files, the environment, the
# database, the event loop, and the ways to a process or a socket. Its inputs (and any file's
# contents) reach it from the shell (worker.conformance.vectors reads the conformance vectors).
CORE_MAY_NOT_IMPORT = {
    "asyncio",
    "gzip",
    "io",
    "os",
    "pathlib",
    "shutil",
    "socket",
    "sqlite3",
    "subprocess",
    "tempfile",
}


def test_the_core_does_no_io() -> None:
    bad = [
        f"{imp}: events/ does no IO; read files, the environment or the network in the worker"
        for module in modules_of("events")
        for imp in imports_of(module)
        if top(imp.module) in CORE_MAY_NOT_IMPORT
    ]
    opens = [
        f"{module} calls open (line {node.lineno})"
        for module in modules_of("events")
        if (path := source_file(module)) is not None
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open"
    ]
    assert not bad and not opens, "\n".join([*bad, *opens])


def test_the_core_never_imports_the_worker() -> None:
    bad = list(violations(modules_of("events"), {"kvhandoff.worker", "kvhandoff.client"}))
    assert not bad, "the core must not depend on the IO shell or the client:\n" + "\n".join(bad)


def test_the_client_imports_the_core_and_of_the_worker_only_the_bus() -> None:
    assert {"kvhandoff.client", "kvhandoff.client.engine", "kvhandoff.client.frontend"} <= set(
        modules_of("client")
    )
    allowed = set(sys.stdlib_module_names) | {"msgspec", "kvhandoff.events", "kvhandoff.client"}
    bad = [
        f"{imp}: client/ may import the standard library, msgspec, events.* and, of the "
        f"worker, only {', '.join(sorted(CLIENT_MAY_IMPORT))}"
        for module in modules_of("client")
        for imp in imports_of(module)
        if package(imp.module) not in allowed and not within(imp.module, CLIENT_MAY_IMPORT)
    ]
    assert not bad, "\n".join(bad)


def test_the_bus_is_the_transport_and_nothing_else() -> None:
    bad = list(violations(bus_modules(), BUS_MUST_NOT_IMPORT))
    assert not bad, (
        "worker.bus must not know the tier, the log or the worker's config (the tier's rules "
        "go in worker.tier, built on the bus's generic calls):\n" + "\n".join(bad)
    )


def test_the_log_and_the_bus_never_import_each_other() -> None:
    bad = [
        *violations(
            ["kvhandoff.worker.log.store", "kvhandoff.worker.log.schema"],
            {"kvhandoff.worker.bus", "nats"},
        ),
        *violations(
            bus_modules(),
            {"kvhandoff.worker.log.store", "kvhandoff.worker.log.schema", "aiosqlite"},
        ),
    ]
    assert not bad, "\n".join(bad)


def test_the_mock_engines_and_the_load_generator_use_the_client_not_the_bus() -> None:
    # They are the client's first users: an engine or a frontend needs nothing else.
    users = [m for m in modules_of("worker") if m.startswith("kvhandoff.worker.engines")]
    assert "kvhandoff.worker.engines.host" in users
    # They may name the settings they connect with (plain data), nothing else of the bus.
    settings = "kvhandoff.worker.bus.settings"
    bad = [
        str(imp)
        for module in [*users, "kvhandoff.worker.loadgen.generator"]
        for imp in imports_of(module)
        if within(imp.module, {NATS_SEAM, "nats"}) and imp.module not in {NATS_SEAM, settings}
    ]
    assert not bad, "go through client.Connection:\n" + "\n".join(bad)


# The simulation's patches of nats-py: it imports nats-py's modules to replace their clock and
# randomness for a simulated run (worker.sim.natspy) and to watch what the pulls ask and read
# (worker.sim.pulls), never to talk to NATS.
NATS_PATCHES = {"kvhandoff.worker.sim.natspy", "kvhandoff.worker.sim.pulls"}


def test_only_the_nats_seam_imports_nats() -> None:
    # bench.load drives the worker as a user would; bench.pull and bench.drain set
    # nats-py itself beside the bus as their baseline.
    users = [*modules_of("worker"), *modules_of("client"), "bench.load"]
    bad = [
        f"{imp}: only {NATS_SEAM}.* may import nats; go through worker.bus"
        for module in users
        if not within(module, {NATS_SEAM, *NATS_PATCHES})
        for imp in imports_of(module)
        if top(imp.module) == "nats"
    ]
    assert not bad, "\n".join(bad)


def test_only_the_sim_command_runs_the_simulation() -> None:
    # The simulation runs the tier on a model of NATS; nothing of the product may depend on it.
    sim = "kvhandoff.worker.sim"
    users = [*modules_of("worker"), *modules_of("client"), *modules_of("events")]
    bad = [
        f"{imp}: only the simulation itself and `kvhandoff sim` may import {sim}"
        for module in users
        if not within(module, {sim, "kvhandoff.worker.commands.sim"})
        for imp in imports_of(module)
        if within(imp.module, {sim})
    ]
    assert not bad, "\n".join(bad)
    assert any(within(i.module, {sim}) for i in imports_of("kvhandoff.worker.commands.sim"))


def with_packages(module: str) -> list[str]:
    """What importing `module` runs: a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = module.split(".")
    return [".".join(parts[:depth]) for depth in range(1, len(parts) + 1)]


def path_to(start: str, target: str) -> list[Import] | None:
    """The chain of runtime imports by which `start` reaches `target`, following ours only."""
    frontier: list[tuple[str, list[Import]]] = [(name, []) for name in with_packages(start)]
    seen = {name for name, _ in frontier}
    while frontier:
        module, chain = frontier.pop(0)
        for imp in imports_of(module):
            if imp.type_checking_only:
                continue
            if top(imp.module) == target:
                return [*chain, imp]
            if top(imp.module) != "kvhandoff":
                continue
            for name in with_packages(imp.module):
                if name not in seen and source_file(name) is not None:
                    seen.add(name)
                    frontier.append((name, [*chain, imp]))
    return None


def require_source(module: str) -> None:
    if source_file(module) is None:
        pytest.fail(f"{module} does not exist: every offline log command must")


@pytest.mark.parametrize("module", OFFLINE)
def test_offline_modules_never_reach_nats_through_any_import(module: str) -> None:
    require_source(module)
    chain = path_to(module, "nats")
    if chain is not None:
        pytest.fail(f"{module} reaches nats:\n  " + "\n  ".join(map(str, chain)))


# Prints which of the packages given (a top-level name, or a dotted one such as
# kvhandoff.worker.tier) a fresh interpreter holds after importing the modules given.
_PROBE = """
import importlib, json, sys
modules, packages = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for module in modules:
    importlib.import_module(module)
print(json.dumps(sorted(
    p for p in packages if any(m == p or m.startswith(p + ".") for m in sys.modules)
)))
"""


def loaded_drivers(modules: list[str], drivers: set[str]) -> list[str]:
    """Those of `drivers` (packages) that a fresh interpreter has loaded after importing
    `modules`."""
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules), json.dumps(sorted(drivers))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0:
        pytest.fail(f"importing {', '.join(modules)} failed:\n{probe.stderr}")
    found: list[str] = json.loads(probe.stdout)
    return found


def assert_load_no(drivers: set[str], modules: list[str]) -> None:
    """Import all of `modules` in one interpreter (what each loads alone is a subset of that);
    only if a driver shows up, import them one by one to name the culprits."""
    if not loaded_drivers(modules, drivers):
        return
    culprits = {m: found for m in modules if (found := loaded_drivers([m], drivers))}
    lines = [f"importing {m} loads {', '.join(found)}" for m, found in culprits.items()]
    pytest.fail("\n".join(lines or [f"importing {', '.join(modules)} together loads a driver"]))


def test_importing_the_offline_modules_leaves_nats_unloaded() -> None:
    present = [m for m in OFFLINE if source_file(m) is not None]
    assert_load_no({"nats"}, present)
    missing = sorted(set(OFFLINE) - set(present))
    assert not missing, f"missing offline modules: {', '.join(missing)}"


def test_importing_an_engine_loads_the_transport_alone() -> None:
    # What an engine or a frontend drags in: the client, the core and the transport, and
    # none of the tier's rules, the worker's log (nor its aiosqlite) or the worker's config.
    # (sqlite3 itself is the engine's own outcome log's, client.outcomes.)
    unwanted = [
        "kvhandoff.worker.tier",
        "kvhandoff.worker.log",
        "kvhandoff.worker.config",
        "aiosqlite",
    ]
    client = ["kvhandoff.client", *modules_of("client")]
    loaded = loaded_drivers(client, set(unwanted))
    assert not loaded, f"importing the client loads {', '.join(loaded)}"


def test_importing_the_core_loads_no_driver() -> None:
    assert_load_no({"nats", "aiosqlite", "sqlite3"}, ["kvhandoff.events"])
    assert_load_no({"nats", "aiosqlite", "sqlite3"}, modules_of("events"))


def test_the_benches_are_programs_that_import_no_tests() -> None:
    benches = modules_of("bench")
    assert {"bench.drain", "bench.hops", "bench.log_size"} <= set(benches)
    bad = [str(imp) for imp in violations(benches, {"tests"})]
    assert not bad, "a bench imports test code:\n" + "\n".join(bad)


def test_everything_loads_under_the_one_kvhandoff_name() -> None:
    # A downstream project has its own `worker` or `events` very likely: ours must never
    # be loaded under those names, whatever imports what.
    ours = [
        m
        for folder in FOLDERS
        for m in modules_of(folder)
        if m != "kvhandoff.worker.harness.containers"
    ]
    assert_load_no(set(FOLDERS), ours)


def test_the_planner_depends_on_no_io() -> None:
    # worker.tier.planner is the partition's batch step without IO (its docstring): what it
    # shares with the store (`Batch`, `Loaded`) lives in worker.log.rows, and it reaches no
    # driver through any import.
    planner = "kvhandoff.worker.tier.planner"
    bad = list(violations([planner], {"kvhandoff.worker.log.store", "kvhandoff.worker.bus"}))
    assert not bad, "the planner must not depend on the store or the bus:\n" + "\n".join(bad)
    for driver in ("nats", "aiosqlite", "sqlite3"):
        chain = path_to(planner, driver)
        assert chain is None, f"{planner} reaches {driver}:\n  " + "\n  ".join(map(str, chain))
