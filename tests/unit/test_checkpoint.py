"""The checkpoint store and writer (ringserve/checkpoint.py) on a real temporary directory, and on
fsspec's in-memory filesystem for URL locations."""

from __future__ import annotations

import os
import pickle
import threading
import uuid
from pathlib import Path

import pytest

from ringserve.commits import Commit
from ringserve.elastic.checkpoint import CheckpointStore, CheckpointWriter, CoordinatorStore, decode, encode, file_name


def test_a_checkpoint_file_round_trips_and_names_its_lineage_and_step() -> None:
    data = encode(Commit(1, 108), b"state")
    assert decode(data) == (Commit(1, 108), b"state")
    assert file_name(Commit(1, 108)) == "ckpt-000001-000000000108.pkl"


@pytest.mark.parametrize("damage", [lambda d: d[:-1], lambda d: b"X" + d[1:], lambda d: d[:9]])
def test_a_truncated_or_foreign_file_is_refused(damage) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        decode(damage(encode(Commit(0, 3), b"some state")))


def test_the_newest_checkpoint_is_the_highest_lineage_then_step_and_temporary_files_are_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep=10)
    for commit in (Commit(0, 110), Commit(1, 108), Commit(1, 9)):
        store.write(commit, pickle.dumps(commit.step))
    (tmp_path / ".ckpt-000001-000000000200.pkl.123-abc.tmp").write_bytes(b"half a file")
    found = store.newest()
    assert found is not None and found[0] == Commit(1, 108) and pickle.loads(found[1]) == 108
    assert [c for c, _ in store.listing()] == [Commit(1, 108), Commit(1, 9), Commit(0, 110)]


def test_a_damaged_newest_checkpoint_is_skipped_for_the_next_one(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    store.write(Commit(0, 4), b"four")
    (tmp_path / file_name(Commit(0, 5))).write_bytes(encode(Commit(0, 5), b"five")[:-2])
    (tmp_path / file_name(Commit(0, 6))).write_bytes(encode(Commit(0, 3), b"mislabelled"))
    found = store.newest()
    assert found is not None and found[:2] == (Commit(0, 4), b"four")


def test_an_empty_or_missing_directory_has_no_checkpoint(tmp_path: Path) -> None:
    assert CheckpointStore(str(tmp_path / "nothing-here")).newest() is None


def test_a_prune_keeps_only_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in range(5):
        store.write(Commit(0, step), b"x")
    store.prune()
    assert sorted(os.listdir(tmp_path)) == [file_name(Commit(0, 3)), file_name(Commit(0, 4))]


def test_an_fsspec_url_location_works_the_same() -> None:
    store = CheckpointStore(f"memory://ringserve-test-{uuid.uuid4().hex}/ckpts", keep=1)
    store.prepare()
    store.write(Commit(0, 1), b"one")
    store.write(Commit(0, 2), b"two")
    store.prune()
    assert [c for c, _ in store.listing()] == [Commit(0, 2)]
    found = store.newest()
    assert found is not None and found[1] == b"two"


class SlowStore(CheckpointStore):
    """A real store whose writes wait for the test, so that commits pile up behind one."""

    def __init__(self, location: str) -> None:
        super().__init__(location, keep=100)
        self.release = threading.Event()
        self.started = threading.Event()

    def write(self, commit: Commit, data: bytes) -> str:
        self.started.set()
        assert self.release.wait(10)
        return super().write(commit, data)


def test_the_writer_writes_the_newest_pending_snapshot_and_never_an_older_one_after_it(tmp_path: Path) -> None:
    store = SlowStore(str(tmp_path))
    writer = CheckpointWriter(store)
    try:
        writer.submit(Commit(0, 1), b"1")
        assert store.started.wait(5)
        for step in (2, 5, 3, 4):  # while commit 1 is being written; 3 and 4 come late
            writer.submit(Commit(0, step), str(step).encode())
        store.release.set()
        assert writer.flush(10)
    finally:
        writer.close(10)
    assert [c.step for c, _ in store.listing()] == [5, 1]  # 2, 3 and 4 were overtaken by 5
    assert writer.written == Commit(0, 5) and writer.failures == 0
    assert not writer._thread.is_alive()


def test_a_failed_write_is_counted_and_the_next_commit_is_written(tmp_path: Path) -> None:
    class Flaky(CheckpointStore):
        fail = True

        def write(self, commit: Commit, data: bytes) -> str:
            if self.fail:
                self.fail = False
                raise OSError("disk full")
            return super().write(commit, data)

    store = Flaky(str(tmp_path))
    writer = CheckpointWriter(store)
    try:
        writer.submit(Commit(0, 1), b"1")
        assert writer.flush(5)
        writer.submit(Commit(0, 2), b"2")
        assert writer.flush(5)
    finally:
        writer.close(5)
    assert writer.failures == 1 and [c.step for c, _ in store.listing()] == [2]


def test_a_location_that_cannot_be_created_fails_when_the_writer_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(OSError):
        CheckpointWriter(CheckpointStore(str(blocker / "ckpts")))


def test_the_coordinator_store_keeps_one_blob_the_newest_write() -> None:
    blobs: dict[str, bytes] = {}
    store = CoordinatorStore(put=blobs.__setitem__, get=blobs.get)
    assert store.newest() is None
    store.write(Commit(0, 1), b"one")
    store.write(Commit(0, 2), b"two")
    found = store.newest()
    assert found is not None and found[:2] == (Commit(0, 2), b"two") and len(blobs) == 1
    blobs[next(iter(blobs))] = b"not a checkpoint"
    assert store.newest() is None
