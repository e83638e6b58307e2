"""DeepSpeed on the ringserve backend: ``deepspeed.init_distributed(dist_backend="ringserve")`` and
ZeRO stages 1, 2 and 3 on CPU (DeepSpeed's CPU accelerator, a plain torch optimizer) train to the
parameters that the same job gets with ``dist_backend="gloo"``: under ``ringserve run`` (stages 1,
2 and 3, the parameters sharded at 3) and under DeepSpeed's own launcher (stage 2). gloo runs
under DeepSpeed's launcher.

Slow: the first run on a machine compiles DeepSpeed's shared-memory op (its CPU accelerator builds
it at start with the C++ compiler, about a minute; then it is cached under ~/.cache/torch_extensions).
At world 2 a gradient is the sum of two values, the same in either order, so the backends agree to
the bit; the tolerance leaves room for a reduction that rounds once more, no more.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _launch import JOBS, PYTHON, compare, free_port, launch, ringserve_run

pytestmark = [pytest.mark.integrations, pytest.mark.slow]
ATOL = 1e-6


def _deepspeed_launch(out: Path, backend: str, stage: int) -> str:
    """Runs the job under DeepSpeed's launcher (the ``deepspeed`` command's module, under this
    interpreter: its ranks run ``sys.executable``, and the op DeepSpeed compiles is rebuilt whenever
    that path changes), 2 local processes (on CPU too), the job's own arguments untouched; returns
    its output.

    The launcher sets LOCAL_SIZE, and with it DeepSpeed's shared-memory op maps two 66 MB buffers
    per run in /dev/shm, named after MASTER_ADDR and MASTER_PORT, which it never unlinks: they are
    removed here (on gloo as on ringserve; ``ringserve run`` sets no LOCAL_SIZE, and none is made).
    """
    port = free_port()
    command = [PYTHON, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), "--no_local_rank", str(JOBS / "deepspeed_job.py"), str(out), backend,
               str(stage)]
    try:
        return launch(command, out, timeout_s=270)
    finally:
        for left in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
            left.unlink(missing_ok=True)


def _trained(log: str, stage: int, backend: str) -> bool:
    return f"trained 6 steps with ZeRO stage {stage} on 2 ranks over {backend}" in log


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """gloo's run of stage ``stage``, made once for the module."""
    runs: dict[int, Path] = {}

    def get(stage: int) -> Path:
        if stage not in runs:
            out = tmp_path_factory.mktemp(f"deepspeed_gloo_{stage}")
            log = _deepspeed_launch(out, "gloo", stage)
            assert _trained(log, stage, "gloo"), log[-3000:]
            runs[stage] = out
        return runs[stage]

    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("launcher", "stage"), [("ringserve-run", 1), ("ringserve-run", 2), ("ringserve-run", 3), ("deepspeed", 2)])
def test_deepspeed_zero_on_ringserve_trains_to_the_parameters_it_gets_on_gloo(
        gloo: Callable[[int], Path], tmp_path: Path, launcher: str, stage: int) -> None:
    if launcher == "ringserve-run":
        log = launch(ringserve_run(2, "deepspeed_job.py", str(tmp_path), "ringserve", str(stage)), tmp_path,
                     timeout_s=270)
    else:
        log = _deepspeed_launch(tmp_path, "ringserve", stage)
    assert _trained(log, stage, "ringserve"), log[-3000:]
    assert compare(tmp_path, gloo(stage)) <= ATOL
