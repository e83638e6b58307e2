"""A shard's checkpoints: its job, values, optimizer state and ledger, every K updates, on disk.

One file per checkpoint, ``<dir>/ps/shard-<i>-of-<S>/v<version>.npz``: numpy's npz of plain
arrays (loaded with ``allow_pickle=False``, so a file can hold nothing but numbers and the JSON
of the ledger), written to a hidden temporary name, flushed and renamed, so a reader never sees
half a file. The newest ``keep`` are kept. A restarted shard of index i loads the newest one
whose job is for index i of S; the updates after it are lost, and the shard counts them from
what the workers saw (see rules.py).

The arrays are taken on the event loop (the values are new arrays at every update, and the
optimizer state is copied), and the file is written on a thread, one write at a time: when
checkpoints come due faster than the disk takes them, the ones in between are skipped.
"""

from __future__ import annotations

import io
import json
import logging
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringserve._proto import ps_pb2 as pb
from ringserve.atomic import fsync_directory, write_atomic
from ringserve.ps import optim
from ringserve.ps.jobs import Job, PieceId
from ringserve.ps.rules import Ledger
from ringserve.ps.shard.store import Store

log = logging.getLogger("ringserve.ps")

_NAME = re.compile(r"^v(\d{12})\.npz$")


def shard_dir(root: str, shard: int, shards: int) -> pathlib.Path:
    return pathlib.Path(root) / "ps" / f"shard-{shard}-of-{shards}"


@dataclass
class Snapshot:
    """What a checkpoint holds, taken at one version."""

    version: int
    arrays: dict[str, np.ndarray]


def snapshot(store: Store, ledger: Ledger) -> Snapshot:
    """The shard's state now, as arrays that later updates do not change."""
    meta = {
        "version": ledger.version,
        "last_step": ledger.last_step,
        "mode": ledger.mode,
        "pieces": [[e.piece.key, e.piece.start] for e in store.entries.values()],
    }
    arrays: dict[str, np.ndarray] = {
        "job": np.frombuffer(store.job.to_proto().SerializeToString(), dtype=np.uint8),
        "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
    }
    for n, entry in enumerate(store.entries.values()):
        arrays[f"values.{n}"] = entry.values
        for name, array in entry.state.to_arrays().items():
            arrays[f"state.{n}.{name}"] = array
    return Snapshot(ledger.version, arrays)


def write(root: str, shard: int, shards: int, snap: Snapshot, keep: int) -> pathlib.Path:
    """Writes a snapshot atomically and deletes all but the newest ``keep``; returns its path."""
    directory = shard_dir(root, shard, shards)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"v{snap.version:012d}.npz"
    buffer = io.BytesIO()
    save: Any = np.savez  # numpy's stubs take the names for its own flags
    save(buffer, **snap.arrays)
    write_atomic(path, buffer.getbuffer())
    stale = sorted(p for p in directory.iterdir() if _NAME.match(p.name))[:-keep]
    for old in stale:
        old.unlink(missing_ok=True)
    if stale:
        fsync_directory(str(directory))  # the deletions durable too: no old file back after a crash
    return path


@dataclass
class Restored:
    """A checkpoint loaded back: the store and ledger to serve from, and the file."""

    store: Store
    ledger: Ledger
    path: pathlib.Path


def newest(root: str, shard: int, shards: int) -> Restored | None:
    """The newest readable checkpoint of shard ``shard`` of ``shards``, or None.

    A file that cannot be read (cut short by a crash of the disk, not of the shard: writes are
    atomic) is skipped with a warning for the next older one.
    """
    directory = shard_dir(root, shard, shards)
    if not directory.is_dir():
        return None
    for path in sorted((p for p in directory.iterdir() if _NAME.match(p.name)), reverse=True):
        try:
            return _load(path)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("shard %d: the checkpoint %s cannot be read (%s); trying an older one", shard, path, exc)
    return None


def _load(path: pathlib.Path) -> Restored:
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    spec = pb.JobSpec()
    spec.ParseFromString(arrays["job"].tobytes())
    job = Job.from_proto(spec)
    meta = json.loads(arrays["meta"].tobytes())
    version = int(meta["version"])
    values: dict[PieceId, np.ndarray] = {}
    states: dict[PieceId, optim.State] = {}
    for n, piece in enumerate(job.pieces):
        values[piece.id] = arrays[f"values.{n}"]
        prefix = f"state.{n}."
        states[piece.id] = optim.State.from_arrays(
            {k[len(prefix):]: v.copy() for k, v in arrays.items() if k.startswith(prefix)}
        )
    store = Store(job, values, version, states)
    ledger = Ledger(job.mode, job.staleness, job.max_lag, version=version,
                    last_step={str(k): int(v) for k, v in meta["last_step"].items()}, restored_version=version)
    return Restored(store, ledger, path)
