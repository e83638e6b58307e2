"""A TLS job's payload lane after its handshake: records of up to a MiB, each sealed with
AES-128-GCM under a key that the lane's TLS session carried.

Why not TLS's own records for the payloads: TLS cuts them into records of 16 KiB, and Python's
``ssl`` hands them over one per ``recv_into``. A 64 MiB allreduce is then 4,096 reads per edge,
each of which gives up the GIL and must win it back from the loop thread, which holds it while
it reduces: measured between hosts, the lane under mTLS took 3.1-3.7x its plaintext time. Sealed
here, a record is a MiB: one ``recv_into`` of the whole record with ``MSG_WAITALL`` and one
``decrypt_into`` straight into the frame's buffer, both with the GIL released. The cipher is
faster too: ``cryptography`` brings OpenSSL 4.0 (AES-128-GCM at 3.8 GiB/s a core here), where
``ssl`` has the system's 3.0. On a bare 64 MiB transfer over loopback this measured 62 ms of CPU
against TLS's 97 (plaintext 37).

What is kept from TLS, and how:

- **Who may attach** is still TLS's: the lane's handshake runs with the job's certificates, CA
  and client-auth rule, and the token is presented inside it (lanes/tcp/server.py). A plaintext client
  is refused at the first byte, as before.
- **The key** is drawn by the sender for this one lane (``KEY_BYTES`` random bytes) and sent to
  the receiver inside that TLS session, with the answer to the token. Only the two ends of the
  authenticated session learn it; it is never used on another lane. Then both ends leave TLS:
  the connection's next bytes are sealed records (``LaneSocket.leave_tls``).
- **Integrity, order, replay, truncation**: a record is ``[u32 length][ciphertext][16-byte tag]``;
  the length is authenticated (associated data), and the nonce is the record's number on this
  lane, which both ends count. A record that is altered, reordered, replayed, cut or forged fails
  its tag, and the lane breaks with a ProtocolError, as a damaged stream does; a lane cut between
  records leaves a frame short, which its reader reports (lanes/tcp/frames.py).
- **Limits on one key**: a new key is derived from the last (HMAC-SHA256) every ``REKEY_RECORDS``
  records, at most 64 GiB, well within AES-GCM's bound per key (TLS 1.3 rekeys at 2^24.5 records
  of 16 KiB, about 380 GiB).

``cryptography`` is imported by the first key (``_Keys``), not with this module: every worker
imports the lane, and only a TLS job's lanes seal. Loaded, it maps 6.3 MB of libraries into the
process (1.5 MB of it private), a sixth of what a numpy worker's imports cost beyond numpy
(docs/ops/worker-memory.md).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING

from ringserve.errors import ProtocolError
from ringserve.worker.dataplane.lanes.tcp.sockets import LaneClosed

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 16  # AES-128-GCM: TLS 1.3's mandatory suite (TLS_AES_128_GCM_SHA256) and ALTS's records; measured
# here through ``cryptography``, 3.8 GiB/s a core against AES-256's 3.2
RECORD = 1 << 20  # the most plaintext one record holds
LENGTH = 4  # the record's plaintext length, little-endian; authenticated as associated data
TAG = 16
OVERHEAD = LENGTH + TAG
REKEY_RECORDS = 1 << 16  # records under one key: at most 64 GiB


class _Keys:
    """The lane's key and record count, shared in form by both ends: the same key, the same nonces."""

    def __init__(self, key: bytes, rekey_records: int) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"A payload lane's key is {KEY_BYTES} bytes, not {len(key)}.")
        # Here, not at the top: a TLS lane's first key loads cryptography (see the module's docstring).
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._cipher = AESGCM
        self.invalid_tag: type[Exception] = InvalidTag  # what a record that fails its tag raises
        self._key = key
        self._aead = AESGCM(key)
        self._rekey = rekey_records
        self.records = 0  # records sealed (or opened) on this lane

    def next(self) -> tuple[AESGCM, bytes]:
        """The cipher and nonce of the next record."""
        if self.records and self.records % self._rekey == 0:
            self._key = hmac.new(self._key, b"ringserve lane rekey", hashlib.sha256).digest()[:KEY_BYTES]
            self._aead = self._cipher(self._key)
        nonce = self.records.to_bytes(12, "little")
        self.records += 1
        return self._aead, nonce


class Sealer:
    """The sender's end: seals plaintext into records, into a buffer of its own that the writer
    sends (lanes/tcp/threads.py). Used on one thread at a time.

    Example:
        ```python
        sealer = Sealer(key)
        n = sealer.seal(memoryview(payload), out)   # records of payload, n bytes of out
        ```
    """

    def __init__(self, key: bytes, *, rekey_records: int = REKEY_RECORDS) -> None:
        self._keys = _Keys(key, rekey_records)

    def seal(self, data: memoryview, out: memoryview) -> tuple[int, int]:
        """Seals a record of the start of ``data`` (all of it, up to ``RECORD``) into ``out``;
        returns (plaintext bytes sealed, bytes written to ``out``); (0, 0) if ``out`` has no room
        for a record of at least ``min(len(data), RECORD)`` bytes."""
        take = min(data.nbytes, RECORD)
        if take == 0 or out.nbytes < take + OVERHEAD:
            return 0, 0
        aead, nonce = self._keys.next()
        length = take.to_bytes(LENGTH, "little")
        out[:LENGTH] = length
        aead.encrypt_into(nonce, data[:take], length, out[LENGTH:LENGTH + take + TAG])
        return take, take + OVERHEAD


class Opener:
    """The receiver's end: reads records from the connection and opens them into the views a
    frame parser asks to fill (lanes/tcp/frames.py), the whole record straight into the view when it
    fits. Used on the lane's reader thread.

    ``read_exact(view)`` must fill ``view`` from the connection, or raise LaneClosed."""

    def __init__(self, key: bytes, read_exact: Callable[[memoryview], None], where: str, *,
                 rekey_records: int = REKEY_RECORDS) -> None:
        self._keys = _Keys(key, rekey_records)
        self._read_exact = read_exact
        self._where = where
        self._length = bytearray(LENGTH)
        self._sealed = memoryview(bytearray(RECORD + TAG))
        self._plain = memoryview(b"")  # a record that a view cannot hold is opened here: made when first needed
        self._left = memoryview(b"")  # opened bytes of the last record not handed on yet

    def read(self, view: memoryview, *, private: bool = True) -> int:
        """Fills the start of ``view`` with the lane's next plaintext: what is left of the last
        record, or the next record; the bytes given. A record is opened straight into ``view`` when
        it fits and the view is ``private`` (the lane's own buffer, which nobody reads unless its
        frame checks out); into the opener's own buffer otherwise, and copied into ``view`` only
        once its tag verified, so that no unauthenticated byte ever reaches a result (a landed
        payload: lanes/tcp/frames.py's Landings).

        Raises:
            LaneClosed: the connection ended (between records, or within one).
            ProtocolError: a record's length is impossible, or it fails its tag.
        """
        if self._left.nbytes:
            n = min(self._left.nbytes, view.nbytes)
            view[:n] = self._left[:n]
            self._left = self._left[n:]
            return n
        self._read_exact(memoryview(self._length))
        size = int.from_bytes(self._length, "little")
        if not 0 < size <= RECORD:
            raise ProtocolError(f"A sealed record on the payload lane from {self._where} names {size} bytes; "
                                f"a record holds 1 to {RECORD}.")
        sealed = self._sealed[:size + TAG]
        self._read_exact(sealed)
        aead, nonce = self._keys.next()
        fits = size <= view.nbytes and private
        if not fits and not self._plain.nbytes:
            self._plain = memoryview(bytearray(RECORD))
        try:
            aead.decrypt_into(nonce, sealed, bytes(self._length), view[:size] if fits else self._plain[:size])
        except self._keys.invalid_tag:
            raise ProtocolError(f"A sealed record on the payload lane from {self._where} failed its "
                                "authentication: altered, reordered, replayed or forged.") from None
        if fits:
            return size
        n = min(size, view.nbytes)
        view[:n] = self._plain[:n]
        self._left = self._plain[n:size]
        return n


def read_exactly(read: Callable[[memoryview], int]) -> Callable[[memoryview], None]:
    """``read`` (bytes read into the view, 0 at the end) made to fill a whole view."""

    def read_exact(view: memoryview) -> None:
        got, total = 0, view.nbytes
        while got < total:
            n = read(view[got:])
            if n == 0:
                raise LaneClosed(f"the lane closed {total - got} bytes short of a sealed record")
            got += n

    return read_exact
