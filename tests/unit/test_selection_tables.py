"""What ``auto`` picks for an allreduce, as docs/design/algorithms.md's tables say: each table is
checked against selection.choose, so a change of the model cannot leave the page behind. Where they
differ the failure prints the table as the model now has it, to paste into the page. Pure."""

from __future__ import annotations

import pathlib

import pytest

from ringserve import selection

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "design" / "algorithms.md"
CHUNK = 2 << 20  # RINGSERVE_CHUNK_BYTES's default, as the page says
SHORT = {selection.RING: "ring", selection.RECURSIVE_DOUBLING: "RD", selection.HALVING_DOUBLING: "HD",
         selection.TREE: "tree", selection.RING2D: "2D"}
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}
# Each table's first words on the page, and the class whose figures it is planned by.
TABLES = {"WAN (": selection.WAN, "LAN (": selection.LAN, "One host (": selection.HOST}


def tables() -> dict[str, list[list[str]]]:
    """The page's tables of what auto picks: the class's, as rows of cells (the header first)."""
    lines = PAGE.read_text().splitlines()
    found: dict[str, list[list[str]]] = {}
    for i, line in enumerate(lines):
        for start, link_class in TABLES.items():
            if line.startswith(start):
                rows: list[list[str]] = []
                for row in lines[i + 1:]:  # the heading's sentence may wrap: the table is the next one
                    if not row.startswith("|"):
                        if rows:
                            break
                        continue
                    if not row.startswith("| ---"):
                        rows.append([cell.strip() for cell in row.strip("|").split("|")])
                found[link_class] = rows
    return found


def size_of(label: str) -> int:
    number, unit = label.split()
    return int(number) * UNITS[unit]


def expected(link_class: str, header: list[str], worlds: list[int]) -> str:
    links = selection.CLASS_LINKS[link_class]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for n in worlds:
        cells = [SHORT[selection.choose("auto", "allreduce", size_of(h), n, links, CHUNK).algorithm] for h in header[1:]]
        out.append("| " + " | ".join([str(n), *cells]) + " |")
    return "\n".join(out)


@pytest.mark.parametrize("link_class", [selection.WAN, selection.LAN, selection.HOST])
def test_the_pages_table_of_what_auto_picks_is_what_the_model_picks(link_class: str) -> None:
    found = tables()
    assert link_class in found, f"docs/design/algorithms.md has no table for the class {link_class!r}."
    header, *rows = found[link_class]
    worlds = [int(row[0]) for row in rows]
    page = "\n".join(["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |",
                      *("| " + " | ".join(row) + " |" for row in rows)])
    assert page == expected(link_class, header, worlds), (
        f"The {link_class} table of docs/design/algorithms.md is not what auto picks; the model's:\n"
        f"{expected(link_class, header, worlds)}")
