"""The worker's small owners, alone: the task owner, the channel cache, the published standing and
the route from other threads to the loop. No sockets: channels here are never dialled."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest

from ringserve.errors import NotInitializedError, RingChangedError, ViewInstallError
from ringserve.worker.control.standing import Standing, on_loop
from ringserve.worker.control.tasks import TaskOwner
from ringserve.worker.dataplane.links.channels import ChannelCache
from ringserve.worker.dataplane.policy import Place

# -- the task owner -----------------------------------------------------------------------------------


async def test_a_crashed_task_is_reported_at_once_with_its_name_and_exception() -> None:
    crashes: list[tuple[str, BaseException]] = []
    tasks = TaskOwner(on_crash=lambda name, exc: crashes.append((name, exc)))

    async def crash() -> None:
        await asyncio.sleep(0)
        raise ValueError("boom")

    tasks.spawn(crash(), "heartbeat")
    await asyncio.sleep(0.01)
    assert [(n, str(e)) for n, e in crashes] == [("heartbeat", "boom")]
    assert tasks.running == []


async def test_a_task_that_ends_or_is_cancelled_is_no_crash() -> None:
    crashes: list[Any] = []
    tasks = TaskOwner(on_crash=lambda *a: crashes.append(a))
    tasks.spawn(asyncio.sleep(0), "quick")
    long = tasks.spawn(asyncio.sleep(10), "long")
    await asyncio.sleep(0.01)
    long.cancel()
    await asyncio.wait([long])
    await asyncio.sleep(0)  # done callbacks run on the next turn
    assert crashes == [] and tasks.running == []


async def test_close_cancels_and_awaits_every_task_and_never_raises_what_they_raised() -> None:
    crashes: list[Any] = []
    tasks = TaskOwner(on_crash=lambda *a: crashes.append(a))
    ended = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            ended.set()
            raise RuntimeError("raised while cancelled")  # logged, not reported: we are closing

    tasks.spawn(stubborn(), "stubborn")
    tasks.spawn(asyncio.sleep(10), "sleeper")
    await asyncio.sleep(0)
    await tasks.close(timeout_s=1)
    assert ended.is_set() and tasks.running == [] and crashes == []
    with pytest.raises(RuntimeError, match=r"shutting down"):
        tasks.spawn(asyncio.sleep(0), "late")


async def test_close_does_not_wait_for_ever_on_a_task_that_swallows_cancellation() -> None:
    tasks = TaskOwner(on_crash=lambda *a: None)
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            try:  # noqa: SIM105 (the bug under test, written as it is usually written)
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # a bug: it swallows cancellation

    task = tasks.spawn(deaf(), "deaf")
    await asyncio.sleep(0)
    async with asyncio.timeout(2):
        await tasks.close(timeout_s=0.1)
    release.set()
    task.cancel()
    await asyncio.sleep(0)


# -- the channel cache --------------------------------------------------------------------------------


class FakeChannel:
    closed = 0

    async def close(self) -> None:
        await asyncio.sleep(0)
        self.closed += 1


def cache() -> tuple[ChannelCache, list[FakeChannel]]:
    made: list[FakeChannel] = []

    def make(address: str) -> grpc.aio.Channel:
        made.append(FakeChannel())
        return made[-1]  # type: ignore[return-value]

    return ChannelCache(make), made


async def test_one_channel_per_address_is_shared_and_closed_only_once_no_lease_holds_it() -> None:
    channels, made = cache()
    a, b = channels.lease("x:1"), channels.lease("x:1")
    assert a.channel is b.channel and len(made) == 1
    a.release()
    a.release()  # a second release of one lease does nothing
    await channels.sweep()
    assert made[0].closed == 0 and channels.addresses == {"x:1"}
    b.release()
    await channels.sweep()
    assert made[0].closed == 1 and channels.addresses == set()


async def test_a_lease_taken_while_a_sweep_closes_gets_a_new_channel_not_the_closing_one() -> None:
    channels, made = cache()
    channels.lease("x:1").release()
    sweeping = asyncio.ensure_future(channels.sweep())
    await asyncio.sleep(0)  # the sweep is inside the old channel's close
    lease = channels.lease("x:1")
    await sweeping
    assert len(made) == 2 and lease.channel is made[1] and made[1].closed == 0
    with channels.leased("x:1") as channel:
        assert channel is made[1]
    lease.release()
    await channels.close()
    assert made[1].closed == 1
    with pytest.raises(RuntimeError, match=r"closed"):
        channels.lease("x:1")


# -- the standing and the route to the loop -----------------------------------------------------------


PLACE = Place(view_id=4, rank=1, size=3, addresses=("a", "b", "c"))


def test_the_standing_says_where_the_worker_is_or_why_not() -> None:
    with pytest.raises(NotInitializedError):
        Standing().current()
    with pytest.raises(RingChangedError, match=r"not in the current view"):
        Standing(running=True, latest_view=5).current()
    # Between views, rank and size keep the last place; calls needing a view do not.
    between = Standing(running=True, last=PLACE, latest_view=5)
    assert between.known() is PLACE and between.tag("w:1") == "worker w:1 view 5"
    cause = OSError("disk full")
    failed = ViewInstallError("could not install view 5")
    failed.__cause__ = cause
    with pytest.raises(ViewInstallError) as caught:
        Standing(running=True, place=PLACE, failure=failed).current()
    assert caught.value is not failed and caught.value.__cause__ is cause
    assert Standing(running=True, place=PLACE, pinned=3).running_view == 3
    assert Standing(running=True, place=PLACE).running_view == 4


async def test_a_write_from_another_thread_runs_on_the_loop_before_what_the_thread_submits_next() -> None:
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, bool]] = []

    def write(what: str) -> None:
        seen.append((what, threading.current_thread() is threading.main_thread()))

    async def after() -> None:
        write("after")

    def thread() -> None:
        on_loop(loop, write, "pin", wait_s=5)
        assert seen == [("pin", True)]  # waited for: it holds once on_loop returns
        on_loop(loop, write, "commit")  # not waited for, but queued before the next call
        asyncio.run_coroutine_threadsafe(after(), loop).result(5)

    await asyncio.to_thread(thread)
    assert seen == [("pin", True), ("commit", True), ("after", True)]
    on_loop(loop, write, "here")  # on the loop's own thread: at once
    assert seen[-1] == ("here", True)
