"""A peer's death fails every survivor's torch.distributed op within ringserve's bounds.

The last of three ranks SIGKILLs itself mid-training (workers/dist_die.py). Its neighbours' streams
break at once, the coordinator confirms the death and publishes a view without it, and every op
of the group, in flight or later, fails: ``work.wait()`` and sync ops raise DistBackendError
caused by ringserve's error; a wait on the op's future (``get_future().wait()``, and DDP's
backward, which waits on it inside torch) raises the RuntimeError torch makes of a failed Python
future, naming DistBackendError; and the next op raises DistBackendError at once. Nobody hangs. Both with the coordinator in the test (as under
``ringserve run``) and with rank 0's own coordinator (as under torchrun); and for a survivor
waiting in a recv from the dead rank (which had sent it messages, or never had), or in a
subgroup's all_reduce with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _dist_worlds import DIST_WORKERS, run_dist

# The test coordinator's heartbeat timeout is 10 s (rank 0's: 5 s); a killed peer's broken
# stream is reported at once, so the survivors hear of it well within that.
BOUND_S = 12.0


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("mode", "launch"), [("allreduce", "env"), ("ddp", "env"), ("wait", "rank0"), ("future", "rank0"),
                                            ("p2p", "env"), ("p2p-idle", "rank0")])
def test_a_killed_peer_fails_every_survivor_with_dist_backend_error(tmp_path: Path, mode: str, launch: str) -> None:
    run_dist(DIST_WORKERS / "dist_die.py", 3, tmp_path, [mode], launch=launch, timeout_s=120, killed=frozenset({2}))
    for r in (0, 1):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        error, after = seen["error"], seen["next"]
        assert error is not None, f"rank {r} trained on without its peer: {seen}"
        if mode in ("ddp", "future"):
            # torch turns the failed future into a RuntimeError, naming ringserve's DistBackendError
            assert error["type"] == "RuntimeError" and "DistBackendError: ringserve:" in error["message"], error
        else:
            # In p2p mode rank 0 waits in a recv from the killed rank, rank 1 in a subgroup's all_reduce.
            op = "recv" if (mode, r) in (("p2p", 0), ("p2p-idle", 1)) else "all_reduce"
            assert error["type"] == "DistBackendError" and error["message"].startswith(f"ringserve: {op} failed"), error
            assert error["cause"] in ("RingChangedError", "PeerUnavailableError"), error
        assert error["after_s"] < BOUND_S, error
        assert after["type"] == "DistBackendError" and after["cause"] in ("RingChangedError", "PeerUnavailableError"), after
        assert after["after_s"] < BOUND_S + 1.0, after
