"""Data-plane frames: encode and decode round trips, zero-copy payloads, and garbage rejected."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest

from ringserve import wire
from ringserve._proto import peer_pb2
from ringserve.errors import InvalidArgumentError, ProtocolError


def full_header() -> wire.FrameHeader:
    header = wire.FrameHeader(
        kind=wire.ABORT,
        view_id=2**40 + 3,
        sender_rank=7,
        op_key="grad.w#12",
        descriptor="allreduce float32 (3, 4) op=sum",
        step=5,
        chunk=300,
        origin=2,
        origin_count=2**33,
        dtype=peer_pb2.FLOAT32,
        count=123,
        reason="mismatch",
        abort_origin=1,
        abort_final=True,
    )
    header.rank_descriptors.update({0: "allreduce float32 (3,)", 4: "allreduce float64 (3,)"})
    return header


PAYLOADS = {
    "empty": b"",
    "one byte": b"\x00",
    "short": b"\x12\x0a\xff" * 5,
    "needs a two-byte length": bytes(range(256)) * 2,
    "one MiB": bytes(1 << 20),
}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_a_frame_decodes_to_the_header_and_payload_it_was_encoded_from(payload: bytes) -> None:
    header = full_header()
    data = wire.encode(header, payload)
    got_header, got_payload = wire.decode(data)
    assert got_header == header
    assert bytes(got_payload) == payload


def test_an_encoded_frame_is_a_valid_protobuf_frame() -> None:
    header = full_header()
    data = wire.encode(header, b"payload")
    frame = peer_pb2.Frame.FromString(data)
    assert frame.payload == b"payload" and set(frame.header.pad) <= {0}  # the pad is zeros
    frame.header.ClearField("pad")
    assert frame.header == header


def test_the_decoded_payload_is_a_view_of_the_received_bytes_not_a_copy() -> None:
    data = wire.encode(full_header(), np.arange(1000, dtype=np.float64))
    _, payload = wire.decode(data)
    assert payload.obj is data
    assert payload.nbytes == 8000


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
def test_an_array_payload_travels_as_its_raw_bytes(dtype: type) -> None:
    array = (np.arange(37) - 18).astype(dtype)
    _, payload = wire.decode(wire.encode(wire.FrameHeader(kind=wire.DATA), array))
    np.testing.assert_array_equal(np.frombuffer(payload, dtype=dtype), array)


def test_a_non_contiguous_array_payload_is_encoded_in_logical_order() -> None:
    array = np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2]
    _, payload = wire.decode(wire.encode(wire.FrameHeader(kind=wire.DATA), array))
    np.testing.assert_array_equal(np.frombuffer(payload, dtype=np.int32), array.reshape(-1))


def test_an_empty_header_and_payload_round_trip() -> None:
    header, payload = wire.decode(wire.encode(wire.FrameHeader()))
    assert header == wire.FrameHeader() and payload.nbytes == 0


def test_a_frame_written_by_another_writer_in_a_different_field_order_still_decodes() -> None:
    header = full_header()
    head = header.SerializeToString()
    payload = b"some payload bytes"
    # payload (field 2) first, then header (field 1): valid protobuf, not the fast layout.
    data = bytes([0x12, len(payload)]) + payload + bytes([0x0A]) + _varint(len(head)) + head
    got_header, got_payload = wire.decode(data)
    assert got_header == header and bytes(got_payload) == payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


GARBAGE = {
    "invalid wire type": b"\xff\xff\xff\xff",
    "a lone header tag": b"\x0a",
    "a length prefix that never ends": b"\x0a\xff\xff\xff",
    "a header longer than the frame": b"\x0a\x05ab",
    "text": b"hello world",
    "a payload longer than the frame": b"\x0a\x00\x12\x05ab",
    "every byte value": bytes(range(256)),
}


@pytest.mark.parametrize("data", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_is_rejected_with_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError, match=r"frame"):
        wire.decode(data)


def test_a_truncated_frame_is_rejected_with_a_protocol_error() -> None:
    data = wire.encode(full_header(), b"x" * 300)
    for cut in (1, 2, 10, 150, len(data) - 1):
        with pytest.raises(ProtocolError):
            wire.decode(data[:cut])


def test_corrupted_frames_either_decode_or_raise_a_protocol_error_and_nothing_else() -> None:
    rng = random.Random(1234)
    valid = wire.encode(full_header(), bytes(range(200)))
    for _ in range(3000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        with contextlib.suppress(ProtocolError):
            wire.decode(bytes(data))
    for _ in range(2000):
        with contextlib.suppress(ProtocolError):
            wire.decode(rng.randbytes(rng.randint(1, 64)))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.int8])
def test_every_supported_dtype_has_a_wire_code_that_maps_back_to_it(dtype: type) -> None:
    assert wire.CODE_TO_DTYPE[wire.dtype_code(np.dtype(dtype))] == np.dtype(dtype)


@pytest.mark.parametrize("dtype", [np.complex64, np.bool_, np.uint16, np.object_, np.dtype("U3")])
def test_an_unsupported_dtype_is_rejected_naming_it_and_the_supported_ones(dtype: type) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"The dtype {np.dtype(dtype)} is not supported; use one of float16, float32"):
        wire.dtype_code(np.dtype(dtype))


@pytest.mark.parametrize("key", ["a", "k" * 37, "long#" * 40])
@pytest.mark.parametrize("nbytes", [1, 3, 8, 1000, 1 << 21])
def test_the_payload_starts_at_a_multiple_of_the_alignment_and_the_pad_is_not_in_the_header(key: str, nbytes: int) -> None:
    header = wire.FrameHeader(kind=wire.DATA, op_key=key, descriptor=key * 2, view_id=2**40, count=nbytes)
    data = wire.encode(header, bytes(nbytes))
    got, payload = wire.decode(data)
    assert (len(data) - payload.nbytes) % wire.ALIGN == 0
    assert got == header and not got.pad
    assert wire.encode(got, payload) == data  # a decoded header encodes to the same frame
    assert peer_pb2.Frame.FromString(data).payload == bytes(nbytes)  # and a plain protobuf reader agrees


def test_a_received_float64_payload_is_aligned_for_numpy() -> None:
    for key in ("a", "bb", "ccc", "dddd" * 9):
        data = bytes(wire.encode(wire.FrameHeader(op_key=key, count=3), np.arange(3.0)))
        _, payload = wire.decode(data)
        assert np.frombuffer(payload, dtype=np.float64).flags.aligned
