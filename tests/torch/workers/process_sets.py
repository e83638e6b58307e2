"""Process sets through ``ringserve.torch`` as Horovod names them, and through the numpy API. Run as
a worker: ``python process_sets.py OUT_DIR`` (saves ``OUT_DIR/rank{r}.pt``)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch


def data(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) + 10 * rank


def outcome(call: Any) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def main(out_dir: str) -> None:
    import ringserve as rs
    import ringserve.torch as hvd

    res: dict[str, Any] = {}
    # A list that names one set twice fails on every rank, and leaves ringserve initialized.
    res["bad_init"] = outcome(lambda: hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet([0])]))
    r, n = hvd.rank(), hvd.size()
    first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(reversed(range(1, n)))
    hvd.init(process_sets=[first, rest])
    hvd.init(process_sets=[first, rest])  # the same sets again: no error, the same ids
    res["static"] = [str(hvd.global_process_set), str(first), str(rest)]
    res["static_ids"] = rs.process_sets()

    evens = hvd.add_process_set(range(0, n, 2))
    odds = hvd.add_process_set(list(range(1, n, 2)))
    mine, other = (evens, odds) if r % 2 == 0 else (odds, evens)
    res["set_view"] = [mine.size(), mine.rank(), mine.included(), other.included()]
    res["sum"] = hvd.allreduce(data(r), op=hvd.Sum, process_set=mine)
    handle = hvd.allreduce_async_(data(r), op=hvd.Average, name="ps.avg", process_set=mine)
    res["avg"] = hvd.synchronize(handle)
    res["gather"] = hvd.allgather(torch.tensor([r]), process_set=mine)
    res["bcast_obj"] = hvd.broadcast_object({"from": r}, root_rank=mine.ranks[-1], process_set=mine)
    res["gather_obj"] = hvd.allgather_object(r, process_set=mine)
    res["outsider"] = outcome(lambda: hvd.allreduce(data(r), process_set=other))
    res["wrong_root"] = outcome(lambda: hvd.broadcast(data(r), root_rank=other.ranks[0], process_set=mine))

    # DistributedOptimizer over the even ranks: they average among themselves; odd ranks step alone.
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(), process_set=evens)
    g = torch.Generator().manual_seed(r)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    res["weights"] = net.weight.detach().clone()
    # Every rank of a set takes its first member's weights.
    hvd.broadcast_parameters(net.state_dict(), root_rank=mine.ranks[0], process_set=mine)
    res["weights_after_bcast"] = net.weight.detach().clone()

    # The numpy API over the same registry.
    pair = rs.add_process_set([1, 0])
    if r in (0, 1):
        res["np_sum"] = rs.allreduce(np.full(3, r + 1.0), op="sum", process_set=pair).tolist()
        res["np_a2a"] = rs.alltoall(np.array([r, r]), process_set=pair)[0].tolist()
    res["np_remove_global"] = outcome(lambda: rs.remove_process_set(rs.global_process_set))
    rs.remove_process_set(pair)
    res["removed"] = [hvd.remove_process_set(hvd.global_process_set), hvd.remove_process_set(pair),
                      hvd.remove_process_set(odds), odds.process_set_id]
    res["left"] = rs.process_sets()
    hvd.barrier()
    torch.save(res, f"{out_dir}/rank{r}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
