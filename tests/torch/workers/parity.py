"""Exercises the parts of the binding that code written for Horovod leans on, on one rank.

Run as a worker: ``python parity.py OUT_DIR`` (saves ``OUT_DIR/rank{r}.pt``): errors and their
types, duplicate names, scaled integer reductions, Product, the optimizer state made before the
first step, the synchronize warning, sparse gradients, the timeline API, ``hvd.elastic`` after
the plain import, and the launcher's HOROVOD_* variables. Inputs are functions of the rank
defined here, so the test recomputes what every rank sent.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any

import torch


def ints(rank: int) -> torch.Tensor:
    return torch.arange(-4, 5, dtype=torch.int32) * (rank + 2)


def floats(rank: int) -> torch.Tensor:
    return torch.linspace(-1.5, 2.0, 8, dtype=torch.float64) + rank


def sparse_rows(rank: int) -> torch.Tensor:
    """A (6, 2) sparse tensor whose nonzero rows depend on the rank (row 1 is on every rank)."""
    dense = torch.zeros(6, 2)
    for row in {1, rank + 2}:
        dense[row] = torch.tensor([row + 0.5, -(rank + 1.0)])
    return dense.to_sparse()


def tokens(rank: int) -> torch.Tensor:
    return torch.tensor([[1, 2, 4], [4, 3 + rank, 1]])


def errors(hvd: Any, r: int, res: dict[str, Any]) -> None:
    caught: dict[str, Any] = {}
    calls = {
        "shape": lambda: hvd.allreduce(torch.zeros(3 + r)),
        "dtype": lambda: hvd.allreduce(torch.zeros(3, dtype=torch.float32 if r == 0 else torch.float64)),
        "root": lambda: hvd.broadcast(torch.zeros(3), root_rank=r),
    }
    for key, call in calls.items():
        try:
            call()
        except RuntimeError as exc:
            caught[key] = (type(exc).__name__, isinstance(exc, hvd.HorovodInternalError))
    res["errors"] = caught
    res["after_errors"] = hvd.allreduce(torch.ones(2), op=hvd.Sum)  # the world still works


def duplicate_names(hvd: Any, r: int, res: dict[str, Any]) -> None:
    """Horovod's pattern: each rank in turn starts a named collective and then one more of that name."""
    refused: dict[str, list[str]] = {}
    starts = {
        "allreduce": lambda: hvd.allreduce_async(torch.ones(3), name="dup", op=hvd.Sum),
        "allgather": lambda: hvd.allgather_async(torch.ones(1, 2), name="dup"),
        "broadcast": lambda: hvd.broadcast_async(torch.full((2,), float(r)), 0, name="dup"),
        "reducescatter": lambda: hvd.reducescatter_async(torch.ones(4), name="dup", op=hvd.Sum),
    }
    handles = {}
    for kind, start in starts.items():
        for turn in range(hvd.size()):
            if turn == r:
                handles[kind] = start()  # a second kind of the same name is no duplicate
                try:
                    start()
                except ValueError as exc:
                    refused.setdefault(kind, []).append(type(exc).__name__)
            hvd.barrier()
    res["duplicates_refused"] = refused
    res["duplicate_results"] = {k: hvd.synchronize(h) for k, h in handles.items()}
    # Once the first has finished, the name is free again.
    res["name_reused"] = hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="dup", op=hvd.Sum))


def dropped_handles(hvd: Any, r: int, res: dict[str, Any]) -> None:
    """Horovod's duplicate-name tests drop the first handle. Rank 0 waits in each collective
    before the others start theirs, so the others' first call finishes at once: the line right
    after it must still find the name in use (Horovod's negotiation cycle makes that so there),
    and after a barrier the name is free. A handle seen finished by poll() frees its name too."""
    starts = {
        "allreduce": lambda n: hvd.allreduce_async(torch.ones(3), name=n, op=hvd.Sum),
        "allgather": lambda n: hvd.allgather_async(torch.ones(1, 2), name=n),
        "broadcast": lambda n: hvd.broadcast_async(torch.full((2,), float(r)), 0, name=n),
        "reducescatter": lambda n: hvd.reducescatter_async(torch.ones(2 * hvd.size()), name=n, op=hvd.Sum),
    }
    refused: dict[str, str] = {}
    reused: dict[str, torch.Tensor] = {}
    polled: dict[str, torch.Tensor] = {}
    for kind, start in starts.items():
        if r == 0:
            hvd.synchronize(start("dropped"))
        else:
            time.sleep(0.3)  # rank 0 is waiting in the collective by now
            start("dropped")  # dropped unwaited, as Horovod's tests do
            time.sleep(0.5)  # it has finished by now: rank 0 was waiting for it
            try:
                start("dropped")
                refused[kind] = "accepted"
            except ValueError as exc:
                refused[kind] = type(exc).__name__
        hvd.barrier()
        reused[kind] = hvd.synchronize(start("dropped"))
        first = start("polled")
        while not hvd.poll(first):
            time.sleep(0.005)
        second = start("polled")  # the first was seen finished: its name is free
        polled[kind] = torch.stack([hvd.synchronize(first), hvd.synchronize(second)])
    res["dropped_refused"] = refused
    res["dropped_reused"] = reused
    res["polled_reused"] = polled


def scaling_and_product(hvd: Any, r: int, res: dict[str, Any]) -> None:
    res["int_prescale"] = hvd.allreduce(ints(r), op=hvd.Sum, prescale_factor=0.7)
    res["int_postscale"] = hvd.allreduce(ints(r), op=hvd.Sum, postscale_factor=0.7)
    in_place = ints(r)
    hvd.allreduce_(in_place, op=hvd.Sum, postscale_factor=0.7)
    res["int_postscale_inplace"] = in_place
    res["int_reducescatter_postscale"] = hvd.reducescatter(ints(r), op=hvd.Sum, postscale_factor=0.7)
    res["product_float"] = hvd.allreduce(floats(r), op=hvd.Product)
    res["product_int"] = hvd.allreduce(ints(r), op=hvd.Product)


def grouped_grad(hvd: Any, r: int, res: dict[str, Any]) -> None:
    xs = [floats(r).float().requires_grad_(), torch.ones(2, 2, dtype=torch.float64, requires_grad=True)]
    out = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grouped_grad")
    sum(o.sum() * (k + 1) for k, o in enumerate(out)).backward()
    res["grouped_grads"] = [x.grad for x in xs]
    for op in ("Sum", "Average"):
        x = (torch.arange(12.0).reshape(4, 3) * (r + 1)).requires_grad_()
        part = hvd.reducescatter(x, op=getattr(hvd, op), postscale_factor=0.5)
        (part * torch.arange(1.0, 4.0)).sum().backward()
        res[f"reducescatter_grad_{op}"] = x.grad


def optimizer_state(hvd: Any, r: int, res: dict[str, Any]) -> None:
    torch.manual_seed(3)
    model = torch.nn.Linear(3, 2)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inner = torch.optim.Adam([*model.parameters(), frozen], lr=0.1 * (r + 1), weight_decay=0.1)
    opt = hvd.DistributedOptimizer(inner, named_parameters=[*model.named_parameters(), ("frozen", frozen)])
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    res["initial_state"] = opt.state_dict()
    res["initial_params_kept"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    res["initial_grads"] = [None if p.grad is None else p.grad.clone() for p in [*model.parameters(), frozen]]
    # The broadcast state works: a step with it runs on every rank alike.
    model(torch.ones(4, 3) * (r + 1)).sum().backward()
    opt.step()
    res["after_step"] = {k: v.clone() for k, v in model.state_dict().items()}


def horovod_positions(hvd: Any, r: int, res: dict[str, Any]) -> None:
    """Calls with Horovod's positional arguments: reducescatter_async(tensor, name, op), and
    broadcast_optimizer_state(optimizer, root_rank, model) for an SGD over a sparse Embedding."""
    rows = torch.arange(2.0 * hvd.size()).reshape(2 * hvd.size(), 1) + r
    res["positional_reducescatter"] = hvd.synchronize(hvd.reducescatter_async(rows, "positional", hvd.Sum))
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Embedding(6, 2, sparse=True), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    hvd.broadcast_optimizer_state(opt, 0, model)
    res["sparse_state"] = opt.state_dict()
    res["sparse_grads"] = [p.grad.is_sparse for p in model.parameters()]
    try:
        hvd.broadcast_optimizer_state(opt, 0, "model")
    except ValueError as exc:
        res["bad_model"] = type(exc).__name__


def synchronize_warning(hvd: Any, r: int, res: dict[str, Any]) -> None:
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    seen = {}
    for case in ("forgotten", "skipped", "plain"):
        model(torch.ones(1, 2)).sum().backward()
        if case != "plain":
            opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if case == "skipped":
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        seen[case] = [str(w.message) for w in caught]
        opt.zero_grad()
    res["step_warnings"] = seen


def sparse(hvd: Any, r: int, res: dict[str, Any]) -> None:
    handle = hvd.sparse_allreduce_async(sparse_rows(r), name="rows", op=hvd.Average)
    gathered = handle()
    res["sparse_gathered"] = (gathered.is_sparse, gathered.to_dense())
    res["sparse_sum"] = hvd.synchronize(hvd.sparse_allreduce_async(sparse_rows(r), op=hvd.Sum)).to_dense()
    none_here = torch.zeros(6, 2).to_sparse() if r == 0 else sparse_rows(r)  # rank 0 holds no entry
    res["sparse_none_on_rank0"] = hvd.synchronize(hvd.sparse_allreduce_async(none_here, op=hvd.Sum)).to_dense()
    for as_dense in (False, True):
        torch.manual_seed(5)
        embedding = torch.nn.Embedding(6, 3, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                                       sparse_as_dense=as_dense)
        embedding(tokens(r)).sum().backward()
        opt.synchronize()
        grad = embedding.weight.grad
        res[f"sparse_grad_{as_dense}"] = (grad.is_sparse, grad.to_dense().clone())
        with opt.skip_synchronize():
            opt.step()
        res[f"sparse_weight_{as_dense}"] = embedding.weight.detach().clone()


def timeline(hvd: Any, r: int, res: dict[str, Any], out_dir: str) -> None:
    path = os.path.join(out_dir, "timeline-{rank}.json")
    hvd.allreduce(torch.ones(2), name="before_start")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(2), name="traced")
    hvd.broadcast(torch.ones(2), 0, name="traced")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(2), name="after_stop")
    with open(path.format(rank=r), encoding="utf-8") as f:
        res["timeline"] = json.load(f)  # closed by stop_timeline: a complete JSON array


def elastic(hvd: Any, r: int, res: dict[str, Any]) -> None:
    dataset = list(range(10))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=4)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    resets: list[int] = []
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0)
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    res["sampler_first"] = list(sampler)

    @hvd.elastic.run
    def train(state: Any) -> int:
        first = list(state.sampler)[:2]
        state.sampler.record_batch(0, 2)  # every rank processed its first 2
        state.commit()
        state.sampler.record_indices([first[0]])  # not committed: restore forgets it
        state.restore()
        res["restored_sampler"] = state.sampler.state_dict()
        state.sampler.record_indices([100 + r])  # each rank a different index, then synced
        state.save()
        state.sync()
        return hvd.size()

    res["elastic_run"] = train(state)
    res["synced_sampler"] = sampler.state_dict()
    res["sampler_after"] = list(sampler)
    res["state_attrs"] = (state.epoch, state.model is model, state.optimizer is opt, state.sampler is sampler)
    res["resets"] = resets


def main(out_dir: str) -> None:
    import ringserve.torch as hvd  # the only import: hvd.elastic must come with it

    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    hvd.init()
    r = hvd.rank()
    errors(hvd, r, res)
    duplicate_names(hvd, r, res)
    dropped_handles(hvd, r, res)
    scaling_and_product(hvd, r, res)
    grouped_grad(hvd, r, res)
    optimizer_state(hvd, r, res)
    horovod_positions(hvd, r, res)
    synchronize_warning(hvd, r, res)
    sparse(hvd, r, res)
    timeline(hvd, r, res, out_dir)
    elastic(hvd, r, res)
    hvd.shutdown()
    torch.save(res, f"{out_dir}/rank{r}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
