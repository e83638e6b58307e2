"""The module map: every module of ringserve/, with its layer and the first sentence of its docstring.

    python scripts/module_map.py           # prints the map
    python scripts/module_map.py --write   # writes it into CONTRIBUTING.md and docs/internals.md
    python scripts/module_map.py --check   # exits 1 if either file's map differs from the tree

The layers are tests/unit/test_import_layers.py's (its ``LAYERS`` table is the rule); a module
belongs to the layer of its longest matching prefix. Each file holds the map between two markers
(``BEGIN`` and ``END`` below), and nothing between them is written by hand:
tests/unit/test_module_map.py fails when a module is added, moved or removed, or its docstring's
first sentence changes, until the map is written again.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [ROOT / "CONTRIBUTING.md", ROOT / "docs" / "internals.md"]
BEGIN = "<!-- the module map: written by scripts/module_map.py --write; do not edit by hand -->"
END = "<!-- end of the module map -->"
WIDTH = 110  # a summary longer than this is cut at a word


def layers() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("import_layers_for_map", ROOT / "tests" / "unit" / "test_import_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def summary(path: Path) -> str:
    """The first sentence of the module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    cut = text.find(". ")
    text = text[: cut + 1] if cut >= 0 else text
    if len(text) > WIDTH:
        text = text[:WIDTH].rsplit(" ", 1)[0] + " ..."
    return text.replace("|", "\\|")


def render() -> str:
    table = layers()
    found = table.modules()
    by_layer: dict[str, list[str]] = {name: [] for name in table.LAYERS}
    for module in sorted(found):
        if module.startswith("ringserve._proto"):
            continue
        by_layer[table.layer_of(module)].append(module)
    lines = [BEGIN, ""]
    for name, modules in by_layer.items():
        if not modules:
            continue
        below = ", ".join(table.LAYERS[name].below) or "nothing"
        lines += [f"**{name}** (stands on: {below})", "", "| module | what it is |", "|---|---|"]
        for module in modules:
            lines.append(f"| `{module}` | {summary(found[module]) or '-'} |")
        lines.append("")
    lines += ["`ringserve._proto` (the wire contract) is generated from `protos/` by scripts/generate_protos.py.", "", END]
    return "\n".join(lines)


def rewritten(text: str, block: str, target: Path) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{target.relative_to(ROOT)} has no module map markers ({BEGIN!r} ... {END!r})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + block + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the map into " + ", ".join(t.name for t in TARGETS))
    parser.add_argument("--check", action="store_true", help="exit 1 if a file's map differs from the tree")
    args = parser.parse_args(argv)
    block = render()
    if not (args.write or args.check):
        print(block)
        return 0
    stale = []
    for target in TARGETS:
        text = target.read_text()
        new = rewritten(text, block, target)
        if new != text:
            if args.write:
                target.write_text(new)
                print(f"wrote the module map into {target.relative_to(ROOT)}")
            else:
                stale.append(str(target.relative_to(ROOT)))
    if stale:
        print(f"the module map is out of date in {', '.join(stale)}: run python scripts/module_map.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
