"""Gradient compression for allreduce: none, fp16 and bf16, with Horovod's interface.

A compressor turns a tensor into the tensor that goes on the wire and back::

    wire, ctx = Compression.fp16.compress(grad)
    ...allreduce wire...
    grad = Compression.fp16.decompress(reduced, ctx)

``Compression.bf16`` rounds values to bfloat16. The wire has no bfloat16 type yet, so bfloat16 is
reduced in float32 on the wire: it gives bfloat16's rounding without its bandwidth saving (yet).
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface of a compressor: a pair of static methods, as in Horovod."""

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
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating point tensors as float16 (half the bytes of float32)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Rounds floating point tensors to bfloat16 (reduced in float32 on the wire for now)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
