"""The Horovod-on-Spark program, on ringserve: a Keras MLP fit on a Spark DataFrame of random features.

    KERAS_BACKEND=torch python examples/keras_spark_estimator.py        # local[4], 4 ranks

KerasEstimator writes the DataFrame once to Parquet in the store, trains in 4 Spark barrier tasks
(the optimizer at 0.01 * num_proc, as Horovod's examples scale it), and ``transform`` adds
``label__output``. The same model trained in this one process on the global batch (4x the batch)
is printed beside it: the accuracies agree within a point.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import keras
import numpy as np

import ringserve.spark
from ringserve.spark.keras import KerasEstimator

NUM_PROC, BATCH, EPOCHS, FEATURES = 4, 32, 4, 10


def make_frames(spark: Any, rows: int = 2400, seed: int = 0) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """Train and test DataFrames of random features labelled by a random plane, and the arrays."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal(FEATURES) > 0).astype(np.int64)
    frame = spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(rows)], ["features", "label"])
    n = rows * 5 // 6
    train = frame.limit(n)
    test = frame.subtract(train)
    return train, test, x[:n], y[:n]


def build(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(2, activation="softmax")])


def accuracy(frame: Any) -> float:
    rows = frame.select("label", "label__output").collect()
    return float(np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in rows]))


def run(spark: Any, store_dir: str) -> dict[str, float]:
    train, test, x, y = make_frames(spark)
    est = KerasEstimator(num_proc=NUM_PROC, model=build(), optimizer=keras.optimizers.SGD(0.01 * NUM_PROC, momentum=0.9),
                         loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
                         label_cols=["label"], batch_size=BATCH, epochs=EPOCHS, random_seed=1,
                         store=ringserve.spark.Store.create(store_dir), verbose=0)
    fitted = est.fit(train)
    test_rows = test.collect()
    tx = np.array([r["features"] for r in test_rows], dtype=np.float32)
    ty = np.array([r["label"] for r in test_rows])
    # One process, the global batch, the same rate.
    one = build()
    one.compile(optimizer=keras.optimizers.SGD(0.01 * NUM_PROC, momentum=0.9), loss="sparse_categorical_crossentropy")
    one.fit(x, y, batch_size=BATCH * NUM_PROC, epochs=EPOCHS, verbose=0)
    return {"estimator": accuracy(fitted.transform(test)),
            "one_process": float(np.mean(one.predict(tx, verbose=0).argmax(1) == ty)),
            "final_loss": fitted.getHistory()["loss"][-1]}


def main() -> None:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master(f"local[{NUM_PROC}]").getOrCreate()
    with tempfile.TemporaryDirectory() as store:
        result = run(spark, store)
    print(f"KerasEstimator on {NUM_PROC} ranks: test accuracy {result['estimator']:.4f}; "
          f"one process on the global batch: {result['one_process']:.4f}")
    spark.stop()


if __name__ == "__main__":
    main()
