"""TorchEstimator on a Spark DataFrame of random features (local[4], 4 ranks), beside one process.

    python examples/torch_spark_estimator.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import numpy as np
import torch

import ringserve.spark
from ringserve.spark.torch import TorchEstimator

NUM_PROC, BATCH, EPOCHS, FEATURES = 4, 32, 4, 10


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def run(spark: Any, store_dir: str) -> dict[str, float]:
    from keras_spark_estimator import make_frames

    train, test, x, y = make_frames(spark)
    model = build()
    est = TorchEstimator(num_proc=NUM_PROC, model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01 * NUM_PROC, momentum=0.9),
                         loss=torch.nn.functional.cross_entropy, feature_cols=["features"], label_cols=["label"],
                         batch_size=BATCH, epochs=EPOCHS, random_seed=1, verbose=0,
                         store=ringserve.spark.Store.create(store_dir))
    fitted = est.fit(train)
    rows = fitted.transform(test).select("label", "label__output").collect()
    acc = float(np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in rows]))
    one = build()
    opt = torch.optim.SGD(one.parameters(), lr=0.01 * NUM_PROC, momentum=0.9)
    gen = np.random.default_rng(1)
    for _ in range(EPOCHS):
        order = gen.permutation(len(x))
        for s in range(0, len(x), BATCH * NUM_PROC):
            idx = order[s:s + BATCH * NUM_PROC]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(one(torch.as_tensor(x[idx])), torch.as_tensor(y[idx])).backward()
            opt.step()
    test_rows = test.collect()
    tx = torch.as_tensor(np.array([r["features"] for r in test_rows], dtype=np.float32))
    ty = np.array([r["label"] for r in test_rows])
    with torch.no_grad():
        one_acc = float(np.mean(one(tx).argmax(1).numpy() == ty))
    return {"estimator": acc, "one_process": one_acc, "final_loss": fitted.getHistory()["loss"][-1]}


def main() -> None:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master(f"local[{NUM_PROC}]").getOrCreate()
    with tempfile.TemporaryDirectory() as store:
        result = run(spark, store)
    print(f"TorchEstimator on {NUM_PROC} ranks: test accuracy {result['estimator']:.4f}; "
          f"one process on the global batch: {result['one_process']:.4f}")
    spark.stop()


if __name__ == "__main__":
    main()
