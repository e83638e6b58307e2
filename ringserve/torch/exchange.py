"""alltoall with Horovod's names, arguments, return values and gradient.

``hvd.alltoall(tensor, splits=None)`` sends ``splits[i]`` rows of ``tensor`` (along dimension 0,
in order) to rank i, and returns the rows every rank sent this one, concatenated in rank order.
Without splits, dimension 0 is split evenly and only the tensor is returned; with splits (a list
or an integer tensor), the received splits are returned too, as a tensor of the splits' dtype and
device (int32 on the CPU for a list), as Horovod returns them. ``alltoall_async``'s handle always
gives the pair.

The gradient is Horovod's: the gradient of the received rows, sent back where they came from (an
alltoall with the received splits). Rows past the sum of the splits were not sent, and get a
zero gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ringserve.torch import _tensors, basics
from ringserve.torch.handles import Handle, claim_name
from ringserve.worker.ops.process_sets import ProcessSet

Splits = torch.Tensor | list[int] | tuple[int, ...] | None


def _splits_array(splits: Splits) -> np.ndarray | None:
    """The splits as numpy (checked by the core, on every rank alike)."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return splits.detach().cpu().numpy()
    return np.asarray(splits)


def _received_like(counts: np.ndarray, splits: Splits) -> torch.Tensor:
    if isinstance(splits, torch.Tensor) and not splits.is_floating_point() and splits.dtype != torch.bool:
        return torch.from_numpy(counts).to(dtype=splits.dtype, device=splits.device)
    return torch.from_numpy(counts.astype(np.int32))


def _alltoall_start(tensor: torch.Tensor, splits: Splits, name: str | None,
                    process_set: ProcessSet | None = None) -> Handle[tuple[torch.Tensor, torch.Tensor]]:
    with basics.named_call(claim_name("alltoall", name)) as call:
        if tensor.dim() == 0:  # refused by the core on every rank, as any wrong argument is
            array, layout = np.zeros((), dtype=np.float32), None
        else:
            array, layout = _tensors.raw(tensor)
        rows = _splits_array(splits)
        future = call.submit(lambda w: w.alltoall(array, splits=rows, name=name, process_set=process_set))

    def finish(result: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        out, counts = result
        assert layout is not None
        return _tensors.restore(out, layout, rows=out.shape[0]), _received_like(counts, splits)

    return Handle(future, finish, claim=call.claim)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Splits, name: str | None,
                process_set: ProcessSet | None) -> Any:
        received, received_splits = _alltoall_start(tensor, splits, name, process_set).wait()
        ctx.process_set = process_set
        ctx.received_splits = received_splits
        ctx.rows = tensor.shape[0]
        if splits is None:
            return received
        ctx.mark_non_differentiable(received_splits)
        return received, received_splits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:
        back, _ = _alltoall_start(grad.contiguous(), ctx.received_splits, None, ctx.process_set).wait()
        if back.shape[0] < ctx.rows:  # rows that were never sent
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0], *back.shape[1:]))])
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Splits = None, name: str | None = None,
             process_set: object = basics.global_process_set) -> Any:
    """Sends ``splits[i]`` rows of ``tensor`` to rank i and gathers what every rank sent this one
    (differentiable).

    Args:
        tensor: dimensions after the first, and the dtype, must match on every rank.
        splits: rows for each rank, in rank order, summing to at most ``tensor.shape[0]``; None
            splits dimension 0 evenly (it must then be a multiple of the world size).
        name: matches the call across ranks.
        process_set: exchange among that set's members only: ``splits[i]`` is for its i-th member
            (by rank within the set), and the received rows come in the set's rank order.

    Returns:
        The received tensor; with ``splits``, the pair (received tensor, received splits).

    Raises:
        InvalidArgumentError (a ValueError): wrong splits, on this rank; the ranks whose
            arguments were right fail at once with MismatchError (a RuntimeError).
    """
    return _Alltoall.apply(tensor, splits, name, basics.resolve_set(process_set))


def alltoall_async(tensor: torch.Tensor, splits: Splits = None, name: str | None = None,
                   process_set: object = basics.global_process_set) -> Handle[tuple[torch.Tensor, torch.Tensor]]:
    """Starts alltoall() and returns its handle; synchronize(handle) returns (tensor, received splits)."""
    return _alltoall_start(tensor, splits, name, basics.resolve_set(process_set))
