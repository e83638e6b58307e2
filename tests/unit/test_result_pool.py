"""The result pool (ringserve/worker/dataplane/pool.py): a buffer goes out again only once nothing outside
the pool can reach it, and the pool never holds more than its capacity."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.worker.dataplane.pool import ResultPool

F32 = np.dtype(np.float32)
N = 1 << 18  # 1 MiB of float32


def base(a: np.ndarray) -> np.ndarray:
    return a if a.base is None else a.base


def test_a_buffer_is_reused_once_its_result_is_dropped() -> None:
    pool = ResultPool(64 << 20)
    first = pool.array(F32, N)
    kept = id(base(first))  # not a reference: that would keep it
    del first
    again = pool.array(F32, N)
    assert id(base(again)) == kept and pool.reused == 1


def test_a_result_still_held_is_never_handed_out_again() -> None:
    pool = ResultPool(64 << 20)
    first = pool.array(F32, N)
    first[:] = 7
    second = pool.array(F32, N)
    second[:] = 1
    assert (first == 7).all() and base(second) is not base(first) and pool.reused == 0


@pytest.mark.parametrize("hold", [
    lambda a: a.reshape(512, -1),  # what allreduce returns: a reshaped view
    lambda a: a[10:20],
    memoryview,
    lambda a: np.frombuffer(a, dtype=np.uint8),
    lambda a: a.view(np.int32),
])
def test_any_view_or_export_of_a_result_keeps_its_buffer_out_of_reach(hold) -> None:
    pool = ResultPool(64 << 20)
    result = pool.array(F32, N)
    held = hold(result)
    del result
    other = pool.array(F32, N)
    assert pool.reused == 0
    assert not np.shares_memory(np.asarray(held).view(np.uint8), other.view(np.uint8))


def test_a_torch_tensor_made_from_a_result_keeps_its_buffer() -> None:
    torch = pytest.importorskip("torch")
    pool = ResultPool(64 << 20)
    result = pool.array(F32, N)
    tensor = torch.from_numpy(result[: N // 2])
    del result
    pool.array(F32, N)
    assert pool.reused == 0
    del tensor
    pool.array(F32, N)
    assert pool.reused == 1


def test_a_loop_of_new_results_cycles_through_two_buffers() -> None:
    pool = ResultPool(64 << 20)
    out = pool.array(F32, N)
    seen = set()
    for _ in range(10):
        out = pool.array(F32, N)  # the last result is alive while the next is made
        seen.add(id(base(out)))
    assert len(seen) == 2 and pool.reused == 9


def test_the_pool_holds_at_most_its_capacity_forgetting_free_buffers_first() -> None:
    pool = ResultPool(3 << 20)
    live = [pool.array(F32, N) for _ in range(2)]
    dropped = pool.array(F32, N)
    del dropped
    assert pool.held_bytes == 3 << 20
    big = pool.array(np.dtype(np.uint8), 2 << 20)  # room for it: the free buffer goes first
    assert pool.held_bytes <= 3 << 20
    assert all(any(base(x) is h for h in pool._held) for x in live[1:])
    del big, live


def test_small_and_oversized_arrays_are_plain_allocations_and_zero_capacity_is_no_pool() -> None:
    pool = ResultPool(4 << 20)
    pool.array(F32, 16)
    pool.array(F32, 2 << 20)  # 8 MiB, over the capacity
    assert pool.held_bytes == 0
    off = ResultPool(0)
    off.array(F32, N)
    off.array(F32, N)
    assert off.held_bytes == 0 and off.reused == 0


def test_a_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match=r"-1"):
        ResultPool(-1)
