"""Files written whole or not at all: a temporary name beside the target, then one rename over it.

Every file ringserve writes for someone else to read (an elastic checkpoint, a parameter-server
shard's snapshot, a Spark store's checkpoint, a merged timeline) is written here, so that a reader
never sees half of one and a crash leaves no stray temporary behind:

- ``write_atomic`` (a local path): the bytes go to a hidden temporary in the same directory, are
  flushed and fsynced, the temporary is renamed over the target (``os.replace``: atomic on POSIX),
  and the directory is fsynced, so that the rename itself survives a power loss. On any failure
  the temporary is removed and the error raised; the target is then the old file, or none.
- ``write_atomic_fs``: the same on an fsspec filesystem (HDFS, S3, ...): written under a temporary
  name, then moved over the target. Durability is the filesystem's: fsspec has no fsync.

Example:
    ```python
    write_atomic("/ckpt/ckpt-1-42.pkl", data)
    ```
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from collections.abc import Callable
from typing import IO, Any


def temporary_name(path: str) -> str:
    """A hidden name beside ``path``, unique to this writer: ``.<name>.<pid>-<random>.tmp``."""
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def write_atomic(path: str | os.PathLike[str], data: bytes | bytearray | memoryview | Callable[[IO[bytes]], None]) -> None:
    """Writes ``data`` (bytes, or a function that writes to the open file) to ``path`` whole.

    Raises:
        OSError: the directory is missing or not writable, or the disk is full (the target is
            left as it was, and no temporary stays behind).
    """
    target = os.fspath(path)
    temporary = temporary_name(target)
    try:
        with open(temporary, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_directory(os.path.dirname(target) or ".")


def fsync_directory(directory: str) -> None:
    """Makes the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic_fs(fs: Any, path: str, data: bytes) -> None:
    """``write_atomic`` on an fsspec filesystem ``fs``: a temporary name, then a move over ``path``."""
    head, name = posixpath.split(path)
    temporary = posixpath.join(head, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with fs.open(temporary, "wb") as f:
            f.write(data)
        fs.mv(temporary, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if fs.exists(temporary):
                fs.rm(temporary)
        raise
