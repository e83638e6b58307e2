"""Trains a small model with DistributedOptimizer in several scenarios, and the single-process
reference for each: the test compares the two, and the ranks with each other.

Run as a worker: ``python equivalence.py OUT_DIR SCENARIO...`` (saves ``OUT_DIR/rank{r}.pt``).
Imported by the test for ``reference()``.

Data layout: each step uses a global batch of ``size * micro * PER_RANK`` rows. Micro-batch ``m`` of
rank ``r`` is rows ``[(m * size + r) * PER_RANK, ...)``, so micro-batch ``m`` of one process on the
whole batch (size 1) is exactly the concatenation of every rank's micro-batch ``m``.

With RINGSERVE_TEST_DEVICE=cuda the ranks train on the GPU (the model is made on the CPU, as the
reference makes it, then moved); the results are saved on the host, with the devices trained on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

STEPS = 5
PER_RANK = 6
IN, HIDDEN, OUT = 12, 16, 3
DEVICE = torch.device(os.environ.get("RINGSERVE_TEST_DEVICE", "cpu"))
SEEN: dict[str, list[str]] = {}  # per scenario of train(): devices(model) after its last step


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)
        self.extra = torch.nn.Linear(HIDDEN, OUT)   # used only by some ranks in some steps
        self.never = torch.nn.Linear(HIDDEN, OUT)   # used by no rank

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        out = self.head(h)
        return out + self.extra(h) if use_extra else out


# name -> (optimizer factory, DistributedOptimizer keyword arguments, micro-batches per step)
def _scenarios() -> dict[str, tuple[Callable[[Any], torch.optim.Optimizer], dict[str, Any], int]]:
    import ringserve.torch as hvd

    return {
        "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), {}, 1),
        "momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
                     {"fusion_bytes": 512}, 1),
        "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2), {"fusion_bytes": 0}, 1),
        "bpps2": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                  {"backward_passes_per_step": 2, "fusion_bytes": 2048}, 2),
        "predivide": (lambda ps: torch.optim.Adam(ps, lr=1e-2), {"gradient_predivide_factor": 2.0}, 1),
        "sum": (lambda ps: torch.optim.SGD(ps, lr=0.02), {"op": hvd.Sum}, 1),
        "fp16": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5), {"compression": hvd.Compression.fp16}, 1),
        "bf16": (lambda ps: torch.optim.SGD(ps, lr=0.1), {"compression": hvd.Compression.bf16}, 1),
        "unused": (lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1), {"fusion_bytes": 700}, 1),
        "int8": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
                 {"compression": hvd.Compression.int8, "error_feedback": True, "fusion_bytes": 4096}, 1),
        # The last rank's loss is NaN at step NAN_STEP: every rank must skip that step alike.
        "nonfinite": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5), {"check_finite": True}, 1),
        # The same with int8 and error feedback: after the skipped step, training goes on.
        "nonfinite_int8": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
                           {"check_finite": True, "compression": hvd.Compression.int8, "error_feedback": True}, 1),
    }


NAN_STEP = 2


def uses_extra(rank: int, step: int) -> bool:
    """Rank 0 uses the extra head on even steps, every other rank on steps divisible by 3."""
    return step % 2 == 0 if rank == 0 else step % 3 == 0


def global_batch(step: int, size: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    rows = size * micro * PER_RANK
    return torch.randn(rows, IN, generator=g), torch.randint(0, OUT, (rows,), generator=g)


def rows(m: int, rank: int, size: int, per: int) -> slice:
    start = (m * size + rank) * per
    return slice(start, start + per)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def train(name: str, rank: int, size: int) -> dict[str, torch.Tensor]:
    """One rank of the distributed run (ringserve.torch must be initialized)."""
    import ringserve.torch as hvd

    make, kwargs, micro = _scenarios()[name]
    model = _model().to(DEVICE)
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if name == "momentum" else None
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = (t.to(DEVICE) for t in global_batch(step, size, micro))
        opt.zero_grad()
        for m in range(micro):
            part = rows(m, rank, size, PER_RANK)
            extra = name == "unused" and uses_extra(rank, step)
            loss = loss_fn(model(x[part], use_extra=extra), y[part])
            if name.startswith("nonfinite") and step == NAN_STEP and rank == size - 1:
                loss = loss * float("nan")
            loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
    SEEN[name] = devices(model)
    return _result(model, opt.skipped_steps)


def _result(model: torch.nn.Module, skipped: int) -> dict[str, torch.Tensor]:
    return {**{k: v.detach().cpu() for k, v in model.state_dict().items()}, "skipped_steps": torch.tensor(skipped)}


def devices(model: torch.nn.Module) -> list[str]:
    """The device types of the model's parameters and of the gradients they hold."""
    return sorted({t.device.type for p in model.parameters() for t in (p, p.grad) if t is not None})


def reference(name: str, size: int) -> dict[str, torch.Tensor]:
    """One process on the whole batch of every step.

    With op=Sum the distributed gradient is the sum, not the mean, of the ranks' gradients, so the
    reference scales its loss by ``size``. In the "unused" scenario the ranks' losses differ in
    form, so the reference averages each rank's loss on its rows, which is what averaging the
    gradients computes.
    """
    make, _, micro = _scenarios()[name]
    model = _model()
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if name == "momentum" else None
    loss_fn = torch.nn.CrossEntropyLoss()
    scale = float(size) if name == "sum" else 1.0
    for step in range(STEPS):
        x, y = global_batch(step, size, micro)
        opt.zero_grad()
        if name.startswith("nonfinite") and step == NAN_STEP:
            continue
        if name == "unused":
            losses = [loss_fn(model(x[rows(0, r, size, PER_RANK)], use_extra=uses_extra(r, step)),
                              y[rows(0, r, size, PER_RANK)]) for r in range(size)]
            (sum(losses) / size).backward()
        else:
            for m in range(micro):
                part = rows(m, 0, 1, size * PER_RANK)
                (loss_fn(model(x[part]), y[part]) * scale).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return _result(model, 1 if name.startswith("nonfinite") else 0)


def main(out_dir: str, names: list[str]) -> None:
    import ringserve.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    results = {name: train(name, hvd.rank(), hvd.size()) for name in names}
    torch.save({"rank": hvd.rank(), "size": hvd.size(), "results": results, "devices": SEEN},
               f"{out_dir}/rank{hvd.rank()}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
