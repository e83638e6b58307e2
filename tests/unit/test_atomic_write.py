"""Files written whole or not at all (ringserve/atomic.py): the one helper every checkpoint and
merged timeline is written with."""

from __future__ import annotations

import os
import pathlib
import stat
from typing import IO

import pytest

from ringserve.atomic import write_atomic, write_atomic_fs


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"old")
    write_atomic(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"old")

    def half(f: IO[bytes]) -> None:
        f.write(b"half of it")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, half)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]


def test_the_file_and_its_directory_are_fsynced_so_the_rename_survives_a_power_loss(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomic(tmp_path / "a", b"x")
    assert synced == ["file", "directory"]


def test_a_missing_directory_raises_os_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "a", b"x")


def test_an_fsspec_write_moves_a_temporary_over_the_target_and_cleans_up_after_a_failure(tmp_path: pathlib.Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("file")
    target = str(tmp_path / "ckpt.bin")
    write_atomic_fs(fs, target, b"one")
    assert pathlib.Path(target).read_bytes() == b"one"

    class Failing:
        def __getattr__(self, name: str) -> object:
            return getattr(fs, name)

        def mv(self, *args: object) -> None:
            raise OSError("the store went away")

    with pytest.raises(OSError, match="went away"):
        write_atomic_fs(Failing(), target, b"two")
    assert pathlib.Path(target).read_bytes() == b"one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]
