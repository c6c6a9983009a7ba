"""A plant that copies a function of the tier differs from it only in its planted lines.

Most plants (worker.sim.plants) wrap the function they break, or break a method small enough to
be only the step they change. Two copy a function whole, where a narrower seam would bend the
tier's code for the plant: `append-without-cas` (`Publishing.append_expecting`: one header
less would need a method of its own) and `publish-before-append`
(`PartitionOwner._act_after_append`: the change is the order of its two steps). A copy drifts
silently when its original changes, and a plant that no longer matches the tier tests a bug
nobody could write. So each copy is compared with the original it replaces, both normalised
(parsed and unparsed: comments, docstrings and annotations dropped; a name the plants reach
through a module of the tier, `bus_publish._ROLLUP`, read as the original reads it, `_ROLLUP`),
line by line: the lines only the original has and those only the copy has must be exactly the
plant's declared change. A change to the original fails here until the copy follows it.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
from dataclasses import dataclass
from types import ModuleType

import pytest

from kvhandoff.worker.sim import plants


@dataclass(frozen=True)
class Copy:
    """A plant whose variant is a copy, and its change: lines (stripped) as normalised."""

    plant: str
    removed: tuple[str, ...]  # only in the original
    added: tuple[str, ...]  # only in the copy


COPIES = (
    Copy(
        "append-without-cas",
        removed=("headers = {'Nats-Msg-Id': new_id(), _EXPECTED_LAST_SUBJECT_SEQ: str(last_seq)}",),
        added=("headers = {'Nats-Msg-Id': new_id()}", "planting.hit()"),
    ),
    Copy(
        "publish-before-append",
        removed=(
            "try:",
            "await self._steps.act(fresh)",
            "except BusError as exc:",
            "raise BusError(f'inputs {fresh[0].stream_seq}..{fresh[-1].stream_seq} are appended "
            "(applied), but acting on them failed ({exc}); claimed must act on them again') "
            "from exc",
        ),
        added=(
            "if not append.done():",
            "planting.hit()",
            "await self._steps.act(fresh)",
        ),
    ),
)

# The tier's modules as worker.sim.plants imports them: `alias.name` there is `name` in them.
_TIER_MODULES = frozenset(
    alias
    for alias, value in vars(plants).items()
    if isinstance(value, ModuleType) and value.__name__.startswith("kvhandoff.worker.")
)


class _Normalise(ast.NodeTransformer):
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return self._function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
        return self._function(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        node.returns = None
        for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
            arg.annotation = None
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            node.body = body[1:] or [ast.Pass()]  # the docstring
        self.generic_visit(node)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if isinstance(node.value, ast.Name) and node.value.id in _TIER_MODULES:
            return ast.copy_location(ast.Name(node.attr, ast.Load()), node)
        return self.generic_visit(node)


def _lines(source: str) -> list[str]:
    tree = ast.parse(textwrap.dedent(source))
    return ast.unparse(_Normalise().visit(tree)).splitlines()


def _sources(plant: plants.Plant) -> tuple[str, str]:
    """The source of the function the plant replaces, and of its copy."""
    original = vars(plant.target)[plant.attribute]
    copy = plant.variant(original, plants.Planting(plant))
    return inspect.getsource(original), inspect.getsource(copy)


def _change(original: str, copy: str) -> tuple[list[str], list[str]]:
    """The lines only `original` has, and those only `copy` has (normalised, stripped)."""
    removed, added = [], []
    for line in difflib.ndiff(_lines(original), _lines(copy)):
        if line.startswith("- "):
            removed.append(line[2:].strip())
        elif line.startswith("+ "):
            added.append(line[2:].strip())
    return removed, added


@pytest.mark.parametrize("copy", COPIES, ids=lambda copy: copy.plant)
def test_copy_differs_from_its_original_only_where_planted(copy: Copy) -> None:
    removed, added = _change(*_sources(plants.PLANTS[copy.plant]))
    assert (removed, added) == (list(copy.removed), list(copy.added)), (
        f"{copy.plant}: its copy and the original it replaces differ elsewhere than in the "
        "planted lines; the original changed: make the copy follow it (and its `Copy` here)"
    )


def test_a_drifted_original_is_caught() -> None:
    """The real original with a line added, as a later change to it might: the comparison
    finds the line, so the copy made before it fails the test above."""
    original, copy = _sources(plants.PLANTS["append-without-cas"])
    anchor = "        what = "
    assert original.count(anchor) == 1
    drifted = original.replace(anchor, '        headers["Nats-TTL"] = "1h"\n' + anchor)
    removed, added = _change(drifted, copy)
    assert "headers['Nats-TTL'] = '1h'" in removed
    assert (removed, added) != _change(original, copy)
