"""``DistributedOptimizer(op=hvd.Adasum)``: Horovod's delta optimizer for Adasum.

Adasum works on the whole of each rank's update, so Horovod's Adasum optimizer does not reduce
gradients: as soon as a parameter's gradients are in (after ``backward_passes_per_step`` backward
passes), the wrapped optimizer takes its step on that parameter alone, from this rank's own
gradient; the change it made (the delta) is combined over the ranks with Adasum, and ``step()``
sets the parameter to its value before that local step plus the combined delta. So the
optimizer's own state (momentum, Adam's moments) follows each rank's own gradients, as in Horovod,
and the learning rate needs no scaling by the world size (Horovod's guide: scale by about 2-2.5
over one worker's at most).

Here the deltas of a fusion bucket are combined in one Adasum collective whose parts are the
parameters, so each parameter keeps its own coefficients, as Horovod's fused Adasum computes them
per tensor. A parameter with no gradient in a step takes its local step with a zero gradient, as
Horovod's does (Horovod gives every parameter a zero gradient up front). On one rank
``DistributedOptimizer(op=Adasum)`` is the plain one, as in Horovod (Adasum of one is the identity).
As in Horovod, ``skip_synchronize()`` is refused, and compression casts around the reduction
(Compression.fp16 sends the deltas as float16).

The optimizer itself is ``AdasumOptimizer`` in ringserve.torch.optimizer (the class that
``DistributedOptimizer`` becomes); how it steps, reduces and steps back is ``Deltas``, here.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ringserve.torch import _tensors, basics
from ringserve.torch._buckets import Bucket
from ringserve.torch.compression import Compression, Compressor

__all__ = ["Deltas", "casts_around"]


def casts_around(codec: str | None, compression: type[Compressor] | Compressor) -> type[Compressor] | Compressor:
    """The compression an Adasum of deltas runs inside: Adasum adds no codec on the wire, so fp16
    and bf16 cast the deltas around it (int8 is not a cast, and is refused by the reduction)."""
    casts: dict[str | None, type[Compressor] | Compressor] = {"fp16": Compression.fp16, "bf16": Compression.bf16}
    return casts.get(codec, compression)


class Deltas:
    """One Adasum optimizer's deltas: each parameter's local step, one Adasum of a bucket's
    deltas, and the way back to where a step began when it is cut short.

    Args:
        optimizer: the wrapped torch optimizer, which takes the local steps.
        around: the compression the deltas travel inside (see ``casts_around``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, around: type[Compressor] | Compressor) -> None:
        self._optimizer = optimizer
        self._around = around
        self._starts: dict[int, torch.Tensor] = {}

    def local_step(self, p: torch.nn.Parameter) -> None:
        """The wrapped optimizer's step on ``p`` alone, from this rank's gradient."""
        groups = self._optimizer.param_groups
        kept = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [q for q in g["params"] if q is p]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._optimizer.step()
        finally:
            for g, params in zip(groups, kept, strict=True):
                g["params"] = params

    def start(self, bucket: Bucket) -> None:
        """Each parameter's local step; then one Adasum of the bucket's deltas, a part per parameter."""
        buf = bucket.buffer
        with torch.no_grad():
            for p, (a, b) in zip(bucket.params, bucket.bounds, strict=True):
                start = p.detach().clone()
                self.local_step(p)
                buf[a:b].copy_((p.detach() - start).reshape(-1))
                self._starts[id(p)] = start
        delta = buf[: bucket.numel]
        around = self._around
        wire, cctx = around.compress(delta)
        array, layout = _tensors.reducible(wire)
        parts = [p.numel() for p in bucket.params]
        name = bucket.name

        async def reduce(worker: Any) -> tuple[Any, float]:
            result = await worker.allreduce(array, op="adasum", name=name, out=array, parts=parts)
            return result, time.perf_counter()

        def finish(result: Any) -> torch.Tensor:
            return around.decompress(_tensors.restore(result, layout), cctx)

        bucket.started_at = time.perf_counter()
        bucket.future = basics.submit(reduce)
        bucket.finish = finish

    def finish(self, bucket: Bucket) -> None:
        """Sets each parameter of ``bucket`` to its value before its local step plus the combined delta."""
        result, bucket.done_at = basics.wait(bucket.future)
        assert bucket.finish is not None
        delta = bucket.finish(result)
        with torch.no_grad():
            for p, (a, b) in zip(bucket.params, bucket.bounds, strict=True):
                start = self._starts.pop(id(p))
                p.copy_(start + delta[a:b].view(p.shape).to(device=p.device, dtype=p.dtype))

    def reset(self, params: list[torch.nn.Parameter]) -> None:
        """Forgets a step cut short by a failure; ``params`` go back to where the step began."""
        with torch.no_grad():
            for p in params:
                start = self._starts.pop(id(p), None)
                if start is not None:
                    p.copy_(start)
        self._starts.clear()
