"""Commits in place (RINGSERVE_COMMIT_IN_PLACE=1) under real faults, on the chaos tests' torch
loop (a DistributedOptimizer, a commit after every step): the survivors of kill -9s restore
commits that are their live tensors, with no copy, and every rank that commits a step holds the
same parameters; a joiner takes the state from a root that commits in place, which sends it from
a copy while its own steps go on. No checkpoint directory: a commit lost would end the run.
"""

from __future__ import annotations

import re
from pathlib import Path

import harness
import pytest
from test_chaos import torch_kill_9s
from test_handoff import STEPS, run_with_joiner

pytestmark = pytest.mark.timeout(240)

IN_PLACE = {"RINGSERVE_COMMIT_IN_PLACE": "1"}


def test_kill_9s_of_a_world_that_commits_in_place_lose_no_commit_and_the_replicas_stay_equal(tmp_path: Path) -> None:
    out = torch_kill_9s(tmp_path, "torch kill -9 x3, in place", 11, IN_PLACE)
    assert "restoring the last commit" in out, out[-3000:]  # the survivors restored, in place


def test_a_joiner_takes_the_state_from_a_root_that_commits_in_place(tmp_path: Path) -> None:
    out, records, joiner = run_with_joiner(tmp_path, IN_PLACE)
    harness.check_invariants(records, STEPS)  # the joiner's commits carry the members' parameters
    assert any(r["pid"] == joiner for r in records), "the joiner never committed"
    # It took the state point to point (the handoff), not in a broadcast of every rank.
    broadcasts = [int(n) for n in re.findall(r"finished at step \d+ after \d+ allreduces and (\d+) broadcasts", out)]
    assert len(broadcasts) == 3 and broadcasts[-1] == 0, broadcasts
