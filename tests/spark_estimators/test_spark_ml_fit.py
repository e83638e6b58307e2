"""``Pipeline([VectorAssembler, VectorAssembler, TorchEstimator]).fit(df)`` on local[4] with two real
ringserve ranks, on dense and sparse ML vectors, an array and a number as five feature columns; the
fitted pipeline's predictions equal the trained model's own, and survive Spark ML persistence.

About two minutes on two busy cores (ranks importing torch), so marked ``slow``:
``pytest -m slow tests/spark_estimators/test_spark_ml_fit.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_models
import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = 96


def test_a_pipeline_fits_the_estimator_after_vector_assemblers_and_saves_and_loads(
        spark_ml: Any, tmp_path: Path) -> None:
    from pyspark.ml import Pipeline, PipelineModel

    from ringserve.spark.torch import TorchEstimator, TorchModel

    model = ml_models.ManyInputs()
    est = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         loss=torch.nn.functional.mse_loss, feature_cols=list(ml_models.FEATURES),
                         label_cols=["label"], batch_size=8, epochs=2, random_seed=3, verbose=0,
                         store=str(tmp_path / "store"))
    df = ml_models.frame(spark_ml, ROWS, partitions=2)
    fitted = Pipeline(stages=[*ml_models.assemblers(), est]).fit(df)
    stage = fitted.stages[-1]
    assert isinstance(stage, TorchModel) and len(stage.getHistory()["loss"]) == 2
    trained = stage.getModel()
    assert not torch.equal(trained.net[0].weight, ml_models.ManyInputs().net[0].weight)

    rows = sorted(fitted.transform(df).select("id", "label__output").collect(), key=lambda r: r["id"])
    got = np.array([r["label__output"] for r in rows])
    np.testing.assert_allclose(got, ml_models.local_predictions(trained, np.arange(ROWS)), rtol=1e-6, atol=1e-7)

    fitted.write().save(str(tmp_path / "pipeline"))
    again = PipelineModel.load(str(tmp_path / "pipeline"))
    rows = sorted(again.transform(df).select("id", "label__output").collect(), key=lambda r: r["id"])
    np.testing.assert_array_equal([r["label__output"] for r in rows], got)
