"""PyTorch's own distributed suite on ringserve and on gloo, side by side, and what differs.

    scripts/torch_dist_suite.sh [--worlds 2 3] [--modes gloo ringserve ringserve-as-gloo]
                                [--out DIR] [--only REGEX] [--compare-only]

For each world it runs the suite (torch_dist_suite_run.py) three times: on gloo (the control), on
ringserve declared to the suite as a third-party backend, and on ringserve with the suite told it
runs gloo (so the tests it gates on gloo by name run too, on ringserve groups). Then it prints, per
world, the tests that passed on both, those that passed on gloo only (with why not on ringserve),
and those that passed on ringserve only (with why not on gloo).

A test passes on ringserve when it passed in one of the two ringserve runs and failed in neither.

Exit status: 1 when a test that passed on gloo did not pass on ringserve and is not in the known
differences (torch_dist_suite_known.txt: ``test_name: reason``, each reason a restriction of
torch's own, such as monitored_barrier being gloo-only); 0 otherwise. Each run takes 15 to 20
minutes on two cores; outcomes go to DIR/<mode>-w<world>.json as tests finish, and each run's log
to DIR/<mode>-w<world>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN = HERE / "torch_dist_suite_run.py"
KNOWN = HERE / "torch_dist_suite_known.txt"
MODES = ("gloo", "ringserve", "ringserve-as-gloo")
RINGSERVE_MODES = MODES[1:]


def known_differences(path: Path) -> dict[str, str]:
    """``{test: reason}`` from the known-differences file (``#`` starts a comment)."""
    known = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, reason = line.partition(":")
            if not reason.strip():
                raise SystemExit(f"{path}: {name.strip()} needs a reason (test_name: reason)")
            known[name.strip()] = reason.strip()
    return known


def run_one(mode: str, world: int, out: Path, only: str) -> None:
    results, log = out / f"{mode}-w{world}.json", out / f"{mode}-w{world}.log"
    if not only and results.exists():
        results.unlink()
    with tempfile.TemporaryDirectory(prefix="torch-dist-suite-") as temp:
        (Path(temp) / "barrier").mkdir()
        env = {**os.environ, "RINGSERVE_SUITE_MODE": mode, "WORLD_SIZE": str(world), "TEMP_DIR": temp,
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for name in ("RINGSERVE_COORDINATOR", "BACKEND", "INIT_METHOD"):
            env.pop(name, None)
        started = time.monotonic()
        print(f"== {mode} at world {world}: log in {log}", flush=True)
        with open(log, "a" if only else "w") as f:
            code = subprocess.call([sys.executable, str(RUN), str(results), "--only", only], env=env,
                                   stdout=f, stderr=subprocess.STDOUT, cwd=temp)
        print(f"   done in {time.monotonic() - started:.0f} s (exit {code})", flush=True)


def _load(path: Path) -> dict[str, list[str]]:
    return json.loads(path.read_text()) if path.exists() else {}


def _ringserve_outcome(runs: list[dict[str, list[str]]], test: str) -> tuple[bool, str]:
    """Whether ``test`` passed on ringserve (in one run, failed in none), and why not."""
    outcomes = [(mode, run.get(test, ["not run", ""])) for mode, run in zip(RINGSERVE_MODES, runs, strict=True)]
    failed = [f"{mode}: {detail or 'failed'}" for mode, (outcome, detail) in outcomes if outcome == "failed"]
    if failed:
        return False, "; ".join(failed)
    if any(outcome == "passed" for _, (outcome, _) in outcomes):
        return True, ""
    return False, "; ".join(f"{mode}: {outcome} {detail}".strip() for mode, (outcome, detail) in outcomes)


def compare(out: Path, world: int, known: dict[str, str]) -> list[str]:
    """Prints the world's table; returns the tests that passed on gloo only and are not known."""
    gloo = _load(out / f"gloo-w{world}.json")
    runs = [_load(out / f"{mode}-w{world}.json") for mode in RINGSERVE_MODES]
    tests = sorted(set(gloo).union(*runs))
    both, gloo_only, ring_only, neither_failed = [], [], [], []
    for test in tests:
        g_outcome, g_detail = gloo.get(test, ["not run", ""])
        r_passed, r_why = _ringserve_outcome(runs, test)
        if g_outcome == "passed" and r_passed:
            both.append(test)
        elif g_outcome == "passed":
            gloo_only.append((test, r_why))
        elif r_passed:
            ring_only.append((test, f"gloo: {g_outcome} {g_detail}".strip()))
        elif "failed" in r_why:
            neither_failed.append((test, r_why))
    counts = {mode: _count(run) for mode, run in zip(MODES, [gloo, *runs], strict=True)}
    print(f"\n### world {world}\n")
    print("| run | passed | failed | skipped |\n|---|---|---|---|")
    for mode, (p, f, s) in counts.items():
        print(f"| {mode} | {p} | {f} | {s} |")
    print(f"\npassed on both: {len(both)}")
    for i in range(0, len(both), 4):
        print("  " + ", ".join(both[i: i + 4]))
    unknown = [t for t, _ in gloo_only if t not in known]
    print(f"\npassed on gloo only: {len(gloo_only)} ({len(gloo_only) - len(unknown)} known differences)")
    for test, why in gloo_only:
        tag = f"known: {known[test]}" if test in known else "NOT KNOWN"
        print(f"  {test}  [{tag}]\n      ringserve: {why}")
    print(f"\npassed on ringserve only: {len(ring_only)}")
    for test, why in ring_only:
        print(f"  {test}\n      {why}")
    if neither_failed:
        print(f"\nfailed on ringserve, not passed on gloo either: {len(neither_failed)}")
        for test, why in neither_failed:
            print(f"  {test}\n      {why}")
    stale = [t for t in known if t in both]
    if stale:
        print(f"\nknown differences that passed on both (drop them from {KNOWN.name}): {', '.join(stale)}")
    return unknown


def _count(run: dict[str, list[str]]) -> tuple[int, int, int]:
    outcomes = [o for o, _ in run.values()]
    return outcomes.count("passed"), outcomes.count("failed"), outcomes.count("skipped")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=Path("torch-dist-suite"))
    parser.add_argument("--only", default="", help="run only the tests matching this regex (keeps other outcomes)")
    parser.add_argument("--compare-only", action="store_true", help="print the tables of the runs already in --out")
    parser.add_argument("--known", type=Path, default=KNOWN)
    args = parser.parse_args(argv)
    # Absolute: torch's suite changes the working directory of the processes that record outcomes.
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.compare_only:
        for world in args.worlds:
            for mode in args.modes:
                run_one(mode, world, args.out, args.only)
    known = known_differences(args.known)
    unknown = {world: compare(args.out, world, known) for world in args.worlds}
    empty = [w for w in args.worlds if not _load(args.out / f"gloo-w{w}.json")]
    if empty:
        print(f"\nFAILED: gloo recorded no outcome at worlds {empty}: nothing was compared (see the logs)")
        return 1
    missing = {w: t for w, t in unknown.items() if t}
    if missing:
        print(f"\nFAILED: passed on gloo but not on ringserve, and not a known difference: {missing}")
        return 1
    print("\nOK: every test that passed on gloo passed on ringserve, known differences aside.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
