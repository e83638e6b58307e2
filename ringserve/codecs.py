"""Wire codecs: how the chunks of a floating point allreduce are packed on the wire.

A codec turns a chunk of the running sum (float32, or float64 for float64 tensors) into fewer
bytes and back. Ranks never add encoded values: each rank decodes what arrives, adds its own input
in the accumulation dtype, and encodes the partial sum again for its successor. The owner of a
segment keeps ``decode(encode(total))``, exactly what every other rank decodes from the bytes it
forwards, so results stay bit-identical across ranks.

Error of one ``decode(encode(x))``, for finite x (u is the codec's unit roundoff):

==========  ============  ==========================================================================
codec       bytes/value   bound on ``|x - decode(encode(x))|``
==========  ============  ==========================================================================
``none``    4 (8)         0
``fp16``    2             ``2**-11 * |x|`` for ``2**-14 <= |x| <= 65504``; ``2**-25`` below;
                          ``|x| >= 65520`` becomes inf
``bf16``    2             ``2**-8 * |x|`` (float32's range; values past it become inf)
``int8``    1 + 4/256     ``max(|block|) * (1/254 + 2**-22) + 2**-142`` per block of 256 values (a
                          float32 scale each; the relative term is the float32 roundings of the scale
                          and of the decoded value, seen at a value halfway between two steps, e.g.
                          60 in a block whose peak is 120; the absolute one is for subnormal scales)
==========  ============  ==========================================================================

(float64 inputs are rounded to float32 first: add ``2**-24 * |x|``. int8's bound holds for
``|x| < 2**127``; within a rounding of float32's largest value a scaled value may become inf.) An allreduce over ``N`` ranks
encodes each element ``N`` times, once per partial sum, so its error is at most the sum of these
bounds over the ``N`` partial sums. Non-finite values stay non-finite: a block of int8 that holds
an inf or a NaN decodes as NaN, so a non-finite check on the result still sees it.
"""

from __future__ import annotations

import numpy as np

from ringserve._proto import peer_pb2
from ringserve.errors import InvalidArgumentError

INT8_BLOCK = 256

_F32 = np.dtype(np.float32)


class Codec:
    """One way to pack float values. Subclasses define name, code and the three methods."""

    name = ""
    code = peer_pb2.CODEC_NONE

    def encoded_bytes(self, count: int) -> int:
        """Bytes of the encoding of ``count`` values."""
        raise NotImplementedError

    def encode(self, x: np.ndarray) -> np.ndarray:
        """A uint8 array holding ``x`` (float32 or float64, 1-D)."""
        raise NotImplementedError

    def decode(self, data: np.ndarray | memoryview, count: int) -> np.ndarray:
        """The float32 values of ``data``, the encoding of ``count`` values."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == _F32 else x.astype(_F32)


def _bytes(data: np.ndarray | memoryview) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


class FP16(Codec):
    """IEEE half precision, round to nearest even."""

    name = "fp16"
    code = peer_pb2.CODEC_FP16

    def encoded_bytes(self, count: int) -> int:
        return 2 * count

    def encode(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint8)

    def decode(self, data: np.ndarray | memoryview, count: int) -> np.ndarray:
        return _bytes(data).view(np.float16).astype(_F32)


class BF16(Codec):
    """bfloat16: the upper half of a float32, rounded to nearest even (NaN stays NaN)."""

    name = "bf16"
    code = peer_pb2.CODEC_BF16

    def encoded_bytes(self, count: int) -> int:
        return 2 * count

    def encode(self, x: np.ndarray) -> np.ndarray:
        bits = _f32(x).view(np.uint32)
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        out = (rounded >> np.uint32(16)).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            # Rounding can carry a NaN's payload into the exponent and make it inf (or wrap).
            out[nan] = 0x7FC0
        return out.view(np.uint8)

    def decode(self, data: np.ndarray | memoryview, count: int) -> np.ndarray:
        wide = _bytes(data).view(np.uint16).astype(np.uint32)
        wide <<= np.uint32(16)
        return wide.view(_F32)


class Int8(Codec):
    """Blocks of 256 values as int8 times a float32 scale of ``max(|block|) / 127``.

    Layout: the float32 scales of all blocks, then the int8 values. A block whose largest
    magnitude is not finite gets a NaN scale, so all its values decode as NaN.
    """

    name = "int8"
    code = peer_pb2.CODEC_INT8

    def encoded_bytes(self, count: int) -> int:
        return 4 * -(-count // INT8_BLOCK) + count

    def encode(self, x: np.ndarray) -> np.ndarray:
        count = x.size
        blocks = -(-count // INT8_BLOCK)
        out = np.empty(self.encoded_bytes(count), dtype=np.uint8)
        scales = out[: 4 * blocks].view(_F32)
        values = out[4 * blocks :].view(np.int8)
        full = count // INT8_BLOCK * INT8_BLOCK
        self._encode_blocks(_f32(x[:full]).reshape(-1, INT8_BLOCK), scales[: full // INT8_BLOCK], values[:full])
        if full < count:
            self._encode_blocks(_f32(x[full:]).reshape(1, -1), scales[full // INT8_BLOCK :], values[full:])
        return out

    @staticmethod
    def _encode_blocks(x: np.ndarray, scales: np.ndarray, values: np.ndarray) -> None:
        if not x.size:
            return
        peak = np.abs(x).max(axis=1)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            np.divide(peak, np.float32(127), out=scales)
            bad = ~np.isfinite(scales)
            q = x / scales[:, None]  # a division, not a product with 1/scale: that overflows for tiny scales
            np.rint(q, out=q)
        bad |= scales == 0  # an all-zero block, or one so tiny its scale underflows
        if bad.any():
            scales[bad & ~np.isfinite(peak)] = np.nan
            q[bad] = 0
        np.clip(q, -127, 127, out=q)
        values[:] = q.reshape(-1).astype(np.int8)

    def decode(self, data: np.ndarray | memoryview, count: int) -> np.ndarray:
        raw = _bytes(data)
        blocks = -(-count // INT8_BLOCK)
        scales = raw[: 4 * blocks].view(_F32)
        out = raw[4 * blocks :].view(np.int8).astype(_F32)
        full = count // INT8_BLOCK * INT8_BLOCK
        body = out[:full].reshape(-1, INT8_BLOCK)
        with np.errstate(over="ignore"):
            body *= scales[: full // INT8_BLOCK, None]
            if full < count:
                out[full:] *= scales[-1]
        return out


def sum_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype coded values are added in: float64 for float64 arrays, else float32."""
    return np.dtype(np.float64 if dtype == np.float64 else np.float32)


CODECS: dict[str, Codec | None] = {"none": None, "fp16": FP16(), "bf16": BF16(), "int8": Int8()}


def codec(name: str | None) -> Codec | None:
    """The codec called ``name`` (None and "none" mean raw values); raises InvalidArgumentError."""
    if name is None:
        return None
    try:
        return CODECS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"The compression {name!r} is not supported; use one of {', '.join(CODECS)}."
        ) from None
