"""What ``import ringserve`` costs, and what each kind of process loads before its first call.

    .venv/bin/python benchmarks/import_cost.py                     # this checkout
    .venv/bin/python benchmarks/import_cost.py --tree /path/to/old  # another checkout, for the ratio

Each figure is the median of ``--runs`` fresh interpreters (``python -c``), each timed from its
start to the end of the statement, with its peak resident set (``ru_maxrss`` of the child):

- ``import ringserve``;
- ``import ringserve; ringserve.init`` (the numpy facade's layers: a worker's import);
- ``from ringserve.ps import Shard`` (a shard's);
- ``from ringserve import Coordinator`` (a coordinator's);
- ``import torch.distributed``, the peer's, for scale.

The issue's target for the first line: under 0.3 s and 30 MB on this machine. With ``--tree``,
the same statements run against that checkout too, and the table gives this checkout's time as a
ratio of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATEMENTS = {
    "import ringserve": "import ringserve",
    "a worker's (ringserve.init)": "import ringserve; ringserve.init",
    "a shard's (ringserve.ps.Shard)": "from ringserve.ps import Shard",
    "a coordinator's (ringserve.Coordinator)": "from ringserve import Coordinator",
    "import torch.distributed (the peer's)": "import torch.distributed",
}


def measure(statement: str, tree: Path, runs: int) -> tuple[float, float]:
    """(median seconds, median peak RSS in MB) of ``statement`` in fresh interpreters on ``tree``."""
    times, peaks = [], []
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # The child reports its own peak: ru_maxrss of this process's children is the largest of all of them.
    code = f"{statement}\nimport resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    for _ in range(runs):
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tree, capture_output=True, text=True)
        times.append(time.perf_counter() - started)
        peaks.append(int(out.stdout.split()[-1]) / 1024)
    return statistics.median(times), statistics.median(peaks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tree", type=Path, help="another checkout to measure alike (the ratio's base)")
    args = parser.parse_args(argv)
    # The bare interpreter's start, subtracted from every time: what the statement costs.
    base, _ = measure("pass", ROOT, args.runs)
    print(f"python -c pass: {base:.3f} s (subtracted below); {args.runs} runs each, medians")
    print("| what | seconds | peak RSS MB |" + (" base seconds | ratio |" if args.tree else ""))
    print("|---|---|---|" + ("---|---|" if args.tree else ""))
    for label, statement in STATEMENTS.items():
        seconds, rss = measure(statement, ROOT, args.runs)
        row = f"| {label} | {seconds - base:.3f} | {rss:.0f} |"
        if args.tree:
            old, _ = measure(statement, args.tree, args.runs)
            row += f" {old - base:.3f} | {(seconds - base) / max(old - base, 1e-6):.2f} |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
