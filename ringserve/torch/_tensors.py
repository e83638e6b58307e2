"""Tensors to and from the core's numpy arrays, with as few copies as the wire allows.

CPU tensors in a dtype the wire carries go out as ``tensor.numpy()`` views: no copy here (the core
makes its one copy when it frames the data). Other tensors take the cheapest faithful route:

- reductions of bfloat16 and int16 are upcast (float32, int32), since the wire cannot add them (bfloat16
  still travels in two bytes per value: see compression.wire_codec);
- broadcasts and gathers of any dtype travel as their raw bytes (a ``uint8`` view), bit for bit;
- CUDA and other device tensors are staged through host memory and come back on their device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ringserve.errors import InvalidArgumentError

# dtypes the wire carries and reduces as they are.
_NATIVE = {
    torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8,
}
# dtypes the wire cannot reduce: reduced in a wider dtype, then cast back.
_UPCAST = {torch.bfloat16: torch.float32, torch.int16: torch.int32}


@dataclass(frozen=True)
class Layout:
    """How to turn a wire array back into a tensor like the one that was sent.

    Attributes:
        dtype: the tensor's dtype.
        shape: the tensor's shape (dimension 0 may differ in the result, as in allgather).
        device: where the result goes back to.
        as_bytes: the wire array holds raw bytes, one row of bytes per entry of dimension 0.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    as_bytes: bool


def _host(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.is_sparse:
        tensor = tensor.to_dense()
    return tensor.contiguous()


def reducible(tensor: torch.Tensor) -> tuple[np.ndarray, Layout]:
    """A numpy array the core can reduce, and the layout to restore the result.

    Raises:
        InvalidArgumentError: the dtype cannot be reduced (bool, complex, ...).
    """
    layout = Layout(tensor.dtype, tuple(tensor.shape), tensor.device, as_bytes=False)
    host = _host(tensor)
    if host.dtype in _NATIVE:
        return host.numpy(), layout
    wide = _UPCAST.get(host.dtype)
    if wide is None:
        raise InvalidArgumentError(
            f"Tensors of dtype {tensor.dtype} cannot be reduced; use a floating point or integer tensor."
        )
    return host.to(wide).numpy(), layout


def raw(tensor: torch.Tensor) -> tuple[np.ndarray, Layout]:
    """A numpy array carrying ``tensor``'s data unchanged, shaped (dim 0, rest) for gathers.

    Tensors in a native dtype go as they are; any other dtype goes as its bytes.
    """
    layout = Layout(tensor.dtype, tuple(tensor.shape), tensor.device, as_bytes=False)
    host = _host(tensor)
    if host.dtype in _NATIVE:
        return host.numpy(), layout
    rows = host.shape[0] if host.dim() else 1
    rest = math.prod(host.shape[1:]) if host.dim() else 1
    as_bytes = host.reshape(-1).view(torch.uint8).reshape(rows, rest * host.element_size())
    return as_bytes.numpy(), Layout(tensor.dtype, tuple(tensor.shape), tensor.device, as_bytes=True)


def restore(array: np.ndarray, layout: Layout, *, rows: int | None = None) -> torch.Tensor:
    """The tensor that ``array`` encodes under ``layout``, on the layout's device.

    Args:
        array: what the core returned (owned by the caller; no copy is made on the CPU).
        layout: from reducible() or raw().
        rows: the result's dimension 0 when it differs from the input's (allgather, reducescatter).
    """
    shape = layout.shape if rows is None else (rows, *layout.shape[1:])
    out = torch.from_numpy(np.ascontiguousarray(array))
    if layout.as_bytes:
        out = out.reshape(-1).view(layout.dtype)
    elif out.dtype != layout.dtype:
        out = out.to(layout.dtype)
    out = out.reshape(shape)
    if out.device != layout.device:
        out = out.to(layout.device)
    return out


def shares_memory(array: np.ndarray, tensor: torch.Tensor) -> bool:
    """True if ``array`` may overlap the memory of the CPU ``tensor`` (so writing it changes the tensor)."""
    if tensor.device.type != "cpu" or array.nbytes == 0:
        return False
    storage = tensor.untyped_storage()
    a0 = array.__array_interface__["data"][0]
    t0 = storage.data_ptr()
    return bool(a0 < t0 + storage.nbytes() and t0 < a0 + array.nbytes)
