"""SyncBatchNorm: batch normalization with statistics over the whole distributed batch.

In training, each forward reduces per-channel (count, sum, sum of squares) over every rank in one
allreduce, and each backward reduces per-channel (sum dy, sum dy * x_hat) in another, so the result
equals BatchNorm on the concatenation of every rank's batch. Ranks may hold batches of different
sizes. The weight and bias gradients stay local, as in torch's SyncBatchNorm: DistributedOptimizer
averages them with the other gradients. Both collectives are unnamed, so every rank must run its
SyncBatchNorm layers in the same order, as the same model does. In eval mode, or with one rank, it
is plain BatchNorm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ringserve.torch import basics, ops
from ringserve.torch.compression import Compression
from ringserve.torch.starts import allreduce_start


def _sum_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    return allreduce_start(
        tensor, op=ops.Sum, name=None, compression=Compression.none, prescale_factor=1.0,
        postscale_factor=1.0, out=None,
    ).wait()


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                eps: float, momentum: float) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        count = x.numel() // max(channels, 1)
        local = torch.cat([
            torch.tensor([float(count)], dtype=torch.float64, device="cpu"),
            x.sum(dims, dtype=torch.float64).cpu(),
            x.double().square().sum(dims).cpu(),
        ])
        total = _sum_across_ranks(local)
        n = float(total[0])
        mean64 = total[1: channels + 1] / n
        var64 = (total[channels + 1:] / n - mean64.square()).clamp_min(0.0)
        mean = mean64.to(device=x.device, dtype=x.dtype)
        invstd = (var64 + eps).rsqrt().to(device=x.device, dtype=x.dtype)
        if running_mean is not None and running_var is not None:
            unbiased = var64 * (n / (n - 1)) if n > 1 else var64
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean64.to(running_mean), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var), alpha=momentum)
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight, x)
        if bias is not None:
            y = y + _per_channel(bias, x)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.n = n
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        xhat, weight, invstd = ctx.saved_tensors
        channels = xhat.shape[1]
        dims = [0, *range(2, xhat.dim())]
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        dx = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat]).to(device="cpu", dtype=torch.float64)
            total = (_sum_across_ranks(both) / ctx.n).to(device=dy.device, dtype=dy.dtype)
            mean_dy, mean_dy_xhat = total[:channels], total[channels:]
            scale = invstd if weight is None else invstd * weight
            dx = (dy - _per_channel(mean_dy, dy) - xhat * _per_channel(mean_dy_xhat, dy)) * _per_channel(scale, dy)
        dweight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        dbias = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover every rank's batch (Horovod's ``hvd.SyncBatchNorm``).

    Args and attributes are BatchNorm's: num_features, eps, momentum (None for a cumulative
    average), affine, track_running_stats.

    Example:
        ```python
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), hvd.SyncBatchNorm(16))
        ```
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions, not {input.dim()}.")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or not basics.is_initialized() or basics.size() == 1:
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        result: torch.Tensor = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum
        )
        return result
