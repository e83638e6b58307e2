"""Bad input fails in the driver, naming the bad value, before any task starts (and before any write)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ringserve.spark
from ringserve.errors import InvalidArgumentError
from ringserve.spark.torch import TorchEstimator


@pytest.fixture(scope="module")
def df(spark: Any) -> Any:
    return spark.createDataFrame([([1.0, 2.0], 0, "a"), ([3.0, 4.0], 1, "b")] * 4, ["features", "label", "text"])


def estimator(store: str, **kw: Any) -> TorchEstimator:
    model = torch.nn.Linear(2, 2)
    args: dict[str, Any] = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                loss=torch.nn.functional.cross_entropy, feature_cols=["features"],
                                label_cols=["label"], num_proc=2, store=store)
    return TorchEstimator(**{**args, **kw})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kw,match", [
    (dict(feature_cols=["features", "nope"]), "no column 'nope'"),
    (dict(feature_cols=["text"]), "'text' is string, not numeric"),
    (dict(num_proc=5), r"num_proc=5\) is more than the 4 task slots"),
    (dict(validation=1.5), r"validation \(1.5\) must be a column name or a fraction"),
    (dict(batch_size=0), r"batch_size \(0\) must be"),
    (dict(optimizer="sgd"), "optimizer must be a torch.optim.Optimizer"),
])
def test_bad_arguments_fail_before_any_task_starts(spark: Any, df: Any, tmp_path: Path, kw: dict[str, Any],
                                                   match: str) -> None:
    store = tmp_path / "store"
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup()
    with pytest.raises(InvalidArgumentError, match=match):
        estimator(str(store), **kw).fit(df)
    assert not store.exists() or not any(store.iterdir())
    assert spark.sparkContext.statusTracker().getJobIdsForGroup() == jobs


@pytest.mark.timeout(180)
def test_an_unwritable_store_fails_before_any_task_starts(spark: Any, df: Any, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="cannot be written"):
        estimator(str(tmp_path / "file" / "store")).fit(df)
    assert isinstance(ringserve.spark.Store.create(str(tmp_path)), ringserve.spark.Store)
