"""Frames on the data plane: a protobuf ``Frame`` whose payload is sliced, never parsed.

A frame is written as ``Frame{header=1, payload=2}`` in that field order, so its bytes are the
header message followed by the raw payload. The reader parses the small header with protobuf and
takes the payload as a memoryview of the received bytes: no copy, and no protobuf object around
megabytes. A frame from another writer, in any field order, still parses (slowly) as a Frame.
"""

from __future__ import annotations

import zlib

import numpy as np

from ringserve._proto import peer_pb2
from ringserve.errors import InvalidArgumentError, ProtocolError

FrameHeader = peer_pb2.FrameHeader
DATA = peer_pb2.DATA
ABORT = peer_pb2.ABORT
HELLO = peer_pb2.HELLO
BYE = peer_pb2.BYE

_HEADER_TAG = 0x0A  # field 1, length-delimited
_PAYLOAD_TAG = 0x12  # field 2, length-delimited

DTYPES: dict[np.dtype, int] = {
    np.dtype(np.float16): peer_pb2.FLOAT16,
    np.dtype(np.float32): peer_pb2.FLOAT32,
    np.dtype(np.float64): peer_pb2.FLOAT64,
    np.dtype(np.int32): peer_pb2.INT32,
    np.dtype(np.int64): peer_pb2.INT64,
    np.dtype(np.uint8): peer_pb2.UINT8,
    np.dtype(np.int8): peer_pb2.INT8,
}
CODE_TO_DTYPE = {code: dt for dt, code in DTYPES.items()}


def dtype_code(dtype: np.dtype) -> int:
    """The wire code of a numpy dtype; raises InvalidArgumentError for an unsupported one."""
    try:
        return DTYPES[np.dtype(dtype)]
    except KeyError:
        names = ", ".join(str(d) for d in DTYPES)
        raise InvalidArgumentError(
            f"The dtype {np.dtype(dtype)} is not supported; use one of {names}."
        ) from None


def frame_crc(header: FrameHeader, payload: bytes | memoryview | np.ndarray) -> int:
    """crc32 of a DATA frame: the fields that route and size it, then its payload.

    Covering the routing fields too means that a flipped bit in a frame's step, chunk, count,
    arguments or collective cannot deliver good bytes to the wrong place unnoticed.
    """
    route = (f"{header.view_id}|{header.sender_rank}|{header.op_key}|{header.descriptor}|{header.step}|"
             f"{header.chunk}|{header.origin}|{header.origin_count}|{header.dtype}|{header.codec}|{header.count}")
    if isinstance(payload, np.ndarray):
        payload = memoryview(np.ascontiguousarray(payload)).cast("B")  # type: ignore[arg-type]
    return zlib.crc32(payload, zlib.crc32(route.encode()))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ProtocolError("A frame ended inside a length prefix.")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode(header: FrameHeader, payload: bytes | memoryview | np.ndarray = b"") -> bytes:
    """Serialises a frame; the payload is copied exactly once, into the returned bytes."""
    head = header.SerializeToString()
    if isinstance(payload, np.ndarray):
        payload = memoryview(np.ascontiguousarray(payload)).cast("B")  # type: ignore[arg-type]
    parts: list[bytes | memoryview] = [bytes((_HEADER_TAG,)), _varint(len(head)), head]
    if len(payload):
        parts += [bytes((_PAYLOAD_TAG,)), _varint(len(payload)), payload]
    return b"".join(parts)


def decode(data: bytes) -> tuple[FrameHeader, memoryview]:
    """Splits a received frame into its parsed header and a zero-copy view of its payload.

    Raises:
        ProtocolError: the bytes are not a Frame.
    """
    buf = memoryview(data)
    try:
        if len(buf) and buf[0] == _HEADER_TAG:
            size, pos = _read_varint(buf, 1)
            header = FrameHeader.FromString(buf[pos : pos + size])
            pos += size
            if pos == len(buf):
                return header, buf[pos:pos]
            if buf[pos] == _PAYLOAD_TAG:
                size, start = _read_varint(buf, pos + 1)
                if start + size == len(buf):
                    return header, buf[start:]
        frame = peer_pb2.Frame.FromString(data)
        return frame.header, memoryview(frame.payload)
    except ProtocolError:
        raise
    except Exception as exc:  # protobuf raises DecodeError and others for garbage
        raise ProtocolError(f"A frame of {len(buf)} bytes could not be parsed: {exc}") from None
