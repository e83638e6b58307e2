"""The seed's Horovod-on-Spark program on local[4]: KerasEstimator and TorchEstimator train (every rank
to the same weights: fit checks the ranks' digests and raises otherwise), and transform's accuracy is
within a point of one process trained on the same data with the global batch.

Minutes long (four barrier tasks importing a framework each on two cores): marked ``slow``; run with
scripts/test_tf.sh (or ``pytest -m slow tests/spark_estimators``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.usefixtures("no_tests_tensorflow")
def test_keras_estimator_matches_one_process_within_a_point(spark: Any, tmp_path: Path) -> None:
    import keras_spark_estimator

    result = keras_spark_estimator.run(spark, str(tmp_path / "store"))
    assert result["estimator"] > 0.85, result
    assert abs(result["estimator"] - result["one_process"]) <= 0.01, result


def test_torch_estimator_matches_one_process_within_a_point(spark: Any, tmp_path: Path) -> None:
    import torch_spark_estimator

    result = torch_spark_estimator.run(spark, str(tmp_path / "store"))
    assert result["estimator"] > 0.85, result
    assert abs(result["estimator"] - result["one_process"]) <= 0.01, result
