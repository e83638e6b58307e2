"""Sparse reduction as Horovod does it: every rank's indices and values gathered, not densified."""

from __future__ import annotations

import concurrent.futures

import torch

from ringserve.errors import InvalidArgumentError
from ringserve.torch import basics, ops
from ringserve.torch.handles import Handle
from ringserve.torch.starts import allgather_start


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: ops.ReduceOp | None = None,
                           process_set: object = None) -> Handle[torch.Tensor]:
    """Starts the reduction of a sparse COO tensor by gathering every rank's indices and values.

    The result, from ``handle()`` or ``synchronize(handle)``, is a sparse tensor holding every
    rank's entries (uncoalesced: an index held by several ranks appears once per rank, and
    ``coalesce()`` adds them), with the values divided by the number of ranks for Average. Its
    dense form equals allreduce() of the dense tensors. This is how Horovod reduces sparse
    gradients: the data moved grows with the ranks, but stays proportional to the nonzeros.

    Args:
        tensor: a sparse COO tensor; the same size and dtype on every rank (the nonzeros may differ).
        name: names the two gathers (of the indices and of the values).
        op: Average (default) or Sum.
        process_set: gather over that set's members only (an Average divides by its size).

    Raises:
        InvalidArgumentError: the tensor is not sparse, or the op is neither Average nor Sum.
    """
    ps = basics.resolve_set(process_set)
    reduce_op = ops.resolve(op)
    if reduce_op not in (ops.Average, ops.Sum):
        raise InvalidArgumentError(f"sparse_allreduce_async reduces with Average or Sum, not {reduce_op!r}.")
    if not tensor.is_sparse:
        raise InvalidArgumentError("sparse_allreduce_async takes a sparse COO tensor; use allreduce_async "
                                   "for a dense one.")
    sparse = tensor.detach().coalesce()
    # Indices travel as rows (nnz, sparse dims), so that the gather concatenates the ranks' entries.
    indices = allgather_start(sparse.indices().t().contiguous(), None if name is None else f"{name}.indices", ps)
    values = allgather_start(sparse.values().contiguous(), None if name is None else f"{name}.values", ps)
    ranks = basics.set_size(ps)
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    done.set_result(None)

    def finish(_: None) -> torch.Tensor:
        gathered = values.wait()
        if reduce_op is ops.Average:
            gathered = gathered / ranks if gathered.is_floating_point() else gathered // ranks
        return torch.sparse_coo_tensor(indices.wait().t(), gathered, sparse.shape)

    return Handle(done, finish, parts=[indices, values])
