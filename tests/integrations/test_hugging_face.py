"""Hugging Face on the ringserve backend, on CPU, against gloo.

- ``Accelerator``, under ``ringserve run`` and under ``accelerate launch``, trains to the parameters
  it gets on gloo (Accelerate's own CPU path, under ``accelerate launch``).
- The transformers ``Trainer`` on a tiny GPT-2 built from a config, under ``ringserve run`` and
  under ``accelerate launch``, trains to the parameters it gets on gloo (``ddp_backend="gloo"``,
  under torchrun).
- Accelerate still refuses the name "ringserve" on CPU, which is why the jobs make the process
  group themselves before Accelerate looks (docs/guide/hugging-face.md): when that test fails,
  Accelerate takes the name, and the page should say so.

At world 2 a gradient is the sum of two values, the same in either order, so the backends agree to
the bit; the tolerance leaves room for a reduction that rounds once more, no more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import BIN, JOBS, PYTHON, compare, free_port, launch, ringserve_run

pytestmark = pytest.mark.integrations
ATOL = 1e-6


def _accelerate_launch(script: str, out: Path, backend: str) -> list[str]:
    """``accelerate launch`` of 2 processes on CPU: its torchrun path (``--multi_gpu``; the
    script's ``cpu=True`` keeps them on the CPU), with every setting given, so no config file is read."""
    return [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(free_port()), str(JOBS / script), str(out), backend]


@pytest.fixture(scope="module")
def accelerate_gloo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("accelerate_gloo")
    log = launch(_accelerate_launch("accelerate_job.py", out, "gloo"), out, timeout_s=240)
    assert "trained 6 steps on 2 ranks over gloo (DistributedType.MULTI_CPU)" in log, log[-3000:]
    return out


@pytest.fixture(scope="module")
def trainer_gloo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trainer_gloo")
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(JOBS / "transformers_job.py"),
               str(out), "gloo"]
    log = launch(command, out, timeout_s=240)
    assert "trained 4 steps on 2 ranks over gloo" in log, log[-3000:]
    return out


# The job, its gloo run (a fixture), its steps, and what its log says of the backend.
CASES = {
    "accelerator": ("accelerate_job.py", "accelerate_gloo", "trained 6 steps on 2 ranks over ringserve (DistributedType.MULTI_CPU)"),
    "trainer": ("transformers_job.py", "trainer_gloo", "trained 4 steps on 2 ranks over ringserve"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", ["ringserve-run", "accelerate-launch"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_accelerator_and_the_transformers_trainer_on_ringserve_train_to_the_parameters_they_get_on_gloo(
        request: pytest.FixtureRequest, tmp_path: Path, case: str, launcher: str) -> None:
    job, gloo, said = CASES[case]
    command = (ringserve_run(2, job, str(tmp_path), "ringserve") if launcher == "ringserve-run"
               else _accelerate_launch(job, tmp_path, "ringserve"))
    log = launch(command, tmp_path, timeout_s=240)
    assert said in log, log[-3000:]
    assert compare(tmp_path, request.getfixturevalue(gloo)) <= ATOL


@pytest.mark.timeout(120)
def test_accelerate_still_refuses_the_backend_name_on_cpu(tmp_path: Path) -> None:
    code = ("import ringserve.torch.distributed\n"
            "from accelerate import Accelerator\n"
            "from accelerate.utils import InitProcessGroupKwargs\n"
            "Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend='ringserve')])\n")
    # Rank 0 of 2 as a launcher describes it; Accelerate refuses before it makes any group.
    with pytest.raises(AssertionError) as refused:
        launch([PYTHON, "-c", code], tmp_path, timeout_s=90, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert "ValueError: Your assigned backend ringserve is not available, please use gloo" in str(refused.value)
