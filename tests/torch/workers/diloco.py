"""One rank of the DiLoCo world: every scenario in turn, results to OUT_DIR/rank{r}.pt.

    diloco.py OUT_DIR

- ``h1_adamw``: DiLoCo with H = 1 and an outer SGD(lr=1, no momentum), uncompressed, around AdamW,
  beside a reference trained with the same AdamW whose parameters are averaged (hvd.allreduce)
  after every step: plain synchronous averaging.
- ``h1_sgd``: the same around plain SGD, beside DistributedOptimizer(SGD): with SGD, averaging the
  parameters after each step is averaging the gradients.
- ``trace.*``: DiLoCo configurations (int8 with error feedback, fragments with a delay and a blend,
  fp16), with the sha256 of the global copy and of the local parameters after every inner step.
- ``numpy``: ringserve.DiLoCo on numpy arrays, with the sha256 of its global copy after every step.

With RINGSERVE_TEST_DEVICE=cuda the models train on the GPU (made on the CPU, then moved); what is
saved is on the host.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ringserve
import ringserve.torch as hvd

TRACES: dict[str, dict[str, Any]] = {
    "int8": dict(sync_every=4, compression="int8"),
    "fragments": dict(sync_every=6, fragments=3, fragment_sync_delay=1, fragment_update_alpha=0.5,
                      compression="int8"),
    "fp16_two_fragments": dict(sync_every=4, fragments=2, compression=hvd.Compression.fp16, outer_lr=0.5),
    "module_fragments": dict(sync_every=6, fragments="layers", fragment_sync_delay=1),  # torchft's model fragments
}
TRACE_STEPS = 14
DEVICE = torch.device(os.environ.get("RINGSERVE_TEST_DEVICE", "cpu"))


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).to(DEVICE)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(8, 12, generator=g).to(DEVICE), torch.randint(0, 4, (8,), generator=g).to(DEVICE)


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step, hvd.rank())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def sha(tensors: list[torch.Tensor] | list[np.ndarray]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update((t.detach().cpu().contiguous().numpy() if isinstance(t, torch.Tensor) else t).tobytes())
    return digest.hexdigest()


def h1(inner: str, steps: int = 6) -> dict[str, Any]:
    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        if inner == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=1e-2)
        return torch.optim.SGD(model.parameters(), lr=0.1)

    model = net()
    opt = hvd.DiLoCo(model, inner=make(model), sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                     compression=None, name=f"h1.{inner}")
    for step in range(steps):
        inner_step(model, opt, step)
    reference = net()
    if inner == "adamw":
        ref_opt = make(reference)
        for step in range(steps):
            inner_step(reference, ref_opt, step)
            with torch.no_grad():
                for p in reference.parameters():
                    hvd.allreduce_(p, op=hvd.Average, name="h1.average")
    else:
        ref_opt = hvd.DistributedOptimizer(make(reference), named_parameters=reference.named_parameters())
        for step in range(steps):
            inner_step(reference, ref_opt, step)
    return {"diloco": params(model), "reference": params(reference), "initial": params(net())}


def trace(label: str, knobs: dict[str, Any]) -> dict[str, Any]:
    model = net()
    if knobs.get("fragments") == "layers":
        knobs = {**knobs, "fragments": [m for m in model if isinstance(m, torch.nn.Linear)]}
    opt = hvd.DiLoCo(model, inner=torch.optim.AdamW(model.parameters(), lr=1e-2), name=f"trace.{label}", **knobs)
    record: dict[str, Any] = {"global": [], "local": [], "outer": [], "in_flight": []}
    for step in range(TRACE_STEPS):
        inner_step(model, opt, step)
        record["global"].append(sha(opt.global_parameters()))
        record["local"].append(sha(list(model.parameters())))
        record["outer"].append(opt.outer_steps)
        record["in_flight"].append(opt.in_flight)
    opt.close()
    return record


def numpy_trace(steps: int = 9) -> list[str]:
    rng = np.random.default_rng(100 + ringserve.rank())
    w = np.zeros((16, 8), np.float32)
    b = np.zeros(8, np.float32)
    opt = ringserve.DiLoCo([w, b], sync_every=3, compression="int8", name="numpy.diloco")
    shas = []
    for _ in range(steps):
        w -= np.float32(0.1) * rng.standard_normal(w.shape).astype(np.float32)  # an inner step of its own
        b -= np.float32(0.1) * rng.standard_normal(b.shape).astype(np.float32)
        opt.step()
        shas.append(sha(opt.global_values()))
    return shas


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    hvd.init()
    results: dict[str, Any] = {"rank": hvd.rank(), "device": str(next(net().parameters()).device), "h1_adamw": h1("adamw"), "h1_sgd": h1("sgd"),
                               "numpy": numpy_trace()}
    for label, knobs in TRACES.items():
        results[f"trace.{label}"] = trace(label, knobs)
    torch.save(results, out / f"rank{hvd.rank()}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main()
