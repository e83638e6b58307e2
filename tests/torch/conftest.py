"""Fixtures of the torch binding's tests; the worlds themselves are built by ``_worlds.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _worlds import Run, RunWorld, run_world


@pytest.fixture
def world_runner(tmp_path: Path) -> Iterator[RunWorld]:
    """``world_runner(script, n, *args, timeout_s=..., env=...)`` -> Run, outputs under tmp_path."""
    count = 0

    def run(script: Path, n: int, *args: str, timeout_s: float = 90.0, env: dict[str, str] | None = None) -> Run:
        nonlocal count
        count += 1
        return run_world(script, n, tmp_path / f"run{count}", args, timeout_s=timeout_s, env=env)

    yield run
