"""The fitted estimator as Spark ML users use it, on local[4] (no ranks: the model is built from a
checkpoint as ``fit`` builds it; test_spark_ml_fit.py fits it in a Pipeline):

- ``transform`` after ``VectorAssembler``s, on dense and sparse ML vectors, an array and a number as
  several feature columns, gives the model's own predictions, computed here from the same rows;
- Spark ML persistence of the stage and of a ``PipelineModel`` holding it, with identical predictions;
- ``transform`` in batches on the executors, on a DataFrame made there by ``spark.range``, with the
  driver's results capped by ``spark.driver.maxResultSize`` (1 MiB, less than the data: a collect of
  it is seen to fail) and only an aggregate coming back;
- bad columns refused with their names, in transform and in fit.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import ml_models
import numpy as np
import pytest
import torch

from ringserve.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(240)

ROWS = 64
# 100k rows of 13 doubles made on the executors (about 10 MiB as Spark holds them): ten times what
# the driver may receive.
BIG_ROWS = 100_000


@pytest.fixture(scope="module")
def pipeline() -> Any:
    """The assemblers, then the estimator's model: a PipelineModel as ``Pipeline.fit`` makes one."""
    from pyspark.ml import PipelineModel

    return PipelineModel(stages=[*ml_models.assemblers(), ml_models.untrained_model()])


def by_id(rows: list[Any]) -> list[Any]:
    """Rows in id order, sorted here: a Spark orderBy would sample, running the model twice."""
    return sorted(rows, key=lambda r: r["id"])


def predictions(model: Any, df: Any) -> np.ndarray:
    return np.array([r["label__output"] for r in by_id(model.transform(df).select("id", "label__output").collect())])


def test_transform_gives_the_models_own_predictions_and_keeps_every_column(spark_ml: Any, pipeline: Any) -> None:
    from pyspark.ml.linalg import DenseVector, SparseVector

    df = ml_models.frame(spark_ml, ROWS)
    out = pipeline.transform(df)
    assert out.columns == [*df.columns, "assembled", "sparse", "label__output"]
    got = by_id(out.collect())
    stage = pipeline.stages[-1]
    want = ml_models.local_predictions(stage.getModel(), np.arange(ROWS))
    np.testing.assert_allclose([r["label__output"] for r in got], want, rtol=1e-6, atol=1e-7)
    # Vectors come back as vectors (the bug: a dict from inside the UDF that Spark could not
    # serialize), dense and sparse ones both.
    assert {type(r["sparse"]) for r in got} == {DenseVector, SparseVector}
    np.testing.assert_array_equal(np.stack([r["dense"].toArray() for r in got]),
                                  np.stack([r["dense"].toArray() for r in by_id(df.collect())]))
    # The stage's predict on arrays here is what transform runs on each batch there.
    feats = {k: v.astype(np.float32) for k, v in ml_models.local_features(np.arange(ROWS)).items()}
    np.testing.assert_allclose(stage.predict(feats)[0], want, rtol=1e-6, atol=1e-7)


def test_several_labels_get_a_column_each_from_one_run_of_the_model(
        spark_ml: Any, capsys: pytest.CaptureFixture[str]) -> None:
    stage = ml_models.model_from(ml_models.TwoOutputs(), {"dense": 3}, ["total", "twice"])
    out = stage.transform(ml_models.frame(spark_ml, 8))
    out.explain()
    assert capsys.readouterr().out.count("ArrowEvalPython") == 1
    rows = by_id(out.collect())
    dense = np.stack([r["dense"].toArray() for r in rows])
    np.testing.assert_allclose([r["total__output"] for r in rows], dense.sum(1), rtol=1e-6)
    np.testing.assert_allclose(np.stack([r["twice__output"] for r in rows]), dense * 2, rtol=1e-6)


def test_the_stage_and_the_pipeline_model_save_and_load_with_identical_predictions(
        spark_ml: Any, pipeline: Any, tmp_path: Path) -> None:
    from pyspark.ml import PipelineModel

    from ringserve.spark.torch import TorchModel

    df = ml_models.frame(spark_ml, ROWS)
    before = predictions(pipeline, df)
    pipeline.write().save(str(tmp_path / "pipeline"))
    np.testing.assert_array_equal(predictions(PipelineModel.load(str(tmp_path / "pipeline")), df), before)

    stage = pipeline.stages[-1]
    stage.write().save(str(tmp_path / "stage"))
    stage.write().overwrite().save(str(tmp_path / "stage"))
    loaded = TorchModel.load(str(tmp_path / "stage"))
    assert (loaded.uid, loaded.getHistory(), loaded.getRunId()) == (stage.uid, stage.getHistory(), stage.getRunId())
    assert loaded.getFeatureColumns() == list(ml_models.FEATURES) and loaded.getOutputCols() == ["label__output"]
    assembled = PipelineModel(stages=pipeline.stages[:-1]).transform(df)
    np.testing.assert_array_equal(predictions(loaded, assembled), before)
    with pytest.raises(InvalidArgumentError, match="not a ringserve estimator's model"):
        TorchModel.load(str(tmp_path / "pipeline"))


def test_transform_runs_in_batches_on_the_executors_and_the_driver_gets_only_an_aggregate(
        spark_ml: Any, pipeline: Any) -> None:
    from pyspark.sql import functions as F

    big = ml_models.frame(spark_ml, BIG_ROWS, partitions=2)  # 50k rows a task, 10k an Arrow batch
    # The cap can fail: the data is more than the driver may receive, so collecting it fails.
    with pytest.raises(Exception, match="maxResultSize"):
        big.select("dense", "arr", "x1", "x2", "x3", "s0", "num").collect()
    out = pipeline.transform(big).agg(F.count("*").alias("n"), F.sum("label__output").alias("total"),
                                      F.max("label__output").alias("top")).first()
    model = pipeline.stages[-1].getModel()
    chunks = [ml_models.local_predictions(model, ids) for ids in np.array_split(np.arange(BIG_ROWS), 8)]
    assert out["n"] == BIG_ROWS
    assert math.isclose(out["total"], float(sum(c.sum() for c in chunks)), rel_tol=1e-6, abs_tol=1e-3)
    assert math.isclose(out["top"], float(max(c.max() for c in chunks)), rel_tol=1e-6)


def test_bad_feature_columns_are_refused_by_name(spark_ml: Any, pipeline: Any) -> None:
    from pyspark.ml import PipelineModel
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    stage = pipeline.stages[-1]
    df = PipelineModel(stages=pipeline.stages[:-1]).transform(ml_models.frame(spark_ml, 16))
    # Known before any job: a vector size recorded in the schema, a type, a missing column.
    short = VectorAssembler(inputCols=["x1", "x2"], outputCol="assembled").transform(df.drop("assembled"))
    with pytest.raises(InvalidArgumentError,
                       match="'assembled' holds vectors of size 2; the model was trained on vectors of size 3"):
        stage.transform(short)
    with pytest.raises(InvalidArgumentError, match="'arr' is string, not numeric"):
        stage.transform(df.withColumn("arr", F.lit("x")))
    with pytest.raises(InvalidArgumentError, match="no column 'num'"):
        stage.transform(df.drop("num"))
    with pytest.raises(InvalidArgumentError, match="'num' holds arrays; the model was trained on one number"):
        stage.transform(df.withColumn("num", F.array("num")))
    # Known on the executors, when an action runs: a vector of another size, with no size recorded.
    wrong = df.withColumn("dense", array_to_vector(F.array("x1", "x2")))
    with pytest.raises(Exception, match="The column 'dense' has a row of 2 values; the model was trained on 3"):
        stage.transform(wrong).agg(F.sum("label__output")).first()


def test_fit_refuses_a_vector_column_of_mixed_sizes_by_name(spark_ml: Any, tmp_path: Path) -> None:
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    from ringserve.spark.torch import TorchEstimator

    df = ml_models.frame(spark_ml, 32).withColumn(
        "dense", array_to_vector(F.when(F.col("id") == 7, F.array("x1")).otherwise(F.array("x1", "x2", "x3"))))
    model = ml_models.ManyInputs()
    est = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         loss=torch.nn.functional.mse_loss, feature_cols=["dense"], label_cols=["label"],
                         verbose=0, store=str(tmp_path / "store"))
    with pytest.raises(InvalidArgumentError, match="'dense' has rows of 1 to 3 values"):
        est.fit(df)
