"""One rank of the p2p world: all_to_all, send/recv and new_group on "ringserve", each beside gloo.

    dist_p2p.py OUT_DIR

The default group is ringserve's; a gloo group of every rank (and a gloo group of the same ranks
beside each ringserve subgroup) runs the very same op on the very same inputs, and each result
must be equal to gloo's (bit for bit: these ops move bytes, and the sums are of small integers).
Rank r's inputs are known functions of r, so each rank also checks the values themselves. The
names of the checks that passed go to OUT_DIR/rank{r}.json; the first that fails raises.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ringserve.torch.distributed  # noqa: F401

PASSED: list[str] = []
# A wrong call must fail every rank well within the collective timeout (60 s in the tests).
FAIL_FAST_S = 15.0


def check(name: str, ok: bool, detail: object = "") -> None:
    if not ok:
        raise AssertionError(f"{name} failed on rank {dist.get_rank()}: {detail}")
    PASSED.append(name)


def same(name: str, got: Any, want: Any) -> None:
    if isinstance(got, list | tuple):
        check(name, len(got) == len(want) and all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want, strict=False)),
              f"{got} != {want}")
        return
    check(name, got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), f"{got} != {want}")


def value(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    n = torch.Size(shape).numel()
    base = torch.arange(1, 1 + n, dtype=torch.float64)
    return (base.reshape(shape) * (rank + 1) + 10 * rank + salt).to(dtype)


def fails_everywhere(name: str, call: Callable[[], Any]) -> None:
    """``call`` raises on this rank (every rank calls it), promptly, not by a deadline."""
    start = time.monotonic()
    try:
        call()
    except (ValueError, RuntimeError) as exc:
        check(name, time.monotonic() - start < FAIL_FAST_S, f"it took {time.monotonic() - start:.1f} s: {exc}")
        return
    check(name, False, "no error")


def rows(src: int, dst: int) -> int:
    """How many rows rank src sends to rank dst in the uneven all_to_all (not symmetric)."""
    return (src + 2 * dst) % 3 + (src == dst)


def all_to_all(rank: int, size: int, gloo: dist.ProcessGroup, group: Any = None, members: list[int] | None = None) -> None:
    """all_to_all_single (even and uneven) and all_to_all (lists) on ``group`` and on ``gloo``."""
    where = "" if group is None else f" on group {members}"
    me = rank if members is None else members.index(rank)
    n = size if members is None else len(members)
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
        results = []
        for pg in (group, gloo):
            src = value(me, (n * 3, 2), dtype) if dtype != torch.bool else torch.arange(n * 6).reshape(n * 3, 2) % (me + 2) == 0
            out = torch.zeros(n * 3, 2, dtype=dtype)
            dist.all_to_all_single(out, src, group=pg)
            results.append(out)
        same(f"all_to_all_single even {dtype}{where} equals gloo's", results[0], results[1])
        if dtype == torch.float32:
            want = torch.cat([value(o, (n * 3, 2), dtype)[me * 3: me * 3 + 3] for o in range(n)])
            same(f"all_to_all_single even{where}: each rank's rows", results[0], want)
    send = [rows(me, d) for d in range(n)]
    recv = [rows(o, me) for o in range(n)]
    results = []
    for pg in (group, gloo):
        out = torch.full((sum(recv), 3), -1.0, dtype=torch.float64)
        work = dist.all_to_all_single(out, value(me, (sum(send), 3), torch.float64), recv, send, group=pg, async_op=True)
        work.wait()
        results.append(out)
    same(f"all_to_all_single uneven{where} equals gloo's", results[0], results[1])
    parts = []
    for o in range(n):
        start = sum(rows(o, d) for d in range(me))
        parts.append(value(o, (sum(rows(o, d) for d in range(n)), 3), torch.float64)[start: start + rows(o, me)])
    same(f"all_to_all_single uneven{where}: the rows each rank sent this one", results[0], torch.cat(parts))
    results = []
    for pg in (group, gloo):
        outs = [torch.zeros(2, 2, dtype=torch.int32) for o in range(n)]
        dist.all_to_all(outs, [value(me, (2, 2), torch.int32, salt=d) for d in range(n)], group=pg)
        results.append(outs)
    same(f"all_to_all (lists){where} equals gloo's", results[0], results[1])
    # Tensors of other sizes per rank (gloo's all_to_all takes one size only).
    outs = [torch.zeros(rows(o, me) + 1, dtype=torch.int32) for o in range(n)]
    dist.all_to_all(outs, [value(me, (rows(me, d) + 1,), torch.int32, salt=d) for d in range(n)], group=group)
    same(f"all_to_all (lists) of uneven sizes{where}: each rank's tensor", outs,
         [value(o, (rows(o, me) + 1,), torch.int32, salt=me) for o in range(n)])


def refusals(rank: int, size: int) -> None:
    # Splits wrong on one rank only: every rank fails at once, and the group goes on.
    bad = [1] * size if rank != 0 else [2] + [1] * (size - 1)
    fails_everywhere("all_to_all_single with splits wrong on rank 0 fails every rank at once",
                     lambda: dist.all_to_all_single(torch.zeros(size), torch.ones(size), None, bad))
    t = torch.ones(1)
    dist.all_reduce(t)
    same("the world works after the refusals", t, torch.tensor([float(size)]))


def point_to_point(rank: int, size: int, gloo: dist.ProcessGroup) -> None:
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    # A ring shift with isend/irecv, on both backends.
    results = []
    for pg in (None, gloo):
        out = torch.zeros(4, 3, dtype=torch.bfloat16)
        works = [dist.isend(value(rank, (4, 3), torch.bfloat16), dst=nxt, group=pg),
                 dist.irecv(out, src=prv, group=pg)]
        for w in works:
            w.wait()
        results.append(out)
    same("isend/irecv ring shift equals gloo's", results[0], results[1])
    same("isend/irecv ring shift: the predecessor's tensor", results[0], value(prv, (4, 3), torch.bfloat16))
    # batch_isend_irecv both ways round the ring at once.
    results = []
    for pg in (None, gloo):
        left, right = torch.zeros(5), torch.zeros(5)
        ops = [dist.P2POp(dist.isend, value(rank, (5,), torch.float32), nxt, pg),
               dist.P2POp(dist.isend, value(rank, (5,), torch.float32, salt=1), prv, pg),
               dist.P2POp(dist.irecv, left, prv, pg), dist.P2POp(dist.irecv, right, nxt, pg)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        results.append([left, right])
    same("batch_isend_irecv both ways equals gloo's", results[0], results[1])
    same("batch_isend_irecv both ways: each neighbour's tensor", results[0],
         [value(prv, (5,), torch.float32), value(nxt, (5,), torch.float32, salt=1)])
    # Ranks 0 and the last exchange 3 messages each way under each of 2 tags, all in flight at
    # once, received tag 1 first: each arrives where its tag and order say.
    a, b = 0, size - 1
    if rank in (a, b):
        peer = b if rank == a else a
        sends = [dist.isend(value(rank, (n + 2,), torch.float64, salt=100 * tag + n), dst=peer, tag=tag)
                 for tag in (0, 1) for n in range(3)]
        got = {(tag, n): torch.zeros(n + 2, dtype=torch.float64) for tag in (1, 0) for n in range(3)}
        recvs = [dist.irecv(buf, src=peer, tag=tag) for (tag, n), buf in got.items()]
        for w in recvs + sends:
            w.wait()
        for (tag, n), buf in got.items():
            same(f"tagged message {n} of tag {tag} both ways at once", buf, value(peer, (n + 2,), torch.float64,
                                                                                  salt=100 * tag + n))
        # Blocking both ways: each sends first, then receives (a send does not wait for its recv).
        back = torch.zeros(3, 4).t()  # a transposed view to receive into
        dist.send(value(rank, (4, 3), torch.float32), dst=peer, tag=7)
        dist.recv(back, src=peer, tag=7)
        same("send then recv on both ends, into a strided view", back, value(peer, (4, 3), torch.float32))
    # Receives from any source: every other rank sends rank 0 two messages; rank 0 takes them as
    # they come, with recv and irecv, and each tells whose it is.
    results = []
    for pg in (None, gloo):
        if rank == 0:
            got = []
            for i in range(2 * (size - 1)):
                buf = torch.zeros(3, dtype=torch.int64)
                if i % 2:
                    work = dist.irecv(buf, group=pg)
                    work.wait()
                    sender = work._source_rank()
                else:
                    sender = dist.recv(buf, group=pg)
                got.append((sender, buf.tolist()))
            results.append(sorted(got))
        else:
            for n in range(2):
                dist.send(torch.full((3,), 10 * rank + n), dst=0, group=pg)
    if rank == 0:
        check("recv from any source equals gloo's", results[0] == results[1], results)
        check("recv from any source: each sender's messages", results[0] == sorted(
            (r, [10 * r + n] * 3) for r in range(1, size) for n in range(2)), results[0])
    dist.barrier()
    check("barrier after the messages", True)


def subgroups(rank: int, size: int) -> None:
    """Every op on sub-rings, each beside gloo's group of the same ranks."""
    specs = [[1], [0, 1]] if size == 2 else [[0, 2], [1, 3], [0, 1, 3], [2]]
    groups = [(m, dist.new_group(m), dist.new_group(m, backend="gloo")) for m in specs]
    for members, group, gloo in groups:
        if rank not in members:
            check(f"a non-member of {members} gets no group", group is dist.GroupMember.NON_GROUP_MEMBER
                  and dist.get_rank(group) == -1, (group, dist.get_rank(group)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check(f"an op on {members} is a no-op on a non-member", dist.all_reduce(torch.ones(1), group=group) is None)
            continue
        me, n = members.index(rank), len(members)
        check(f"group rank on {members}", (dist.get_rank(group), dist.get_world_size(group), dist.get_backend(group))
              == (me, n, "ringserve"), (dist.get_rank(group), dist.get_world_size(group)))
        results = []
        for pg in (group, gloo):
            t = value(rank, (3, 4), torch.float32)
            dist.all_reduce(t, group=pg)
            results.append(t)
        same(f"all_reduce on {members} equals gloo's new_group", results[0], results[1])
        same(f"all_reduce on {members}: its members' sum", results[0], sum(value(r, (3, 4), torch.float32) for r in members))
        root = members[-1]  # a global rank, as torch takes it
        for pg in (group, gloo):
            t = value(rank, (5,), torch.int64)
            dist.broadcast(t, src=root, group=pg)
            results.append(t)
        same(f"broadcast on {members} equals gloo's", results[-2], results[-1])
        same(f"broadcast on {members} from global rank {root}", results[-2], value(root, (5,), torch.int64))
        outs = [torch.zeros(r + 1) for r in members]
        dist.all_gather(outs, value(rank, (rank + 1,), torch.float32), group=group)
        same(f"all_gather on {members}", outs, [value(r, (r + 1,), torch.float32) for r in members])
        out = torch.zeros(2)
        dist.reduce_scatter_tensor(out, value(rank, (2 * n,), torch.float32), group=group)
        same(f"reduce_scatter_tensor on {members}", out, sum(value(r, (2 * n,), torch.float32) for r in members)[2 * me: 2 * me + 2])
        t = value(rank, (3,), torch.float64)
        dist.reduce(t, dst=root, group=group)
        same(f"reduce on {members}", t, sum(value(r, (3,), torch.float64) for r in members) if rank == root else value(rank, (3,), torch.float64))
        gathered = [torch.zeros(2) for _ in members] if rank == root else None
        dist.gather(value(rank, (2,), torch.float32), gathered, dst=root, group=group)
        if gathered is not None:
            same(f"gather on {members}", gathered, [value(r, (2,), torch.float32) for r in members])
        mine = torch.zeros(2)
        dist.scatter(mine, [value(r, (2,), torch.float32, salt=5) for r in members] if rank == root else None, src=root, group=group)
        same(f"scatter on {members}", mine, value(rank, (2,), torch.float32, salt=5))
        dist.barrier(group=group)
        if n > 1:
            all_to_all(rank, size, gloo, group, members)
            peer = members[(me + 1) % n]
            before = members[(me - 1) % n]
            got = torch.zeros(3)
            works = [dist.isend(value(rank, (3,), torch.float32), dst=peer, group=group),
                     dist.irecv(got, group_src=(me - 1) % n, group=group)]
            for w in works:
                w.wait()
            same(f"isend/irecv on {members} (group ranks)", got, value(before, (3,), torch.float32))
    # Collectives of the world and of disjoint subgroups in flight at once, waited in reverse.
    pending, want = [], []
    for members, group, _ in groups:
        if rank in members:
            t = torch.full((64,), float(rank))
            pending.append(dist.all_reduce(t, group=group, async_op=True))
            want.append((t, float(sum(members))))
        t = torch.full((64,), float(rank))
        pending.append(dist.all_reduce(t, async_op=True))
        want.append((t, float(sum(range(size)))))
    for w in reversed(pending):
        w.wait()
    check("subgroups' and the world's all_reduces in flight at once", all(bool((t == v).all()) for t, v in want),
          [(t[0].item(), v) for t, v in want])
    for _, group, gloo in groups:
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
            dist.destroy_process_group(gloo)
    # new_subgroups: groups of 2 (of 1 in a world of 2, beside gloo's).
    width = 2 if size % 2 == 0 and size > 2 else 1
    mine_rs, _ = dist.new_subgroups(group_size=width)
    mine_gloo, _ = dist.new_subgroups(group_size=width, backend="gloo")
    ts = [value(rank, (4,), torch.float32) for _ in range(2)]
    dist.all_reduce(ts[0], group=mine_rs)
    dist.all_reduce(ts[1], group=mine_gloo)
    same("new_subgroups' all_reduce equals gloo's", ts[0], ts[1])
    # new_subgroups_by_enumeration: the first and the last rank, and the others (in a world of 2: each alone).
    spec = [[0, size - 1], list(range(1, size - 1))] if size > 2 else [[0], [1]]
    mine_rs, _ = dist.new_subgroups_by_enumeration(spec)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=mine_rs)
    ours = next(m for m in spec if rank in m)
    same("new_subgroups_by_enumeration's all_reduce", t, torch.full((3,), float(sum(r + 1 for r in ours))))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ringserve", rank=rank, world_size=size)
    gloo = dist.new_group(list(range(size)), backend="gloo")
    all_to_all(rank, size, gloo)
    refusals(rank, size)
    point_to_point(rank, size, gloo)
    subgroups(rank, size)
    (out / f"rank{rank}.json").write_text(json.dumps(PASSED))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
