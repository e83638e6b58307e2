"""Exercises the Horovod-style API on one rank and saves every result for the test to check.

Run as a worker: ``python api.py OUT_DIR`` (saves ``OUT_DIR/rank{r}.pt``). The inputs are functions
of the rank defined here, so the test recomputes what every rank sent. Imported by the test for
those functions. With RINGSERVE_TEST_DEVICE=cuda every tensor it makes is on the GPU (torch's
default device; the seeded modules and batches are made on the CPU, as the test makes them, then
moved), and the results are saved on the host with the devices they had.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Any

import torch

DEVICE = torch.device(os.environ.get("RINGSERVE_TEST_DEVICE", "cpu"))


def base(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(6, dtype=torch.float64).reshape(2, 3) * (rank + 1) - 2.5).to(dtype)


def bytes_sent(call: Any) -> int:
    """Bytes this rank sent to its ring successor during ``call()``."""
    from ringserve import api

    before = api._worker().counters.bytes_sent
    call()
    return api._worker().counters.bytes_sent - before


def gathered_rows(rank: int) -> torch.Tensor:
    return torch.full((rank + 1, 2), float(rank)) + torch.arange(2.0)


def bn_batch(rank: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's input (3 + r rows: the ranks' batches differ in size) and its output weights."""
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn((3 + rank, *shape), generator=g, device="cpu") * 2 + 1
    return x, torch.randn((3 + rank, *shape), generator=g, device="cpu")


def bn_module(kind: type[torch.nn.Module], channels: int) -> torch.nn.Module:
    torch.manual_seed(7)
    with torch.device("cpu"):
        module = kind(channels)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.uniform_(-0.5, 0.5)
    return module


def devices(x: Any) -> list[str]:
    """The device types of the tensors in ``x`` (through dicts, lists and tuples)."""
    if isinstance(x, torch.Tensor):
        return [x.device.type]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list | tuple):
        return sorted({d for y in x for d in devices(y)})
    return []


def on_host(x: Any) -> Any:
    """``x`` with every tensor in it on the CPU."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: on_host(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(on_host(y) for y in x)
    return x


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(5, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 2, dtype=torch.float64)


def collectives(hvd: Any, r: int, res: dict[str, Any]) -> None:
    res["topology"] = dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                           local_size=hvd.local_size(), cross_rank=hvd.cross_rank(),
                           cross_size=hvd.cross_size(), initialized=hvd.is_initialized(),
                           built=[hvd.ringserve_built(), hvd.nccl_built(), hvd.mpi_built(), hvd.gloo_built()])
    res["average"] = hvd.allreduce(base(r))
    res["sum"] = hvd.allreduce(base(r), op=hvd.Sum, name="sum")
    res["min"] = hvd.allreduce(base(r), op=hvd.Min)
    res["max"] = hvd.allreduce(base(r), op=hvd.Max, name="max")
    res["average_false"] = hvd.allreduce(base(r), average=False)
    res["scaled"] = hvd.allreduce(base(r), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    res["fp16"] = hvd.allreduce(base(r), name="fp16", compression=hvd.Compression.fp16)
    res["bf16_compression"] = hvd.allreduce(base(r), compression=hvd.Compression.bf16, op=hvd.Sum)
    res["int8"] = hvd.allreduce(base(r), name="int8", compression=hvd.Compression.int8)
    res["int8_grouped"] = hvd.grouped_allreduce([base(r), base(r, torch.float64)], compression=hvd.Compression.int8)
    res["int8_int32"] = hvd.allreduce(base(r, torch.int32), op=hvd.Sum, compression=hvd.Compression.int8)
    res["wire_bytes"] = {str(dtype): bytes_sent(lambda d=dtype: hvd.allreduce(torch.ones(1 << 16, dtype=d)))
                         for dtype in (torch.float32, torch.bfloat16)}
    res["bf16_tensor"] = hvd.allreduce(base(r, torch.bfloat16), op=hvd.Sum)
    res["int16"] = hvd.allreduce(base(r, torch.int16), op=hvd.Sum)
    res["float64"] = hvd.allreduce(base(r, torch.float64))
    t = base(r).clone()
    res["inplace"] = (hvd.allreduce_(t, op=hvd.Sum, name="inplace") is t, t)
    handle = hvd.allreduce_async(base(r), name="async", op=hvd.Sum)
    while not hvd.poll(handle):
        pass
    res["async"] = hvd.synchronize(handle)
    t = base(r).clone()
    handle = hvd.allreduce_async_(t, op=hvd.Max)
    res["async_inplace"] = (hvd.synchronize(handle) is t, t)
    group = [base(r), base(r, torch.float64), base(r, torch.int64), base(r)[0]]
    res["grouped"] = hvd.grouped_allreduce(group, op=hvd.Sum, name="grouped")
    handle = hvd.grouped_allreduce_async(group, op=hvd.Sum, name="grouped_async")
    while not hvd.poll(handle):
        pass
    res["grouped_async"] = hvd.synchronize(handle)
    copies = [g.clone() for g in group]
    res["grouped_inplace"] = (all(a is b for a, b in zip(hvd.grouped_allreduce_(copies, op=hvd.Sum), copies, strict=True)),
                              copies)
    x = base(r).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
    res["allreduce_grad"] = x.grad
    res["allgather"] = hvd.allgather(gathered_rows(r), name="gather")
    res["allgather_bf16"] = hvd.allgather(gathered_rows(r).to(torch.bfloat16) / 3)
    res["allgather_bool"] = hvd.allgather(gathered_rows(r) > 0.5)
    x = gathered_rows(r).requires_grad_()
    weights = torch.arange(2.0 * sum(k + 1 for k in range(hvd.size()))).reshape(-1, 2)
    (hvd.allgather(x) * weights).sum().backward()
    res["allgather_grad"] = x.grad
    res["allgather_async"] = hvd.synchronize(hvd.allgather_async(gathered_rows(r), name="gather_async"))
    res["broadcast"] = hvd.broadcast(base(r), root_rank=1)
    t = base(r, torch.bfloat16) / 3
    res["broadcast_inplace_bf16"] = (hvd.broadcast_(t, root_rank=2, name="bcast") is t, t)
    t = base(r, torch.int64)
    res["broadcast_async_inplace"] = hvd.synchronize(hvd.broadcast_async_(t, root_rank=0))
    res["reducescatter"] = hvd.reducescatter(torch.arange(10.0).reshape(5, 2) * (r + 1), op=hvd.Sum)
    res["broadcast_object"] = hvd.broadcast_object({"from": r, "list": [r] * 3}, root_rank=1)
    res["allgather_object"] = hvd.allgather_object(("rank", r))
    hvd.barrier()
    res["join"] = hvd.join()
    errors = {}
    for label, call in [
        ("adasum", lambda: hvd.allreduce(base(r), op=hvd.Adasum)),
        ("optimizer_adasum", lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(base(r))], lr=1),
                                                              op=hvd.Adasum)),
    ]:
        try:
            call()
        except Exception as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    res["errors"] = errors


def state(hvd: Any, r: int, res: dict[str, Any]) -> None:
    torch.manual_seed(100 + r)  # a different model on every rank
    model = Small()
    model.bn.running_mean.add_(r)
    model.bn.num_batches_tracked.add_(r + 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    res["parameters_state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(200 + r)
    other = Small()
    hvd.broadcast_parameters(other.named_parameters(), root_rank=1)
    res["parameters_named"] = {k: v.detach().clone() for k, v in other.named_parameters()}

    inner = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), betas=(0.8, 0.9 + 0.01 * r))
    for p in model.parameters():
        p.grad = torch.full_like(p, float(r + 1))
    inner.step()  # each rank's moments now differ
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    res["optimizer_state"] = opt.state_dict()
    fresh = torch.optim.SGD(other.parameters(), lr=0.1 * (r + 1), momentum=0.5 * r)
    hvd.broadcast_optimizer_state(fresh, root_rank=2)
    res["optimizer_fresh"] = fresh.state_dict()


def sync_batch_norm(hvd: Any, r: int, res: dict[str, Any]) -> None:
    for label, kind, shape in [("bn1d", torch.nn.BatchNorm1d, (4, 5)), ("bn2d", torch.nn.BatchNorm2d, (3, 2, 2))]:
        module = bn_module(kind, shape[0])
        sync = hvd.SyncBatchNorm(shape[0])
        sync.load_state_dict(module.state_dict())
        x, w = (t.to(DEVICE) for t in bn_batch(r, shape))
        x.requires_grad_()
        for _ in range(2):  # twice, so running statistics compound
            x.grad = None
            sync.zero_grad()
            y = sync(x)
            (y * w).sum().backward()
        res[label] = dict(
            y=y.detach(), x_grad=x.grad, running_mean=sync.running_mean.clone(),
            running_var=sync.running_var.clone(), num_batches_tracked=sync.num_batches_tracked.clone(),
            weight_grad=hvd.allreduce(sync.weight.grad, op=hvd.Sum),
            bias_grad=hvd.allreduce(sync.bias.grad, op=hvd.Sum),
            eval_y=sync.eval()(x).detach(),
        )


def optimizer_usage(hvd: Any, r: int, res: dict[str, Any]) -> None:
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 4) * (r + 1)).sum().backward()
    try:
        opt.zero_grad()
        res["zero_grad_between"] = "no error"
    except hvd_errors().UsageError as exc:
        res["zero_grad_between"] = str(exc)
    opt.synchronize()
    opt.synchronize()  # a second synchronize without backward does nothing
    res["synchronized_grad"] = model.weight.grad.clone()
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    # Rank 1 runs no backward at all in this step: its buckets go out with presence flags of 0.
    if r != 1:
        model(torch.ones(1, 4) * (r + 1)).sum().backward()
    opt.synchronize()
    res["grad_without_rank_1"] = None if model.weight.grad is None else model.weight.grad.clone()
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    try:
        model(torch.ones(1, 4)).sum().backward()
        res["too_many_passes"] = "no error"
    except Exception as exc:
        res["too_many_passes"] = str(exc)
    opt.synchronize()
    opt.zero_grad()
    res["optimizer_isinstance"] = isinstance(opt, torch.optim.Optimizer)
    res["param_groups_shared"] = opt.param_groups is opt._optimizer.param_groups


def default_device_elsewhere(hvd: Any, r: int, res: dict[str, Any]) -> None:
    """CPU tensors while torch's default device is another (here "meta", which holds no data; on a
    GPU, "cuda" in many scripts): ringserve's own host buffers must not follow the default."""
    torch.manual_seed(5)
    with torch.device("cpu"):
        model = torch.nn.Linear(3, 2)
        inner = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
    with torch.device("meta"):
        params = {"w": torch.full((3,), float(r), device="cpu")}
        hvd.broadcast_parameters(params, root_rank=1)
        hvd.broadcast_optimizer_state(inner, root_rank=1)
        summed = hvd.allreduce(torch.ones(3, device="cpu") * r, op=hvd.Sum)
    res["default_device_elsewhere"] = dict(broadcast=params["w"], lr=inner.param_groups[0]["lr"], summed=summed)


def hvd_errors() -> Any:
    import ringserve.errors

    return ringserve.errors


def threads_left(grace_s: float = 2.0) -> list[str]:
    """The threads still running once those on their way out (gRPC's poller joins lazily) have ended."""
    deadline = time.monotonic() + grace_s
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return sorted(t.name for t in threading.enumerate())


def lifecycle(hvd: Any, r: int, res: dict[str, Any]) -> None:
    from ringserve import api

    hvd.barrier()
    ctx = api.context()
    ctx.call(lambda w: w.close())

    async def others(_: Any) -> list[str]:
        current = asyncio.current_task()
        return sorted(t.get_name() for t in asyncio.all_tasks() if t is not current)

    res["tasks_after_close"] = ctx.call(others)
    del ctx  # the test must not keep the context (and its gRPC objects) alive
    hvd.shutdown()
    res["threads_after_shutdown"] = threads_left()
    res["initialized_after_shutdown"] = hvd.is_initialized()
    hvd.init()
    res["after_reinit"] = (hvd.size(), hvd.allreduce(base(r), op=hvd.Sum, name="again"))
    hvd.shutdown()
    res["threads_after_second_shutdown"] = threads_left()


def main(out_dir: str) -> None:
    import ringserve.torch as hvd

    torch.set_num_threads(1)
    if DEVICE.type != "cpu":
        torch.set_default_device(DEVICE)
    res: dict[str, Any] = {"threads_before_init": sorted(t.name for t in threading.enumerate())}
    hvd.init()
    r = hvd.rank()
    collectives(hvd, r, res)
    state(hvd, r, res)
    sync_batch_norm(hvd, r, res)
    optimizer_usage(hvd, r, res)
    default_device_elsewhere(hvd, r, res)
    lifecycle(hvd, r, res)
    res["devices"] = {key: devices(value) for key, value in res.items()}
    torch.save(on_host(res), f"{out_dir}/rank{r}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
