"""`ringserve run` exports Horovod's variables, as horovodrun does, for scripts that read them."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ringserve.launch.env import horovod_env

SCRIPT = "import os; print(sorted((k, v) for k, v in os.environ.items() if k.startswith('HOROVOD_')))"


@pytest.mark.timeout(60)
def test_each_worker_gets_horovods_rank_size_local_and_cross_variables() -> None:
    result = subprocess.run([sys.executable, "-m", "ringserve.cli", "run", "-np", "3", sys.executable, "-c", SCRIPT],
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = {}
    for line in result.stdout.splitlines():
        if line.startswith("[") and "HOROVOD_" in line:
            slot, printed = line.split("] ", 1)
            seen[int(slot[1:])] = dict(eval(printed))
    host = socket.gethostname()
    assert seen == {
        r: {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": str(r), "HOROVOD_LOCAL_SIZE": "3",
            "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1", "HOROVOD_HOSTNAME": host}
        for r in range(3)
    }


def test_the_variables_describe_one_host_of_num_proc_slots() -> None:
    assert horovod_env(2, 4, hostname="h") == {
        "HOROVOD_HOSTNAME": "h", "HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "2",
        "HOROVOD_LOCAL_SIZE": "4", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
    }
