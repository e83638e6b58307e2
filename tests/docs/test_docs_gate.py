"""The docs gate cannot go vacuous: the strict build that scripts/docs.sh runs fails on a planted
bad docstring, and passes on the same site with the docstring fixed; the install page lists every
extra; the reference shows no reST literal markers.

An unpinned toolchain, or a ``--quiet`` beside ``--strict`` (it hid the warnings that strict mode
counts), let CI pass over four griffe warnings (issue 43).
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)

PLANTED = '''"""A module planted by the docs gate's test."""


def scaled(x: float, factor: float = 2.0) -> float:
    """x times a factor.

    Args:
        x: the value.
        {second}: the factor.
    """
    return x * factor
'''


def build_command() -> list[str]:
    """The mkdocs command scripts/docs.sh runs."""
    lines = [line.strip() for line in (ROOT / "scripts" / "docs.sh").read_text().splitlines()]
    found = [line for line in lines if re.match(r"^\S*mkdocs build\b", line)]
    assert len(found) == 1, found
    return shlex.split(found[0])


def test_the_docs_script_builds_strict_and_shows_what_strict_counts() -> None:
    command = build_command()
    assert "--strict" in command
    assert not {"--quiet", "-q"} & set(command), "--quiet hides the warnings that --strict counts"


def site(tmp_path: Path, second: str) -> Path:
    """A one-page site with the project's theme, plugins and extensions, documenting the planted module."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(tmp_path)]
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "docs" / "index.md").write_text("# Planted\n\n::: planted\n")
    (tmp_path / "planted.py").write_text(PLANTED.format(second=second))
    config.update(docs_dir=str(tmp_path / "docs"), site_dir=str(tmp_path / "site"), nav=[{"Planted": "index.md"}])
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def build(config: Path) -> subprocess.CompletedProcess[str]:
    command = build_command()
    command[0] = str(ROOT / command[0]) if command[0].startswith(".venv") else command[0]
    return subprocess.run([*command, "-f", str(config)], capture_output=True, text=True, timeout=150,
                          cwd=config.parent, env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"})


def test_the_strict_build_fails_on_a_planted_bad_docstring_and_passes_once_it_is_fixed(tmp_path: Path) -> None:
    bad = build(site(tmp_path / "bad", "scale"))
    assert bad.returncode != 0, bad.stderr[-3000:]
    assert "Parameter 'scale' does not appear in the function signature" in bad.stderr, bad.stderr[-3000:]
    good = build(site(tmp_path / "good", "factor"))
    assert good.returncode == 0, good.stderr[-3000:]


def test_the_install_page_lists_every_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    listed = set(re.findall(r"^\| `([a-z-]+)` \|", (ROOT / "docs" / "start" / "install.md").read_text(), re.M))
    assert set(extras) == listed, f"missing {sorted(set(extras) - listed)}, stale {sorted(listed - set(extras))}"


def docstrings() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted((ROOT / "ringserve").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False)
                if text:
                    found.append((str(path.relative_to(ROOT)), getattr(node, "lineno", 1), text))
    return found


def test_no_docstring_uses_a_rest_literal_block() -> None:
    # Markdown renders "Example::" as text with two colons, and the block after it unhighlighted.
    marked = [f"{path}:{line}" for path, line, text in docstrings() if re.search(r"::\s*$", text, re.M)]
    assert not marked, marked
