"""Horovod's classic examples, written for ringserve, run under `ringserve run -np 2`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN = [sys.executable, "-m", "ringserve.cli", "run"]


def ringserve_run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(RUN + args, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("model", ["lenet5", "resnet10"])
def test_the_synthetic_benchmark_reports_images_per_second_and_the_ranks_agree(model: str) -> None:
    result = ringserve_run(["-np", "2", sys.executable, str(EXAMPLES / "pytorch_synthetic_benchmark.py"),
                            "--model", model, "--batch-size", "4", "--image-size", "32", "--width", "8",
                            "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
                            "--fp16-allreduce"], timeout=140)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert f"[0] Model: {model} (" in out and "batch size 4, images 32x32, 2 workers, fp16 allreduce" in out
    iters = re.findall(r"\[0\] Iter #(\d): ([0-9.]+) img/sec per worker", out)
    assert [i for i, _ in iters] == ["0", "1"] and all(float(rate) > 0 for _, rate in iters), out
    mean = float(re.search(r"\[0\] Img/sec per worker: ([0-9.]+) \+-", out).group(1))  # type: ignore[union-attr]
    total = float(re.search(r"\[0\] Total img/sec on 2 worker\(s\): ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert abs(total - 2 * mean) < 0.2
    assert "[0] all 2 ranks hold identical parameters" in out


@pytest.mark.timeout(150)
def test_the_elastic_example_trains_and_ends_with_identical_parameters() -> None:
    result = ringserve_run(["-np", "2", sys.executable, str(EXAMPLES / "pytorch_elastic_train.py"), "--epochs", "3"],
                           timeout=140)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert re.findall(r"\[0\] epoch (\d): loss [0-9.]+ on 2 workers", out) == ["0", "1", "2"]
    accuracy = float(re.search(r"\[0\] test accuracy ([0-9.]+)%", out).group(1))  # type: ignore[union-attr]
    assert accuracy > 70.0, out
    assert "[0] all 2 ranks hold identical parameters" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_elastic_example_survives_a_killed_worker_that_is_started_again(tmp_path: Path) -> None:
    err = tmp_path / "launcher.err"  # its log (its coordinator's too), read only on failure: a pipe could fill
    with err.open("w") as sink:
        launcher = subprocess.Popen([*RUN, "-np", "2", "--min-np", "1", "--restart-failed", sys.executable, str(EXAMPLES / "pytorch_elastic_train.py"), "--epochs", "12"],
                                    stdout=subprocess.PIPE, stderr=sink, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 200
        while not any("epoch 1:" in line for line in lines):
            assert time.monotonic() < deadline and launcher.poll() is None, "".join(lines)
            time.sleep(0.1)
        with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
            victim = int(f.read().split()[-1])
        os.kill(victim, signal.SIGKILL)
        assert launcher.wait(240) == 0, "".join(lines) + err.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    reader.join(5)
    out = "".join(lines)
    assert "exited with code 137; starting it again" in out
    assert "[0] epoch 11: loss" in out or "epoch 11: loss" in out
    assert re.search(r"all \d ranks hold identical parameters", out), out
