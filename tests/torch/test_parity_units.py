"""Pure parts of Horovod parity, without a world: the elastic sampler's dealing, the error tree as
code written for Horovod sees it, and the product reduction."""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
import torch

import ringserve.torch as hvd
from ringserve import errors
from ringserve.ring import REDUCE_OPS, combine_into, finish_into
from ringserve.torch.basics import _InFlight
from ringserve.torch.sampler import ElasticSampler, deal, remaining


@pytest.mark.parametrize(("length", "world"), [(10, 1), (10, 3), (7, 4), (2, 3), (1, 5), (0, 2)])
def test_dealt_shares_cover_every_index_with_equal_counts(length: int, world: int) -> None:
    indices = list(range(length))
    shares = [deal(indices, r, world) for r in range(world)]
    assert len({len(s) for s in shares}) <= 1
    assert set(itertools.chain(*shares)) == set(indices)
    # Padding repeats as little as it can: fewer than one index per rank.
    assert sum(map(len, shares)) - length < world or length == 0


def test_what_remains_after_a_world_change_is_what_the_old_world_left() -> None:
    order = remaining(23, shuffle=True, seed=9, processed_num=0, processed=set())
    assert sorted(order) == list(range(23))
    # Three ranks processed two batches of 2 each: the first 12 positions of the order.
    shares = [deal(order, r, 3)[:4] for r in range(3)]
    left = remaining(23, shuffle=True, seed=9, processed_num=12, processed=set())
    assert set(left) == set(range(23)) - set(itertools.chain(*shares))
    # Dealt to two ranks now, nothing processed is seen again.
    again = set(itertools.chain(*(deal(left, r, 2) for r in range(2))))
    assert again == set(left)


def test_the_sampler_resumes_from_its_state_dict_and_set_epoch_starts_afresh() -> None:
    sampler = ElasticSampler(list(range(12)), shuffle=True, seed=1)
    whole = list(sampler)
    assert sorted(whole) == list(range(12)) and len(sampler) == 12
    sampler.record_batch(0, 5)
    sampler.record_indices([whole[7]])
    saved = sampler.state_dict()
    resumed = ElasticSampler(list(range(12)), shuffle=True, seed=1)
    resumed.load_state_dict(saved)
    assert list(resumed) == [i for i in whole[5:] if i != whole[7]]
    resumed.set_epoch(1)
    assert resumed.state_dict() == {"epoch": 1, "processed_num": 0, "processed_indices": []}
    assert sorted(resumed) == list(range(12)) and list(resumed) != whole  # another epoch's order


def test_unshuffled_order_is_the_dataset_order() -> None:
    assert list(ElasticSampler(range(5), shuffle=False)) == [0, 1, 2, 3, 4]


def test_errors_are_runtime_errors_as_horovods_are() -> None:
    assert issubclass(errors.RingserveError, RuntimeError)
    assert issubclass(errors.MismatchError, RuntimeError)
    assert not issubclass(errors.MismatchError, hvd.HorovodInternalError)  # elastic must not retry it
    assert issubclass(errors.InvalidArgumentError, ValueError)
    with pytest.raises(ValueError, match=r"not initialized"):
        hvd.rank()  # before init(), as Horovod's
    assert issubclass(errors.PeerUnavailableError, hvd.HorovodInternalError)
    assert hvd.HostsUpdatedInterrupt is errors.HostsUpdatedInterrupt
    assert issubclass(hvd.HostsUpdatedInterrupt, RuntimeError)


def test_hvd_elastic_comes_with_the_plain_import() -> None:
    for name in ("run", "TorchState", "ObjectState", "ElasticSampler"):
        assert hasattr(hvd.elastic, name), name


def test_product_is_a_core_reduce_op_that_multiplies() -> None:
    assert "product" in REDUCE_OPS
    acc = np.array([2, -3, 4], dtype=np.int64)
    combine_into(acc, np.array([5, 6, -1], dtype=np.int64), "product")
    finish_into(acc, "product", world=2)  # nothing to finish: not an average
    assert acc.tolist() == [10, -18, -4]


def test_torch_state_keeps_extra_modules_and_samplers_by_their_state_dict() -> None:
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    sampler = ElasticSampler(range(6), shuffle=False)
    state = hvd.elastic.TorchState(model, None, second=other, sampler=sampler, epoch=3)
    kept = other.weight.detach().clone()
    with torch.no_grad():
        other.weight.add_(1.0)
    sampler.record_batch(0, 2)
    state.epoch = 4
    state.restore()
    assert torch.equal(other.weight, kept) and sampler.state_dict()["processed_num"] == 0 and state.epoch == 3
    assert state.second is other and state.sampler is sampler


@pytest.mark.parametrize("order", [("finished", "taken"), ("taken", "finished")])
def test_a_name_is_free_again_only_once_its_collective_finished_and_its_result_was_taken(
    order: tuple[str, str],
) -> None:
    names = _InFlight()
    claim = names.claim("allreduce.g")
    getattr(claim, order[0])()
    with pytest.raises(errors.InvalidArgumentError, match=r"still in flight"):
        names.claim("allreduce.g")
    getattr(claim, order[1])()
    names.claim("allreduce.g")  # free again
    names.claim("allgather.g")  # another kind of the same name was never taken


def test_a_dropped_handle_frees_its_name_only_after_it_finished_and_its_caller_waited_since() -> None:
    names = _InFlight()
    early = names.claim("allreduce.early")  # finishes at once, as when the peers already wait
    early.dropped()
    early.finished()
    with pytest.raises(errors.InvalidArgumentError, match=r"still in flight"):
        names.claim("allreduce.early")  # the caller's next line: no wait since
    late = names.claim("allreduce.late")
    late.dropped()
    names.waited()  # a wait while it is still in flight frees nothing
    with pytest.raises(errors.InvalidArgumentError, match=r"still in flight"):
        names.claim("allreduce.late")
    late.finished()  # ...but it counts once the collective is done
    names.claim("allreduce.late")
    names.waited()
    names.claim("allreduce.early")
    # A claim made after the last wait needs a wait of its own.
    fresh = names.claim("allgather.g")
    fresh.dropped()
    fresh.finished()
    with pytest.raises(errors.InvalidArgumentError, match=r"still in flight"):
        names.claim("allgather.g")


def test_horovods_positional_arguments_keep_their_order() -> None:
    """Horovod's signatures (horovod/torch/mpi_ops.py, functions.py, optimizer.py): each public
    function's positional parameters, in order. Ours may add keyword ones after them."""
    horovod = {
        "allreduce": "tensor average name compression op prescale_factor postscale_factor process_set",
        "allreduce_async": "tensor average name op prescale_factor postscale_factor process_set",
        "allreduce_": "tensor average name op prescale_factor postscale_factor process_set",
        "allreduce_async_": "tensor average name op prescale_factor postscale_factor process_set",
        "grouped_allreduce": "tensors average name compression op prescale_factor postscale_factor process_set",
        "grouped_allreduce_async": "tensors average name op prescale_factor postscale_factor process_set",
        "grouped_allreduce_": "tensors average name op prescale_factor postscale_factor process_set",
        "grouped_allreduce_async_": "tensors average name op prescale_factor postscale_factor process_set",
        "sparse_allreduce_async": "tensor name op process_set",
        "allgather": "tensor name process_set",
        "allgather_async": "tensor name process_set",
        "grouped_allgather": "tensors name process_set",
        "grouped_allgather_async": "tensors name process_set",
        "broadcast": "tensor root_rank name process_set",
        "broadcast_async": "tensor root_rank name process_set",
        "broadcast_": "tensor root_rank name process_set",
        "broadcast_async_": "tensor root_rank name process_set",
        "alltoall": "tensor splits name process_set",
        "alltoall_async": "tensor splits name process_set",
        "reducescatter": "tensor name compression op process_set prescale_factor postscale_factor",
        "reducescatter_async": "tensor name op process_set prescale_factor postscale_factor",
        "grouped_reducescatter": "tensors name compression op process_set prescale_factor postscale_factor",
        "grouped_reducescatter_async": "tensors name op process_set prescale_factor postscale_factor",
        "poll": "handle",
        "synchronize": "handle",
        "join": "device",
        "barrier": "process_set",
        "broadcast_parameters": "params root_rank",
        "broadcast_optimizer_state": "optimizer root_rank model",
        "broadcast_object": "obj root_rank name process_set",
        "allgather_object": "obj name",
    }
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for name, params in horovod.items():
        ours = [p.name for p in inspect.signature(getattr(hvd, name)).parameters.values() if p.kind in positional]
        assert ours[: len(params.split())] == params.split(), name
    init = inspect.signature(hvd.DistributedOptimizer.__init__).parameters
    assert list(init)[1:11] == ["optimizer", "named_parameters", "compression", "backward_passes_per_step", "op", "gradient_predivide_factor", "num_groups", "groups", "sparse_as_dense", "process_set"]
