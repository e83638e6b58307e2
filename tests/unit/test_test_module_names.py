"""pytest imports test modules by their file name (rootdir import mode, no packages): two test
files of one name in different folders stop the whole run at collection. Caught here, by name."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_file_name() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "workers" in path.parts or path.name == "conftest.py" or "__pycache__" in path.parts:
            continue
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules share a name (rename one of each): {clashes}"
