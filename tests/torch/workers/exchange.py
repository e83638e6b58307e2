"""alltoall, grouped allgather and reducescatter, join and Adasum through ``ringserve.torch``, as
Horovod names them. Run as a worker: ``python exchange.py OUT_DIR`` (saves ``OUT_DIR/rank{r}.pt``).
Inputs are functions of the rank defined here, so the test recomputes what every rank sent.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def splits_of(rank: int, size: int) -> list[int]:
    """Uneven rows for each destination; rank 0 sends nothing to the last rank."""
    return [0 if (rank == 0 and d == size - 1) else (rank + 2 * d) % 3 + 1 for d in range(size)]


def rows_of(rank: int, size: int) -> torch.Tensor:
    """Rows tagged by origin and position, and one row more than the splits send."""
    n = sum(splits_of(rank, size)) + 1
    return torch.stack([torch.arange(n, dtype=torch.float32) + 100 * rank, torch.full((n,), float(rank))], dim=1)


def weights_of(rank: int, rows: int) -> torch.Tensor:
    """The gradient each rank puts on the rows it received (a function of the receiver and the row)."""
    return torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (rank + 1)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def alltoall(hvd: Any, r: int, n: int, res: dict[str, Any]) -> None:
    x = rows_of(r, n).requires_grad_()
    got, received = hvd.alltoall(x, splits=splits_of(r, n), name="rows")
    got.backward(weights_of(r, got.shape[0]))
    res["alltoall"] = (got.detach(), received, x.grad)
    res["alltoall_tensor_splits"] = hvd.alltoall(x.detach(), torch.tensor(splits_of(r, n), dtype=torch.int64))[1].dtype
    even = torch.arange(2 * n, dtype=torch.bfloat16) + 10 * r
    res["alltoall_even_bf16"] = hvd.alltoall(even)
    handle = hvd.alltoall_async(torch.arange(n, dtype=torch.int64) * (r + 1), name="async")
    res["alltoall_async"] = hvd.synchronize(handle)
    try:  # wrong splits on the last rank only: every rank fails, none hangs
        hvd.alltoall(torch.zeros(n), splits=[1] * n if r != n - 1 else [2] * n)
        res["alltoall_bad"] = "no error"
    except ValueError:
        res["alltoall_bad"] = "ValueError"
    except RuntimeError as exc:
        res["alltoall_bad"] = type(exc).__name__


def grouped(hvd: Any, r: int, n: int, res: dict[str, Any]) -> None:
    a = (torch.ones(r + 1, 3) * r).requires_grad_()
    b = torch.arange(2, dtype=torch.int64) + r
    c = torch.full((r, 2), r + 0.5, dtype=torch.bfloat16)
    ga, gb, gc = hvd.grouped_allgather([a, b, c])
    ga.backward(torch.arange(ga.numel(), dtype=torch.float32).reshape(ga.shape))
    res["grouped_allgather"] = (ga.detach(), gb, gc, a.grad)
    x = (torch.arange((2 * n + 1) * 2, dtype=torch.float64).reshape(2 * n + 1, 2) * (r + 1)).requires_grad_()
    y = torch.arange(n, dtype=torch.int32) * (r + 1)
    sx, sy = hvd.grouped_reducescatter([x, y], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    sx.backward(torch.ones_like(sx))
    res["grouped_reducescatter"] = (sx.detach(), sy, x.grad)
    res["grouped_reducescatter_average"] = hvd.grouped_reducescatter_async([x.detach()]).wait()


def join(hvd: Any, r: int, n: int, res: dict[str, Any]) -> None:
    """Uneven data: rank r trains r + 1 steps, then joins; the others' averages count its zeros."""
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    for step in range(r + 1):
        x, y = batch(r, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    res["join_last"] = last = hvd.join()
    res["join_params"] = [p.detach().clone() for p in net.parameters()]
    hvd.broadcast_parameters(net.state_dict(), root_rank=last)  # what join's answer is for
    res["join_synced"] = [p.detach().clone() for p in net.parameters()]
    try:
        hvd.join()  # a second join at once: nobody trains in between
        res["join_again"] = "ok"
    except RuntimeError as exc:
        res["join_again"] = repr(exc)


def adasum(hvd: Any, r: int, n: int, res: dict[str, Any]) -> None:
    torch.manual_seed(r)
    x = torch.randn(33, dtype=torch.float64)
    parts = [torch.randn(5, dtype=torch.float32), torch.randn(2, 3, dtype=torch.float32)]
    try:
        res["adasum"] = hvd.allreduce(x, op=hvd.Adasum, name="adasum")
        res["adasum_grouped"] = hvd.grouped_allreduce(parts, op=hvd.Adasum)
    except NotImplementedError as exc:
        res["adasum"] = ("NotImplementedError", str(exc))
        return
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                   op=hvd.Adasum)
    res["adasum_optimizer_class"] = type(opt).__name__
    for step in range(2):
        x, y = batch(r, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        if step == 0:
            opt.synchronize()  # nothing, as in Horovod: step() applies the combined deltas once
        opt.step()
    try:
        with opt.skip_synchronize():
            pass
        res["adasum_skip"] = "allowed"
    except RuntimeError as exc:
        res["adasum_skip"] = str(exc)
    res["adasum_params"] = [p.detach().clone() for p in net.parameters()]


def main(out_dir: str) -> None:
    import ringserve.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    res: dict[str, Any] = {"size": n}
    for part in (alltoall, grouped, join, adasum):
        part(hvd, r, n, res)
    torch.save(res, f"{out_dir}/rank{r}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
