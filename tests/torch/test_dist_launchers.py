"""A plain DDP script with its backend string changed to "ringserve" trains under both launchers.

examples/ddp_digits.py is the usual torch.distributed shape (``init_process_group(backend,
rank=rank, world_size=world_size)``, DDP, an optimizer, a DistributedSampler). Under ``ringserve
run -np N`` and under ``torchrun --nproc-per-node N`` it learns, ends with identical parameters on
every rank, and prints the very losses that the same script prints over gloo.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _dist_worlds import REPO, run_dist

EXAMPLE = REPO / "examples" / "ddp_digits.py"


def _train(tmp_path: Path, n: int, launch: str, *args: str) -> tuple[list[str], float, str]:
    """(rank 0's loss lines, its test accuracy, the whole output)."""
    run = run_dist(EXAMPLE, n, tmp_path, ["--epochs", "3", *args], launch=launch, timeout_s=240, pass_out_dir=False)
    log = run.outputs[0]
    assert f"all {n} ranks hold identical parameters" in log, log[-4000:]
    losses = re.findall(r"epoch \d+: loss [0-9.]+", log)
    accuracy = float(re.search(r"test accuracy ([0-9.]+)%", log).group(1))  # type: ignore[union-attr]
    return losses, accuracy, log


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launch", ["ringserve-run", "torchrun"])
def test_the_ddp_example_trains_on_2_workers(tmp_path: Path, launch: str) -> None:
    losses, accuracy, log = _train(tmp_path, 2, launch)
    assert "on 2 workers over ringserve" in log and len(losses) == 3, log[-3000:]
    first, last = (float(x.rsplit(" ", 1)[1]) for x in (losses[0], losses[-1]))
    assert last < first and accuracy > 75.0, log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("launch", ["ringserve-run", "torchrun"])
def test_the_ddp_example_trains_on_4_workers_to_the_losses_it_has_over_gloo(tmp_path: Path, launch: str) -> None:
    ours, accuracy, log = _train(tmp_path / "ringserve", 4, launch)
    gloo, gloo_accuracy, _ = _train(tmp_path / "gloo", 4, launch, "--backend", "gloo")
    assert "on 4 workers over ringserve" in log, log[-3000:]
    # The same data, seeds and steps; sums of four float32 values in another order may differ in
    # their last bit, which the four printed decimals do not show.
    assert ours == gloo and abs(accuracy - gloo_accuracy) < 0.5, (ours, gloo, accuracy, gloo_accuracy)
