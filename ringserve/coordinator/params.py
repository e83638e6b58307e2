"""The coordinator's parameter store: named blobs under one cap on the bytes held.

PutParams streams a blob in chunks; GetParams streams it back. Every byte the coordinator holds
for this counts against ``max_param_bytes``: the blobs stored, and the puts still streaming, each
for its whole declared size from its first chunk on, so that neither many keys nor many puts at
once can grow the process without bound.
A blob put under a key already used replaces the old one when the put completes; until then
both are held, so a replacement needs room for the old and the new copy.
"""

from __future__ import annotations

from ringserve.errors import RingserveError


class ParamsFullError(RingserveError):
    """A put would take the coordinator's parameter bytes past its cap."""


class ParamStore:
    """Blobs by key with a version each, and the byte accounting that bounds them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blobs: dict[str, bytes] = {}
        self._versions: dict[str, int] = {}
        self.stored_bytes = 0
        self.streaming_bytes = 0
        # Bytes given up so far (puts ended, blobs replaced): a hint to return memory to the system.
        self.freed_bytes = 0

    def reserve(self, nbytes: int, key: str) -> None:
        """Counts ``nbytes`` of a put in flight; the caller releases them when it ends.

        Raises:
            ParamsFullError: the bytes held would pass ``max_bytes``; nothing is counted then.
        """
        held = self.stored_bytes + self.streaming_bytes
        if held + nbytes > self.max_bytes:
            raise ParamsFullError(
                f"Storing {key!r} would take the coordinator's parameters past their cap of "
                f"{self.max_bytes} bytes (max_param_bytes): {self.stored_bytes} bytes are stored and "
                f"{self.streaming_bytes} are streaming. Put under an existing key to replace a blob."
            )
        self.streaming_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.streaming_bytes -= nbytes
        self.freed_bytes += nbytes

    def commit(self, key: str, data: bytes) -> int:
        """Stores ``data`` under ``key``, replacing (and freeing) what was there; returns the
        key's new version. The caller releases the reservation that covered ``data``."""
        old = self._blobs.pop(key, None)
        if old is not None:
            self.stored_bytes -= len(old)
            self.freed_bytes += len(old)
        self._blobs[key] = data
        self.stored_bytes += len(data)
        version = self._versions[key] = self._versions.get(key, 0) + 1
        return version

    def get(self, key: str) -> bytes | None:
        return self._blobs.get(key)


class ParamsInvalidError(RingserveError):
    """A put's chunks do not make the blobs they declare (out of order, too long, cut short)."""


class Upload:
    """One PutParams call's blobs, chunk by chunk, each counted against the store's cap for its
    whole declared size from its first chunk on; ``release()`` gives the reservation back.

    Example:
        ```python
        upload = Upload(store)
        try:
            for chunk in chunks:
                upload.add(chunk.key, chunk.offset, chunk.total_bytes, chunk.data)
            version = upload.commit()
        finally:
            upload.release()
        ```
    """

    def __init__(self, store: ParamStore) -> None:
        self._store = store
        self._parts: dict[str, list[bytes]] = {}
        self._received: dict[str, int] = {}
        self._totals: dict[str, int] = {}

    def add(self, key: str, offset: int, total_bytes: int, data: bytes) -> None:
        """Takes the chunk of ``key`` at ``offset`` of a blob of ``total_bytes``.

        Raises:
            ParamsFullError: the blob's declared size does not fit under the cap.
            ParamsInvalidError: the chunk does not follow the bytes received, or runs past the total.
        """
        if key not in self._totals:
            self._store.reserve(total_bytes, key)
            self._totals[key], self._parts[key], self._received[key] = total_bytes, [], 0
        received, total = self._received[key], self._totals[key]
        if offset != received or total_bytes != total:
            raise ParamsInvalidError(
                f"Chunk of {key!r} at offset {offset} does not follow the {received} bytes received so far of {total}."
            )
        if received + len(data) > total:
            raise ParamsInvalidError(f"{key!r} is longer than its total.")
        self._parts[key].append(data)
        self._received[key] = received + len(data)

    def commit(self) -> int:
        """Stores every blob of the put; returns the last one's version (0: the put was empty).

        Raises:
            ParamsInvalidError: a blob ended before its total.
        """
        for key, total in self._totals.items():
            if self._received[key] != total:
                raise ParamsInvalidError(f"{key!r} ended after {self._received[key]} of {total} bytes.")
        version = 0
        for key, pieces in self._parts.items():
            version = self._store.commit(key, b"".join(pieces))
            pieces.clear()
        return version

    def release(self) -> None:
        """Gives back the bytes this put reserved (stored blobs are counted as stored now)."""
        self._store.release(sum(self._totals.values()))
        self._totals.clear()
        self._parts.clear()  # a put cut short lets go of its chunks now, not when its frame does
