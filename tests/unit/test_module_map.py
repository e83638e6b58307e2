"""The module map in CONTRIBUTING.md and docs/internals.md is the tree's: every module of ringserve/,
with its layer (tests/unit/test_import_layers.py's table) and its docstring's first sentence, as
scripts/module_map.py writes it. A module added, moved or removed fails this until the map is
written again (``python scripts/module_map.py --write``)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]


def module_map() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("module_map", ROOT / "scripts" / "module_map.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_contributing_and_the_internals_page_hold_the_map_of_the_tree_as_it_is() -> None:
    assert module_map().main(["--check"]) == 0, "run: python scripts/module_map.py --write"


def test_the_map_lists_every_module_once_with_its_layer() -> None:
    mapping = module_map()
    block = mapping.render()
    listed = [line.split("`")[1] for line in block.splitlines() if line.startswith("| `")]
    tree = [m for m in mapping.layers().modules() if not m.startswith("ringserve._proto")]
    assert sorted(listed) == sorted(tree)
    assert "**parameter servers** (stands on: ground)" in block
    assert "| `ringserve.worker.dataplane.lanes.tcp.seal` |" in block
