"""The Horovod-style API on a real world of three processes, checked against what every rank sent.

One run of ``workers/api.py`` exercises the collectives, the state broadcasts, SyncBatchNorm, the
optimizer's synchronize protocol and the lifecycle; each test below checks one part of its results.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _worlds import DEVICES, WORKERS, device_env, run_world

sys.path.insert(0, str(WORKERS))
import api as worker

N = 3

pytestmark = pytest.mark.timeout(150)


def _run(tmp_path_factory: pytest.TempPathFactory, device: str, env: dict[str, str]) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("api")
    # The ring: the wire-bytes check compares a float32 tensor with a bfloat16 one of half its
    # bytes, which under auto could run another algorithm (the measured links decide), with
    # other traffic. The algorithms have their own tests (tests/unit/test_algorithms_sim.py).
    run_world(WORKERS / "api.py", N, out, timeout_s=120,
              env={"RINGSERVE_ALGORITHM": "ring", **device_env(device), **env})
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(N)]
    for res in results:
        res["asked_device"] = device
    return sorted(results, key=lambda res: res["topology"]["rank"])


@pytest.fixture(scope="module", params=DEVICES)
def ranks(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return _run(tmp_path_factory, request.param, {})


@pytest.fixture(scope="module")
def ranks_over_tcp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The same world with the shared-memory lane off: its payloads on the TCP lane, as between hosts."""
    return _run(tmp_path_factory, "cpu", {"RINGSERVE_SHARED_MEMORY": "0", "RINGSERVE_PAYLOAD_LANE": "tcp"})


def stacked(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.stack([worker.base(r, dtype) for r in range(N)])


def same_on_every_rank(ranks: list[dict[str, Any]], key: str) -> Any:
    first = ranks[0][key]
    for r in ranks[1:]:
        assert_equal(r[key], first, key)
    return first


def assert_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_topology_matches_horovods_functions(ranks: list[dict[str, Any]]) -> None:
    assert [r["topology"]["rank"] for r in ranks] == list(range(N))
    for r in ranks:
        t = r["topology"]
        assert (t["size"], t["local_size"], t["cross_size"], t["cross_rank"]) == (N, N, 1, 0)
        assert t["local_rank"] == t["rank"] and t["initialized"]
        assert t["built"] == [True, False, False, False]


def test_allreduce_reduces_with_every_op_and_option(ranks: list[dict[str, Any]]) -> None:
    x = stacked()
    expected = {
        "average": x.sum(0) / N, "sum": x.sum(0), "min": x.min(0).values, "max": x.max(0).values,
        "average_false": x.sum(0), "scaled": x.sum(0) * 2 * 0.25, "float64": stacked(torch.float64).sum(0) / N,
        "async": x.sum(0), "int16": stacked(torch.int16).sum(0, dtype=torch.int16),
        "bf16_tensor": stacked(torch.bfloat16).float().sum(0).to(torch.bfloat16),
    }
    for key, value in expected.items():
        got = same_on_every_rank(ranks, key)
        assert got.dtype == value.dtype, key
        torch.testing.assert_close(got, value, msg=key)
    torch.testing.assert_close(same_on_every_rank(ranks, "fp16"), x.sum(0) / N, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(same_on_every_rank(ranks, "bf16_compression"), x.sum(0), rtol=1e-2, atol=5e-2)
    # int8: a 254th of the block's largest partial sum per encoding, N + 1 encodings at most.
    int8_bound = float(x.abs().sum(0).max()) * (N + 1) / 254 / N
    torch.testing.assert_close(same_on_every_rank(ranks, "int8"), x.sum(0) / N, rtol=0, atol=int8_bound)
    grouped = same_on_every_rank(ranks, "int8_grouped")
    assert [t.dtype for t in grouped] == [torch.float32, torch.float64]
    for t in grouped:
        torch.testing.assert_close(t.float(), x.sum(0) / N, rtol=0, atol=int8_bound)
    # bfloat16 tensors are added in float32 but travel in two bytes per value.
    sent = ranks[0]["wire_bytes"]
    assert 0.49 < sent["torch.bfloat16"] / sent["torch.float32"] < 0.51, sent
    # Integers travel as they are: int8 compression leaves them exact.
    torch.testing.assert_close(same_on_every_rank(ranks, "int8_int32"), stacked(torch.int32).sum(0, dtype=torch.int32))


def test_in_place_and_async_forms_write_into_the_given_tensor(ranks: list[dict[str, Any]]) -> None:
    x = stacked()
    for r in ranks:
        same, value = r["inplace"]
        assert same and torch.equal(value, x.sum(0))
        same, value = r["async_inplace"]
        assert same and torch.equal(value, x.max(0).values)
        same, values = r["grouped_inplace"]
        assert same and torch.equal(values[1], stacked(torch.float64).sum(0))


def test_grouped_allreduce_reduces_tensors_of_mixed_dtypes(ranks: list[dict[str, Any]]) -> None:
    expected = [stacked().sum(0), stacked(torch.float64).sum(0), stacked(torch.int64).sum(0), stacked()[:, 0].sum(0)]
    for key in ("grouped", "grouped_async"):
        for g, e in zip(same_on_every_rank(ranks, key), expected, strict=True):
            assert g.dtype == e.dtype and torch.equal(g, e), key


def test_allreduce_allgather_and_broadcast_are_differentiable(ranks: list[dict[str, Any]]) -> None:
    # d/dx_r of sum_k (k + 1) * allreduce(x): the backward sums every rank's upstream gradient.
    for r in ranks:
        torch.testing.assert_close(r["allreduce_grad"], torch.full((2, 3), float(sum(k + 1 for k in range(N)))))
    weights = torch.arange(2.0 * sum(k + 1 for k in range(N))).reshape(-1, 2)
    offset = 0
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["allgather_grad"], weights[offset: offset + rank + 1])
        offset += rank + 1


def test_allgather_concatenates_uneven_rows_bit_for_bit_in_any_dtype(ranks: list[dict[str, Any]]) -> None:
    rows = torch.cat([worker.gathered_rows(r) for r in range(N)])
    assert torch.equal(same_on_every_rank(ranks, "allgather"), rows)
    assert torch.equal(same_on_every_rank(ranks, "allgather_async"), rows)
    assert_equal(same_on_every_rank(ranks, "allgather_bf16"),
                 torch.cat([worker.gathered_rows(r).to(torch.bfloat16) / 3 for r in range(N)]), "bf16")
    assert_equal(same_on_every_rank(ranks, "allgather_bool"), rows > 0.5, "bool")


def test_broadcast_forms_give_every_rank_the_roots_tensor(ranks: list[dict[str, Any]]) -> None:
    assert_equal(same_on_every_rank(ranks, "broadcast"), worker.base(1), "broadcast")
    for r in ranks:
        same, value = r["broadcast_inplace_bf16"]
        assert same
        assert_equal(value, worker.base(2, torch.bfloat16) / 3, "broadcast_ bf16")
    assert_equal(same_on_every_rank(ranks, "broadcast_async_inplace"), worker.base(0, torch.int64), "async_")


def test_reducescatter_gives_each_rank_its_rows_of_the_sum(ranks: list[dict[str, Any]]) -> None:
    total = torch.arange(10.0).reshape(5, 2) * sum(r + 1 for r in range(N))
    parts = [r["reducescatter"] for r in ranks]
    assert [p.shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat(parts), total)


def test_objects_barrier_and_join(ranks: list[dict[str, Any]]) -> None:
    assert same_on_every_rank(ranks, "broadcast_object") == {"from": 1, "list": [1, 1, 1]}
    assert same_on_every_rank(ranks, "allgather_object") == [("rank", r) for r in range(N)]
    last = same_on_every_rank(ranks, "join")
    assert 0 <= last < N


def test_adasum_on_a_world_of_three_fails_as_horovods_does(ranks: list[dict[str, Any]]) -> None:
    errors = ranks[0]["errors"]
    for label in ("adasum", "optimizer_adasum"):
        assert errors[label].startswith("UnsupportedError: Running Adasum with non-power of 2 ranks"), errors[label]


def test_broadcast_parameters_makes_every_rank_equal_to_the_root(ranks: list[dict[str, Any]]) -> None:
    state = same_on_every_rank(ranks, "parameters_state_dict")
    assert state["bn.num_batches_tracked"].item() == 1  # rank 0's, not this rank's
    assert state["bn.running_mean"].sum().item() == 0.0
    named = same_on_every_rank(ranks, "parameters_named")
    assert named["out.weight"].dtype == torch.float64
    assert not torch.equal(named["fc.weight"], state["fc.weight"])  # from root 1, another seed


def test_broadcast_optimizer_state_makes_every_rank_equal_to_the_root(ranks: list[dict[str, Any]]) -> None:
    state = same_on_every_rank(ranks, "optimizer_state")
    group = state["param_groups"][0]
    assert group["lr"] == pytest.approx(0.01) and group["betas"] == (0.8, 0.9)
    assert torch.allclose(state["state"][0]["exp_avg"], torch.full((4, 5), 0.2))  # rank 0's gradient of 1
    fresh = same_on_every_rank(ranks, "optimizer_fresh")
    # Made before the broadcast, as Horovod makes it: one step on zero gradients.
    assert fresh["state"] and all(not entry["momentum_buffer"].any() for entry in fresh["state"].values())
    assert fresh["param_groups"][0]["lr"] == pytest.approx(0.3)
    assert fresh["param_groups"][0]["momentum"] == pytest.approx(1.0)


@pytest.mark.parametrize("label, kind", [("bn1d", torch.nn.BatchNorm1d), ("bn2d", torch.nn.BatchNorm2d)])
def test_sync_batch_norm_matches_batch_norm_on_the_concatenated_batch(
    ranks: list[dict[str, Any]], label: str, kind: type[torch.nn.Module]
) -> None:
    shape = (4, 5) if label == "bn1d" else (3, 2, 2)
    module = worker.bn_module(kind, shape[0])
    xs, ws = zip(*(worker.bn_batch(r, shape) for r in range(N)), strict=True)
    x = torch.cat(xs).requires_grad_()
    for _ in range(2):
        x.grad = None
        module.zero_grad()
        y = module(x)
        (y * torch.cat(ws)).sum().backward()
    offsets = [0]
    for part in xs:
        offsets.append(offsets[-1] + part.shape[0])
    close = dict(rtol=1e-4, atol=1e-5)
    for rank, r in enumerate(ranks):
        got = r[label]
        rows = slice(offsets[rank], offsets[rank + 1])
        torch.testing.assert_close(got["y"], y.detach()[rows], **close)
        torch.testing.assert_close(got["x_grad"], x.grad[rows], **close)
        torch.testing.assert_close(got["running_mean"], module.running_mean, **close)
        torch.testing.assert_close(got["running_var"], module.running_var, **close)
        assert got["num_batches_tracked"].item() == 2
        torch.testing.assert_close(got["weight_grad"], module.weight.grad, **close)
        torch.testing.assert_close(got["bias_grad"], module.bias.grad, **close)
        torch.testing.assert_close(got["eval_y"], module.eval()(xs[rank]).detach(), **close)
        module.train()


def test_optimizer_synchronize_protocol(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "cannot zero the gradients between loss.backward() and step()" in r["zero_grad_between"]
        assert r["optimizer_isinstance"] and r["param_groups_shared"]
    # d/dW sum(W x + b) = x, with x = (rank + 1) * ones, averaged over ranks: 2 for three ranks.
    assert torch.equal(same_on_every_rank(ranks, "synchronized_grad"), torch.full((2, 4), 2.0))
    # Rank 1 ran no backward: ranks 0 and 2 contribute 1 and 3, rank 1 zeros, averaged over 3.
    assert torch.equal(same_on_every_rank(ranks, "grad_without_rank_1"), torch.full((2, 4), 4.0 / 3.0))
    for r in ranks:
        assert "more than backward_passes_per_step (1)" in r["too_many_passes"]


def test_state_and_collectives_of_cpu_tensors_under_another_default_device(ranks: list[dict[str, Any]]) -> None:
    # broadcast_parameters and broadcast_optimizer_state made their host buffers on torch's default
    # device (found on a GPU: "can't convert cuda:0 device type tensor to numpy").
    got = same_on_every_rank(ranks, "default_device_elsewhere")
    assert torch.equal(got["broadcast"], torch.full((3,), 1.0))
    assert got["lr"] == pytest.approx(0.2)
    assert torch.equal(got["summed"], torch.full((3,), float(sum(range(N)))))


def test_every_result_is_on_the_device_of_the_inputs(ranks: list[dict[str, Any]]) -> None:
    # The optimizers' states hold torch's own host tensors beside the device ones (Adam's step counts).
    for r in ranks:
        device = r["asked_device"]
        wrong = {key: seen for key, seen in r["devices"].items()
                 if seen and key not in ("optimizer_state", "optimizer_fresh", "default_device_elsewhere")
                 and seen != [device]}
        assert not wrong, f"rank {r['topology']['rank']}: results not on {device}: {wrong}"
        assert len([key for key, seen in r["devices"].items() if seen == [device]]) >= 30


def test_shutdown_leaves_no_task_or_thread_and_init_works_again(ranks: list[dict[str, Any]]) -> None:
    _shut_down_clean(ranks)


def test_shutdown_over_tcp_lanes_leaves_no_thread_without_a_garbage_collection(
        ranks_over_tcp: list[dict[str, Any]]) -> None:
    # A lane's reader and the lane held each other, and the lane held the stream's route: the
    # plane, its links and their gRPC channels, whose poller thread then outlived hvd.shutdown()
    # until Python's next garbage collection.
    _shut_down_clean(ranks_over_tcp)
    same_on_every_rank(ranks_over_tcp, "sum")
    assert torch.equal(ranks_over_tcp[0]["sum"], stacked().sum(0))


def _shut_down_clean(ranks: list[dict[str, Any]]) -> None:
    x = stacked()
    for r in ranks:
        assert r["threads_before_init"] == ["MainThread"]
        assert r["tasks_after_close"] == []
        assert r["threads_after_shutdown"] == ["MainThread"]
        assert r["initialized_after_shutdown"] is False
        size, total = r["after_reinit"]
        assert size == N and torch.equal(total, x.sum(0))
        assert r["threads_after_second_shutdown"] == ["MainThread"]
