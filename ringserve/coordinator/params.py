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
