"""Gradient compression for allreduce: none, fp16, bf16 and int8, with Horovod's interface.

A compressor has Horovod's pair of static methods, which turn a tensor into the tensor to reduce
and back:

```python
wire, ctx = Compression.fp16.compress(grad)
...allreduce wire...
grad = Compression.fp16.decompress(reduced, ctx)
```

ringserve's own compressors also name a wire codec (``wire``, see ringserve.codecs). Its
collectives and DistributedOptimizer then skip compress/decompress and reduce the tensor as it is,
with each chunk encoded on the wire and every sum added in float32: fp16 and bf16 halve the bytes,
int8 (a float32 scale per block of 256 values) quarters them, without float16's overflow or loss
in the sums. A compressor of your own (compress/decompress only) is applied around the reduction,
as in Horovod.

``Compression.powersgd(rank=4)`` is of another kind: PowerSGD's low-rank factors with warm start
and error feedback (ringserve.powersgd), kept per fusion bucket of a DistributedOptimizer, which
runs its two allreduces per bucket. It is not a per-tensor compress/decompress pair.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ringserve.errors import InvalidArgumentError, UnsupportedError
from ringserve.powersgd import PowerSGD


class Compressor:
    """Interface of a compressor: a pair of static methods, as in Horovod, and a wire codec."""

    wire: str | None = None  # the codec of ringserve.codecs that replaces compress/decompress

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Returns the tensor to send and the context that decompress() needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Returns the received tensor in the original form, given compress()'s context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Casts floating point tensors to ``wire_dtype`` and back; leaves other tensors alone."""

    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating point values as float16 (half the bytes of float32)."""

    wire_dtype = torch.float16
    wire = "fp16"


class BF16Compressor(_CastCompressor):
    """Sends floating point values as bfloat16 (half the bytes, float32's range)."""

    wire_dtype = torch.bfloat16
    wire = "bf16"


class Int8Compressor(NoneCompressor):
    """Sends floating point values as int8 with a float32 scale per block of 256 (a quarter of the
    bytes). It exists only on the wire: compress/decompress leave tensors as they are. Use it with
    ``DistributedOptimizer(..., error_feedback=True)`` so that training converges as uncompressed."""

    wire = "int8"


class PowerSGDCompressor(Compressor):
    """PowerSGD for DistributedOptimizer: made by ``Compression.powersgd(...)``; ``core`` is the
    ringserve.powersgd.PowerSGD that holds the knobs and each bucket's Qs and errors.

    Its initial Qs are drawn as torch's ``powerSGD_hook`` draws them (``torch.randn`` under
    ``torch.manual_seed`` of a seed from ``numpy.random.RandomState(random_seed)``), so that a run
    and the hook's start from the same projections.
    """

    def __init__(self, core: PowerSGD) -> None:
        self.core = core

    def __repr__(self) -> str:
        return f"Compression.powersgd: {self.core!r}"

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        raise UnsupportedError(
            "Compression.powersgd keeps state per fusion bucket across steps: use it with DistributedOptimizer "
            "(or ringserve.allreduce(..., compression=ringserve.PowerSGD(...)) with a name), not with a single collective."
        )

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return self.compress(tensor)[0]


def torch_init_q(seed: int, shapes: list[tuple[int, int]] | Any) -> list[np.ndarray]:
    """Standard normal Qs as torch's powerSGD_hook draws them for one bucket, in order."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [torch.randn(*shape, dtype=torch.float32, device="cpu").numpy() for shape in shapes]


def powersgd(rank: int | None = None, *, matrix_approximation_rank: int | None = None,
             start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2.0, use_error_feedback: bool = True,
             warm_start: bool = True, orthogonalization_epsilon: float = 0.0, random_seed: int = 0) -> PowerSGDCompressor:
    """PowerSGD with torch's ``PowerSGDState`` knobs and defaults, for DistributedOptimizer.

    Args:
        rank: the matrix approximation rank (``matrix_approximation_rank`` is the same, torch's name;
            1 when neither is given).
        start_powerSGD_iter: steps reduced uncompressed first (torch's default: 1,000).
        min_compression_rate, use_error_feedback, warm_start, orthogonalization_epsilon, random_seed:
            as in torch's PowerSGDState (see ringserve.powersgd).

    Raises:
        InvalidArgumentError: both ranks given and different, or a knob out of range.

    Example:
        ```python
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.powersgd(rank=4, start_powerSGD_iter=10))
        ```
    """
    if rank is not None and matrix_approximation_rank is not None and rank != matrix_approximation_rank:
        raise InvalidArgumentError(
            f"rank ({rank}) and matrix_approximation_rank ({matrix_approximation_rank}) name the same knob: give one.")
    r = rank if rank is not None else (matrix_approximation_rank if matrix_approximation_rank is not None else 1)
    return PowerSGDCompressor(PowerSGD(r, start_powerSGD_iter, min_compression_rate=min_compression_rate,
                                       use_error_feedback=use_error_feedback, warm_start=warm_start,
                                       orthogonalization_epsilon=orthogonalization_epsilon, random_seed=random_seed,
                                       init_q=torch_init_q))


class Compression:
    """The available compressors: ``none``, ``fp16``, ``bf16`` and ``int8``, and ``powersgd(...)``,
    which makes a PowerSGD compressor for DistributedOptimizer."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    int8 = Int8Compressor
    powersgd = staticmethod(powersgd)


def split(compression: type[Compressor] | Compressor) -> tuple[type[Compressor] | Compressor, str | None]:
    """(the compressor to apply around the reduction, the wire codec): one of them does nothing."""
    wire = getattr(compression, "wire", None)
    return (NoneCompressor, wire) if wire else (compression, None)


def wire_codec(codec: str | None, dtype: torch.dtype, array_kind: str) -> str | None:
    """The codec a reduction travels in, for a tensor of ``dtype`` sent as an array of ``array_kind``.

    Codecs apply to floating point values only. bfloat16 tensors travel as bf16 even when no
    compression is asked for: the wire adds them in float32 and every partial sum is rounded to
    bfloat16, as a bfloat16 reduction would round it, in half the bytes of the float32 they are
    reduced in.
    """
    if array_kind != "f":
        return None
    if codec is None and dtype == torch.bfloat16:
        return "bf16"
    return codec
