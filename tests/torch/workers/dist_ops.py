"""One rank of the ops world: every torch.distributed op on the "ringserve" backend, checked.

    dist_ops.py OUT_DIR

Rank r's inputs are known functions of r, so each rank computes what every op must give with
plain torch and checks it. The names of the checks that passed go to OUT_DIR/rank{r}.json; the
first that fails raises, and the process exits non-zero with the reason.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ringserve.torch.distributed  # noqa: F401

PASSED: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    if not ok:
        raise AssertionError(f"{name} failed on rank {dist.get_rank()}: {detail}")
    PASSED.append(name)


def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    check(name, got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), f"{got} != {want}")


def raises(name: str, kind: type[BaseException], words: list[str], call: Callable[[], Any]) -> None:
    try:
        call()
    except kind as exc:
        check(name, all(w in str(exc) for w in words), f"message {exc!s} lacks {words}")
        return
    check(name, False, "no error")


def value(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(1, 1 + max(1, torch.Size(shape).numel()), dtype=torch.float64)[: torch.Size(shape).numel()]
    return (base.reshape(shape) * (rank + 1) + rank).to(dtype)


def reductions(rank: int, size: int) -> None:
    for op, fold in [(dist.ReduceOp.SUM, torch.sum), (dist.ReduceOp.MIN, torch.amin), (dist.ReduceOp.MAX, torch.amax),
                     (dist.ReduceOp.PRODUCT, torch.prod), (dist.ReduceOp.AVG, torch.mean)]:
        t = value(rank, (3, 5), torch.float64)
        dist.all_reduce(t, op=op)
        same(f"all_reduce {op}", t, fold(torch.stack([value(r, (3, 5), torch.float64) for r in range(size)]), dim=0))
    for dtype in (torch.float32, torch.int64, torch.int32, torch.uint8, torch.float16, torch.bfloat16, torch.int16):
        t = value(rank, (7,), dtype)
        dist.all_reduce(t)
        want = sum(value(r, (7,), torch.float64) for r in range(size)).to(dtype)
        check(f"all_reduce sum {dtype}", t.dtype == dtype and torch.allclose(t.double(), want.double(), rtol=1e-2), (t, want))
    # A strided view is reduced in place, and the memory around it is left alone.
    big = value(rank, (4, 6), torch.float32)
    view = big[:, ::2]
    dist.all_reduce(view)
    want = sum(value(r, (4, 6), torch.float32) for r in range(size))
    same("all_reduce of a strided view", big[:, ::2], want[:, ::2])
    same("all_reduce leaves the rest of the storage", big[:, 1::2], value(rank, (4, 6), torch.float32)[:, 1::2])
    scalar = torch.tensor(float(rank + 1))
    dist.all_reduce(scalar)
    same("all_reduce of a 0-dim tensor", scalar, torch.tensor(float(size * (size + 1) // 2)))
    z = torch.complex(torch.ones(3) * rank, torch.ones(3))
    dist.all_reduce(z)
    same("all_reduce of a complex tensor", z, torch.complex(torch.ones(3) * sum(range(size)), torch.ones(3) * size))
    ts = [value(rank, (2, 2), torch.float32), value(rank, (3,), torch.float32)]
    dist.all_reduce_coalesced(ts)
    same("all_reduce_coalesced", ts[1], sum(value(r, (3,), torch.float32) for r in range(size)))
    # reduce: only the root holds the result; the others keep their input.
    t = value(rank, (4,), torch.float32)
    dist.reduce(t, dst=size - 1)
    want = sum(value(r, (4,), torch.float32) for r in range(size)) if rank == size - 1 else value(rank, (4,), torch.float32)
    same("reduce", t, want)
    out = torch.zeros(3, dtype=torch.float32)
    dist.reduce_scatter_tensor(out, value(rank, (size * 3,), torch.float32))
    total = sum(value(r, (size * 3,), torch.float32) for r in range(size))
    same("reduce_scatter_tensor", out, total[rank * 3: rank * 3 + 3])
    out = torch.zeros(2, 2, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, value(rank, (size * 2, 2), torch.bfloat16), op=dist.ReduceOp.MAX)
    same("reduce_scatter_tensor max bfloat16", out, value(size - 1, (size * 2, 2), torch.bfloat16)[rank * 2: rank * 2 + 2])
    out = torch.zeros(4, dtype=torch.int64)
    dist.reduce_scatter(out, [value(rank, (4,), torch.int64) + 100 * i for i in range(size)])
    same("reduce_scatter (list)", out, sum(value(r, (4,), torch.int64) + 100 * rank for r in range(size)))


def moves(rank: int, size: int) -> None:
    root = size - 1
    for dtype in (torch.float32, torch.bool, torch.bfloat16, torch.int8):
        t = value(rank, (5,), dtype) if dtype != torch.bool else torch.tensor([rank % 2 == 0, True, False])
        want = value(root, (5,), dtype) if dtype != torch.bool else torch.tensor([root % 2 == 0, True, False])
        dist.broadcast(t, src=root)
        same(f"broadcast {dtype}", t, want)
    src = value(root, (4, 4), torch.float32)
    buf = src.clone() if rank == root else torch.zeros(4, 4)
    dist.broadcast(buf.t(), src=root)  # a strided view, sent and received in its logical order
    same("broadcast of and into a transposed view", buf, src)
    outs = [torch.zeros(r + 1, 2) for r in range(size)]
    dist.all_gather(outs, value(rank, (rank + 1, 2), torch.float32))
    for r in range(size):
        same(f"all_gather (uneven) from rank {r}", outs[r], value(r, (r + 1, 2), torch.float32))
    bools = [torch.zeros(2, dtype=torch.bool) for _ in range(size)]
    dist.all_gather(bools, torch.tensor([rank == 0, True]))
    same("all_gather bool", torch.stack(bools), torch.tensor([[r == 0, True] for r in range(size)]))
    flat = torch.zeros(size * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(flat, value(rank, (3,), torch.int64))
    same("all_gather_into_tensor", flat, torch.cat([value(r, (3,), torch.int64) for r in range(size)]))
    stacked = torch.zeros(size, 2, 3)
    dist.all_gather_into_tensor(stacked, value(rank, (2, 3), torch.float32))
    same("all_gather_into_tensor (stacked)", stacked, torch.stack([value(r, (2, 3), torch.float32) for r in range(size)]))
    gathered = [torch.zeros(2) for _ in range(size)] if rank == 0 else None
    dist.gather(value(rank, (2,), torch.float32), gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        same("gather", torch.stack(gathered), torch.stack([value(r, (2,), torch.float32) for r in range(size)]))
    mine = torch.zeros(3, dtype=torch.float64)
    dist.scatter(mine, [value(i, (3,), torch.float64) * 7 for i in range(size)] if rank == root else None, src=root)
    same("scatter", mine, value(rank, (3,), torch.float64) * 7)
    dist.barrier()
    check("barrier", True)


def objects(rank: int, size: int) -> None:
    got: list[Any] = [None] * size
    dist.all_gather_object(got, {"rank": rank, "text": "x" * rank})
    check("all_gather_object", got == [{"rank": r, "text": "x" * r} for r in range(size)], got)
    box: list[Any] = [("from", rank)] if rank == 1 else [None]
    dist.broadcast_object_list(box, src=1)
    check("broadcast_object_list", box == [("from", 1)], box)
    into: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(rank * 10, into, dst=0)
    check("gather_object", rank != 0 or into == [r * 10 for r in range(size)], into)
    out: list[Any] = [None]
    dist.scatter_object_list(out, [f"item {i}" for i in range(size)] if rank == 0 else None, src=0)
    check("scatter_object_list", out == [f"item {rank}"], out)


def asynchronous(rank: int, size: int) -> None:
    t = torch.ones(8) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    seen: list[Any] = []
    chained = work.get_future().then(lambda f: seen.append(f.value()[0].clone()) or f.value()[0] * 2)
    work.wait()
    check("async all_reduce: wait then is_completed", work.is_completed())
    total = float(size * (size + 1) // 2)
    same("async all_reduce: the future's value is the reduced tensor", work.get_future().wait()[0], torch.full((8,), total))
    same("async all_reduce: a then() callback sees the result", chained.wait(), torch.full((8,), 2 * total))
    works = [dist.broadcast(torch.full((3,), float(rank)), src=0, async_op=True),
             dist.all_gather_into_tensor(torch.zeros(size), torch.tensor([float(rank)]), async_op=True),
             dist.barrier(async_op=True)]
    for w in works:
        w.wait()
    same("async all_gather_into_tensor's future", works[1].get_future().wait()[0], torch.arange(size, dtype=torch.float32))
    # Many in flight at once, waited in reverse order.
    many = [torch.full((100,), float(i + rank)) for i in range(12)]
    pending = [dist.all_reduce(m, async_op=True) for m in many]
    for w in reversed(pending):
        w.wait()
    same("12 async all_reduces in flight at once", torch.stack(many)[:, 0],
         torch.tensor([float(size * i + sum(range(size))) for i in range(12)]))


def refusals(rank: int, size: int) -> None:
    peer = (rank + 1) % size
    raises("BAND of floats names the op and the dtype", ValueError, ["BAND", "non-integral", "float32"],
           lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND))
    raises("AVG of integers says why", ValueError, ["AVG", "can't be cast"],
           lambda: dist.all_reduce(torch.ones(1, dtype=torch.int64), op=dist.ReduceOp.AVG))
    premul = dist._make_nccl_premul_sum(2.0)
    raises("PREMUL_SUM names the op", NotImplementedError, ["PREMUL_SUM", "SUM"], lambda: dist.all_reduce(torch.ones(1), op=premul))
    solo = dist.new_group([0])  # the other ranks are not members: torch gives them no group, and calls nothing
    if rank == 0:
        t = torch.full((2,), 3.0)
        dist.all_reduce(t, group=solo)
        same("new_group of some ranks", t, torch.full((2,), 3.0))
        dist.destroy_process_group(solo)
    else:
        check("a non-member of new_group gets no group", solo is dist.GroupMember.NON_GROUP_MEMBER, solo)
    got = torch.zeros(1)
    works = [dist.isend(torch.full((1,), float(rank)), dst=peer), dist.irecv(got, src=(rank - 1) % size)]
    for w in works:
        w.wait()
    same("isend/irecv round the ring", got, torch.full((1,), float((rank - 1) % size)))
    # Nothing hung: the world still works.
    t = torch.ones(1)
    dist.all_reduce(t)
    same("the world works after the refusals", t, torch.tensor([float(size)]))


def groups(rank: int, size: int) -> None:
    everyone = dist.new_group(list(range(size)))
    t = torch.ones(2) * rank
    dist.all_reduce(t, group=everyone)
    same("new_group of every rank", t, torch.full((2,), float(sum(range(size)))))
    check("new_group's backend", dist.get_backend(everyone) == "ringserve", dist.get_backend(everyone))
    gloo = dist.new_group(list(range(size)), backend="gloo")  # a second backend, on ringserve's store
    t = torch.ones(2)
    dist.all_reduce(t, group=gloo)
    same("a gloo group beside the ringserve one", t, torch.full((2,), float(size)))
    dist.destroy_process_group(everyone)
    dist.destroy_process_group(gloo)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ringserve", rank=rank, world_size=size)
    check("rank and size", (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (rank, size, "ringserve"))
    for part in (reductions, moves, objects, asynchronous, refusals, groups):
        part(rank, size)
    (out / f"rank{rank}.json").write_text(json.dumps(PASSED))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
