"""The binding's pure parts, in this process and without a world: bucket planning, tensor
conversion, compression, ops, configuration, and the optimizer wrapper's delegation."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import ringserve.torch as hvd
from ringserve.errors import InvalidArgumentError
from ringserve.torch import _tensors
from ringserve.torch._buckets import DEFAULT_FUSION_BYTES, fusion_bytes_from_env, plan


def params(*shapes: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in shapes]


def positions(buckets: list[list[torch.nn.Parameter]], ps: list[torch.nn.Parameter]) -> list[list[int]]:
    ids = [id(p) for p in ps]
    return [[ids.index(id(p)) for p in bucket] for bucket in buckets]


def test_buckets_take_parameters_in_reverse_order_until_they_hold_the_fusion_size() -> None:
    ps = params(10, 10, 30, 5)  # 40, 40, 120, 20 bytes
    buckets = plan(ps, fusion_bytes=80, groups=None)
    # The 20 bytes ride with the 120 that take the bucket past 80, not alone (as DDP's buckets).
    assert positions(buckets, ps) == [[3, 2], [1, 0]]
    assert positions(plan(ps, fusion_bytes=81, groups=None), ps) == [[3, 2], [1, 0]]
    assert positions(plan(ps, fusion_bytes=161, groups=None), ps) == [[3, 2, 1], [0]]


def test_a_zero_fusion_size_gives_each_parameter_its_own_bucket() -> None:
    ps = params(1, 2, 3)
    assert [len(b) for b in plan(ps, fusion_bytes=0, groups=None)] == [1, 1, 1]


def test_buckets_never_mix_dtypes() -> None:
    ps = params(4, 4) + params(4, dtype=torch.float64) + params(4)
    buckets = plan(ps, fusion_bytes=1 << 20, groups=None)
    assert all(len({p.dtype for p in b}) == 1 for b in buckets)
    assert sum(len(b) for b in buckets) == 4


def test_explicit_groups_come_first_and_a_count_splits_evenly() -> None:
    ps = params(1, 1, 1, 1, 1)
    buckets = plan(ps, fusion_bytes=1 << 20, groups=[[ps[0], ps[2]]])
    assert positions(buckets, ps) == [[0, 2], [4, 3, 1]]
    assert [len(b) for b in plan(ps, fusion_bytes=1 << 20, groups=2)] in ([2, 3], [3, 2])


def test_cpu_tensors_of_wire_dtypes_go_out_without_a_copy() -> None:
    t = torch.arange(6.0).reshape(2, 3)
    array, layout = _tensors.reducible(t)
    assert _tensors.shares_memory(array, t) and array.shape == (2, 3)
    assert torch.equal(_tensors.restore(array, layout), t)


def test_bfloat16_is_reduced_in_float32_and_gathered_bit_for_bit() -> None:
    t = (torch.arange(6.0).reshape(3, 2) / 7).to(torch.bfloat16)
    array, layout = _tensors.reducible(t)
    assert array.dtype == np.float32
    assert _tensors.restore(array, layout).dtype == torch.bfloat16
    raw, layout = _tensors.raw(t)
    assert raw.dtype == np.uint8 and raw.shape == (3, 4)
    doubled = np.concatenate([raw, raw])
    back = _tensors.restore(doubled, layout, rows=6)
    assert torch.equal(back, torch.cat([t, t]))


def test_bool_complex_and_scalar_tensors_travel_as_bytes() -> None:
    for t in [torch.tensor([[True, False]]), torch.tensor([1 + 2j, 3 - 1j]), torch.tensor(1.5, dtype=torch.bfloat16)]:
        raw, layout = _tensors.raw(t)
        assert torch.equal(_tensors.restore(raw.copy(), layout), t)


def test_tensors_that_cannot_be_reduced_are_refused_with_their_dtype() -> None:
    with pytest.raises(InvalidArgumentError, match=r"torch.bool"):
        _tensors.reducible(torch.tensor([True]))


def test_compressors_cast_floats_and_restore_the_dtype() -> None:
    t = torch.linspace(-1, 1, 5, dtype=torch.float64)
    for compressor, wire in [(hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)]:
        sent, ctx = compressor.compress(t)
        assert sent.dtype == wire
        back = compressor.decompress(sent, ctx)
        assert back.dtype == torch.float64
        torch.testing.assert_close(back, t, rtol=1e-2, atol=1e-2)
    ints = torch.arange(3)
    assert hvd.Compression.fp16.compress(ints)[0] is ints
    assert hvd.Compression.none.compress(t)[0] is t


def test_ops_resolve_horovods_names_and_adasum_is_an_allreduce_op_only() -> None:
    from ringserve.torch import ops

    assert ops.resolve(None) is hvd.Average
    assert ops.resolve(None, average=False) is hvd.Sum
    assert ops.resolve("max") is hvd.Max
    assert ops.resolve(hvd.Adasum) is hvd.Adasum and ops.core_op(hvd.Adasum) == "adasum"
    with pytest.raises(InvalidArgumentError, match=r"reducescatter does not support Adasum"):
        ops.core_op(hvd.Adasum, "reducescatter")
    with pytest.raises(InvalidArgumentError, match=r"not both"):
        ops.resolve(hvd.Sum, average=True)
    with pytest.raises(InvalidArgumentError, match=r"unknown"):
        ops.resolve("median")


def test_the_fusion_size_comes_from_the_environment_or_the_default() -> None:
    assert fusion_bytes_from_env({}) == DEFAULT_FUSION_BYTES
    assert fusion_bytes_from_env({"RINGSERVE_FUSION_BYTES": "1024"}) == 1024
    with pytest.raises(InvalidArgumentError, match=r"RINGSERVE_FUSION_BYTES"):
        fusion_bytes_from_env({"RINGSERVE_FUSION_BYTES": "lots"})


def test_the_distributed_optimizer_behaves_as_the_optimizer_it_wraps() -> None:
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    try:
        assert isinstance(opt, torch.optim.Optimizer) and type(opt) is hvd.DistributedOptimizer
        assert opt.param_groups is inner.param_groups and opt.state is inner.state
        assert opt.defaults is inner.defaults and opt.state_dict() == inner.state_dict()
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
        assert scheduler.get_last_lr() == [0.5]
        opt.param_groups[0]["lr"] = 0.25
        assert inner.param_groups[0]["lr"] == 0.25
        extra = torch.nn.Parameter(torch.zeros(4))
        opt.add_param_group({"params": [extra]})
        assert len(inner.param_groups) == 2 and "DistributedOptimizer(SGD" in repr(opt)
    finally:
        opt.remove_hooks()


@pytest.mark.parametrize("kwargs, message", [
    ({"op": hvd.Min}, "Average, Sum or Adasum"),
    ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "needs op=Average"),
    ({"backward_passes_per_step": 0}, "at least 1"),
    ({"process_set": object()}, "process_set must be a ProcessSet"),
    ({"process_set": hvd.ProcessSet([0])}, "is not registered"),
    ({"error_feedback": True}, "error_feedback needs a wire compression"),
])
def test_the_distributed_optimizer_refuses_bad_arguments(kwargs: dict, message: str) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match=message):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), **kwargs)


def test_named_parameters_must_name_every_parameter_once() -> None:
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=1)
    with pytest.raises(InvalidArgumentError, match=r"does not name 1"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("w", model.weight)])
    with pytest.raises(InvalidArgumentError, match=r"unique"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("w", model.weight), ("w", model.bias)])


def test_calls_before_init_say_so() -> None:
    from ringserve.errors import NotInitializedError

    with pytest.raises(NotInitializedError, match=r"init"):
        hvd.allreduce(torch.ones(2))
    assert hvd.is_initialized() is False
    assert (hvd.ringserve_built(), hvd.nccl_built(), hvd.mpi_built(), hvd.gloo_built()) == (True, False, False, False)


def test_importing_ringserve_does_not_import_torch() -> None:
    code = "import sys, ringserve; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_torch_state_snapshot_pickles_and_restores_model_optimizer_and_extras_into_another_replica() -> None:
    import pickle

    from ringserve.torch.elastic import TorchState

    def replica(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, optimizer = replica(1)
    for _ in range(2):  # momentum buffers and batch-norm statistics, not just weights
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    state = TorchState(model=model, optimizer=optimizer, epoch=3)
    data = pickle.dumps(state.snapshot(), protocol=5)

    other_model, other_optimizer = replica(2)
    other = TorchState(model=other_model, optimizer=other_optimizer, epoch=0)
    other.load_snapshot(pickle.loads(data))
    other.restore()
    assert other.epoch == 3  # type: ignore[attr-defined]
    for (name, a), b in zip(model.state_dict().items(), other_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.equal(a, other_optimizer.state[p]["momentum_buffer"])
               for a, p in zip(momentum, other_model.parameters(), strict=True))


def test_a_torch_state_saves_into_its_last_copy_and_never_into_tensors_a_restore_handed_out() -> None:
    from ringserve.torch.elastic import TorchState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()

    def moment() -> torch.Tensor:
        return state._optimizer_saved["state"][0]["exp_avg"]

    step()
    state = TorchState(model=model, optimizer=optimizer)
    weight, first_moment = state._model_saved["0.weight"], moment()
    step()
    state.save()
    # A commit every step allocates nothing: the same tensors hold the new copy.
    assert state._model_saved["0.weight"] is weight and moment() is first_moment
    assert torch.equal(weight, model[0].weight) and hasattr(state._model_saved, "_metadata")
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    kept_moment = moment().clone()
    step()  # training goes on; the copy does not move with it
    assert torch.equal(state._model_saved["0.weight"], kept["0.weight"]) and torch.equal(moment(), kept_moment)
    state.restore()
    assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())
    step()
    assert torch.equal(moment(), kept_moment)  # the optimizer was handed a copy, not the saved tensors
    # Even handed the saved tensors themselves, it never trains into the next copy.
    optimizer.load_state_dict(state._optimizer_saved)
    state.save()
    assert moment().data_ptr() != optimizer.state_dict()["state"][0]["exp_avg"].data_ptr()
    kept_moment = moment().clone()
    step()
    assert torch.equal(moment(), kept_moment)
