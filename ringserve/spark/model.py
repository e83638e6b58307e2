"""The fitted estimator: a Spark ML ``Model`` that predicts on the executors and saves with Spark ML.

``transform(df)`` is lazy and runs where the data is. It adds one column, computed by an iterator
pandas UDF (one model load per Spark task, then Arrow batches of
``spark.sql.execution.arrow.maxRecordsPerBatch`` rows), so the driver never holds the data and a
DataFrame larger than any one machine's memory goes through a batch at a time. Only the feature
columns go to Python; the others stay on the JVM, untouched. The UDF returns a struct of the
predictions, which is then opened into the ``<label>__output`` columns.

Persistence is Spark ML's (``MLWritable``/``MLReadable``), so a ``PipelineModel`` holding this stage
saves and loads it too. A saved model is a directory:

```text
<path>/metadata/   Spark ML's metadata JSON (class, uid), with the columns, shapes and history
<path>/data/       Parquet, one row: the checkpoint (the framework's bytes) and the pickled Scorer
```

Both are written and read through Spark, so ``path`` is any URL Spark can write (local, ``hdfs://``,
``s3a://``). The Scorer is the framework's small, picklable part (input shapes; custom objects and
the Keras backend), pickled with cloudpickle: loading needs the same ringserve, and the model's own
classes importable, as torch.load and Keras loading need anyway.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from ringserve.bindings import require
from ringserve.errors import InvalidArgumentError
from ringserve.spark import columns as cols

require("pyspark", "spark")
require("pandas", "spark")

import pandas as pd  # noqa: E402
from pyspark.ml import Model  # noqa: E402
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter  # noqa: E402

Predict = Callable[[dict[str, np.ndarray]], list[np.ndarray]]

# The struct column the UDF fills, opened into the output columns and dropped in the same select.
_PREDICTIONS = "__ringserve_predictions"


class Scorer(Protocol):
    """A framework's way to load its checkpoint and predict with it: small and picklable, since it is
    saved with the model and shipped to the executors."""

    def load(self, blob: bytes) -> Any: ...

    def predictor(self, model: Any, feature_cols: list[str]) -> Predict: ...


def output_columns(label_cols: list[str]) -> list[str]:
    """Horovod's names of the predictions: ``<label>__output``."""
    return [f"{c}__output" for c in label_cols]


def add_predictions(df: Any, predict: Predict, *, feature_cols: list[str], feature_shapes: list[tuple[int, ...]],
                    label_cols: list[str], widths: list[int]) -> Any:
    """``df`` with a ``<label>__output`` column per label: a double, or an array of doubles when the
    model gives more than one value per row (class probabilities).

    Raises:
        InvalidArgumentError: (here, before any job) a feature column is missing, of an unsupported
            type or of the wrong size; (on the executors, when an action runs) a null or a row of the
            wrong length, naming the column.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    from pyspark.sql.functions import pandas_udf

    kinds = cols.check_features(df, feature_cols, feature_shapes)
    outputs = output_columns(label_cols)
    clash = [o for o in [*outputs, _PREDICTIONS] if o in df.columns]
    if clash:
        raise InvalidArgumentError(f"The DataFrame already has the output column {clash[0]!r}; rename or drop it.")
    result = T.StructType([T.StructField(o, T.DoubleType() if w == 1 else T.ArrayType(T.DoubleType()))
                           for o, w in zip(outputs, widths, strict=True)])
    inputs = F.struct(*[cols.as_array(name, kind).alias(f"f{i}")
                        for i, (name, kind) in enumerate(zip(feature_cols, kinds, strict=True))])
    names, shapes = list(feature_cols), list(feature_shapes)

    def predict_batches(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for frame in batches:
            feats = {name: cols.to_numpy(frame[f"f{i}"], name, shape)
                     for i, (name, shape) in enumerate(zip(names, shapes, strict=True))}
            out = {}
            for out_name, raw, width in zip(outputs, predict(feats), widths, strict=True):
                values = np.asarray(raw, dtype=np.float64).reshape(len(frame), -1)
                out[out_name] = values[:, 0] if width == 1 else list(values)
            yield pd.DataFrame(out, index=frame.index)

    # Nondeterministic, so that the optimizer keeps one evaluation of the UDF for all the fields
    # rather than inlining it into each (which would run the model once per output column).
    udf = pandas_udf(predict_batches, result).asNondeterministic()  # type: ignore[call-overload]
    with_struct = df.withColumn(_PREDICTIONS, udf(inputs))
    struct = F.col(_PREDICTIONS)
    return with_struct.select(*[F.col(cols.quoted(c)) for c in df.columns],
                              *[struct.getField(o).alias(o) for o in outputs])


class EstimatorModel(Model, MLWritable, MLReadable):
    """A trained model as a Spark ML Transformer: ``transform(df)`` adds ``<label>__output`` columns.

    As Horovod's: ``getModel()`` is the trained model, ``getHistory()`` the per-epoch metrics averaged
    over the ranks, ``getRunId()`` the run (with its checkpoint in the store), and
    ``getFeatureColumns()``, ``getLabelColumns()`` and ``getOutputCols()`` the columns.
    ``write().save(path)`` and ``EstimatorModel.load(path)`` (also ``TorchModel.load`` and
    ``KerasModel.load``) are Spark ML's persistence; the model can be a stage of a ``PipelineModel``.

    Example:
        ```python
        fitted = est.fit(df)
        fitted.write().overwrite().save("/models/m1")
        again = TorchModel.load("/models/m1")
        again.transform(df).select("label__output")
        ```
    """

    def __init__(self, *, checkpoint: bytes, scorer: Scorer, history: dict[str, list[float]], run_id: str,
                 feature_cols: list[str], feature_shapes: list[tuple[int, ...]], label_cols: list[str]) -> None:
        super().__init__()
        self._checkpoint = checkpoint
        self._scorer = scorer
        self._model = scorer.load(checkpoint)
        self._predict = scorer.predictor(self._model, list(feature_cols))
        self._history = history
        self._run_id = run_id
        self._feature_cols = list(feature_cols)
        self._feature_shapes = [tuple(s) for s in feature_shapes]
        self._label_cols = list(label_cols)
        # Values per row of each output (1: a double column; more: an array), from one row of zeros.
        probe = {n: np.zeros((1, *s), dtype=np.float32) for n, s in zip(self._feature_cols, self._feature_shapes,
                                                                          strict=True)}
        self._widths = [int(np.asarray(o).reshape(1, -1).shape[1]) for o in self._predict(probe)]
        if len(self._widths) != len(self._label_cols):
            raise InvalidArgumentError(f"The model gives {len(self._widths)} outputs for {len(self._label_cols)} "
                                       f"label columns ({self._label_cols}); it must give one per label.")

    def getModel(self) -> Any:
        return self._model

    def getHistory(self) -> dict[str, list[float]]:
        return self._history

    def getRunId(self) -> str:
        return self._run_id

    def getFeatureColumns(self) -> list[str]:
        return list(self._feature_cols)

    def getLabelColumns(self) -> list[str]:
        return list(self._label_cols)

    def getOutputCols(self) -> list[str]:
        return output_columns(self._label_cols)

    def predict(self, features: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The model's outputs for arrays of rows, one per label, in this process (what transform
        runs on each batch): ``features`` maps each feature column to ``(rows, *shape)``."""
        return [np.asarray(o) for o in self._predict(features)]

    def _transform(self, dataset: Any) -> Any:
        return add_predictions(dataset, self._predict, feature_cols=self._feature_cols,
                               feature_shapes=self._feature_shapes, label_cols=self._label_cols, widths=self._widths)

    def write(self) -> MLWriter:
        return _Writer(self)

    @classmethod
    def read(cls) -> MLReader:
        return _Reader(cls)

    def _state(self) -> dict[str, Any]:
        return {"featureCols": self._feature_cols, "featureShapes": [list(s) for s in self._feature_shapes],
                "labelCols": self._label_cols, "runId": self._run_id,
                "history": self._history}


class _Writer(MLWriter):
    def __init__(self, instance: EstimatorModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        from pyspark import cloudpickle

        m = self.instance
        DefaultParamsWriter.saveMetadata(m, path, self.sparkSession, extraMetadata={"ringserve": m._state()})
        data = [(bytearray(m._checkpoint), bytearray(cloudpickle.dumps(m._scorer)))]
        self.sparkSession.createDataFrame(data, "checkpoint binary, scorer binary").coalesce(1).write.parquet(
            os.path.join(path, "data"))


class _Reader(MLReader):
    def __init__(self, cls: type[EstimatorModel]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> EstimatorModel:
        from pyspark import cloudpickle

        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        state = metadata.get("ringserve")
        if not isinstance(state, dict):
            raise InvalidArgumentError(f"The directory {path!r} holds a {metadata.get('class')}, not a ringserve "
                                       "estimator's model.")
        row = self.sparkSession.read.parquet(os.path.join(path, "data")).first()
        if row is None:
            raise InvalidArgumentError(f"The saved model at {path!r} has no data (its data/ Parquet is empty).")
        model = self.cls(checkpoint=bytes(row["checkpoint"]), scorer=cloudpickle.loads(bytes(row["scorer"])),
                         history=state["history"], run_id=state["runId"],
                         feature_cols=state["featureCols"], feature_shapes=[tuple(s) for s in state["featureShapes"]],
                         label_cols=state["labelCols"])
        model._resetUid(metadata["uid"])
        return model
