"""The Keras model of the estimator on Spark ML's inputs (no ranks: built from a ``.keras`` checkpoint
as ``fit`` builds it): transform after VectorAssemblers, on dense and sparse vectors and an array as
four inputs, gives the Keras model's own predictions, and the PipelineModel saves and loads
with identical ones. Keras loads in each Python worker, so marked ``slow``:
``pytest -m slow tests/spark_estimators/test_spark_ml_keras.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_models
import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = 64


@pytest.mark.usefixtures("no_tests_tensorflow")
def test_a_keras_stage_transforms_vectors_and_arrays_and_saves_and_loads(spark_ml: Any, tmp_path: Path) -> None:
    keras = pytest.importorskip("keras")
    from pyspark.ml import PipelineModel

    from ringserve.spark.keras import KerasModel, KerasScorer

    features = {c: n for c, n in ml_models.FEATURES.items() if n}  # numbers: test_spark_ml.py, with torch
    inputs = [keras.Input((n,), name=f"in_{c}") for c, n in features.items()]
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
    model.save(tmp_path / "model.keras")
    stage = KerasModel(checkpoint=(tmp_path / "model.keras").read_bytes(), scorer=KerasScorer(None, str(keras.backend.backend())),
                       history={}, run_id="run-keras", feature_cols=list(features),
                       feature_shapes=[(n,) for n in features.values()], label_cols=["label"])
    pipeline = PipelineModel(stages=[*ml_models.assemblers(), stage])
    df = ml_models.frame(spark_ml, ROWS)

    def predictions(p: Any) -> np.ndarray:
        rows = sorted(p.transform(df).select("id", "label__output").collect(), key=lambda r: r["id"])
        return np.array([r["label__output"] for r in rows])

    got = predictions(pipeline)
    feats = ml_models.local_features(np.arange(ROWS))
    want = model.predict([feats[c].astype(np.float32) for c in features], verbose=0)
    assert got.shape == (ROWS, 2)  # two values a row: an array column
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    pipeline.write().save(str(tmp_path / "pipeline"))
    np.testing.assert_array_equal(predictions(PipelineModel.load(str(tmp_path / "pipeline"))), got)
