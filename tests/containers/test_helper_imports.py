"""`worker.harness.containers` needs testcontainers, which only the `[dev]` extra installs: nothing
else in the package may load it, or `import worker` and the `kvhandoff` command would need it
too."""

from __future__ import annotations

from tests.test_layering import loaded_drivers, modules_of


def test_nothing_but_worker_testing_loads_testcontainers() -> None:
    modules = [
        module for module in modules_of("worker") if module != "kvhandoff.worker.harness.containers"
    ]
    assert "kvhandoff.worker.cli" in modules and "kvhandoff.worker.commands.run" in modules
    assert loaded_drivers(modules, {"testcontainers", "docker"}) == []


def test_worker_testing_itself_loads_testcontainers() -> None:
    # Guards the test above against a probe that never sees the package.
    assert loaded_drivers(
        ["kvhandoff.worker.harness.containers"], {"testcontainers", "docker"}
    ) == [
        "docker",
        "testcontainers",
    ]
