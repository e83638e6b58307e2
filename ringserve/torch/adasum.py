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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ringserve import api
from ringserve.errors import InvalidArgumentError, UsageError
from ringserve.torch import _tensors, basics
from ringserve.torch._buckets import Bucket
from ringserve.torch.compression import Compression, Compressor
from ringserve.torch.optimizer import DistributedOptimizer
from ringserve.worker.ops import adasum


class AdasumOptimizer(DistributedOptimizer):
    """What ``DistributedOptimizer(..., op=Adasum)`` is on more than one rank (see the module)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        # Horovod raises this at the first reduction; here at once, before any local step.
        adasum.check(np.dtype(np.float32), api.size())
        super().__init__(optimizer, *args, **kwargs)
        if self._error_feedback or self._check_finite:
            raise InvalidArgumentError("op=Adasum takes neither error_feedback nor check_finite.")
        if self._predivide != 1.0:
            raise InvalidArgumentError("gradient_predivide_factor needs op=Average, not Adasum.")
        # Adasum adds no codec on the wire: fp16 and bf16 cast the deltas around it, int8 is not one.
        casts: dict[str | None, type[Compressor] | Compressor] = {"fp16": Compression.fp16, "bf16": Compression.bf16}
        self._around = casts.get(self._codec, self._compression)
        self._starts: dict[int, torch.Tensor] = {}

    def _local_step(self, p: torch.nn.Parameter) -> None:
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

    def _start(self, bucket: Bucket) -> None:
        """Each parameter's local step; then one Adasum of the bucket's deltas, a part per parameter."""
        buf = bucket.buffer
        with torch.no_grad():
            for p, (a, b) in zip(bucket.params, bucket.bounds, strict=True):
                start = p.detach().clone()
                self._local_step(p)
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

    def _finish(self, bucket: Bucket) -> None:
        result, bucket.done_at = basics.wait(bucket.future)
        assert bucket.finish is not None
        delta = bucket.finish(result)
        with torch.no_grad():
            for p, (a, b) in zip(bucket.params, bucket.bounds, strict=True):
                start = self._starts.pop(id(p))
                p.copy_(start + delta[a:b].view(p.shape).to(device=p.device, dtype=p.dtype))

    def reset(self) -> None:
        """Forgets a step cut short by a failure; parameters go back to where the step began."""
        super().reset()
        with torch.no_grad():
            for p in self._params():
                start = self._starts.pop(id(p), None)
                if start is not None:
                    p.copy_(start)
        self._starts.clear()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Refused, as in Horovod: the Adasum optimizer's step is its synchronization."""
        raise UsageError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def synchronize(self) -> None:
        """Does nothing, as in Horovod's Adasum optimizer: step() combines and applies the deltas
        (a synchronize that applied them would let the next step() take its local steps again)."""

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Waits for every bucket's Adasum of deltas and applies it; the local steps ran as the
        gradients came in (or run now, for parameters whose gradients never came)."""
        loss = closure() if closure is not None else None
        self._synchronized = False
        DistributedOptimizer.synchronize(self)
        self._synchronized = False
        return loss
