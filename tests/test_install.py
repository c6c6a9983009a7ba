"""kvhandoff as another project gets it: installed (not from the checkout), under the one import
name `kvhandoff`, beside that project's own `worker` and `events` packages; and the example in
`docs/tier.md` for such a project's integration tests is `mypy --strict` clean.

The wheel is built from a copy of the checkout (`pip wheel`, as `pip install <checkout>` or a
git URL builds it) and installed without its dependencies into a fresh venv, which borrows them
from this one: what is checked is the package's own contents and names, not PyPI.
"""

from __future__ import annotations

import re
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_COPY_IGNORES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
)

_THEIR_WORKER = '"""The downstream project\'s own worker."""\nNAME = "their worker"\n'
_THEIR_EVENTS = '"""The downstream project\'s own events."""\nNAME = "their events"\n'
_THEIR_TEST = """
import events
import worker
from kvhandoff.client import Frontend
from kvhandoff.events.messages import EngineType, StartHandoff
from kvhandoff.worker.harness.containers import KvhandoffWorkerContainer, NatsContainer

import kvhandoff.worker.harness.containers as testing

assert worker.NAME == "their worker" and events.NAME == "their events"
assert "site-packages" in testing.__file__, testing.__file__  # the wheel, not a checkout
assert KvhandoffWorkerContainer.__module__ == "kvhandoff.worker.harness.containers"
assert StartHandoff.__module__ == "kvhandoff.events.messages"
print("ok", EngineType.VLLM.value, Frontend.__name__, NatsContainer.__name__)
"""


def _run(*command: str | Path, cwd: Path) -> str:
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_a_project_with_its_own_worker_and_events_installs_and_uses_kvhandoff(
    tmp_path: Path,
) -> None:
    source = tmp_path / "kvhandoff-src"
    shutil.copytree(ROOT, source, symlinks=True, ignore=_COPY_IGNORES)
    wheels = tmp_path / "wheels"
    _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, source, cwd=tmp_path
    )
    [wheel] = wheels.glob("kvhandoff-*.whl")

    project = tmp_path / "downstream"
    for package, text in (("worker", _THEIR_WORKER), ("events", _THEIR_EVENTS)):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(text)
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--no-deps", wheel, cwd=project)
    # The dependencies (msgspec, nats-py, testcontainers, ...) from this environment, after
    # the venv's own site-packages, which hold kvhandoff.
    their_site = Path(
        _run(python, "-c", "import site; print(site.getsitepackages()[0])", cwd=project).strip()
    )
    (their_site / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    (project / "test_it.py").write_text(_THEIR_TEST)
    assert _run(python, "test_it.py", cwd=project).startswith("ok vllm Frontend NatsContainer")
    assert "usage: kvhandoff" in _run(env / "bin" / "kvhandoff", "--help", cwd=project)


def test_the_docs_integration_test_example_is_mypy_strict_clean(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "tier.md").read_text()
    section = page[page.index("## In your own integration tests") :]
    [example] = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:1]
    assert "from kvhandoff.worker.harness.containers import" in example
    path = tmp_path / "docs_example.py"
    path.write_text(example)
    # From the checkout, so that mypy finds kvhandoff/ (an editable install is an import hook,
    # which mypy does not follow); with the project's mypy settings, strict among them.
    _run(sys.executable, "-m", "mypy", "--strict", "--no-incremental", path, cwd=ROOT)
