"""What the code reads, and what the configuration page documents: RINGSERVE_* variables and
command-line flags. Pure file reading, no imports of the package's modules beyond its config.

- Variables: every ``RINGSERVE_NAME`` written in the package's source, and ``RINGSERVE_<FIELD>``
  for every field of the configs that ``from_env()`` reads (``_from_env`` builds those names from
  the field names, so a grep alone would miss them).
- Flags: every option string (``-H``, ``--min-np``) passed to an ``add_argument`` call in the
  package's source, found with ``ast``, with the file that declares it.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ringserve"
CONFIG_PAGE = ROOT / "docs" / "guide" / "configuration.md"
VARIABLE = re.compile(r"\bRINGSERVE_[A-Z][A-Z0-9_]*[A-Z0-9]\b")


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts and "testing" not in p.parts)


def variables_read() -> set[str]:
    """Every RINGSERVE_* variable the package reads."""
    from ringserve.config import CoordinatorConfig, PSClientConfig, ShardConfig, WorkerConfig

    names = {m for p in _sources() for m in VARIABLE.findall(p.read_text())}
    for cls in (WorkerConfig, CoordinatorConfig, ShardConfig, PSClientConfig):
        names |= {f"RINGSERVE_{f.name.upper()}" for f in dataclasses.fields(cls)}
    return names


def flags_read() -> dict[str, set[str]]:
    """Every command-line option string of the package, by the file that declares it."""
    flags: dict[str, set[str]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"):
                        flags.setdefault(str(path.relative_to(ROOT)), set()).add(arg.value)
    return flags


def documented(page: Path = CONFIG_PAGE) -> tuple[set[str], set[str]]:
    """The variables and the flags a page names in code spans (`RINGSERVE_X`, `--flag`, `-H`)."""
    spans = re.findall(r"`([^`\n]+)`", page.read_text())
    variables = {m for s in spans for m in VARIABLE.findall(s)}
    flags = {s for s in spans if re.fullmatch(r"--?[A-Za-z][A-Za-z0-9-]*", s)}
    return variables, flags


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))
    print(" ".join(sorted(variables_read())))
    for where, found in sorted(flags_read().items()):
        print(where, " ".join(sorted(found)))
