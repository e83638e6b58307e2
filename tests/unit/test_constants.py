"""Each deadline and slack that is not a setting has one home (ringserve/constants.py), and the
settings and launchers that default to it read it from there."""

from __future__ import annotations

import ast
import pathlib

from ringserve import constants
from ringserve.config import WorkerConfig
from ringserve.launch.group import Placement
from ringserve.launch.procs import SshSettings

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ringserve"


def test_the_elastic_and_start_timeouts_default_to_the_one_constant_everywhere() -> None:
    assert WorkerConfig().elastic_timeout_s == Placement().elastic_timeout_s == constants.ELASTIC_TIMEOUT_S == 600.0
    assert SshSettings().start_timeout_s == constants.REMOTE_START_TIMEOUT_S == 30.0


def test_no_module_defines_a_slack_or_backoff_constant_of_its_own() -> None:
    # The names that drifted before: a module-level *_WAIT_SLACK_S or *_BACKOFF_* outside constants.py.
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "constants.py" or "_proto" in path.parts:
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Name) and ("WAIT_SLACK" in target.id or "ELASTIC_TIMEOUT" in target.id):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {target.id}")
    assert not found, found
