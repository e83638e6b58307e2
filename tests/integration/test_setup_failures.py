"""A worker that cannot take its place fails fast and says why: a bad setting is refused when the
config is made, and an error while installing a view fails start() (or the waiting collective)
at once with its cause chained, while the worker leaves so that its peers are not kept waiting."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import ringserve
from ringserve import Coordinator, InvalidArgumentError, RecoverableError, ViewInstallError, Worker
from ringserve._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(30)


async def test_an_out_of_range_shared_slots_setting_fails_init_at_once_naming_the_value(monkeypatch, make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(min_workers=1)) as coord:
        monkeypatch.setenv("RINGSERVE_SHARED_SLOTS", "5000")
        started = time.monotonic()
        with pytest.raises(InvalidArgumentError, match=r"shared_slots \(5000\) must be in \[1, 4032\]"):
            await asyncio.to_thread(ringserve.init, coord.address)
        assert time.monotonic() - started < 1.0
        assert not ringserve.is_initialized()
        assert (await coord.service.Status(pb.StatusRequest(), None)).pending_workers == 0


async def test_a_timeline_in_a_directory_that_does_not_exist_yet_is_made_at_the_first_view(tmp_path, world_factory) -> None:
    world = await world_factory(1, timeline=str(tmp_path / "made" / "later" / "trace-{rank}.json"))
    await world.workers[0].allreduce(np.ones(3), op="sum", name="traced")
    assert (tmp_path / "made" / "later" / "trace-0.json").exists()


async def test_a_view_that_cannot_be_installed_fails_start_at_once_and_the_peer_is_not_kept_waiting(
    tmp_path, make_coordinator_config, make_worker_config
) -> None:
    async with Coordinator(make_coordinator_config(min_workers=2)) as coord:
        traces = tmp_path / "traces"
        bad = Worker(config=make_worker_config(coord.address, timeline=str(traces / "trace-{rank}.json")))
        traces.write_text("")  # the directory the config accepted became a file before the first view
        good = Worker(config=make_worker_config(coord.address))
        started = time.monotonic()
        outcomes = await asyncio.gather(bad.start(), good.start(), return_exceptions=True)
        assert time.monotonic() - started < 2.0, "start() waited instead of failing"
        failure, joined = outcomes
        assert isinstance(failure, ViewInstallError), failure
        assert isinstance(failure.__cause__, (FileExistsError, NotADirectoryError)), failure.__cause__
        assert "could not install view 1: FileExistsError" in str(failure) and str(traces) in str(failure)
        try:
            assert joined is good
            # The healthy peer's first collective ends within a bound, recoverable, instead of
            # waiting out its collective deadline (30 s here) for a rank that is gone.
            began = time.monotonic()
            with pytest.raises(RecoverableError):
                await good.allreduce(np.ones(4), op="sum", name="first")
            assert time.monotonic() - began < 2.0
            async with asyncio.timeout(2):
                while bad.worker_id in [m.worker_id for m in coord.service.view.members]:
                    await asyncio.sleep(0.01)
            assert bad.worker_id not in [m.worker_id for m in coord.service.view.members]
        finally:
            await good.close()
