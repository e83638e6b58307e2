"""The Python code blocks of the docs, and how each one is tested. Pure: reads markdown, runs nothing.

Every fenced block whose language is ``python`` (or ``py``) is one of two kinds, told by an HTML
comment on the line before its fence, or before one blank line (invisible on the rendered page):

- ``<!-- not runnable: REASON -->``: not run, and the reason must be given (a fragment that needs a
  model of yours, a cluster of hosts, Spark, a GPU...);
- anything else runs in the test suite (tests/docs/test_code_blocks.py), as a script of its own in
  a fresh process, and must exit 0. ``<!-- run: KEY=VALUE ... -->`` says how:

  - ``world=N``: under ``ringserve run -np N`` (a real coordinator and N real workers on loopback);
  - ``ps=S``: with ``world``, under ``ringserve run --ps S -np N`` (S parameter-server shards too);
  - ``prelude=NAME``: the prelude NAME of tests/docs/preludes.py runs first (the arrays or the model
    a fragment names without making them);
  - ``timeout=S``: seconds it may take (default 90).

``python tests/docs/codeblocks.py`` prints the count of each kind, page by page.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\n]*?)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*(?P<kind>run|not runnable)\s*:\s*(?P<rest>.*?)\s*-->\s*$")
PYTHON = {"python", "py", "python3"}
KEYS = {"world", "ps", "prelude", "timeout"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    runnable: bool
    reason: str = ""  # why it is not runnable
    options: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{_shown(self.path)}:{self.line}"


class DirectiveError(ValueError):
    """A directive that cannot be read: names the file, the line and the fault."""


def blocks(path: Path) -> list[Block]:
    """The Python blocks of one markdown file, in order."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, info = m.group("fence"), m.group("indent"), m.group("info")
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence) and lines[end].strip().strip(fence[0]) == ""):
            end += 1
        language = info.split()[0].lower() if info else ""
        if language in PYTHON:
            body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
            found.append(_block(path, i, textwrap.dedent(body) + "\n", _line_before(lines, i)))
        i = end + 1
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _line_before(lines: list[str], index: int) -> str:
    """The line that may hold a block's directive: the one before its fence, or before one blank line."""
    if index >= 1 and lines[index - 1].strip():
        return lines[index - 1]
    if index >= 2 and not lines[index - 1].strip():
        return lines[index - 2]
    return ""


def _block(path: Path, index: int, code: str, before: str) -> Block:
    where = f"{_shown(path)}:{index + 1}"
    d = DIRECTIVE.match(before)
    if d is None:
        if "<!--" in before:
            raise DirectiveError(f"{where}: the comment before this block is not a directive: {before.strip()!r}")
        return Block(path, index + 1, code, runnable=True)
    if d.group("kind") == "not runnable":
        if not d.group("rest"):
            raise DirectiveError(f"{where}: 'not runnable' needs a reason")
        return Block(path, index + 1, code, runnable=False, reason=d.group("rest"))
    options = dict(part.split("=", 1) for part in d.group("rest").split() if "=" in part)
    unknown = set(options) - KEYS
    bare = [part for part in d.group("rest").split() if "=" not in part]
    if unknown or bare:
        raise DirectiveError(f"{where}: unknown run options {sorted(unknown) + bare}; known: {sorted(KEYS)}")
    return Block(path, index + 1, code, runnable=True, options=options)


def pages() -> list[Path]:
    """Every markdown page the docs are built from, and the README."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


if __name__ == "__main__":
    every = all_blocks()
    for page in pages():
        mine = [b for b in every if b.path == page]
        if mine:
            print(f"{page.relative_to(ROOT)}: {sum(b.runnable for b in mine)} run, "
                  f"{sum(not b.runnable for b in mine)} not runnable")
    print(f"total: {sum(b.runnable for b in every)} run in tests, {sum(not b.runnable for b in every)} marked not runnable")
