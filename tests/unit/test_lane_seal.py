"""A TLS lane's sealed records (lanes/tcp/seal.py), pure: every byte comes back as sealed, whatever the
views the parser reads into; every kind of damage is refused by name; a cut record is a closed
lane; the key changes every so many records at both ends alike."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from ringserve.errors import ProtocolError
from ringserve.worker.dataplane.lanes.tcp.seal import (
    KEY_BYTES,
    LENGTH,
    OVERHEAD,
    RECORD,
    TAG,
    Opener,
    Sealer,
    read_exactly,
)
from ringserve.worker.dataplane.lanes.tcp.sockets import LaneClosed


def seal_all(sealer: Sealer, pieces: list[bytes]) -> list[bytes]:
    """Each piece sealed into records of up to RECORD bytes, as the writer cuts them: the records."""
    records = []
    out = memoryview(bytearray(RECORD + OVERHEAD))
    for piece in pieces:
        rest = memoryview(piece)
        while rest.nbytes:
            took, wrote = sealer.seal(rest, out)
            assert took
            records.append(bytes(out[:wrote]))
            rest = rest[took:]
    return records


class Wire:
    """The bytes of a connection, read as the reader's thread reads them (0 at the end)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def read(self, view: memoryview) -> int:
        n = min(view.nbytes, len(self.data) - self.at)
        view[:n] = self.data[self.at:self.at + n]
        self.at += n
        return n


def opener(key: bytes, data: bytes, **kw: int) -> Opener:
    return Opener(key, read_exactly(Wire(data).read), "127.0.0.1:9", **kw)


def read_all(op: Opener, total: int, view_bytes: int) -> bytes:
    got, buf = bytearray(), memoryview(bytearray(view_bytes))
    while len(got) < total:
        n = op.read(buf[: min(view_bytes, total - len(got))])
        got += buf[:n]
    return bytes(got)


SIZES = [[1], [100, 3 << 20], [RECORD], [RECORD + 1, 7, RECORD - 1], [64 << 10] * 5]
VIEWS = [1, 4096, 64 << 10, RECORD, 3 << 20]


@pytest.mark.parametrize(("sizes", "view_bytes"), [
    (sizes, view) for sizes in SIZES for view in VIEWS if view > 1 or sum(sizes) <= 64 << 10])  # a byte a read: small
def test_what_is_sealed_comes_back_byte_for_byte_whatever_views_the_reader_fills(sizes: list[int], view_bytes: int) -> None:
    key = secrets.token_bytes(KEY_BYTES)
    pieces = [secrets.token_bytes(n) for n in sizes]
    wire = b"".join(seal_all(Sealer(key), pieces))
    assert len(wire) == sum(sizes) + OVERHEAD * sum(-(-n // RECORD) for n in sizes)
    assert read_all(opener(key, wire), sum(sizes), view_bytes) == b"".join(pieces)


def test_a_record_that_fits_its_view_is_opened_straight_into_it() -> None:
    key = secrets.token_bytes(KEY_BYTES)
    wire = b"".join(seal_all(Sealer(key), [b"x" * 1000]))
    view = memoryview(bytearray(4096))
    assert opener(key, wire).read(view) == 1000 and bytes(view[:1000]) == b"x" * 1000


def test_the_wire_never_shows_the_plaintext() -> None:
    key = secrets.token_bytes(KEY_BYTES)
    wire = b"".join(seal_all(Sealer(key), [b"PLAINTEXT-MARKER" * 70_000]))
    assert b"PLAINTEXT-MARKER" not in wire


def _flipped(record: bytes, at: int, bit: int) -> bytes:
    damaged = bytearray(record)
    damaged[at] ^= bit
    return bytes(damaged)


def _damaged(kind: str, records: list[bytes]) -> bytes:
    first, second, third = records
    if kind == "a bit of the ciphertext":
        return first + _flipped(second, LENGTH + 5, 1) + third
    if kind == "the tag":
        return first + _flipped(second, -1, 0x80) + third
    if kind == "two records swapped":
        return first + third + second
    if kind == "a record replayed":
        return first + first + second
    if kind == "a record dropped":
        return first + third
    if kind == "a record of another key":
        return first + seal_all(Sealer(secrets.token_bytes(KEY_BYTES)), [b"b" * 5000])[0] + third
    if kind == "a shorter length":  # the same bytes, but the length says fewer: its tag covers the length
        body = second[LENGTH:]
        return first + (len(body) - TAG - 1).to_bytes(LENGTH, "little") + body[:-1] + third
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["a bit of the ciphertext", "the tag", "two records swapped", "a record replayed",
                                  "a record dropped", "a record of another key", "a shorter length"])
def test_every_kind_of_damage_to_a_record_is_refused_by_name_never_passed_on(kind: str) -> None:
    key = secrets.token_bytes(KEY_BYTES)
    records = seal_all(Sealer(key), [b"a" * 5000, b"b" * 5000, b"c" * 5000])
    op = opener(key, _damaged(kind, records))
    view = memoryview(bytearray(8192))
    assert op.read(view) == 5000 and bytes(view[:5000]) == b"a" * 5000
    with pytest.raises(ProtocolError, match="failed its authentication: altered, reordered, replayed or forged"):
        op.read(view)


@pytest.mark.parametrize("kind", ["a bit of the ciphertext", "the tag", "a record replayed", "a record of another key"])
def test_no_unauthenticated_byte_reaches_a_result_a_payload_lands_in(kind: str) -> None:
    key = secrets.token_bytes(KEY_BYTES)
    records = seal_all(Sealer(key), [b"a" * 5000, b"b" * 5000, b"c" * 5000])
    op = opener(key, _damaged(kind, records))
    result = memoryview(bytearray(b"r" * 5000))  # a collective's result, landed into (not the lane's own)
    assert op.read(result, private=False) == 5000 and bytes(result) == b"a" * 5000  # verified, then copied
    result[:] = b"r" * 5000
    with pytest.raises(ProtocolError, match="failed its authentication"):
        op.read(result, private=False)
    assert bytes(result) == b"r" * 5000  # untouched: the damaged record was opened elsewhere


def test_a_landed_read_gets_whole_records_and_the_rest_in_order() -> None:
    key = secrets.token_bytes(KEY_BYTES)
    payload = bytes(range(256)) * 40  # 10,240 bytes: one record
    op = opener(key, b"".join(seal_all(Sealer(key), [payload])))
    got = bytearray()
    for size in (4096, 4096, 8192):
        view = memoryview(bytearray(size))
        n = op.read(view, private=False)
        got += view[:n]
    assert bytes(got) == payload


@pytest.mark.parametrize("size", [0, RECORD + 1, 2**32 - 1])
def test_a_record_naming_an_impossible_length_is_refused_before_anything_is_read_for_it(size: int) -> None:
    with pytest.raises(ProtocolError, match=f"names {size} bytes; a record holds 1 to {RECORD}"):
        opener(secrets.token_bytes(KEY_BYTES), size.to_bytes(LENGTH, "little") + bytes(64)).read(memoryview(bytearray(8)))


@pytest.mark.parametrize("cut", [0, 2, LENGTH + 10, LENGTH + 5000 + TAG - 1])
def test_a_lane_cut_within_or_before_a_record_is_a_closed_lane(cut: int) -> None:
    key = secrets.token_bytes(KEY_BYTES)
    record = seal_all(Sealer(key), [b"a" * 5000])[0]
    with pytest.raises(LaneClosed, match="bytes short of a sealed record"):
        opener(key, record[:cut]).read(memoryview(bytearray(8192)))


def test_the_key_changes_every_so_many_records_at_both_ends_alike() -> None:
    key = secrets.token_bytes(KEY_BYTES)
    block = b"z" * 4096
    rekeyed = seal_all(Sealer(key, rekey_records=4), [block] * 10)
    same_key = seal_all(Sealer(key, rekey_records=1 << 16), [block] * 10)
    assert rekeyed[:4] == same_key[:4] and all(a != b for a, b in zip(rekeyed[4:], same_key[4:], strict=True))
    assert read_all(opener(key, b"".join(rekeyed), rekey_records=4), 10 * 4096, 4096) == block * 10
    late = opener(key, b"".join(rekeyed))  # an end that did not change its key
    assert read_all(late, 4 * 4096, 4096) == block * 4
    with pytest.raises(ProtocolError, match="failed its authentication"):
        late.read(memoryview(bytearray(4096)))


def test_a_sealer_seals_nothing_into_a_buffer_without_room_for_a_whole_record() -> None:
    sealer = Sealer(secrets.token_bytes(KEY_BYTES))
    assert sealer.seal(memoryview(b"x" * 100), memoryview(bytearray(100 + OVERHEAD - 1))) == (0, 0)
    took, wrote = sealer.seal(memoryview(np.zeros(3 * RECORD, np.uint8)), memoryview(bytearray(RECORD + OVERHEAD)))
    assert (took, wrote) == (RECORD, RECORD + OVERHEAD)
    with pytest.raises(ValueError, match="key is 16 bytes, not 32"):
        Sealer(bytes(32))
