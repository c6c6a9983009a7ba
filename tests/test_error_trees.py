"""Each package's exception tree is drawn in its errors module's docstring; the drawing and the
classes must agree: every class drawn exists under the parent it is drawn under, and every
exception class of the package is drawn."""

from __future__ import annotations

import inspect
import re
from types import ModuleType

import pytest

import kvhandoff.events.errors
import kvhandoff.worker.errors
import kvhandoff.worker.harness.containers

_ROOT = re.compile(r"( *)(\w+Error)")
_BRANCH = re.compile(r" *[│ ]*[├└]── (\w+)")


def drawn(module: ModuleType) -> dict[str, str | None]:
    """Each class name drawn in the module's docstring, with the name it is drawn under."""
    parents: dict[str, str | None] = {}
    path: list[str] = []  # the names drawn at each depth above the current line
    root_column = 0
    for line in (module.__doc__ or "").splitlines():
        if not path:
            if (root := _ROOT.fullmatch(line)) is not None:
                root_column, path = len(root.group(1)), [root.group(2)]
                parents[root.group(2)] = None
            continue
        if (branch := _BRANCH.match(line)) is None:
            continue  # a description's second line
        column = min(line.index(c) for c in "├└" if c in line)
        del path[(column - root_column) // 4 + 1 :]
        parents[branch.group(1)] = path[-1]
        path.append(branch.group(1))
    return parents


def defined(module: ModuleType, root: type[Exception]) -> dict[str, type[Exception]]:
    return {
        name: cls
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, root) and cls.__module__ == module.__name__
    }


@pytest.mark.parametrize(
    ("module", "root", "elsewhere"),
    [
        (kvhandoff.events.errors, kvhandoff.events.errors.HandoffError, []),
        (
            kvhandoff.worker.errors,
            kvhandoff.worker.errors.WorkerError,
            [kvhandoff.worker.harness.containers],
        ),
    ],
    ids=["events", "worker"],
)
def test_the_drawn_tree_is_the_class_tree(
    module: ModuleType, root: type[Exception], elsewhere: list[ModuleType]
) -> None:
    classes = defined(module, root)
    for other in elsewhere:  # drawn here, defined beside the code that raises it
        classes.update(defined(other, root))
    tree = drawn(module)
    assert set(tree) == set(classes)
    for name, parent in tree.items():
        base = classes[name].__bases__[0]
        assert (None if parent is None else classes[parent]) is (
            None if base is Exception else base
        ), name
