"""One run of PyTorch's own distributed suite, from the installed wheel, on one backend and world.

    RINGSERVE_SUITE_MODE=gloo|ringserve|ringserve-as-gloo WORLD_SIZE=2 \\
        python scripts/torch_dist_suite_run.py RESULTS.json [--only REGEX]

Driven by ``scripts/torch_dist_suite.py`` (which sets the environment); run by hand to retry a few
tests. The suite is ``torch.testing._internal.distributed.distributed_test``: its
``DistributedTest._DistTestBase`` tests, run as torch's CI runs them (test_distributed_spawn.py
sets BACKEND, WORLD_SIZE and TEMP_DIR, and mixes ``TestDistBackend`` into the test base). Nothing
of the suite is copied here: it is imported from the wheel.

Modes (``RINGSERVE_SUITE_MODE``):

- ``gloo``: the control. BACKEND=gloo, gloo process groups.
- ``ringserve``: BACKEND=ringserve, declared to the suite as a third-party backend is
  (``DistTestCases.backend_feature``: DDP, subgroups, a plugin), before the suite is imported,
  since the suite decides its skips at import.
- ``ringserve-as-gloo``: BACKEND=gloo, so the suite runs every test it gates on gloo by name,
  while every process group it makes (the default one and every new_group, whatever backend it
  names) is a ringserve one.

The suite's tests spawn their ranks with the "spawn" start method, which runs this file again as
``__mp_main__`` in each rank: so the setup below runs at import, in the parent and in every rank
alike, from the environment the parent set.

Each test's outcome goes to RESULTS.json as it finishes: ``{test: [outcome, detail]}``, outcome
one of passed, failed, skipped.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import unittest
from typing import Any, ClassVar

MODE = os.environ.get("RINGSERVE_SUITE_MODE", "")
MODES = ("gloo", "ringserve", "ringserve-as-gloo")
if MODE not in MODES:
    raise SystemExit(f"RINGSERVE_SUITE_MODE must be one of {MODES}, not {MODE!r}: run scripts/torch_dist_suite.sh")
os.environ["BACKEND"] = "ringserve" if MODE == "ringserve" else "gloo"

import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
import torch.multiprocessing  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if MODE != "gloo":
    import ringserve.torch.distributed  # noqa: F401  registers the "ringserve" backend

if MODE == "ringserve":
    # What a third-party backend tells the suite it supports (CPU only: no "gpu"/"cuda").
    for feature in ("ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[feature].add("ringserve")

if MODE == "ringserve-as-gloo":
    # Every process group torch makes goes through this helper: the default group, new_group and
    # the subgroup helpers. A group named gloo (or "cpu:gloo,...") is made a ringserve one.
    _make_group = c10d._new_process_group_helper

    def _ringserve_instead(group_size: Any, group_rank: Any, global_ranks: Any, backend: Any, *args: Any,
                           **kwargs: Any) -> Any:
        name = str(backend)
        if "gloo" in name:
            backend = dist.Backend(name.replace("gloo", "ringserve"))
        return _make_group(group_size, group_rank, global_ranks, backend, *args, **kwargs)

    c10d._new_process_group_helper = _ringserve_instead

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's suite over this mode's backend, each test in WORLD_SIZE ranks: forked from this
    process (which has imported everything, and started nothing), or spawned as torch's CI
    spawns them (RINGSERVE_SUITE_SPAWN=1: each rank imports torch and the suite again, which
    takes several times as long on two cores)."""

    def setUp(self) -> None:
        super().setUp()
        if os.environ.get("RINGSERVE_SUITE_SPAWN") == "1":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)


def _detail(err: Any) -> str:
    """The line of a failure that says what went wrong: the last exception line, rank's or parent's."""
    text = err if isinstance(err, str) else "".join(__import__("traceback").format_exception(*err))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Timeout)\b", ln) or "Error:" in ln]
    picked = errors[-1] if errors else (lines[-1] if lines else "")
    return picked[:300]


class Recording(unittest.TextTestResult):
    """A test result that also writes every outcome to the results file as it comes."""

    path = ""
    outcomes: ClassVar[dict[str, list[str]]] = {}  # one process records one run

    def _put(self, test: unittest.TestCase, outcome: str, detail: str) -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = [outcome, detail]
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.outcomes, f, indent=0, sort_keys=True)
        os.replace(self.path + ".tmp", self.path)

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._put(test, "passed", "")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._put(test, "failed", _detail(err))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._put(test, "failed", _detail(err))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._put(test, "skipped", reason[:300])

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._put(test, "passed", "an expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._put(test, "failed", "passed, but the suite expects it to fail")


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="where to write the outcomes (JSON)")
    parser.add_argument("--only", default="", help="run only the tests whose name matches this regex")
    args = parser.parse_args(argv)
    Recording.path = args.results
    if os.path.exists(args.results):  # a rerun of some tests keeps the others' outcomes
        with open(args.results) as f:
            Recording.outcomes = json.load(f)
    loader = unittest.TestLoader()
    names = [n for n in loader.getTestCaseNames(TestDistBackendWithSpawn) if re.search(args.only, n)]
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    started = time.monotonic()
    print(f"torch_dist_suite: {MODE} at world {os.environ['WORLD_SIZE']}: {len(names)} tests", flush=True)
    runner = unittest.TextTestRunner(resultclass=Recording, verbosity=2, stream=sys.stdout)
    result = runner.run(suite)
    print(f"torch_dist_suite: {MODE} at world {os.environ['WORLD_SIZE']} took {time.monotonic() - started:.0f} s "
          f"({len(result.failures) + len(result.errors)} failed, {len(result.skipped)} skipped)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
