"""DistributedOptimizer's buckets under PowerSGD: one round of ringserve.powersgd per bucket per step.

The round starts in the gradient hook, as a plain bucket's allreduce does: the bucket's gradients
(with this rank's error fed back) are multiplied by their warm-start Qs there, on the training
thread, and the first allreduce (the uncompressed tensors and the presence flags, then the Ps)
starts on the loop. The orthogonalization and ``M^T P`` run in a thread of the loop once the Ps
are averaged, then the Qs' allreduce; ``P Q^T`` is formed in ``step()``, back on the training
thread, straight into the bucket. The presence flags ride in the uncompressed part, reduced exactly
and without error feedback.

The step count that decides plain allreduce (before ``start_powerSGD_iter``) or PowerSGD is the
optimizer's, kept in its state_dict, so that a worker that joins an elastic job takes it with the
rest of the optimizer's state and sends what the others send.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ringserve import powersgd
from ringserve.torch import basics
from ringserve.torch._buckets import Bucket
from ringserve.torch.compression import PowerSGDCompressor
from ringserve.worker.ops.process_sets import ProcessSet

STATE_KEY = "ringserve.powersgd_iter"  # DistributedOptimizer's state_dict: its step count under PowerSGD


def applies(bucket: Bucket) -> bool:
    """PowerSGD reduces float32 CPU-staged buckets; others go as a plain allreduce."""
    return bucket.buffer.dtype == torch.float32


def start(bucket: Bucket, compressor: PowerSGDCompressor, iteration: int,
          process_set: ProcessSet | None) -> tuple[Any, Callable[[Any], torch.Tensor]]:
    """Starts the bucket's round; returns the future (as DistributedOptimizer keeps it) and finish."""
    host = bucket.buffer if bucket.buffer.device.type == "cpu" else bucket.buffer.cpu()
    flat = host.numpy()
    shapes = [tuple(p.shape) for p in bucket.params]
    core = compressor.core
    # The average goes straight into a CPU bucket (begin copies the gradients out of it first).
    rnd = core.begin(bucket.name, flat, shapes, exact=flat.size - bucket.numel, iteration=iteration,
                     out=flat if host is bucket.buffer else None)
    name = bucket.name

    async def reduce(worker: Any) -> tuple[Any, float]:
        def allreduce(x: np.ndarray, n: str) -> Any:
            return worker.allreduce(x, op="average", name=n, process_set=process_set)

        second = await powersgd.exchange(rnd, name, allreduce)
        return second, time.perf_counter()

    def finish(second: Any) -> torch.Tensor:
        out = rnd.finish(second)
        if host is not bucket.buffer:
            with torch.no_grad():
                bucket.buffer.copy_(torch.from_numpy(out))
        return bucket.buffer

    return basics.submit(reduce), finish
