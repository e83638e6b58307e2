"""Worlds for the Keras binding's tests: ``binding_worlds`` (shared with the TensorFlow tests) and
the folder of the Keras workers' scripts."""

from __future__ import annotations

from pathlib import Path

from binding_worlds import ENV, REPO, run_script

WORKERS = Path(__file__).parent / "workers"

__all__ = ["ENV", "REPO", "WORKERS", "run_script"]
