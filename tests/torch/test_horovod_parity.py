"""What code written for Horovod relies on beyond the collectives' results, on a real world of two.

One run of ``workers/parity.py`` exercises errors, duplicate names, scaled integer reductions, Product, the
optimizer state made before the first step, the synchronize warning, sparse gradients, the
timeline API and ``hvd.elastic``; each test below checks one part of its results.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _worlds import WORKERS, run_world

sys.path.insert(0, str(WORKERS))
import parity as worker

N = 2

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("parity")
    run_world(WORKERS / "parity.py", N, out, timeout_s=120)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(N)]


def same_on_every_rank(ranks: list[dict[str, Any]], key: str) -> Any:
    first = ranks[0][key]
    for other in ranks[1:]:
        value = other[key]
        if isinstance(first, torch.Tensor):
            assert value.dtype == first.dtype and torch.equal(value, first), key
        else:
            assert value == first, key
    return first


def test_a_mismatch_of_shape_dtype_or_root_is_a_runtime_error_but_no_internal_error(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["errors"] == {
            "shape": ("MismatchError", False),
            "dtype": ("MismatchError", False),
            "root": ("MismatchError", False),
        }
        assert torch.equal(r["after_errors"], torch.full((2,), float(N)))


def test_a_second_collective_of_a_name_in_flight_is_refused_with_a_value_error(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["duplicates_refused"] == {
            kind: ["InvalidArgumentError"] for kind in ("allreduce", "allgather", "broadcast", "reducescatter")
        }
    results = ranks[0]["duplicate_results"]
    assert torch.equal(results["allreduce"], torch.full((3,), float(N)))
    assert torch.equal(results["allgather"], torch.ones(N, 2))
    assert torch.equal(results["broadcast"], torch.zeros(2))
    for r in ranks:
        assert torch.equal(r["duplicate_results"]["allreduce"], results["allreduce"])
        assert torch.equal(r["name_reused"], torch.full((3,), float(N)))


def test_a_dropped_handle_holds_its_name_until_its_caller_has_waited_since(ranks: list[dict[str, Any]]) -> None:
    kinds = ("allreduce", "allgather", "broadcast", "reducescatter")
    assert ranks[0]["dropped_refused"] == {}
    for r in ranks[1:]:
        assert r["dropped_refused"] == {kind: "InvalidArgumentError" for kind in kinds}
    expected = {
        "allreduce": torch.full((3,), float(N)),
        "allgather": torch.ones(N, 2),
        "broadcast": torch.zeros(2),
        "reducescatter": torch.full((2,), float(N)),
    }
    for r in ranks:
        for kind in kinds:
            assert torch.equal(r["dropped_reused"][kind], expected[kind]), kind
            assert torch.equal(r["polled_reused"][kind], torch.stack([expected[kind]] * 2)), kind


def test_scaled_integer_reductions_keep_their_dtype_and_scale_in_float64(ranks: list[dict[str, Any]]) -> None:
    inputs = [worker.ints(r) for r in range(N)]
    pre = sum((x.double() * 0.7).to(torch.int32) for x in inputs)
    post = (sum(x.double() for x in inputs) * 0.7).to(torch.int32)
    assert isinstance(pre, torch.Tensor) and isinstance(post, torch.Tensor)
    for key, expected in {"int_prescale": pre, "int_postscale": post, "int_postscale_inplace": post}.items():
        got = same_on_every_rank(ranks, key)
        assert got.dtype == torch.int32 and torch.equal(got, expected), key
    halves = torch.tensor_split(post, N)
    for r, result in enumerate(ranks):
        got = result["int_reducescatter_postscale"]
        assert got.dtype == torch.int32 and torch.equal(got, halves[r])


def test_product_multiplies_across_ranks(ranks: list[dict[str, Any]]) -> None:
    expected_float = torch.stack([worker.floats(r) for r in range(N)]).prod(0)
    expected_int = torch.stack([worker.ints(r) for r in range(N)]).prod(0)
    torch.testing.assert_close(same_on_every_rank(ranks, "product_float"), expected_float)
    got = same_on_every_rank(ranks, "product_int")
    assert got.dtype == torch.int32 and torch.equal(got, expected_int)


def test_grouped_allreduce_is_differentiable_as_allreduce_is(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        first, second = r["grouped_grads"]
        assert torch.equal(first, torch.full((8,), float(N))) and first.dtype == torch.float32
        assert torch.equal(second, torch.full((2, 2), 2.0 * N)) and second.dtype == torch.float64


def test_reducescatter_is_differentiable_with_horovods_scaling(ranks: list[dict[str, Any]]) -> None:
    # Every rank's rows of the gradient, gathered; for Sum scaled by the world size, as in Horovod.
    rows = torch.arange(1.0, 4.0).expand(4, 3) * 0.5
    for r in ranks:
        torch.testing.assert_close(r["reducescatter_grad_Sum"], rows * N)
        torch.testing.assert_close(r["reducescatter_grad_Average"], rows)


def test_broadcast_optimizer_state_before_the_first_step_makes_the_state_first(ranks: list[dict[str, Any]]) -> None:
    state = ranks[0]["initial_state"]
    assert len(state["state"]) == 2  # weight and bias; not the frozen parameter
    for r in ranks:
        assert r["initial_params_kept"]
        assert r["initial_state"]["param_groups"][0]["lr"] == 0.1  # rank 0's
        for pid, entry in state["state"].items():
            for k, v in entry.items():
                assert torch.equal(r["initial_state"]["state"][pid][k], v), (pid, k)
        weight_grad, bias_grad, frozen_grad = r["initial_grads"]
        assert torch.equal(weight_grad, torch.zeros(2, 3)) and torch.equal(bias_grad, torch.zeros(2))
        assert frozen_grad is None
    after = [r["after_step"] for r in ranks]
    for key in after[0]:
        assert torch.equal(after[0][key], after[1][key]), key


def test_horovods_positional_arguments_mean_what_they_mean_there(ranks: list[dict[str, Any]]) -> None:
    summed = sum(torch.arange(2.0 * N).reshape(2 * N, 1) + r for r in range(N))
    state = ranks[0]["sparse_state"]
    assert state["state"][0]["momentum_buffer"].is_sparse  # the Embedding's, made from a sparse zero
    assert not state["state"][1]["momentum_buffer"].is_sparse  # the Linear's weight
    for rank, r in enumerate(ranks):
        assert torch.equal(r["positional_reducescatter"], summed[2 * rank: 2 * rank + 2])  # op=Sum, not compression
        assert r["sparse_grads"] == [True, False, False]
        assert r["sparse_state"]["param_groups"][0]["lr"] == 0.1  # rank 0's
        for pid, entry in state["state"].items():
            got = r["sparse_state"]["state"][pid]["momentum_buffer"]
            assert got.is_sparse == entry["momentum_buffer"].is_sparse
            assert torch.equal(got.to_dense(), entry["momentum_buffer"].to_dense()), pid
        assert r["bad_model"] == "InvalidArgumentError"


def test_step_after_synchronize_without_skip_synchronize_warns(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        warned = r["step_warnings"]
        assert len(warned["forgotten"]) == 1
        assert "optimizer.step() called without optimizer.skip_synchronize()" in warned["forgotten"][0]
        assert warned["skipped"] == [] and warned["plain"] == []


def test_sparse_allreduce_gathers_indices_and_values_into_the_dense_reduction(ranks: list[dict[str, Any]]) -> None:
    dense = torch.stack([worker.sparse_rows(r).to_dense() for r in range(N)])
    for r in ranks:
        is_sparse, value = r["sparse_gathered"]
        assert is_sparse
        torch.testing.assert_close(value, dense.mean(0))
        torch.testing.assert_close(r["sparse_sum"], dense.sum(0))
        torch.testing.assert_close(r["sparse_none_on_rank0"], dense[1:].sum(0))


def test_sparse_gradients_reach_sparse_adam_averaged_with_or_without_sparse_as_dense(ranks: list[dict[str, Any]]) -> None:
    torch.manual_seed(5)
    embedding = torch.nn.Embedding(6, 3, sparse=True)
    grads = []
    for r in range(N):
        embedding.zero_grad()
        embedding(worker.tokens(r)).sum().backward()
        assert embedding.weight.grad is not None
        grads.append(embedding.weight.grad.to_dense())
    expected = torch.stack(grads).mean(0)
    for as_dense in (False, True):
        for r in ranks:
            is_sparse, grad = r[f"sparse_grad_{as_dense}"]
            assert is_sparse, as_dense
            torch.testing.assert_close(grad, expected)
        weights = [r[f"sparse_weight_{as_dense}"] for r in ranks]
        torch.testing.assert_close(weights[0], weights[1])
    torch.testing.assert_close(ranks[0]["sparse_weight_False"], ranks[0]["sparse_weight_True"])


def test_the_timeline_api_writes_horovods_names_between_start_and_stop(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        events = r["timeline"]
        names = {e["name"] for e in events}
        assert {"start_time_since_epoch_in_micros", "NEGOTIATE_ALLREDUCE", "ALLREDUCE",
                "NEGOTIATE_BROADCAST", "BROADCAST", "CYCLE_START"} <= names
        rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert {"allreduce.traced", "broadcast.traced"} <= rows
        assert not any("before_start" in row or "after_stop" in row for row in rows)


def test_hvd_elastic_runs_after_the_plain_import_with_an_elastic_sampler(ranks: list[dict[str, Any]]) -> None:
    first = [r["sampler_first"] for r in ranks]
    assert sorted(first[0] + first[1]) == list(range(10))  # dealt without overlap
    for r in ranks:
        assert r["elastic_run"] == N
        assert r["restored_sampler"] == {"epoch": 0, "processed_num": 2 * N, "processed_indices": []}
        # Synced: rank 0's position, and the indices every rank recorded.
        assert r["synced_sampler"] == {"epoch": 0, "processed_num": 2 * N, "processed_indices": [100, 101]}
        assert r["state_attrs"] == (0, True, True, True)
        assert r["resets"] == []  # no world change, no reset
    after = [r["sampler_after"] for r in ranks]
    done = set(first[0][:2] + first[1][:2])
    assert sorted(after[0] + after[1]) == sorted(set(range(10)) - done)

