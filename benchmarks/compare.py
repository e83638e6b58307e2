"""allreduce.py on two versions of ringserve, interleaved in one run: a git ref against this tree.

    python benchmarks/compare.py --before main --rounds 3 -- --worlds 2 4 --sizes 1M 64M

Each round runs allreduce.py from the ``--before`` ref (exported with ``git archive`` into a
temporary directory) and then from this working tree, so both see the same machine load, which on
a small shared machine swings more than any change under test. It prints, for each world and size,
the median and the range over the rounds of each ratio to gloo (gloo runs in every round, next to
each version), before and after, and the median over the rounds of after / before within a round
(paired, so a swing of the load between rounds cancels out). The same for ringserve's own times.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RATIOS = ("busbw / gloo", "stream-only busbw / gloo")
TIMES = ("ringserve ms/op", "stream-only ms/op")


def export(ref: str, into: pathlib.Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def run(tree: pathlib.Path, args: list[str]) -> dict[tuple[str, str], dict[str, float]]:
    """One allreduce.py run from ``tree``: its table, by (world, size)."""
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / "allreduce.py"), *args], check=True,
                         capture_output=True, text=True, cwd=tree, env={"PYTHONPATH": str(tree), **_env()}).stdout
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines() if line.startswith("|")]
    head, body = rows[0], [r for r in rows[2:]]
    table = {}
    for r in body:
        cells = dict(zip(head, r, strict=True))
        table[(cells["world"], cells["size"])] = {k: float(cells[k]) for k in RATIOS + TIMES
                                                  if k in cells and cells[k] != "-"}
    return table


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="main", help="the git ref to compare this tree with")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("args", nargs="*", help="allreduce.py's arguments (after --)")
    opts = p.parse_args()
    results: dict[str, list[dict[tuple[str, str], dict[str, float]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        before = pathlib.Path(tmp)
        export(opts.before, before)
        for i in range(opts.rounds):
            for name, tree in (("before", before), ("after", ROOT)):
                print(f"round {i + 1}: {name}", file=sys.stderr, flush=True)
                results[name].append(run(tree, opts.args))
    print(f"median [min - max] over {opts.rounds} interleaved rounds; before = {opts.before}; "
          "paired: the median of after / before within each round (for times, below 1 is faster)")
    print("| world | size | column | before | after | after / before | paired |")
    print("|---|---|---|---|---|---|---|")
    for cell in results["before"][0]:
        for col in RATIOS + TIMES:
            b = [t[cell][col] for t in results["before"] if col in t[cell]]
            a = [t[cell][col] for t in results["after"] if col in t[cell]]
            if not a or not b:
                continue
            mb, ma = statistics.median(b), statistics.median(a)
            paired = statistics.median(x / y for x, y in zip(a, b, strict=True))
            print(f"| {cell[0]} | {cell[1]} | {col} | {mb:.2f} [{min(b):.2f} - {max(b):.2f}] | "
                  f"{ma:.2f} [{min(a):.2f} - {max(a):.2f}] | {ma / mb:.2f} | {paired:.2f} |")

if __name__ == "__main__":
    main()
