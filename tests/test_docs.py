"""The README and `docs/` stay true: every relative link resolves (to a file, and for `#anchor`
links to a heading of that file, slugged as GitHub slugs it), and every `kvhandoff …` command
line in a fenced code block parses with the real CLI parser.

A command line may be a usage synopsis (`[--flag VALUE]`, `[--a N | --b R]`, `PATH|-`): its
brackets are opened and the first alternative taken, and upper-case placeholders (`URL`,
`ENGINE_ID`, `$DB`) get sample values. Whatever still fails to parse is a doc to fix."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvhandoff.worker.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```+|~~~+)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_COMMAND = re.compile(r"\s*(?:\$\s+)?(?:\w+=\S*\s+)*(kvhandoff(?:\s.*)?)$")

# Placeholders the docs use, and a value each parses with.
_SAMPLES = {
    "URL": "nats://127.0.0.1:4222",
    "PATH": "report.json",
    "FILE": "handoff.jsonl",
    "DIR": "data",
    "DB": "kvhandoff.db",
    "$DB": "kvhandoff.db",
    "LOG": "kvhandoff.db",
    "ID": "vllm-prefill-0",
    "ENGINE_ID": "vllm-prefill-0",
    "HANDOFF": "14674c1d",
    "DURATION": "30s",
    "P": "4",
    "N": "3",
    "C": "16",
    "R": "100",
    "S": "2",
    "F": "0.1",
    "MS": "100",
}


def _prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """The lines outside fenced code blocks, and those inside them."""
    prose: list[str] = []
    code: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        marker = _FENCE.match(line.strip())
        if fence is None and marker:
            fence = marker.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            prose.append(line)
        else:
            code.append(line)
    return prose, code


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    prose, _ = _prose_and_code(path.read_text())
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for line in prose:
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match is None:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    prose, _ = _prose_and_code(path.read_text())
    text = _INLINE_CODE.sub("", "\n".join(prose))
    return [
        target
        for target in _LINK.findall(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def _open_synopsis(line: str) -> str:
    """`[--a N | --b R]` becomes `--a N`, `[--x]` becomes `--x`, innermost groups first."""
    group = re.compile(r"\[([^\[\]]*)\]")
    while group.search(line):
        line = group.sub(lambda m: m.group(1).split("|")[0].strip(), line)
    return re.sub(r"(\S)\|-", r"\1", line)  # PATH|- : a value or stdout


def _command_lines() -> list[tuple[str, str]]:
    """(page, command line) for every `kvhandoff …` line in a fenced block."""
    found: list[tuple[str, str]] = []
    for page in PAGES:
        _, code = _prose_and_code(page.read_text())
        joined = "\n".join(code).replace("\\\n", " ")
        for line in joined.splitlines():
            for segment in re.split(r"&&|\|\||;|\s\|\s", _open_synopsis(line)):
                # A prompt and environment assignments may come first; output lines do not match.
                match = _COMMAND.match(segment)
                if match is not None:
                    found.append((page.relative_to(ROOT).as_posix(), match.group(1).strip()))
    return found


def _sample(word: str) -> str:
    return _SAMPLES.get(word.rstrip("…"), word)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (resolved.is_dir() or anchor not in _anchors(resolved)):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, broken


COMMANDS = _command_lines()


def test_the_docs_show_commands() -> None:
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "docs/cli.md", "docs/debugging.md", "docs/tier.md"} <= pages
    assert any(line == "kvhandoff demo --cluster" for _, line in COMMANDS)


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_every_command_line_parses(page: str, line: str) -> None:
    words = [_sample(word) for word in shlex.split(line, comments=True)[1:]]
    try:
        build_parser(words).parse_args(words)
    except SystemExit as exc:
        pytest.fail(f"{page}: `{line}` does not parse (exit {exc.code})")


def test_a_broken_link_and_a_wrong_flag_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere) `[x](no.md)`\n")
    assert _links(page) == ["#title", "missing.md", "#nowhere"]
    assert _anchors(page) == {"title"}
    with pytest.raises(SystemExit):
        build_parser(["list", "--no-such-flag"]).parse_args(["list", "--no-such-flag"])
