"""Bad input raises a typed error on every rank, naming what was wrong, within seconds: never a hang."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from functools import partial

import numpy as np
import pytest

import ringserve
from ringserve import (
    CoordinatorUnreachableError,
    InvalidArgumentError,
    MismatchError,
    NotInitializedError,
    RendezvousTimeoutError,
    Worker,
)
from ringserve._proto import coordinator_pb2 as pb
from ringserve.worker.dataplane import routes
from ringserve.worker.dataplane.descriptor import Descriptor

# abort_grace_s is 1 s in the test config; a mismatch must be reported well within this.
MISMATCH_DEADLINE_S = 5.0


async def outcomes_within(world, call, deadline_s: float = MISMATCH_DEADLINE_S) -> tuple[list, float]:
    start = time.monotonic()
    try:
        outcomes = await world.each_outcome(call, timeout_s=deadline_s)
    except TimeoutError:
        pytest.fail(f"a rank was still waiting {deadline_s} s after the mismatched collective started")
    return outcomes, time.monotonic() - start


def assert_mismatch_everywhere(outcomes: list, *fragments: str) -> None:
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, MismatchError), f"rank {rank} got {outcome!r}"
        message = str(outcome)
        for fragment in fragments:
            assert fragment in message, f"rank {rank}'s error does not name {fragment!r}: {message}"


@pytest.mark.parametrize("world", [2, 3, 4], indirect=True)
async def test_a_shape_mismatch_raises_mismatch_error_on_every_rank_naming_the_ranks_and_shapes(world) -> None:
    odd = world.size - 1

    def call(w):
        return w.allreduce(np.ones(4 if w.rank == odd else 3, dtype=np.float32), op="sum", name="grad")

    outcomes, _ = await outcomes_within(world, call)
    assert_mismatch_everywhere(outcomes, "'grad#1'", f"rank {odd}: allreduce float32 (4,)", "(3,)")
    for outcome in outcomes:
        assert outcome.op_key == "grad#1"
        assert routes.untagged(Descriptor.parse(outcome.descriptors[odd])).text == "allreduce float32 (4,) op=sum"
        assert any("(3,)" in d for r, d in outcome.descriptors.items() if r != odd)


@pytest.mark.parametrize("world", [2, 3], indirect=True)
async def test_a_dtype_mismatch_raises_mismatch_error_on_every_rank_naming_both_dtypes(world) -> None:
    def call(w):
        return w.allreduce(np.ones(6, dtype=np.float64 if w.rank == 0 else np.float32), op="average", name="loss")

    outcomes, _ = await outcomes_within(world, call)
    assert_mismatch_everywhere(outcomes, "rank 0: allreduce float64 (6,)", "float32 (6,)")


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_a_mismatch_on_a_multi_chunk_tensor_is_still_caught_within_seconds(world) -> None:
    def call(w):
        return w.allreduce(np.ones(5000 + w.rank, dtype=np.float32), op="sum", name="big")

    outcomes, _ = await outcomes_within(world, call)
    assert_mismatch_everywhere(outcomes)
    # All three shapes differ. A rank names all three once the abort's second lap reaches it, but fails
    # abort_grace_s after it first heard of the abort if that lap is late (a loaded machine): then it
    # names the pair the abort started with, or more. A pair is what every rank must name.
    shapes = [f"({5000 + rank},)" for rank in range(world.size)]
    for rank, outcome in enumerate(outcomes):
        named = [shape for shape in shapes if shape in str(outcome)]
        assert len(named) >= 2, f"rank {rank} names fewer than two shapes: {outcome}"


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_an_op_mismatch_raises_mismatch_error_on_every_rank(world) -> None:
    outcomes, _ = await outcomes_within(world, lambda w: w.allreduce(np.ones(3), op="max" if w.rank == 1 else "sum"))
    assert_mismatch_everywhere(outcomes, "op=max", "op=sum")


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_a_broadcast_shape_mismatch_raises_mismatch_error_on_every_rank(world) -> None:
    outcomes, _ = await outcomes_within(world, lambda w: w.broadcast(np.zeros(2 + (w.rank == 2)), root=0, name="params"))
    assert_mismatch_everywhere(outcomes, "rank 2: broadcast float64 (3,) root=0", "(2,)")


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_a_root_mismatch_raises_mismatch_error_on_every_rank(world) -> None:
    outcomes, _ = await outcomes_within(world, lambda w: w.broadcast(np.zeros(4), root=0 if w.rank == 0 else 1, name="init"))
    assert_mismatch_everywhere(outcomes, "root=0", "root=1")


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_a_root_mismatch_whose_two_trees_reach_a_rank_before_it_opens_is_still_a_mismatch(world) -> None:
    # Forced: rank 2 opens the broadcast late, so the same chunk reaches it from rank 0 (root of
    # its own tree) and from rank 1 (root of the others') before it knows which is foreign. That
    # was a ProtocolError ("arrived twice") that broke the stream: PeerUnavailableError elsewhere.
    async def call(w):
        if w.rank == 2:
            await asyncio.sleep(0.5)
        return await w.broadcast(np.zeros(4), root=0 if w.rank == 0 else 1, name="init")

    outcomes, _ = await outcomes_within(world, call)
    assert_mismatch_everywhere(outcomes, "root=0", "root=1")
    outs = await world.each(lambda w: w.broadcast(np.full(2, w.rank), root=1))
    assert [o.tolist() for o in outs] == [[1, 1]] * 3


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_an_allgather_with_different_row_shapes_raises_mismatch_error_on_every_rank(world) -> None:
    outcomes, _ = await outcomes_within(world, lambda w: w.allgather(np.zeros((2, 3 + (w.rank == 1))), name="feats"))
    assert_mismatch_everywhere(outcomes, "(*, 4)", "(*, 3)")


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_different_collectives_at_the_same_place_raise_mismatch_error_on_every_rank(world) -> None:
    def call(w):
        return w.barrier() if w.rank == 1 else w.allreduce(np.ones(1, dtype=np.int32), op="sum")

    outcomes, _ = await outcomes_within(world, call)
    assert_mismatch_everywhere(outcomes, "barrier", "allreduce int32 (1,)")


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_the_world_keeps_working_after_a_mismatch(world) -> None:
    outcomes, _ = await outcomes_within(world, lambda w: w.allreduce(np.ones(2 + w.rank), op="sum", name="bad"))
    assert_mismatch_everywhere(outcomes)
    for i in range(3):
        outs = await world.each(lambda w: w.allreduce(np.full(5, w.rank, dtype=np.int64), op="sum", name="bad"))
        assert [o.tolist() for o in outs] == [[3] * 5] * 3, f"round {i}"
    outs = await world.each(lambda w: w.allreduce(np.ones(2), op="sum"))
    assert [o.tolist() for o in outs] == [[3.0, 3.0]] * 3


@pytest.mark.parametrize("world", [2], indirect=True)
async def test_an_unknown_op_raises_invalid_argument_error_naming_it(world) -> None:
    for call in (
        lambda w: w.allreduce(np.ones(3), op="prod"),
        lambda w: w.reduce_scatter(np.ones((4, 2)), op="mean"),
    ):
        outcomes = await world.each_outcome(call, timeout_s=5)
        for outcome in outcomes:
            assert isinstance(outcome, InvalidArgumentError), outcome
            assert "is not supported; use one of sum, average, min, max" in str(outcome)
    outs = await world.each(lambda w: w.allreduce(np.ones(3), op="sum"))
    assert [o.tolist() for o in outs] == [[2.0] * 3] * 2


def call_method(method: str, value: object, w: Worker, **kwargs: object):
    return getattr(w, method)(value, **kwargs)


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_a_root_out_of_range_raises_invalid_argument_error_naming_the_root(world) -> None:
    for root in (3, -1, 100):
        for method, value in (("broadcast", np.ones(2)), ("broadcast_object", "x")):
            outcomes = await world.each_outcome(partial(call_method, method, value, root=root), timeout_s=5)
            for outcome in outcomes:
                assert isinstance(outcome, InvalidArgumentError), outcome
                assert f"The root rank ({root}) must be in [0, 3)." in str(outcome)
    outs = await world.each(lambda w: w.broadcast(np.full(2, w.rank), root=2))
    assert [o.tolist() for o in outs] == [[2, 2]] * 3


@pytest.mark.parametrize("world", [2], indirect=True)
async def test_an_unsupported_dtype_or_a_scalar_where_rows_are_needed_raises_invalid_argument_error(world) -> None:
    w = world.workers[0]
    with pytest.raises(InvalidArgumentError, match=r"The dtype complex128 is not supported"):
        await w.allreduce(np.ones(2, dtype=np.complex128))
    with pytest.raises(InvalidArgumentError, match=r"The dtype bool is not supported"):
        await w.broadcast(np.ones(2, dtype=bool))
    with pytest.raises(InvalidArgumentError, match=r"allgather needs an array with at least one dimension"):
        await w.allgather(np.float32(1.0))
    with pytest.raises(InvalidArgumentError, match=r"reduce_scatter needs an array with at least one dimension"):
        await w.reduce_scatter(np.float32(1.0))


async def test_collectives_on_a_worker_that_was_never_started_raise_not_initialized_error(make_worker_config) -> None:
    w = Worker(config=make_worker_config("127.0.0.1:1"))
    for call in (
        lambda: w.allreduce(np.ones(2)),
        lambda: w.broadcast(np.ones(2)),
        lambda: w.allgather(np.ones(2)),
        lambda: w.reduce_scatter(np.ones(2)),
        w.barrier,
        lambda: w.broadcast_object(1),
        lambda: w.allgather_object(1),
    ):
        with pytest.raises(NotInitializedError, match=r"call start\(\) \(or ringserve.init\(\)\) first"):
            await call()
    with pytest.raises(NotInitializedError):
        _ = w.rank


@pytest.mark.parametrize("world", [2], indirect=True)
async def test_collectives_on_a_closed_worker_raise_not_initialized_error(world) -> None:
    w = world.workers[1]
    await w.close()
    with pytest.raises(NotInitializedError):
        await w.allreduce(np.ones(2))
    with pytest.raises(NotInitializedError):
        _ = w.size


@pytest.fixture
def not_initialized() -> Iterator[None]:
    ringserve.shutdown()
    assert not ringserve.is_initialized()
    yield
    ringserve.shutdown()


def test_the_sync_api_before_init_raises_not_initialized_error(not_initialized) -> None:
    for call in (
        lambda: ringserve.allreduce(np.ones(2)),
        lambda: ringserve.broadcast(np.ones(2)),
        lambda: ringserve.allgather(np.ones(2)),
        lambda: ringserve.reduce_scatter(np.ones(2)),
        ringserve.barrier,
        lambda: ringserve.broadcast_object(1),
        lambda: ringserve.allgather_object(1),
        ringserve.rank,
        ringserve.size,
        ringserve.local_rank,
        ringserve.local_size,
    ):
        with pytest.raises(NotInitializedError, match=r"ringserve is not initialized: call ringserve.init\(\) first."):
            call()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that is bound but not listening: connections to it are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


async def test_an_unreachable_coordinator_raises_coordinator_unreachable_error_naming_the_address(make_worker_config, closed_port) -> None:
    address = f"127.0.0.1:{closed_port}"
    w = Worker(config=make_worker_config(address, connect_timeout_s=0.5))
    start = time.monotonic()
    with pytest.raises(CoordinatorUnreachableError) as info:
        async with asyncio.timeout(10):
            await w.start()
    elapsed = time.monotonic() - start
    assert info.value.address == address
    assert f"The coordinator at {address} could not be reached within 0.5 s" in str(info.value)
    assert 0.4 <= elapsed < 5, elapsed
    with pytest.raises(NotInitializedError):
        await w.allreduce(np.ones(1))
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


def test_init_with_an_unreachable_coordinator_raises_and_leaves_nothing_running(not_initialized, closed_port) -> None:
    address = f"127.0.0.1:{closed_port}"
    before = set(threading.enumerate())
    with pytest.raises(CoordinatorUnreachableError, match=f"The coordinator at {address} could not be reached"):
        ringserve.init(coordinator=address, connect_timeout_s=0.5)
    assert not ringserve.is_initialized()
    leaked = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("ringserve")]
    assert leaked == []


@pytest.mark.parametrize("coordinator", [{"min_workers": 2}], indirect=True, ids=["min_workers=2"])
async def test_a_worker_whose_world_never_forms_raises_rendezvous_timeout_error(coordinator, make_worker_config) -> None:
    w = Worker(config=make_worker_config(coordinator.address, rendezvous_timeout_s=0.5))
    with pytest.raises(RendezvousTimeoutError, match=f"formed within 0.5 s \\(coordinator {coordinator.address}\\)"):
        async with asyncio.timeout(10):
            await w.start()
    with pytest.raises(NotInitializedError):
        await w.barrier()
    status = await coordinator.service.Status(pb.StatusRequest(), None)  # the worker left on its way out
    assert status.pending_workers == 0


@pytest.mark.parametrize("lane", ["off", "tcp"])
async def test_workers_set_to_different_chunk_sizes_fail_naming_the_setting(world_factory, lane: str) -> None:
    # Rank 0 cuts 1 MiB chunks, rank 1 256 KiB: each sees frames of sizes its program does not
    # expect. Over shared memory, and over the payload lane, where rank 1 refuses a frame larger
    # than its own chunk before reading it.
    world = await world_factory(2, each=lambda i: {"chunk_bytes": (1 << 20) if i == 0 else (256 << 10)},
                                payload_lane=lane, shared_memory=lane == "off")
    outcomes, _ = await outcomes_within(world, lambda w: w.allreduce(np.ones(1 << 21, dtype=np.float32), op="sum"))
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, ringserve.RingserveError), f"rank {rank} got {outcome!r}"
    named = [o for o in outcomes if isinstance(o, ringserve.ProtocolError) and "RINGSERVE_CHUNK_BYTES" in str(o)]
    # Over the lane, the rank that refuses a frame closes the lane, and its peer may see that close
    # (PeerUnavailableError) before it reads a frame of the wrong size itself.
    assert len(named) == 2 if lane == "off" else len(named) >= 1, outcomes
