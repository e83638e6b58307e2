"""One rank of the differential world: every torch.distributed call on ringserve and on gloo.

    dist_differential.py OUT_DIR

Each rank holds process groups of both kinds over the same ranks: the default group (ringserve's)
beside a gloo group of every rank, and each ringserve subgroup beside a gloo one of its ranks.
Every call runs on both, with the same inputs, and the results are compared (``compare.py``):
exactly for integer and bool dtypes, within ``TOLERANCE`` for floating point ones. Where gloo
refuses a call, ringserve must refuse it too, unless the case gives what ringserve must return
instead (the places where it does better than gloo), computed here from every rank's inputs.

What each check found goes to OUT_DIR/rank{r}.json: ``{"passed": [...], "failed": {name: why}}``.
A failed check does not stop the others: every call is made on every rank alike, so the ranks stay
in step, and the test sees every difference at once.
"""

from __future__ import annotations

import json
import os
import sys
from functools import reduce
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diffing import Pair, Recorder, value

import ringserve.torch.distributed  # noqa: F401

R = dist.ReduceOp
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64, torch.int16)
GLOO_LACKS = (torch.int16,)  # gloo refuses these dtypes ("Invalid scalar type"); ringserve takes them
DTYPES = FLOATS + INTS + (torch.bool, torch.complex64)
OPS = (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)
SHAPES: tuple[Any, ...] = ((), (0,), (7,), (3, 5), "strided")


def make(me: int, shape: Any, dtype: torch.dtype, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor to pass, the tensor to look at afterwards): for "strided", a view of every
    other column, and its whole base (whose other columns must be left alone)."""
    if shape == "strided":
        base = value(me, (4, 6), dtype, salt)
        return base[:, ::2], base
    t = value(me, shape, dtype, salt)
    return t, t


def fold(op: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    """What a reduction of ``tensors`` gives, as torch computes it on one tensor."""
    dtype = tensors[0].dtype
    stack = torch.stack(tensors)
    if dtype == torch.bool:
        stack = stack.to(torch.uint8)
        if op in (R.SUM, R.MAX, R.BOR):
            return stack.amax(0).bool()
        if op in (R.PRODUCT, R.MIN, R.BAND):
            return stack.amin(0).bool()
        return (stack.sum(0) % 2).bool()
    bitwise = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}
    if op in bitwise:
        return reduce(bitwise[op], tensors)
    if op == R.SUM:
        return stack.sum(0, dtype=dtype)
    if op == R.PRODUCT:
        return stack.prod(0, dtype=dtype)
    if op == R.AVG:
        return stack.sum(0, dtype=dtype) / len(tensors)
    return stack.amin(0) if op == R.MIN else stack.amax(0)


def reductions(rec: Recorder, p: Pair) -> None:
    for i, dtype in enumerate(DTYPES):
        for j, op in enumerate(OPS):
            if (i * len(OPS) + j) % p.sample:
                continue
            shape = SHAPES[(i + j) % len(SHAPES)]
            asynchronous = (i + j) % 3 == 0

            def call(pg: Any, dtype: torch.dtype = dtype, op: Any = op, shape: Any = shape,
                     asynchronous: bool = asynchronous) -> Any:
                t, whole = make(p.me, shape, dtype)
                if asynchronous:
                    work = dist.all_reduce(t, op=op, group=pg, async_op=True)
                    return [whole, work.get_future().wait()[0]] if work.wait() else None
                dist.all_reduce(t, op=op, group=pg)
                return whole

            def expect(dtype: torch.dtype = dtype, op: Any = op, shape: Any = shape,
                       asynchronous: bool = asynchronous) -> Any:
                mine, whole = make(p.me, shape, dtype)
                with torch.no_grad():
                    mine.copy_(fold(op, [make(r, shape, dtype)[0] for r in range(p.n)]).to(dtype))
                return [whole, mine] if asynchronous else whole

            form = " async" if asynchronous else ""
            name = f"all_reduce {op} {dtype} {shape}{form}"
            if dtype in GLOO_LACKS or shape == "strided":
                # gloo reduces a strided view's first numel() elements of memory, not the view's.
                valid = not (op == R.AVG and not (dtype.is_floating_point or dtype.is_complex)) and not (
                    op in (R.BAND, R.BOR, R.BXOR) and (dtype.is_floating_point or dtype.is_complex)) and not (
                    dtype.is_complex and op not in (R.SUM, R.AVG))
                if valid:
                    rec.better(name, p, call, expect)
                else:
                    rec.refused(name, p, call)
                continue
            rec.differ(name, p, call)
    # Every op of the integer and bool dtypes on one more shape, beside gloo's (the list above
    # gives each dtype and op one shape only).
    for dtype in (torch.bool, torch.int32, torch.uint8):
        for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR):
            if p.sample > 1:
                break

            def again(pg: Any, dtype: torch.dtype = dtype, op: Any = op) -> Any:
                t = value(p.me, (2, 7), dtype, salt=1)
                dist.all_reduce(t, op=op, group=pg)
                return t

            rec.differ(f"all_reduce {op} {dtype} (2, 7)", p, again)
    for dtype, op in [(torch.float32, R.SUM), (torch.int64, R.MAX), (torch.bool, R.SUM), (torch.float64, R.PRODUCT),
                      (torch.int32, R.BXOR)]:
        def coalesced(pg: Any, dtype: torch.dtype = dtype, op: Any = op) -> Any:
            ts = [value(p.me, (2, 2), dtype), value(p.me, (3,), dtype, 1), value(p.me, (1,), dtype, 2)]
            fut = dist.all_reduce_coalesced(ts, op=op, group=pg, async_op=True)
            return [ts, fut.wait()]

        rec.differ(f"all_reduce_coalesced {op} {dtype} async", p, coalesced)
    for k, (dtype, op) in enumerate([(torch.float32, R.SUM), (torch.int32, R.MAX), (torch.bool, R.PRODUCT),
                                     (torch.bfloat16, R.MIN), (torch.int64, R.BAND), (torch.float64, R.AVG)]):
        dst = k % p.n

        def rooted(pg: Any, dtype: torch.dtype = dtype, op: Any = op, dst: int = dst) -> Any:
            t = value(p.me, (5,), dtype)
            dist.reduce(t, dst=p.members[dst], op=op, group=pg)
            return t if p.me == dst else None  # the others' tensors are unspecified by torch

        rec.differ(f"reduce {op} {dtype} to {dst}", p, rooted)
    sparse(rec, p)


def sparse(rec: Recorder, p: Pair) -> None:
    for dtype, hybrid in [(torch.float32, False), (torch.int64, False), (torch.float64, True)]:
        def call(pg: Any, dtype: torch.dtype = dtype, hybrid: bool = hybrid) -> Any:
            idx = torch.tensor([[p.me, 2, p.me % 2, 4]])  # repeated and shared indices, uncoalesced
            vals = value(p.me, (4, 2) if hybrid else (4,), dtype)
            t = torch.sparse_coo_tensor(idx, vals, (6, 2) if hybrid else (6,))
            dist.all_reduce(t, group=pg)
            return t

        rec.differ(f"all_reduce sparse {dtype}{' hybrid' if hybrid else ''}", p, call)

    def empty(pg: Any) -> Any:
        t = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), (3,))
        dist.all_reduce(t, group=pg)
        return t

    rec.differ("all_reduce sparse, every rank empty", p, empty)

    def maximum(pg: Any) -> Any:
        t = torch.sparse_coo_tensor(torch.tensor([[p.me]]), torch.ones(1), (3,))
        dist.all_reduce(t, op=R.MAX, group=pg)
        return t

    rec.differ("all_reduce sparse MAX", p, maximum)


def scatters(rec: Recorder, p: Pair) -> None:
    for k, (dtype, op) in enumerate([(torch.float32, R.SUM), (torch.int64, R.MAX), (torch.bool, R.SUM),
                                     (torch.bfloat16, R.MIN), (torch.float64, R.AVG), (torch.int32, R.BOR),
                                     (torch.float16, R.PRODUCT), (torch.int64, R.AVG)]):
        asynchronous = k % 2 == 1

        def listed(pg: Any, dtype: torch.dtype = dtype, op: Any = op, asynchronous: bool = asynchronous) -> Any:
            out = torch.zeros(3, dtype=dtype)
            work = dist.reduce_scatter(out, [value(p.me, (3,), dtype, salt=d) for d in range(p.n)], op=op, group=pg,
                                       async_op=asynchronous)
            if work is not None:
                work.wait()
            return out

        def flat(pg: Any, dtype: torch.dtype = dtype, op: Any = op, asynchronous: bool = asynchronous) -> Any:
            out = torch.zeros(2, 3, dtype=dtype)
            work = dist.reduce_scatter_tensor(out, value(p.me, (2 * p.n, 3), dtype), op=op, group=pg,
                                              async_op=asynchronous)
            if work is not None:
                work.wait()
            return out

        form = " async" if asynchronous else ""
        rec.differ(f"reduce_scatter {op} {dtype}{form}", p, listed)
        rec.differ(f"reduce_scatter_tensor {op} {dtype}{form}", p, flat)


def gathers(rec: Recorder, p: Pair) -> None:
    for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.complex64, torch.int16):
        for shape in ((), (0,), (3, 2), "strided"):
            def gather_all(pg: Any, dtype: torch.dtype = dtype, shape: Any = shape) -> Any:
                outs = [torch.zeros_like(make(0, shape, dtype)[0]) for _ in range(p.n)]
                dist.all_gather(outs, make(p.me, shape, dtype)[0], group=pg)
                return outs

            if dtype in GLOO_LACKS:
                rec.better(f"all_gather {dtype} {shape}", p, gather_all,
                           lambda dtype=dtype, shape=shape: [make(r, shape, dtype)[0] for r in range(p.n)])
            else:
                rec.differ(f"all_gather {dtype} {shape}", p, gather_all)

        def into(pg: Any, dtype: torch.dtype = dtype, stacked: bool = False) -> Any:
            # Into (n * 2, 3), or (n, 2, 3) stacked, which gloo refuses (NCCL takes it).
            out = torch.zeros((p.n, 2, 3) if stacked else (p.n * 2, 3), dtype=dtype)
            work = dist.all_gather_into_tensor(out, value(p.me, (2, 3), dtype), group=pg, async_op=True)
            work.wait()
            return out

        if dtype not in GLOO_LACKS:
            rec.differ(f"all_gather_into_tensor {dtype} async", p, into)
        rec.better(f"all_gather_into_tensor {dtype} stacked async", p, lambda pg, dtype=dtype: into(pg, dtype, True),
                   lambda dtype=dtype: torch.stack([value(r, (2, 3), dtype) for r in range(p.n)]))

    def uneven(pg: Any) -> Any:
        outs = [torch.zeros(r + 1, 2) for r in range(p.n)]
        dist.all_gather(outs, value(p.me, (p.me + 1, 2), torch.float32), group=pg)
        return outs

    rec.better("all_gather uneven", p, uneven, lambda: [value(r, (r + 1, 2), torch.float32) for r in range(p.n)])
    coalesced_gathers(rec, p)
    for dst in range(p.n):
        def gather_to(pg: Any, dst: int = dst) -> Any:
            outs = [torch.zeros(2, 2, dtype=torch.int32) for _ in range(p.n)] if p.me == dst else None
            dist.gather(value(p.me, (2, 2), torch.int32), outs, dst=p.members[dst], group=pg)
            return outs

        def scatter_from(pg: Any, dst: int = dst) -> Any:
            out = torch.zeros(3, dtype=torch.float64)
            ins = [value(r, (3,), torch.float64, salt=7) for r in range(p.n)] if p.me == dst else None
            work = dist.scatter(out, ins, src=p.members[dst], group=pg, async_op=True)
            work.wait()
            return out

        rec.differ(f"gather to {dst}", p, gather_to)
        rec.differ(f"scatter from {dst} async", p, scatter_from)


def coalesced_gathers(rec: Recorder, p: Pair) -> None:
    """torch's layout: ``output_lists[src][i]`` is rank src's input i (the issue's bug)."""
    for count in sorted({1, p.n, 3}):
        for dtype in (torch.float32, torch.int64):
            def call(pg: Any, count: int = count, dtype: torch.dtype = dtype) -> Any:
                shapes = [(2,), (0,), (2, 3)][:count] if count < 3 else [(2,), (0,), (2, 3)]
                ins = [value(p.me, s, dtype, salt=100 * i) for i, s in enumerate(shapes)]
                outs = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(p.n)]
                fut = dist.all_gather_coalesced(outs, ins, group=pg, async_op=True)
                got = fut.wait()
                # (The future's value too, where torch hands it to the caller; gloo's is another
                # shape in a group of one, which ringserve does not copy.)
                return [outs, got] if p.n > 1 else outs

            rec.differ(f"all_gather_coalesced of {count} {dtype}", p, call)

    def same_shapes(pg: Any) -> Any:
        # The case: as many inputs as ranks, all of one shape (the transpose of the right
        # answer looks right to every check of sizes).
        ins = [torch.full((2,), float(100 * p.me + i)) for i in range(p.n)]
        outs = [[torch.zeros(2) for _ in range(p.n)] for _ in range(p.n)]
        dist.all_gather_coalesced(outs, ins, group=pg)
        return outs

    rec.differ(f"all_gather_coalesced of {p.n} of one shape", p, same_shapes)

    def strided(pg: Any) -> Any:
        outs = [[torch.zeros(3, 2).t()] for _ in range(p.n)]
        dist.all_gather_coalesced(outs, [value(p.me, (2, 3), torch.float32)], group=pg)
        return outs

    rec.differ("all_gather_coalesced into transposed views", p, strided)


def all_to_all(rec: Recorder, p: Pair) -> None:
    for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
        def even(pg: Any, dtype: torch.dtype = dtype) -> Any:
            out = torch.zeros(p.n * 2, 3, dtype=dtype)
            dist.all_to_all_single(out, value(p.me, (p.n * 2, 3), dtype), group=pg)
            return out

        rec.differ(f"all_to_all_single even {dtype}", p, even)

    def rows(src: int, dst: int) -> int:
        return (src + 2 * dst) % 3

    def split(pg: Any) -> Any:
        ins = [rows(p.me, d) for d in range(p.n)]
        outs = [rows(o, p.me) for o in range(p.n)]
        out = torch.zeros(sum(outs), 2, dtype=torch.int32)
        work = dist.all_to_all_single(out, value(p.me, (sum(ins), 2), torch.int32), outs, ins, group=pg, async_op=True)
        work.wait()
        return out

    rec.differ("all_to_all_single with split sizes async", p, split)

    def lists(pg: Any) -> Any:
        outs = [torch.zeros(2, 2) for _ in range(p.n)]
        dist.all_to_all(outs, [value(p.me, (2, 2), torch.float32, salt=d) for d in range(p.n)], group=pg)
        return outs

    # gloo's all_to_all of lists came with torch 2.13 (earlier: "does not support alltoall").
    rec.differ("all_to_all lists", p, lists,
               lambda: [value(o, (2, 2), torch.float32, salt=p.me) for o in range(p.n)])

    def uneven(pg: Any) -> Any:
        outs = [torch.zeros(rows(o, p.me) + 1, dtype=torch.int64) for o in range(p.n)]
        dist.all_to_all(outs, [value(p.me, (rows(p.me, d) + 1,), torch.int64, salt=d) for d in range(p.n)], group=pg)
        return outs

    rec.better("all_to_all lists of uneven sizes", p, uneven,
               lambda: [value(o, (rows(o, p.me) + 1,), torch.int64, salt=p.me) for o in range(p.n)])


def moves(rec: Recorder, p: Pair) -> None:
    for k, dtype in enumerate((torch.float32, torch.bool, torch.bfloat16, torch.int8, torch.complex64, torch.int16)):
        for shape in ((), (0,), (5,), "strided"):
            src = k % p.n

            def call(pg: Any, dtype: torch.dtype = dtype, shape: Any = shape, src: int = src) -> Any:
                t, whole = make(p.me, shape, dtype)
                dist.broadcast(t, src=p.members[src], group=pg)
                return whole

            def expect(dtype: torch.dtype = dtype, shape: Any = shape, src: int = src) -> Any:
                mine, whole = make(p.me, shape, dtype)
                mine.copy_(make(src, shape, dtype)[0])
                return whole

            if dtype in GLOO_LACKS or shape == "strided":  # gloo broadcasts a strided view's memory, not the view
                rec.better(f"broadcast {dtype} {shape} from {src}", p, call, expect)
            else:
                rec.differ(f"broadcast {dtype} {shape} from {src}", p, call)

    def barrier(pg: Any) -> Any:
        work = dist.barrier(group=pg, async_op=True)
        return work.wait()

    rec.differ("barrier async", p, barrier)

    def objects(pg: Any) -> Any:
        got: list[Any] = [None] * p.n
        dist.all_gather_object(got, {"rank": p.me, "x": "y" * p.me}, group=pg)
        box: list[Any] = [("from", p.me, [1.5])] if p.me == p.n - 1 else [None]
        dist.broadcast_object_list(box, src=p.members[-1], group=pg)
        into: list[Any] | None = [None] * p.n if p.me == 0 else None
        dist.gather_object(p.me * 10, into, dst=p.members[0], group=pg)
        out: list[Any] = [None]
        dist.scatter_object_list(out, [f"item {i}" for i in range(p.n)] if p.me == 0 else None, src=p.members[0], group=pg)
        return [got, box, into, out]

    rec.differ("object collectives", p, objects)

    def singles(pg: Any) -> Any:
        # torch 2.13's names for all_gather_into_tensor and reduce_scatter_tensor.
        gathered, reduced = torch.zeros(p.n * 2, dtype=torch.int64), torch.zeros(2)
        dist.all_gather_single(gathered, value(p.me, (2,), torch.int64), group=pg)
        dist.reduce_scatter_single(reduced, value(p.me, (2 * p.n,), torch.float32), group=pg)
        return [gathered, reduced]

    rec.differ("all_gather_single and reduce_scatter_single", p, singles)
    if p.n > 1:
        def object_messages(pg: Any) -> Any:
            box: list[Any] = [{"from": p.me, "t": [1, 2]}, "text"] if p.me == 0 else [None, None]
            if p.me == 0:
                for dst in p.members[1:]:
                    dist.send_object_list(box, dst=dst, group=pg)
            else:
                dist.recv_object_list(box, src=p.members[0], group=pg)
            return box

        rec.differ("send_object_list and recv_object_list", p, object_messages)


def point_to_point(rec: Recorder, p: Pair) -> None:
    if p.n < 2:
        return
    nxt, prv = (p.me + 1) % p.n, (p.me - 1) % p.n

    def shift(pg: Any) -> Any:
        out = torch.zeros(4, 3, dtype=torch.bfloat16)
        works = [dist.isend(value(p.me, (4, 3), torch.bfloat16), dst=p.members[nxt], group=pg),
                 dist.irecv(out, src=p.members[prv], group=pg)]
        for w in works:
            w.wait()
        return out

    rec.differ("isend/irecv ring shift", p, shift)

    def batched(pg: Any) -> Any:
        left, right = torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, value(p.me, (5,), torch.int64), p.members[nxt], pg),
               dist.P2POp(dist.isend, value(p.me, (5,), torch.int64, salt=1), p.members[prv], pg),
               dist.P2POp(dist.irecv, left, p.members[prv], pg), dist.P2POp(dist.irecv, right, p.members[nxt], pg)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return [left, right]

    rec.differ("batch_isend_irecv both ways", p, batched)

    def any_source(pg: Any) -> Any:
        if p.me != 0:
            for n in range(2):
                dist.send(torch.full((3,), 10 * p.me + n), dst=p.members[0], group=pg, tag=5)
            return None
        got = []
        for i in range(2 * (p.n - 1)):
            buf = torch.zeros(3, dtype=torch.int64)
            if i % 2:
                work = dist.irecv(buf, group=pg, tag=5)
                work.wait()
                sender = p.members[work._source_rank()]  # a group rank, as torch's recv turns it
            else:
                sender = dist.recv(buf, group=pg, tag=5)
            got.append((sender, buf.tolist()))
        return sorted(got)  # the order of arrival is the senders' race; each one's messages come in order

    rec.differ("recv and irecv from any source", p, any_source,
               lambda: None if p.me else sorted((p.members[r], [10 * r + n] * 3) for r in range(1, p.n) for n in range(2)))

    def sendrecv(pg: Any) -> Any:
        # Blocking calls round the group: even group ranks send first, odd ones receive first.
        # (Into a contiguous tensor: gloo's recv refuses a strided one, and its sender then waits.)
        out = torch.zeros(3, 2)
        first, second = (dist.send, dist.recv) if p.me % 2 == 0 else (dist.recv, dist.send)
        for call in (first, second):
            if call is dist.send:
                dist.send(value(p.me, (3, 2), torch.float32), dst=p.members[nxt], group=pg)
            else:
                dist.recv(out, src=p.members[prv], group=pg)
        return out

    rec.differ("send/recv round the group", p, sendrecv)
    if p.me in (0, 1):  # ringserve only: on gloo, recvs posted in another tag order than the sends deadlock
        peer = p.members[1 - p.me]
        sends = [dist.isend(value(p.me, (n + 1,), torch.float64, salt=tag), dst=peer, tag=tag, group=p.ring)
                 for tag in (3, 4) for n in range(2)]
        got = {(tag, n): torch.zeros(n + 1, dtype=torch.float64) for tag in (4, 3) for n in range(2)}
        for w in [dist.irecv(buf, src=peer, tag=tag, group=p.ring) for (tag, n), buf in got.items()] + sends:
            w.wait()
        want = {k: value(1 - p.me, (k[1] + 1,), torch.float64, salt=k[0]) for k in got}
        rec.expect("messages received in another tag order than sent (ringserve only: gloo deadlocks)",
                   list(got.values()), list(want.values()))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ringserve", rank=rank, world_size=size)
    rec = Recorder(rank)
    # Every group first, while the ranks are in step: making a gloo group blocks in torch's store
    # (holding the GIL) until every member makes it.
    specs = [[1], [0, 1]] if size == 2 else [[0, 2], [1, 2]]
    world = Pair(None, dist.new_group(backend="gloo"), list(range(size)), rank, sample=1)
    subgroups = [(m, dist.new_group(m), dist.new_group(m, backend="gloo")) for m in specs]
    for part in (reductions, scatters, gathers, all_to_all, moves, point_to_point):
        part(rec, world)
    # Subgroups: torch hands non-members no group, and their calls do nothing.
    for members, ring, gloo in subgroups:
        if rank in members:
            sub = Pair(ring, gloo, members, rank, sample=5)  # every 5th all_reduce case
            for part in (reductions, scatters, gathers, all_to_all, moves, point_to_point):
                part(rec.under(f"group {members}"), sub)
        else:
            rec.check(f"a non-member of {members} gets no group", ring is dist.GroupMember.NON_GROUP_MEMBER)
    (out / f"rank{rank}.json").write_text(json.dumps(rec.report()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
