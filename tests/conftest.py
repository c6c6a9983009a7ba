"""How the suite is spread over pytest-xdist's workers (`-n 2 --dist loadfile`, pyproject's
addopts): most of its time is waiting on real processes (servers electing leaders, priority
timeouts, ack waits), so two workers nearly halve the run on two cores. Each test file goes to
one worker whole, so that a module's fixtures (a cluster, the plants' campaign) are made once.
The container tests of two files may run at once: deploy/build-images.sh builds one at a time,
and each worker removes only its own containers (testcontainers' session label).

What a test reports for the end of the run (`record_property(SUMMARY, text)`: the plants' table,
the images' build time) is printed in the run's terminal summary, since what a worker prints
is not shown.
"""

from __future__ import annotations

import pytest

SUMMARY = "summary"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for outcome in ("passed", "failed"):
        for report in terminalreporter.getreports(outcome):
            for name, text in report.user_properties:
                if name == SUMMARY:
                    terminalreporter.write_line(str(text))
