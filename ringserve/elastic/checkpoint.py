"""Durable copies of elastic commits: a checkpoint store, and the one thread that writes to it.

Rank 0 of each view hands every ``checkpoint_every``-th confirmed commit to a ``CheckpointWriter``
(see ringserve.elastic). The state is pickled on the training thread, where it cannot change under
the pickler (a torch optimizer's restored buffers may alias the saved copy); only the write, the
slow part on remote storage, runs on the writer's thread. That thread holds one pending snapshot:
a newer one replaces it, and nothing older than what was written is ever written, so commits that
come faster than writes cost nothing but the pickling, and the newest copy always wins.

A write is atomic: the bytes go to a hidden temporary name in the same directory, are flushed
(fsync on local disks), then renamed to ``ckpt-<lineage>-<step>.pkl``. A reader never sees half
a file, and a writer killed mid-write leaves only a temporary file that no reader looks at.

The store is a local directory or, when the location has a scheme (``s3://``, ``gs://``,
``memory://``, ``file://``), any filesystem fsspec knows; fsspec is imported only then. The
location ``coordinator://`` keeps the newest copy in the coordinator's parameter store instead
(``CoordinatorStore``): no shared storage needed, and under ``ringserve run`` the coordinator
lives in the launcher, which outlives every worker; but it lives in the coordinator's memory
only, within whatever size the coordinator allows a blob.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringserve.atomic import write_atomic, write_atomic_fs
from ringserve.commits import Commit
from ringserve.errors import InvalidArgumentError

log = logging.getLogger("ringserve.elastic.checkpoint")

MAGIC = b"RSCKPT1\n"
_NAME = re.compile(r"^ckpt-(\d+)-(\d+)\.pkl$")


def file_name(commit: Commit) -> str:
    return f"ckpt-{commit.lineage:06d}-{commit.step:012d}.pkl"


def encode(commit: Commit, state: bytes) -> bytes:
    """A checkpoint file: a magic line, a JSON header line naming the commit, the pickled state."""
    header = json.dumps({"lineage": commit.lineage, "step": commit.step, "bytes": len(state)}).encode()
    return MAGIC + header + b"\n" + state


def decode(data: bytes) -> tuple[Commit, bytes]:
    """Raises ValueError for anything but a whole checkpoint file."""
    if not data.startswith(MAGIC):
        raise ValueError("not a ringserve checkpoint (bad magic)")
    header, sep, state = data[len(MAGIC):].partition(b"\n")
    if not sep:
        raise ValueError("truncated header")
    meta = json.loads(header)
    if len(state) != meta["bytes"]:
        raise ValueError(f"{len(state)} bytes of state where the header says {meta['bytes']}")
    return Commit(int(meta["lineage"]), int(meta["step"])), state


class CheckpointStore:
    """Checkpoint files in one directory: atomic writes, the newest first, a bounded history.

    Args:
        location: a local path, or an fsspec URL.
        keep: how many of the newest checkpoints survive a prune.
    """

    def __init__(self, location: str, keep: int = 2) -> None:
        self.location = location
        self.keep = keep
        self._fs: Any = None
        if "://" in location:
            try:
                import fsspec  # optional: only remote or URL locations need it
            except ImportError:
                raise InvalidArgumentError(
                    f"The checkpoint location {location!r} is a URL, which needs fsspec (pip install fsspec)."
                ) from None
            self._fs, self._root = fsspec.core.url_to_fs(location)
        else:
            self._root = os.path.abspath(location)

    def _join(self, name: str) -> str:
        return posixpath.join(self._root, name) if self._fs is not None else os.path.join(self._root, name)

    def prepare(self) -> None:
        """Creates the directory; raises OSError (naming it) where it cannot be."""
        if self._fs is not None:
            self._fs.makedirs(self._root, exist_ok=True)
        else:
            os.makedirs(self._root, exist_ok=True)

    def write(self, commit: Commit, state: bytes) -> str:
        """Writes the pickled ``state`` as the checkpoint of ``commit``, atomically; returns its path."""
        data = encode(commit, state)
        final = self._join(file_name(commit))
        if self._fs is not None:
            write_atomic_fs(self._fs, final, data)
        else:
            write_atomic(final, data)
        return final

    def listing(self) -> list[tuple[Commit, str]]:
        """The checkpoints present, newest first (temporary files are not checkpoints)."""
        try:
            if self._fs is not None:
                names = [posixpath.basename(p.rstrip("/")) for p in self._fs.ls(self._root, detail=False)]
            else:
                names = os.listdir(self._root)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = _NAME.match(name)
            if m:
                found.append((Commit(int(m.group(1)), int(m.group(2))), self._join(name)))
        return sorted(found, reverse=True)

    def _read(self, path: str) -> bytes:
        if self._fs is not None:
            with self._fs.open(path, "rb") as f:
                return bytes(f.read())
        with open(path, "rb") as f:
            return f.read()

    def newest(self) -> tuple[Commit, bytes, str] | None:
        """The newest checkpoint that reads back whole: (its commit, the pickled state, its path).

        A file that fails to read or decode, or whose header disagrees with its name, is skipped
        with a warning, and the next older one is tried.
        """
        for commit, path in self.listing():
            try:
                recorded, state = decode(self._read(path))
            except (OSError, ValueError, KeyError) as exc:
                log.warning("skipping the checkpoint %s: %s", path, exc)
                continue
            if recorded != commit:
                log.warning("skipping the checkpoint %s: it holds %s", path, recorded)
                continue
            return commit, state, path
        return None

    def prune(self) -> None:
        """Deletes all but the ``keep`` newest checkpoints."""
        for _commit, path in self.listing()[self.keep:]:
            with contextlib.suppress(OSError):  # best effort: another writer may have removed it
                if self._fs is not None:
                    self._fs.rm(path)
                else:
                    os.unlink(path)


COORDINATOR = "coordinator://"
COORDINATOR_KEY = "ringserve.elastic.checkpoint"


class CoordinatorStore:
    """The newest checkpoint as one blob in the coordinator's parameter store (latest wins).

    Args:
        put: stores a blob under a key (a worker's put_params, called from the writer thread).
        get: the blob under a key, or None when there is none or it cannot be had.
    """

    def __init__(self, put: Callable[[str, bytes], object], get: Callable[[str], bytes | None]) -> None:
        self.location = COORDINATOR
        self._put = put
        self._get = get

    def prepare(self) -> None:
        return None

    def write(self, commit: Commit, state: bytes) -> str:
        self._put(COORDINATOR_KEY, encode(commit, state))
        return f"{COORDINATOR}{COORDINATOR_KEY}"

    def newest(self) -> tuple[Commit, bytes, str] | None:
        data = self._get(COORDINATOR_KEY)
        if not data:
            return None
        try:
            commit, state = decode(data)
        except (ValueError, KeyError) as exc:
            log.warning("skipping the checkpoint in the coordinator's parameter store: %s", exc)
            return None
        return commit, state, f"{COORDINATOR}{COORDINATOR_KEY}"

    def prune(self) -> None:
        return None  # one blob, replaced by every write


@dataclass(frozen=True)
class _Snapshot:
    commit: Commit
    data: bytes


class CheckpointWriter:
    """The thread that writes snapshots to a store, the newest pending one only.

    Owned by the elastic state that submits to it, and closed by ``ringserve.elastic.run`` when
    training ends (after the last snapshot is written). A failed write is logged and counted, and
    the next commit writes again: a durable copy is a fallback, and a storage hiccup must not stop
    training (a store that cannot be written at all fails ``prepare``, at the first submit).
    """

    def __init__(self, store: CheckpointStore | CoordinatorStore) -> None:
        self.store = store
        self.written: Commit | None = None
        self.failures = 0
        self._cond = threading.Condition()
        self._pending: _Snapshot | None = None
        self._busy = False
        self._closed = False
        store.prepare()
        self._thread = threading.Thread(target=self._run, name="ringserve-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, commit: Commit, state: bytes) -> None:
        """Queues the pickled state of ``commit``; an older pending snapshot is dropped."""
        with self._cond:
            if self._closed:
                raise RuntimeError("The checkpoint writer is closed.")
            if self._pending is None or commit > self._pending.commit:
                self._pending = _Snapshot(commit, state)
                self._cond.notify_all()

    def _take(self) -> _Snapshot | None:
        with self._cond:
            while self._pending is None and not self._closed:
                self._cond.wait()
            snapshot, self._pending = self._pending, None
            self._busy = snapshot is not None
            return snapshot

    def _run(self) -> None:
        while (snapshot := self._take()) is not None:
            try:
                if self.written is None or snapshot.commit > self.written:
                    path = self.store.write(snapshot.commit, snapshot.data)
                    self.written = snapshot.commit
                    log.debug("wrote the checkpoint of %s to %s", snapshot.commit, path)
                    self.store.prune()
            except Exception as exc:
                self.failures += 1
                log.warning("writing the checkpoint of %s to %s failed: %s", snapshot.commit, self.store.location, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Waits until every submitted snapshot is written (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout_s)

    def close(self, timeout_s: float) -> None:
        """Writes what is pending, then stops the thread (gives up on it after timeout_s)."""
        if not self.flush(timeout_s):
            log.warning("the last checkpoint write to %s did not finish within %g s", self.store.location, timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

