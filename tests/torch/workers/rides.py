"""One rank of the rides world (test_rides_world.py): a commit's check carried by the gradient allreduce.

    rides.py OUT_DIR [user]

Writes OUT_DIR/rank{r}.json (with ``user``: only ``user_compressor``) with, per case, what the test checks:

- ``answers``: a ride published by hand, with flags set on the last rank only, carried by one
  optimizer step of each kind of optimizer (plain, fp16, bf16, int8, PowerSGD, a predivide factor,
  Sum): the answer every rank read, and whether the optimizer carries rides at all;
- ``steady``: allreduces per commit while every commit is followed by a step (one bucket: one);
- ``no_step``: allreduces per commit when commits follow each other with no step (the check's
  own allreduce: one);
- ``user_compressor`` (a world of its own: one job, one elastic state): allreduces per commit
  with a compressor of the user's, which rides refuse (the bucket and the check: two);
- ``healing``: the last rank heals through one step of each kind of optimizer that carries rides
  (``rider.begin_heal``): every rank's reduced gradient against the other ranks' average (or
  sum), and when the heal's load ran on the last rank (once, after the step's reductions);
- ``ahead_commit``: allreduces over a commit, a step and a commit, where the last rank started
  its healing step ahead (``heal_ahead``) before the first commit; ``ahead_commit_mid``: over a
  backward pass, a commit, the step and a commit, where it started its step ahead first;
- ``sha``: the parameters' digest at the end (every rank alike).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ringserve.torch as hvd
from ringserve import api
from ringserve.elastic import rider
from ringserve.torch import elastic


class Identity(hvd.Compression.none):
    """A user's compressor: it changes nothing (it is ringserve's own, subclassed), but ringserve
    cannot know that of a class of the user's."""


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train_step(model: torch.nn.Module, opt: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step * 31 + hvd.rank())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(8, 16, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
    opt.step()


def allreduces() -> int:
    entry = api.context().worker.counters.latency.get("allreduce")
    return 0 if entry is None else entry.count


def answers() -> dict[str, Any]:
    kinds: dict[str, dict[str, Any]] = {
        "plain": {}, "fp16": {"compression": hvd.Compression.fp16}, "bf16": {"compression": hvd.Compression.bf16},
        "int8": {"compression": hvd.Compression.int8},
        "powersgd": {"compression": hvd.Compression.powersgd(rank=1, start_powerSGD_iter=0)},
        "predivide": {"gradient_predivide_factor": 2.0}, "sum": {"op": hvd.Sum},
    }
    out = {}
    last = hvd.rank() == hvd.size() - 1
    for name, kwargs in kinds.items():
        model = net()
        # A bucket a parameter (fusion_bytes=1): several carry the ride, and the first answer alone
        # starts the commit's report.
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                       fusion_bytes=1, **kwargs)
        answered: list[int] = []
        ride = rider.Ride(np.array([1, 0] if last else [0, 0]), on_answer=functools.partial(answered.append, 1))
        rider.publish(ride)
        train_step(model, opt, 0)
        rider.withdraw()
        out[name] = {"carries": opt.carries_rides, "answer": None if ride.answer is None else ride.answer.tolist(),
                     "answered": len(answered), "buckets": len(opt._buckets)}
    return out


def healing() -> dict[str, Any]:
    """The last rank heals (its state on its way) through one step of each kind of optimizer that
    carries rides: the gradient every rank ends with, against the average (or sum) of the other
    ranks' own gradients, and how often the heal's load ran, and when."""
    kinds: dict[str, dict[str, Any]] = {
        "plain": {}, "fp16": {"compression": hvd.Compression.fp16}, "bf16": {"compression": hvd.Compression.bf16},
        "predivide": {"gradient_predivide_factor": 2.0}, "sum": {"op": hvd.Sum},
    }
    out = {}
    heals = hvd.rank() == hvd.size() - 1
    for name, kwargs in kinds.items():
        own = net()
        g = torch.Generator().manual_seed(hvd.rank())
        torch.nn.functional.cross_entropy(own(torch.randn(8, 16, generator=g)),
                                          torch.randint(0, 4, (8,), generator=g)).backward()
        mine = torch.cat([p.grad.reshape(-1) for p in own.parameters()])
        everyone = hvd.allgather(mine.unsqueeze(0), name=f"healing.{name}")
        contributors = everyone[:-1]
        expected = contributors.sum(0) if name == "sum" else contributors.mean(0)
        for ahead in (False, True):
            model = net()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), fusion_bytes=1, **kwargs)
            if ahead:
                # A reduction first, with no step: every gradient is then a view of its bucket,
                # as on a worker that trained before it was dropped, and backward would add into it.
                model(torch.randn(8, 16)).sum().backward()
                opt.synchronize()
            loads: list[bool] = []
            if heals:
                rider.begin_heal(lambda opt=opt, loads=loads: loads.append(opt._synchronized))
                if ahead:
                    opt.heal_ahead()  # as TorchState's handoff does: before the forward pass
            g = torch.Generator().manual_seed(hvd.rank())
            opt.zero_grad()  # not refused on the healing rank, whose buckets are under way
            torch.nn.functional.cross_entropy(model(torch.randn(8, 16, generator=g)),
                                              torch.randint(0, 4, (8,), generator=g)).backward()
            opt.synchronize()
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            tolerance = {"fp16": 2e-3, "bf16": 2e-2}.get(name, 1e-6)
            out[name + (".ahead" if ahead else "")] = {
                "error": float((got - expected).abs().max()), "tolerance": tolerance,
                "scale": float(expected.abs().max()), "loads": loads, "healing_after": rider.healing()}
            rider.drop_heal()
    out["sparse"] = sparse_healing(ahead=False)
    out["sparse.ahead"] = sparse_healing(ahead=True)
    return out


def sparse_healing(*, ahead: bool) -> dict[str, Any]:
    """A sparse gradient (an Embedding's), gathered as Horovod gathers it, while the last rank heals:
    it gives no index, and the others' sum, divided by the world's size, is every rank's.
    ``ahead``: the healing step started before the backward pass, which still gathers the sparse one."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    own = torch.nn.Embedding(10, 4, sparse=True)
    own.load_state_dict(emb.state_dict())
    idx = torch.tensor([hvd.rank(), (hvd.rank() + 3) % 10])
    own(idx).sum().backward()
    everyone = hvd.allgather(own.weight.grad.to_dense().unsqueeze(0), name="healing.sparse")
    expected = everyone[:-1].sum(0) / hvd.size()
    # A parameter that gets no gradient shares the embedding's bucket, which backward then never
    # fills: the step's synchronize starts it (and, started ahead, the embedding's gather).
    unused = torch.nn.Linear(2, 2)
    named = [*emb.named_parameters(), *(("unused." + n, q) for n, q in unused.named_parameters())]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([q for _, q in named], lr=0.1), named_parameters=named)
    assert len(opt._buckets) == 1
    loads: list[bool] = []
    if hvd.rank() == hvd.size() - 1:
        rider.begin_heal(lambda: loads.append(True))
        if ahead:
            opt.heal_ahead()
    emb(idx).sum().backward()
    opt.synchronize()
    got = emb.weight.grad.to_dense()
    rider.drop_heal()
    return {"error": float((got - expected).abs().max()), "tolerance": 1e-6, "scale": float(expected.abs().max()),
            "loads": loads, "healing_after": rider.healing()}


def per_commit(state: elastic.TorchState, commits: int, between: Any) -> float:
    before = allreduces()
    for _ in range(commits):
        between()
        state.commit()
    return (allreduces() - before) / commits


def main() -> None:
    out_dir, user = Path(sys.argv[1]), sys.argv[2:] == ["user"]
    hvd.init()
    torch.set_num_threads(1)
    result: dict[str, Any] = {} if user else {"answers": answers(), "healing": healing()}
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=Identity if user else hvd.Compression.none)
    state = elastic.TorchState(model=model, optimizer=opt, step=0)

    def step() -> None:
        train_step(model, opt, state.step)
        state.step += 1

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        per_commit(state, 2, step)  # the first check rides on the next step: warm up past it
        if user:
            result["user_compressor"] = per_commit(state, 8, step)
            return
        result["steady"] = per_commit(state, 8, step)
        result["no_step"] = per_commit(state, 4, lambda: None)
        per_commit(state, 1, step)
        # The last rank's healing step started ahead, then a commit before its backward (a loop
        # that commits first): its buckets carry that commit's check as the others' do, or its
        # next commit would run a check of its own that the others never join.
        loads: list[bool] = []
        if hvd.rank() == hvd.size() - 1:
            rider.begin_heal(lambda: loads.append(True))
            opt.heal_ahead()
        before = allreduces()
        state.commit()  # the last commit's check: nothing carried it (no step), so its own allreduce
        step()
        state.commit()
        result["ahead_commit"] = {"allreduces": allreduces() - before, "buckets": len(opt._buckets), "loads": loads}
        # Started ahead, then a commit between the backward pass and the step (a loop may do that):
        # the buckets carry what they carry on the others, the ride of where theirs start.
        loads = []
        if hvd.rank() == hvd.size() - 1:
            rider.begin_heal(lambda: loads.append(True))
            opt.heal_ahead()
        before = allreduces()
        g = torch.Generator().manual_seed(state.step * 31 + hvd.rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 16, generator=g)),
                                          torch.randint(0, 4, (8,), generator=g)).backward()
        state.commit()  # its check: the buckets under way carry the last one's, not this one's
        opt.step()
        state.step += 1
        state.commit()
        result["ahead_commit_mid"] = {"allreduces": allreduces() - before, "buckets": len(opt._buckets),
                                      "loads": loads}

    train(state)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    result["sha"] = digest.hexdigest()
    (out_dir / f"rank{hvd.rank()}.json").write_text(json.dumps(result))
    hvd.shutdown()


if __name__ == "__main__":
    main()
