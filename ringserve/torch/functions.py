"""Broadcasting model and optimizer state, and picklable objects, from one rank to all.

Tensors travel fused as raw bytes (bit for bit, any dtype) in a few large broadcasts rather than
one broadcast per tensor; structure and non-tensor values travel once as a pickled skeleton.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ringserve import api
from ringserve.errors import InvalidArgumentError
from ringserve.torch import basics
from ringserve.worker.ops.process_sets import ProcessSet

# Tensors are fused into broadcast buffers of at most this many bytes (one tensor may exceed it).
_GROUP_BYTES = 64 << 20
_ALIGN = 16


def _groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: list[list[torch.Tensor]] = []
    size = _GROUP_BYTES
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if size + nbytes > _GROUP_BYTES and (not groups or groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _aligned_offsets(group: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets that keep every tensor aligned, so the received bytes view as its dtype."""
    offsets, end = [], 0
    for t in group:
        start = _aligned(end)
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


def packed_size(tensors: list[torch.Tensor], prefix_bytes: int = 0) -> int:
    """The size in bytes of ``pack(tensors, prefix)`` with a prefix of ``prefix_bytes``."""
    return _aligned(prefix_bytes) + _aligned_offsets(tensors)[1]


def pack(tensors: list[torch.Tensor], prefix: bytes = b"") -> np.ndarray:
    """``prefix``, then the bytes of ``tensors``, in one new array, each tensor at an aligned offset
    (``unpack_into`` reads them back into tensors of the same shapes and dtypes); the padding is zeros."""
    start = _aligned(len(prefix))
    offsets, total = _aligned_offsets(tensors)
    flat = torch.empty(start + total, dtype=torch.uint8)  # every byte is written below: no pass of zeros first
    out = flat.numpy()
    out[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    end = len(prefix)
    for t, at in zip(tensors, offsets, strict=True):
        out[end: start + at] = 0
        end = start + at + t.numel() * t.element_size()
        flat[start + at: end] = _as_bytes(t)
    out[end:] = 0
    return out


def unpack_into(flat: np.ndarray, tensors: list[torch.Tensor], prefix_bytes: int = 0) -> None:
    """Copies ``pack``'s bytes (after a prefix of ``prefix_bytes``) into ``tensors``, in place.

    Raises:
        InvalidArgumentError: ``flat`` is not the size that tensors of these shapes and dtypes pack to.
    """
    start = _aligned(prefix_bytes)
    offsets, total = _aligned_offsets(tensors)
    if flat.size != start + total:
        raise InvalidArgumentError(f"received {flat.size - start} bytes of tensors where these tensors take {total}: "
                                   "the ranks' models or optimizers differ in their shapes or dtypes")
    received = torch.from_numpy(flat)
    with torch.no_grad():
        for t, at in zip(tensors, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            t.copy_(received[start + at: start + at + nbytes].view(t.dtype).view(t.shape))


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _broadcast(array: np.ndarray, root_rank: int, name: str, process_set: ProcessSet | None) -> np.ndarray:
    return basics.wait(basics.submit(lambda w: w.broadcast(array, root=root_rank, name=name, process_set=process_set)))


def broadcast_tensors_(tensors: Iterable[torch.Tensor], root_rank: int, name: str,
                       process_set: ProcessSet | None = None) -> None:
    """Overwrites every tensor with root_rank's, in place; all ranks pass the same shapes and dtypes.

    Args:
        tensors: tensors of any dtype and device.
        root_rank: the rank whose values win.
        name: names the broadcasts, so they match across ranks in any order.
        process_set: among that registered set's members only (root_rank is a global rank).
    """
    items = [t for t in tensors if t.numel() > 0]
    is_root = api.rank() == root_rank
    for k, group in enumerate(_groups(items)):
        offsets, total = _aligned_offsets(group)
        flat = torch.zeros(total, dtype=torch.uint8, device="cpu")
        if is_root:
            for t, start in zip(group, offsets, strict=True):
                flat[start: start + t.numel() * t.element_size()] = _as_bytes(t)
        result = _broadcast(flat.numpy(), root_rank, f"{name}.{k}", process_set)
        if is_root:
            continue
        received = torch.from_numpy(result)
        with torch.no_grad():
            for t, start in zip(group, offsets, strict=True):
                nbytes = t.numel() * t.element_size()
                t.copy_(received[start: start + nbytes].view(t.dtype).view(t.shape))


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int,
                         process_set: object = None) -> None:
    """Overwrites parameters or buffers with root_rank's values, in place.

    Args:
        params: a ``state_dict()``, ``named_parameters()``, or an iterable of tensors.
        root_rank: the rank whose values every rank takes.
        process_set: among that set's members only (root_rank is a global rank, one of them).

    Example:
        ```python
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        ```
    """
    ps = basics.resolve_set(process_set)
    if isinstance(params, Mapping):
        entries = sorted(params.items(), key=lambda kv: str(kv[0]))
        tensors = [t for _, t in entries]
    else:
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    for t in tensors:
        if t is not None and not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(
                f"broadcast_parameters takes tensors, not {type(t).__name__} values."
            )
    broadcast_tensors_([t for t in tensors if t is not None], root_rank, "ringserve.torch.parameters", ps)


@dataclass(frozen=True)
class _Slot:
    """Stands for a tensor in a pickled skeleton: which one, and how to allocate it."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    sparse: bool = False  # travels dense, made sparse again on arrival


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        sparse = value.is_sparse
        tensors.append(value.to_dense() if sparse else value)
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype, sparse)
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_strip(v, tensors) for v in value)
    return value


def _slots(value: Any, found: list[_Slot]) -> None:
    if isinstance(value, _Slot):
        found.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _slots(v, found)
    elif isinstance(value, list | tuple):
        for v in value:
            _slots(v, found)


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        tensor = tensors[value.index]
        return tensor.to_sparse() if value.sparse else tensor
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_fill(v, tensors) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None, *, process_set: object = None) -> None:
    """Makes every rank's optimizer state (moments, steps, hyperparameters) equal to root_rank's.

    Before the first step, the state is first made on every rank, as Horovod does: each parameter
    that needs a gradient and has none gets a zero one, and the wrapped optimizer takes one step
    (its changes to the parameters are undone), so that the moments exist and can be broadcast.
    Those zero gradients stay, as in Horovod. The zero gradients are sparse for a SparseAdam, and,
    as Horovod's ``model`` argument says, for an SGD's parameters of ``model``'s sparse
    ``Embedding`` modules; sparse tensors in the state arrive sparse. With ``process_set``, among
    its members only.

    Example:
        ```python
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        ```
    """
    ps = basics.resolve_set(process_set)
    is_root = api.rank() == root_rank
    skeleton, tensors = optimizer_payload(optimizer, model)  # the state is made on every rank, as Horovod's
    skeleton = api.broadcast_object(skeleton if is_root else None, root=root_rank,
                                    name="ringserve.torch.optimizer_skeleton", process_set=ps)
    if not is_root:
        tensors = receivers(skeleton)
    broadcast_tensors_(tensors, root_rank, "ringserve.torch.optimizer_state", ps)
    if not is_root:
        load_optimizer_payload(optimizer, skeleton, tensors)


def optimizer_payload(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                      make: bool = True) -> tuple[Any, list[torch.Tensor]]:
    """An optimizer's state_dict as a picklable skeleton and the tensors it stands for (what a root
    sends), its state made first where it has none and ``make`` says so (see
    broadcast_optimizer_state; a rank that others keep their state beside must not make one)."""
    sparse_params = _sparse_parameters(model)  # checks ``model`` whether or not the state is made
    if make and not optimizer.state_dict()["state"]:
        _initialize_state(optimizer, sparse_params)
    return state_payload(optimizer.state_dict())


def state_payload(state_dict: dict[str, Any]) -> tuple[Any, list[torch.Tensor]]:
    """An optimizer's state_dict (or a copy of one) as a picklable skeleton and the tensors it
    stands for, in the order ``receivers`` makes them."""
    tensors: list[torch.Tensor] = []
    return _strip(state_dict, tensors), tensors


def receivers(skeleton: Any) -> list[torch.Tensor]:
    """Empty CPU tensors to receive the tensors of ``skeleton`` into (``optimizer_payload``'s order)."""
    slots: list[_Slot] = []
    _slots(skeleton, slots)
    tensors = [torch.empty(0, device="cpu")] * len(slots)
    for slot in slots:
        tensors[slot.index] = torch.empty(slot.shape, dtype=slot.dtype, device="cpu")
    return tensors


def load_optimizer_payload(optimizer: torch.optim.Optimizer, skeleton: Any, tensors: list[torch.Tensor]) -> None:
    """Loads a skeleton and its received tensors (``receivers``) into ``optimizer``."""
    optimizer.load_state_dict(_fill(skeleton, tensors))


def _sparse_parameters(model: torch.nn.Module | None) -> set[int]:
    """The ids of the parameters of ``model``'s ``Embedding(sparse=True)`` modules."""
    if model is None:
        return set()
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"broadcast_optimizer_state's model must be a torch.nn.Module, not {model!r}.")
    return {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse
            for p in m.parameters()}


def _initialize_state(optimizer: torch.optim.Optimizer, sparse_params: set[int]) -> None:
    """Makes an optimizer's state with one step on zero gradients, leaving the parameters as they were.

    The step is the wrapped optimizer's own: a DistributedOptimizer's would start collectives
    that only this function's callers, not every rank's training loop, would meet.
    """
    inner = getattr(optimizer, "_optimizer", optimizer)  # a DistributedOptimizer's wrapped optimizer
    all_sparse = isinstance(inner, torch.optim.SparseAdam)
    sgd = isinstance(inner, torch.optim.SGD)
    params = [p for group in inner.param_groups for p in group["params"] if p.requires_grad]
    kept = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            sparse = all_sparse or (sgd and id(p) in sparse_params)
            p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
    if isinstance(inner, torch.optim.LBFGS):
        return  # its step needs a closure that evaluates the model: its state stays empty
    try:
        inner.step()
    finally:
        with torch.no_grad():
            for p, value in zip(params, kept, strict=True):
                p.copy_(value)


def broadcast_object(obj: object = None, root_rank: int = 0, name: str | None = None,
                     process_set: object = None) -> object:
    """Returns root_rank's picklable ``obj`` on every rank (of ``process_set``, if given)."""
    return api.broadcast_object(obj, root=root_rank, name=name, process_set=basics.resolve_set(process_set))


def allgather_object(obj: object, name: str | None = None, process_set: object = None) -> list[object]:
    """Returns every rank's picklable ``obj``, in rank order (of ``process_set``'s members, if given)."""
    return api.allgather_object(obj, name=name, process_set=basics.resolve_set(process_set))
