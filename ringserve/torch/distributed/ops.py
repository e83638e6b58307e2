"""Each torch op as ringserve calls: what to send, and how to put the results where torch wants them.

An op here returns ``Started``: the concurrent futures of its ringserve calls (on the plane) and
``finish``, which runs once they are all done, on a completion thread: it copies results into the
op's output tensors and returns what the op's torch future resolves to (the outputs, as gloo's).

CPU tensors in a dtype the wire reduces are reduced in place through numpy views, without a copy
(DDP's gradient buckets are); anything else (another dtype, a non-contiguous or a CUDA tensor) is
staged through a host copy, as ``ringserve.torch`` does. Gathers and broadcasts move raw bytes, so
every dtype arrives bit for bit.

The ops ringserve has no collective for run over the ring:

- ``reduce``: a ring all_reduce, whose result only the root keeps (the others' tensors are left
  as they were): 2(N-1)/N of the tensor sent per rank instead of (N-1)/N;
- ``gather``: a ring all_gather of every rank's bytes, which only the root keeps;
- ``scatter``: the root's whole list goes round the ring as one chain broadcast, and each rank
  keeps its own slice (every rank's output must have the same size).
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed import ReduceOp

from ringserve import codecs
from ringserve.errors import InvalidArgumentError
from ringserve.torch import _tensors
from ringserve.torch.compression import wire_codec
from ringserve.torch.distributed.plane import Plane

_CORE: dict[Any, str] = {
    ReduceOp.SUM: "sum", ReduceOp.AVG: "average", ReduceOp.MIN: "min", ReduceOp.MAX: "max", ReduceOp.PRODUCT: "product",
    ReduceOp.BAND: "band", ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor",
}
_BITWISE = ("band", "bor", "bxor")
# Bool tensors are reduced as their 0/1 bytes, each op as gloo computes it on bool: SUM, MAX and BOR
# are "any", PRODUCT, MIN and BAND "all", BXOR "an odd count".
_ON_BOOL = {"sum": "max", "max": "max", "bor": "max", "product": "min", "min": "min", "band": "min", "bxor": "bxor"}
# How many tensors keep an error-feedback residual at once (the least recently reduced goes first):
# DDP reduces a handful of buckets, the same tensors every step.
RESIDUALS_KEPT = 32


@dataclass
class Started:
    """An op's ringserve calls in flight, and what completes it once they are done."""

    parts: list[concurrent.futures.Future[Any]]
    finish: Callable[[list[Any]], Any]


def core_op(op: Any, what: str, dtype: torch.dtype | None = None) -> str:
    """ringserve's name of a torch ReduceOp on tensors of ``dtype`` (None: any).

    Raises:
        NotImplementedError: PREMUL_SUM (gloo has none either).
        InvalidArgumentError: an op the dtype has not, as gloo refuses it: BAND, BOR, BXOR on a
            floating point or complex tensor; AVG on an integer or bool tensor (its mean is a float,
            which torch does not cast back in place).
    """
    red = getattr(op, "op", op)  # a ReduceOp holds its RedOpType
    core = _CORE.get(red)
    name = getattr(red, "name", str(red))
    if core is None:
        raise NotImplementedError(
            f"{what} with ReduceOp.{name} is not supported by the ringserve backend (nor by gloo); use SUM, AVG, MIN, "
            "MAX, PRODUCT, BAND, BOR or BXOR (for PREMUL_SUM, multiply the tensor by the factor, then use SUM)."
        )
    if dtype is None:
        return core
    if core in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgumentError(f"Cannot use ReduceOp.{name} with non-integral dtype {dtype} ({what}).")
    if core == "average" and not (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgumentError(
            f"{what} with ReduceOp.AVG on a {dtype} tensor: result type Float can't be cast to the desired output "
            f"type {dtype} (as on gloo); reduce with SUM and divide in a floating point dtype."
        )
    return _ON_BOOL[core] if dtype == torch.bool else core


def wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor to reduce for ``tensor``: itself, or for a bool tensor its 0/1 bytes (a view)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def single(tensors: Sequence[torch.Tensor] | torch.Tensor, what: str) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise InvalidArgumentError(f"The ringserve backend's {what} takes one tensor per call, not {len(tensors)}.")
    return tensors[0]


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A 1-D uint8 array of ``tensor``'s bytes (a view of a contiguous CPU tensor, else a host copy)."""
    host = tensor.detach()
    if host.device.type != "cpu":
        host = host.to("cpu")
    host = host.contiguous()
    if host.dim() == 0:
        host = host.reshape(1)
    return host.reshape(-1).view(torch.uint8).numpy()


def fill(tensor: torch.Tensor, data: np.ndarray) -> None:
    """Overwrites ``tensor`` with ``data``, its bytes (any dtype, device or layout)."""
    if data.nbytes != tensor.numel() * tensor.element_size():
        raise InvalidArgumentError(
            f"Received {data.nbytes} bytes for a tensor of {tuple(tensor.shape)} {tensor.dtype}: the ranks' tensors differ in size."
        )
    if data.nbytes == 0:
        return  # nothing to write (and numpy's empty arrays may not view as another dtype)
    with torch.no_grad():
        tensor.copy_(from_bytes(data, tensor.dtype, tuple(tensor.shape)))


def from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over a copy of ``data``, its bytes."""
    if data.nbytes == 0:
        return torch.empty(shape, dtype=dtype, device="cpu")
    return torch.from_numpy(np.ascontiguousarray(data)).view(dtype).reshape(shape)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _restore_into(tensor: torch.Tensor, result: np.ndarray) -> None:
    layout = _tensors.Layout(tensor.dtype, tuple(tensor.shape), tensor.device, as_bytes=False)
    with torch.no_grad():
        tensor.copy_(_tensors.restore(result, layout))


class Residuals:
    """Error-feedback residuals by tensor (its memory, size and dtype), the newest RESIDUALS_KEPT."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()

    def of(self, tensor: torch.Tensor, array: np.ndarray) -> np.ndarray:
        key = (tensor.device, tensor.data_ptr(), tensor.numel(), tensor.dtype)
        residual = self._kept.get(key)
        if residual is None:
            residual = self._kept[key] = np.zeros(array.size, dtype=codecs.sum_dtype(array.dtype))
            while len(self._kept) > RESIDUALS_KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(key)
        return residual


def _reducible(tensor: torch.Tensor) -> tuple[np.ndarray, bool]:
    """The array to reduce for ``tensor`` and whether it is the tensor's own memory."""
    array, _ = _tensors.reducible(tensor)
    return array, _tensors.shares_memory(array, tensor)


def allreduce(plane: Plane, tensor: torch.Tensor, op: str, *, compression: str | None,
              residuals: Residuals | None) -> Started:
    """``tensor`` reduced in place (``op`` from ``core_op`` for its dtype)."""
    given, tensor = tensor, wire(tensor)
    array, in_place = _reducible(tensor)
    lossy = compression if op in ("sum", "average") and array.dtype.kind == "f" else None
    codec = wire_codec(lossy, tensor.dtype, array.dtype.kind)
    residual = residuals.of(tensor, array) if residuals is not None and lossy is not None else None
    # Reduced in place: in the tensor's own memory, or in the host copy it was staged to.
    part = plane.allreduce(array, op, out=array, compression=codec, residual=residual)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        if not in_place:
            _restore_into(tensor, results[0])
        return [given]

    return Started([part], finish)


def allreduce_coalesced(plane: Plane, tensors: Sequence[torch.Tensor], op: str, *, compression: str | None) -> Started:
    if len({t.dtype for t in tensors}) > 1:
        raise InvalidArgumentError(
            f"all_reduce_coalesced needs tensors of one dtype, not {sorted({str(t.dtype) for t in tensors})}."
        )
    flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors]) if tensors else torch.zeros(0, device="cpu")
    started = allreduce(plane, flat, op, compression=compression, residuals=None)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        started.finish(results)
        return unflatten_into(tensors, flat)

    return Started(started.parts, finish)


def unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """Copies consecutive parts of ``flat`` into ``tensors``, each its own shape; returns them."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
    return list(tensors)


def broadcast(plane: Plane, tensor: torch.Tensor, root: int) -> Started:
    array, layout = _tensors.raw(tensor)
    part = plane.broadcast(array, root)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        if plane.rank != root:
            with torch.no_grad():
                tensor.copy_(_tensors.restore(results[0], layout))
        return [tensor]

    return Started([part], finish)


def _check_sizes(outputs: Sequence[torch.Tensor], size: int, what: str) -> None:
    if len(outputs) != size:
        raise InvalidArgumentError(f"{what} needs a list of {size} output tensors (the group's size), not {len(outputs)}.")


def _split_into(outputs: Sequence[torch.Tensor], data: np.ndarray) -> None:
    offset = 0
    for out in outputs:
        fill(out, data[offset: offset + _nbytes(out)])
        offset += _nbytes(out)
    if offset != data.nbytes:
        raise InvalidArgumentError(
            f"The ranks sent {data.nbytes} bytes in all, but the output tensors hold {offset}: the ranks' tensors differ in size."
        )


def allgather(plane: Plane, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Started:
    _check_sizes(outputs, plane.size, "all_gather")
    part = plane.allgather(as_bytes(tensor))

    def finish(results: list[Any]) -> list[list[torch.Tensor]]:
        _split_into(outputs, results[0])
        return [list(outputs)]

    return Started([part], finish)


def allgather_coalesced(plane: Plane, output_lists: Sequence[Sequence[torch.Tensor]],
                        inputs: Sequence[torch.Tensor]) -> Started:
    """torch's all_gather_coalesced: ``output_lists[src][i]`` receives ``inputs[i]`` of group rank
    ``src`` (torch's layout: the source rank first). Every rank's inputs go round as one allgather."""
    if len(output_lists) != plane.size:
        raise InvalidArgumentError(
            f"all_gather_coalesced needs one list of outputs per rank of the group ({plane.size}), not "
            f"{len(output_lists)}."
        )
    lengths = [len(o) for o in output_lists]
    if any(n != len(inputs) for n in lengths):
        raise InvalidArgumentError(
            f"all_gather_coalesced needs {len(inputs)} outputs (one per input) in each rank's list, not {lengths}."
        )
    data = np.concatenate([as_bytes(t) for t in inputs]) if inputs else np.zeros(0, np.uint8)
    part = plane.allgather(data)

    def finish(results: list[Any]) -> list[list[torch.Tensor]]:
        _split_into([t for outputs in output_lists for t in outputs], results[0])
        return [list(outputs) for outputs in output_lists]

    return Started([part], finish)


def allgather_into(plane: Plane, output: torch.Tensor, tensor: torch.Tensor) -> Started:
    if output.numel() != tensor.numel() * plane.size:
        raise InvalidArgumentError(
            f"all_gather_into_tensor's output has {output.numel()} elements; it needs {plane.size} x {tensor.numel()}."
        )
    part = plane.allgather(as_bytes(tensor))

    def finish(results: list[Any]) -> list[torch.Tensor]:
        fill(output, results[0])
        return [output]

    return Started([part], finish)


def reduce_scatter_into(plane: Plane, output: torch.Tensor, tensor: torch.Tensor, op: str) -> Started:
    """Row ``rank`` of the reduction of ``tensor`` (``size`` rows of ``output``'s size each)."""
    if tensor.numel() != output.numel() * plane.size:
        raise InvalidArgumentError(
            f"reduce_scatter's input has {tensor.numel()} elements; it needs {plane.size} x {output.numel()} (the output's)."
        )
    array, _ = _tensors.reducible(wire(tensor))
    part = plane.reduce_scatter(array.reshape(plane.size, -1), op)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        _restore_into(output, results[0].reshape(-1))
        return [output]

    return Started([part], finish)


def reduce_scatter_list(plane: Plane, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str) -> Started:
    _check_sizes(inputs, plane.size, "reduce_scatter")
    if any(t.numel() != output.numel() for t in inputs):
        raise InvalidArgumentError(
            f"reduce_scatter needs every input of the output's size ({output.numel()} elements), not "
            f"{[t.numel() for t in inputs]}."
        )
    stacked = torch.cat([t.detach().reshape(-1).cpu() for t in inputs])
    return reduce_scatter_into(plane, output, stacked, op)


def reduce(plane: Plane, tensor: torch.Tensor, root: int, op: str) -> Started:
    given, tensor = tensor, wire(tensor)
    array, in_place = _reducible(tensor)
    keep = plane.rank == root
    part = plane.allreduce(array, op, out=array if keep or not in_place else None, compression=None, residual=None)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        if keep and not in_place:
            _restore_into(tensor, results[0])
        return [given]

    return Started([part], finish)


def gather(plane: Plane, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, root: int) -> Started:
    keep = plane.rank == root
    if keep:
        _check_sizes(outputs, plane.size, "gather")
    part = plane.allgather(as_bytes(tensor))

    def finish(results: list[Any]) -> list[list[torch.Tensor]]:
        if keep:
            _split_into(outputs, results[0])
            return [list(outputs)]
        return []

    return Started([part], finish)


def scatter(plane: Plane, output: torch.Tensor, inputs: Sequence[torch.Tensor], root: int) -> Started:
    each = _nbytes(output)
    if plane.rank == root:
        _check_sizes(inputs, plane.size, "scatter")
        if any(_nbytes(t) != each for t in inputs):
            raise InvalidArgumentError(
                f"scatter over ringserve needs every tensor of the output's size ({tuple(output.shape)} {output.dtype})."
            )
        data = np.concatenate([as_bytes(t) for t in inputs]) if inputs else np.zeros(0, np.uint8)
    else:
        data = np.empty(each * plane.size, dtype=np.uint8)
    part = plane.broadcast(data, root)
    rank = plane.rank

    def finish(results: list[Any]) -> list[torch.Tensor]:
        fill(output, results[0][rank * each: (rank + 1) * each])
        return [output]

    return Started([part], finish)


def _split(which: str, splits: Sequence[int], tensor: torch.Tensor, size: int) -> tuple[list[int], str]:
    """Bytes per group rank of all_to_all_single's ``which`` tensor, split along dim 0 by
    ``splits`` (rows; empty: evenly), and what is wrong with them ("" if nothing), as torch checks."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row = _nbytes(tensor) // rows if rows else 0
    parts = [int(s) for s in splits]
    if not parts:
        if rows % size:
            return [], (f"all_to_all_single's {which} has {rows} rows along dim 0, which is not a multiple of the "
                        f"group's size ({size}): pass {which}_split_sizes")
        return [rows // size * row] * size, ""
    if len(parts) != size:
        return [], f"all_to_all_single's {which}_split_sizes {parts} have {len(parts)} entries, not one per rank ({size})"
    if any(p < 0 for p in parts) or sum(parts) != rows:
        return [], (f"all_to_all_single's {which}_split_sizes {parts} must be non-negative and sum to its {rows} "
                    f"rows along dim 0")
    return [p * row for p in parts], ""


def all_to_all(plane: Plane, output: torch.Tensor, tensor: torch.Tensor,
               output_splits: Sequence[int], input_splits: Sequence[int]) -> Started:
    """all_to_all_single over ``Plane.alltoall``: rows of dim 0 sent and received as bytes, split
    as torch splits them. Splits that are wrong on a rank fail the op on every rank of the group
    (Plane.alltoall's ``problem``), not by a deadline."""
    send, problem = _split("input", input_splits, tensor, plane.size)
    recv, other = _split("output", output_splits, output, plane.size)
    part = plane.alltoall(as_bytes(tensor), send, recv, problem=problem or other)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        fill(output, results[0])
        return [output]

    return Started([part], finish)


def all_to_all_list(plane: Plane, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Started:
    """all_to_all of tensor lists: ``inputs[d]`` to group rank d, ``outputs[o]`` from group rank o
    (any sizes and dtypes, each tensor's bytes as they are)."""
    problem = ""
    if len(inputs) != plane.size or len(outputs) != plane.size:
        problem = (f"all_to_all needs one input and one output tensor per rank of the group ({plane.size}), not "
                   f"{len(inputs)} inputs and {len(outputs)} outputs")
    data = np.concatenate([as_bytes(t) for t in inputs]) if inputs else np.zeros(0, np.uint8)
    part = plane.alltoall(data, [_nbytes(t) for t in inputs], [_nbytes(t) for t in outputs], problem=problem)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        _split_into(outputs, results[0])
        return list(outputs)

    return Started([part], finish)
