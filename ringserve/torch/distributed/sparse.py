"""all_reduce of sparse COO tensors, as gloo's: the sum of every rank's tensor, coalesced.

Each rank's coalesced indices and values go round as one allgather of blocks of any size (a block:
the count of entries as 8 bytes, then the indices, then the values), and every rank adds them up in
group-rank order, so every rank holds the same bits. The ranks' dtypes, shapes and sparse
dimensions must agree: they name the allgather, and ranks that disagree fail (MismatchError).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ringserve.errors import InvalidArgumentError
from ringserve.torch.distributed.ops import Started, as_bytes, from_bytes
from ringserve.torch.distributed.plane import Plane
from ringserve.worker.dataplane.descriptor import Descriptor


def allreduce(plane: Plane, tensor: torch.Tensor, op: str) -> Started:
    """The sum of every rank's sparse COO ``tensor``, coalesced, in place of ``tensor``.

    Raises:
        InvalidArgumentError: ``op`` is not "sum" (gloo has SUM only for sparse tensors).
    """
    if op != "sum":
        raise InvalidArgumentError(f"all_reduce of sparse tensors works with ReduceOp.SUM only, not {op!r} (as on gloo).")
    local = tensor.detach().to("cpu").coalesce()
    indices, values = local.indices().contiguous(), local.values().contiguous()
    block = np.concatenate([np.array([local._nnz()], dtype=np.int64).view(np.uint8), as_bytes(indices), as_bytes(values)])
    dense_shape = tuple(values.shape[1:])
    # Ranks that disagree on the dtype, the dense shape or the sparse dimensions fail alike (MismatchError).
    what = Descriptor("sparse_allreduce", dtype=str(values.dtype).removeprefix("torch."), shape=tuple(local.shape),
                      stage=f"sparse_dim={local.sparse_dim()}")
    part = plane.allgather_blocks(block, what)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        total = None
        for data in results[0]:
            nnz = int(data[:8].view(np.int64)[0])
            cut = 8 + nnz * indices.shape[0] * 8
            idx = from_bytes(data[8:cut].copy(), torch.int64, (indices.shape[0], nnz))
            val = from_bytes(data[cut:].copy(), values.dtype, (nnz, *dense_shape))
            one = torch.sparse_coo_tensor(idx, val, local.shape)
            total = one if total is None else total + one
        assert total is not None
        with torch.no_grad():
            tensor.copy_(total.coalesce().to(tensor.device))
        return [tensor]

    return Started([part], finish)
