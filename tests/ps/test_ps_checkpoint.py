"""A shard's checkpoints: written atomically, the newest readable one restored with its ledger and
optimizer state, older ones pruned (ringserve/ps/shard/checkpoint.py)."""

from __future__ import annotations

import pathlib

import numpy as np

from ringserve.ps import optim
from ringserve.ps.jobs import Job
from ringserve.ps.layout import partition, specs_of
from ringserve.ps.rules import Ledger
from ringserve.ps.shard import checkpoint
from ringserve.ps.shard.store import Store


def shard_state(version: int) -> tuple[Store, Ledger]:
    tensors = [("w", np.arange(6, dtype=np.float32).reshape(2, 3)), ("b", np.ones(2, np.float64))]
    layout = partition(specs_of(tensors), 2)
    job = Job(mode="ssp", staleness=1, sum=False, groups=(optim.Optimizer(kind="adam", lr=0.1),),
              pieces=layout.shards[1], shard=1, shards=2)
    values = {p.id: dict(tensors)[p.key].reshape(-1)[p.start : p.stop] for p in job.pieces}
    store = Store(job, values, version)
    grads = {pid: np.ones_like(v, dtype=np.float32) for pid, v in values.items()}
    store.apply(grads, version)
    ledger = Ledger("ssp", 1, version=version, last_step={"a": version - 1})
    return store, ledger


def test_the_newest_checkpoint_comes_back_with_its_values_optimizer_state_and_ledger(tmp_path: pathlib.Path) -> None:
    for version in (3, 6, 9):
        store, ledger = shard_state(version)
        checkpoint.write(str(tmp_path), 1, 2, checkpoint.snapshot(store, ledger), keep=2)
    names = sorted(p.name for p in checkpoint.shard_dir(str(tmp_path), 1, 2).iterdir())
    assert names == ["v000000000006.npz", "v000000000009.npz"]
    restored = checkpoint.newest(str(tmp_path), 1, 2)
    assert restored is not None and restored.path.name == "v000000000009.npz"
    assert restored.store.job == store.job
    assert (restored.ledger.version, restored.ledger.restored_version, restored.ledger.last_step) == (9, 9, {"a": 8})
    for pid, entry in store.entries.items():
        back = restored.store.entries[pid]
        np.testing.assert_array_equal(back.values, entry.values)
        assert back.state.step == entry.state.step == 1
        np.testing.assert_array_equal(back.state.m, entry.state.m)
        np.testing.assert_array_equal(back.state.v, entry.state.v)


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path: pathlib.Path) -> None:
    for version in (4, 8):
        store, ledger = shard_state(version)
        checkpoint.write(str(tmp_path), 1, 2, checkpoint.snapshot(store, ledger), keep=2)
    (checkpoint.shard_dir(str(tmp_path), 1, 2) / "v000000000008.npz").write_bytes(b"not a checkpoint")
    restored = checkpoint.newest(str(tmp_path), 1, 2)
    assert restored is not None and restored.ledger.version == 4


def test_no_checkpoint_of_this_index_means_none(tmp_path: pathlib.Path) -> None:
    store, ledger = shard_state(2)
    checkpoint.write(str(tmp_path), 1, 2, checkpoint.snapshot(store, ledger), keep=1)
    assert checkpoint.newest(str(tmp_path), 0, 2) is None
    assert checkpoint.newest(str(tmp_path), 1, 3) is None
