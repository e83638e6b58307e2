"""A script written for horovod.torch runs on ringserve with only its import changed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _worlds import WORKERS, RunWorld

HOROVOD_IMPORT = "import horovod.torch as hvd\n"


@pytest.mark.timeout(150)
def test_a_horovod_script_runs_unchanged_but_for_its_import(tmp_path: Path, world_runner: RunWorld) -> None:
    text = (WORKERS / "horovod_style.py").read_text()
    assert text.count(HOROVOD_IMPORT) == 1
    script = tmp_path / "train.py"
    script.write_text(text.replace(HOROVOD_IMPORT, "import ringserve.torch as hvd\n"))

    run = world_runner(script, 2, timeout_s=120)

    log = run.outputs[0] + run.outputs[1]
    accuracies = [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", log)]
    assert len(accuracies) == 3, log
    assert accuracies[-1] > 80.0, log
    losses = [float(v) for v in re.findall(r"Loss: ([0-9.]+)", log)]
    assert losses[-1] < losses[0], log
    first, second = (torch.load(run.out_dir / f"checkpoint-rank{r}.pt") for r in range(2))
    for key, value in first.items():
        assert torch.equal(value, second[key]), f"{key} differs between the ranks"
