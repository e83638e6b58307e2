"""Each rank reads its own rows of the store's Parquet, from the footers, with pyarrow (no Spark)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ringserve.errors import InvalidArgumentError
from ringserve.spark.data import describe, read_shard, shard_bounds
from ringserve.spark.store import Store


def write(tmp: Path, rows: int, files: int = 3) -> Store:
    store = Store.create(str(tmp / "store"))
    path = Path(store.get_train_data_path("r1"))
    path.mkdir(parents=True)
    ids = np.arange(rows)
    for i, part in enumerate(np.array_split(ids, files)):
        table = pa.table({"id": part, "x": [[float(v), float(-v)] for v in part], "name": [str(v) for v in part]})
        pq.write_table(table, path / f"part-{i}.parquet", row_group_size=7)
    return store


@pytest.mark.parametrize("rows,size", [(100, 4), (101, 4), (5, 3), (64, 1)])
def test_ranks_read_disjoint_equal_shards_in_row_order(tmp_path: Path, rows: int, size: int) -> None:
    store = write(tmp_path, rows)
    data = describe(store, store.get_train_data_path("r1"), ["id", "x"])
    assert data.rows == rows and data.columns["x"].shape == (2,)
    got = [read_shard(store, data, r, size) for r in range(size)]
    k = rows // size
    for r, shard in enumerate(got):
        np.testing.assert_array_equal(shard["id"], np.arange(r * k, (r + 1) * k))
        np.testing.assert_array_equal(shard["x"][:, 1], -shard["id"])


def test_uneven_shards_cover_every_row_once() -> None:
    bounds = [shard_bounds(10, r, 4, even=False) for r in range(4)]
    assert bounds == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_a_text_column_is_refused_by_name(tmp_path: Path) -> None:
    store = write(tmp_path, 20)
    with pytest.raises(InvalidArgumentError, match="'name' is string, not numeric"):
        describe(store, store.get_train_data_path("r1"), ["id", "name"])


def test_a_store_below_a_file_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="cannot be written"):
        Store.create(str(tmp_path / "file" / "store")).check_writable()


def test_a_store_url_picks_its_filesystem_and_survives_pickling(tmp_path: Path) -> None:
    import pickle

    store = Store.create(f"file://{tmp_path}/s")
    assert store.local and store.prefix_path == f"{tmp_path}/s"
    store.write(store.get_checkpoint_path("run", "pt"), b"abc")
    again = pickle.loads(pickle.dumps(store))
    assert again.read(again.get_checkpoint_path("run", "pt")) == b"abc"
    assert store.spark_url(store.get_train_data_path("r")) == f"file://{tmp_path}/s/intermediate_train_data.r"
