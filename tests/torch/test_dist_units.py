"""The torch.distributed backend's parts that need no world: settings, ops, Work and its threads.

The failure path of a Work is checked under real DDP too (workers/dist_one_rank.py): a one-rank
process group whose ops complete through ringserve's Work (the part under test), one failing.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist_worlds import DIST_WORKERS, REPO

from ringserve.errors import InvalidArgumentError, PeerUnavailableError
from ringserve.launch.env import torch_env
from ringserve.launch.hosts import Slot
from ringserve.torch.distributed import Options, ops
from ringserve.torch.distributed.rendezvous import _check, _store_host
from ringserve.torch.distributed.settings import Settings
from ringserve.torch.distributed.work import Completer, RingserveWork

# -- settings -----------------------------------------------------------------------------------


def test_options_win_over_the_environment_and_the_environment_over_the_defaults() -> None:
    env = {"RINGSERVE_COMPRESSION": "bf16", "RINGSERVE_COORDINATOR": "h:1"}
    assert Settings.from_env(None, env).compression == "bf16"
    assert Settings.from_env(Options(compression="int8"), env).compression == "int8"
    assert Settings.from_env(Options(compression="none"), env).compression is None
    assert Settings.from_env(None, {}).compression is None
    assert Settings.from_env(None, env).coordinator == "h:1"
    assert Settings.from_env(Options(coordinator=""), env).coordinator == ""
    assert Settings.from_env(None, {}).error_feedback is True
    assert Settings.from_env(None, {"RINGSERVE_ERROR_FEEDBACK": "0"}).error_feedback is False
    assert Settings.from_env(None, {"RINGSERVE_COLLECTIVE_TIMEOUT_S": "5"}).timeout_from_env is True


def test_bad_settings_are_refused_naming_the_value() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'zstd' is not supported; use one of none, fp16, bf16, int8"):
        Settings.from_env(Options(compression="zstd"), {})
    with pytest.raises(InvalidArgumentError, match=r"takes pg_options=ringserve.torch.distributed.Options"):
        Settings.from_env({"compression": "fp16"}, {})
    with pytest.raises(InvalidArgumentError, match=r"coordinator_port \(70000\)"):
        Settings.from_env(Options(coordinator_port=70000), {})
    with pytest.raises(InvalidArgumentError, match=r"address \('nohost'\) must have the form host:port"):
        Settings.from_env(Options(coordinator="nohost"), {})


def test_ringserve_run_gives_torchruns_variables() -> None:
    one_host = Slot(host="h", rank=1, local_rank=1, local_size=4, cross_rank=0, cross_size=1, size=4)
    assert torch_env(one_host, "127.0.0.1", 2345) == {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
        "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "2345",
    }
    second_host = Slot(host="b", rank=5, local_rank=1, local_size=4, cross_rank=1, cross_size=2, size=8)
    assert torch_env(second_host, "a", 2345) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "8", "MASTER_ADDR": "a", "MASTER_PORT": "2345",
    }


def test_a_view_that_disagrees_with_torchs_rank_or_size_is_refused_naming_both() -> None:
    context: Any = SimpleNamespace(worker=SimpleNamespace(rank=1, size=2, view_id=3))
    _check(context, 1, 2, "c:1")
    _check(context, -1, -1, "c:1")
    with pytest.raises(InvalidArgumentError, match=r"given world_size=4, but ringserve's first view \(view 3, coordinator c:1\) has 2"):
        _check(context, 1, 4, "c:1")
    with pytest.raises(InvalidArgumentError, match=r"given rank=7, .* made this process rank 1 of 2"):
        _check(context, 7, 2, "c:1")


def test_rank_0_advertises_its_coordinator_on_the_host_of_torchs_store() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert _store_host(dist.PrefixStore("a/", dist.PrefixStore("b", store))) == "127.0.0.1"
    assert _store_host(dist.HashStore()) == "127.0.0.1"


# -- ops ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "core"), [(dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "average"),
                                          (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.MAX, "max"),
                                          (dist.ReduceOp.PRODUCT, "product"), (dist.ReduceOp.BAND, "band"),
                                          (dist.ReduceOp.BOR, "bor"), (dist.ReduceOp.BXOR, "bxor")])
def test_torchs_reduce_ops_map_onto_ringserves(op: Any, core: str) -> None:
    assert ops.core_op(op, "all_reduce") == core
    assert ops.core_op(dist.ReduceOp(op), "all_reduce") == core


@pytest.mark.parametrize(("op", "core"), [(dist.ReduceOp.SUM, "max"), (dist.ReduceOp.MAX, "max"),
                                          (dist.ReduceOp.BOR, "max"), (dist.ReduceOp.PRODUCT, "min"),
                                          (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.BAND, "min"),
                                          (dist.ReduceOp.BXOR, "bxor")])
def test_bool_tensors_reduce_as_gloo_reduces_them_any_all_or_odd(op: Any, core: str) -> None:
    assert ops.core_op(op, "all_reduce", torch.bool) == core


@pytest.mark.parametrize("op", [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR])
def test_the_bitwise_reduce_ops_of_floats_are_refused_naming_the_op_and_the_dtype(op: Any) -> None:
    with pytest.raises(ValueError, match=f"Cannot use ReduceOp.{op.name} with non-integral dtype torch.bfloat16"):
        ops.core_op(op, "reduce_scatter", torch.bfloat16)
    assert ops.core_op(op, "reduce_scatter", torch.int16) == op.name.lower()


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_avg_of_integers_is_refused_as_gloo_refuses_it(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=r"AVG .* result type Float can't be cast"):
        ops.core_op(dist.ReduceOp.AVG, "all_reduce", dtype)
    assert ops.core_op(dist.ReduceOp.AVG, "all_reduce", torch.float16) == "average"


def test_premul_sum_is_refused_naming_what_to_use() -> None:
    with pytest.raises(NotImplementedError, match=r"PREMUL_SUM is not supported.*multiply the tensor"):
        ops.core_op(dist._make_nccl_premul_sum(2.0), "all_reduce", torch.float32)


def test_tensors_travel_as_their_bytes_and_come_back_bit_for_bit() -> None:
    for t in [torch.randn(3, 4).t(), torch.tensor([True, False]), torch.randn(5).to(torch.bfloat16), torch.tensor(3.5)]:
        data = ops.as_bytes(t)
        assert data.dtype == np.uint8 and data.nbytes == t.numel() * t.element_size()
        out = torch.empty_like(t)
        ops.fill(out, data.copy())
        assert torch.equal(out, t)
    with pytest.raises(InvalidArgumentError, match=r"Received 3 bytes for a tensor of \(2,\) torch.float32"):
        ops.fill(torch.zeros(2), np.zeros(3, np.uint8))


def test_error_feedback_residuals_follow_the_tensor_and_only_the_newest_are_kept() -> None:
    residuals = ops.Residuals()
    t = torch.zeros(10)
    first = residuals.of(t, t.numpy())
    assert first.dtype == np.float32 and first.size == 10 and residuals.of(t, t.numpy()) is first
    others = [torch.zeros(3) for _ in range(ops.RESIDUALS_KEPT)]
    for o in others:
        residuals.of(o, o.numpy())
    assert residuals.of(t, t.numpy()) is not first  # the least recently used went first
    assert residuals.of(others[-1], others[-1].numpy()) is residuals.of(others[-1], others[-1].numpy())


# -- work ---------------------------------------------------------------------------------------


def _completing(value: Any = None, error: BaseException | None = None, delay_s: float = 0.0,
                thread_name: str = "fake-loop") -> concurrent.futures.Future[Any]:
    """A concurrent future completed by another thread, as ringserve's loop completes its calls."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        time.sleep(delay_s)
        future.set_exception(error) if error is not None else future.set_result(value)

    threading.Thread(target=run, name=thread_name).start()
    return future


def test_a_failed_op_raises_dist_backend_error_caused_by_ringserves_error() -> None:
    completer = Completer(10.0)
    cause = PeerUnavailableError("The stream from rank 2 of view 1 broke.")
    work = completer.track("all_reduce", [_completing(error=cause)], lambda results: results)
    with pytest.raises(dist.DistBackendError, match=r"ringserve: all_reduce failed: PeerUnavailableError: The stream") as got:
        work.wait()
    assert got.value.__cause__ is cause and work.is_completed() and not work.is_success()
    # The future fails in C++ terms (DDP's reducer sees a failure, not a value), naming the error.
    with pytest.raises(RuntimeError, match=r"DistBackendError: ringserve: all_reduce failed"):
        work.get_future().wait()
    with pytest.raises(RuntimeError, match=r"DistBackendError"):
        work.get_future().then(lambda f: f.value()).wait()
    completer.close()


def test_an_argument_error_stays_a_value_error() -> None:
    completer = Completer(10.0)
    work = completer.track("broadcast", [_completing(error=InvalidArgumentError("root 9"))], lambda r: r)
    with pytest.raises(InvalidArgumentError, match=r"root 9"):
        work.wait()
    completer.close()


def test_callbacks_run_on_completion_threads_not_on_ringserves_loop() -> None:
    completer = Completer(10.0)
    ran_on: list[str] = []
    work = completer.track("all_reduce", [_completing(1, delay_s=0.05)], lambda results: [torch.ones(1) * results[0]])
    chained = work.get_future().then(lambda f: ran_on.append(threading.current_thread().name) or f.value()[0] + 1)
    assert torch.equal(chained.wait(), torch.tensor([2.0]))
    assert ran_on and ran_on[0].startswith("ringserve-dist"), ran_on
    completer.close()


def test_a_callback_that_waits_for_another_op_does_not_deadlock_the_completions() -> None:
    # PowerSGD's hook starts an all_reduce inside a callback and waits for it there.
    completer = Completer(10.0)
    inner: list[RingserveWork] = []

    def nested(_: Any) -> torch.Tensor:
        work = completer.track("all_reduce", [_completing(5, delay_s=0.05)], lambda r: [torch.tensor(float(r[0]))])
        inner.append(work)
        return work.get_future().wait()[0]

    outer = completer.track("all_reduce", [_completing(1)], lambda r: [torch.tensor(1.0)])
    chained = outer.get_future().then(nested)
    assert chained.wait().item() == 5.0
    completer.close()


def test_every_part_must_finish_and_the_first_error_wins() -> None:
    completer = Completer(10.0)
    work = completer.track("all_gather_coalesced", [_completing(1, delay_s=0.1), _completing(2)], lambda r: r)
    assert work.get_future().wait() == [1, 2]
    failing = completer.track("x", [_completing(1), _completing(error=PeerUnavailableError("gone"), delay_s=0.05)],
                              lambda r: r)
    with pytest.raises(dist.DistBackendError, match=r"PeerUnavailableError: gone"):
        failing.wait()
    broken = completer.track("x", [_completing(1)], lambda r: 1 / 0)
    with pytest.raises(dist.DistBackendError, match=r"ZeroDivisionError"):
        broken.wait()
    completer.close()


def test_a_wait_with_a_timeout_gives_up_with_dist_backend_error() -> None:
    completer = Completer(10.0)
    slow = _completing(1, delay_s=2.0)
    work = completer.track("barrier", [slow], lambda r: [])
    t0 = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"barrier Timed out: it did not complete within 0.2 s"):
        work.wait(timedelta(seconds=0.2))
    assert time.monotonic() - t0 < 1.5
    assert work.wait() is True  # the op itself still finishes
    completer.close()


def test_ddp_raises_a_failed_op_from_backward_instead_of_crashing() -> None:
    # Future.set_exception only stores the error as the future's value; DDP's reducer, reading it
    # as tensors, took the process down with a segmentation fault. In a process of its own, so
    # that a crash fails this test only.
    result = subprocess.run([sys.executable, str(DIST_WORKERS / "dist_one_rank.py")], capture_output=True, text=True,
                            timeout=100, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcomes[:2] == ["ok", "ok"]
    assert "DistBackendError: ringserve: op failed: PeerUnavailableError: gone" in outcomes[2], outcomes


# -- all_to_all_single's split sizes, as torch checks them ----------------------------------------


@pytest.mark.parametrize(("shape", "splits", "size", "want"), [
    ((6, 2), [], 3, [16, 16, 16]),                  # even: 2 rows of 2 float32 each
    ((5, 2), [3, 0, 2], 3, [24, 0, 16]),
    ((4,), [1, 3], 2, [4, 12]),
    ((), [], 1, [4]),                                # a 0-dim tensor is one row
])
def test_all_to_all_splits_become_byte_counts_per_rank(shape: tuple[int, ...], splits: list[int], size: int,
                                                       want: list[int]) -> None:
    assert ops._split("input", splits, torch.zeros(shape), size) == (want, "")


@pytest.mark.parametrize(("shape", "splits", "size", "words"), [
    ((5, 2), [], 3, "5 rows along dim 0, which is not a multiple of the group's size (3): pass input_split_sizes"),
    ((5, 2), [3, 2], 3, "have 2 entries, not one per rank (3)"),
    ((5, 2), [3, 3, 0], 3, "must be non-negative and sum to its 5 rows"),
    ((5, 2), [6, -1, 0], 3, "must be non-negative"),
])
def test_wrong_all_to_all_splits_are_named(shape: tuple[int, ...], splits: list[int], size: int, words: str) -> None:
    counts, problem = ops._split("input", splits, torch.zeros(shape), size)
    assert counts == [] and words in problem
