"""The model and data of the Spark ML tests, in a module of its own so that the tests can ship it
to the executors with ``SparkContext.addPyFile`` (torch checkpoints name the model's class).

The data is made on the executors from ``spark.range`` (``frame``), and here with numpy from the
same ids (``local_features``), so that a test can compare transform with the model run locally
without the driver ever holding the DataFrame.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

# The feature columns and the values per row that the model takes from each (0: one number).
FEATURES = {"assembled": 3, "dense": 3, "sparse": 4, "arr": 2, "num": 0}


class ManyInputs(torch.nn.Module):
    """``model(assembled, dense, sparse, arr, num)``: one output per row (a regression)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        width = sum(max(1, n) for n in FEATURES.values())
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        flat = [x.reshape(len(x), -1) for x in xs]
        return self.net(torch.cat(flat, dim=1)).squeeze(1)


class TwoOutputs(torch.nn.Module):
    """``model(dense) -> (sum of the row, the row doubled)``: an output for each of two labels."""

    def forward(self, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dense.sum(1), dense * 2


def frame(spark: Any, rows: int, partitions: int = 1) -> Any:
    """Rows made on the executors from their id: the raw columns the assemblers read (x1..x3 for
    "assembled", s0..s3, mostly zeros, for "sparse"), a dense vector (array_to_vector, with no size
    recorded), an array, a number and the label."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    i = F.col("id").cast("double")
    every = F.col("id") % 5 == 0
    return spark.range(0, rows, numPartitions=partitions).select(
        "id", F.sin(i * 0.1).alias("x1"), F.cos(i * 0.2).alias("x2"),
        F.when(F.col("id") % 3 == 0, 0.0).otherwise(F.sin(i * 0.3)).alias("x3"),
        F.sin(i * 0.13).alias("s0"), *[F.when(every, F.cos(i * k)).otherwise(0.0).alias(f"s{n}")
                                       for n, k in ((1, 0.3), (2, 0.7), (3, 1.7))],
        array_to_vector(F.array(F.sin(i * 0.5), F.cos(i * 0.7), F.sin(i * 1.1))).alias("dense"),
        F.array(F.sin(i * 0.9), F.cos(i * 1.3)).alias("arr"),
        ((F.col("id") % 7).cast("double") / 7.0).alias("num"),
        F.sin(i * 0.05).alias("label"))


def assemblers() -> list[Any]:
    """The VectorAssemblers that make "assembled" (mostly dense rows) and "sparse" (mostly sparse)."""
    from pyspark.ml.feature import VectorAssembler

    return [VectorAssembler(inputCols=["x1", "x2", "x3"], outputCol="assembled"),
            VectorAssembler(inputCols=["s0", "s1", "s2", "s3"], outputCol="sparse")]


def local_features(ids: np.ndarray) -> dict[str, np.ndarray]:
    """``frame``'s feature columns, after the assemblers, for these ids, computed here with numpy."""
    i = ids.astype(np.float64)
    every = ids % 5 == 0
    x3 = np.where(ids % 3 == 0, 0.0, np.sin(i * 0.3))
    sparse = [np.sin(i * 0.13)] + [np.where(every, np.cos(i * k), 0.0) for k in (0.3, 0.7, 1.7)]
    return {"assembled": np.stack([np.sin(i * 0.1), np.cos(i * 0.2), x3], 1),
            "dense": np.stack([np.sin(i * 0.5), np.cos(i * 0.7), np.sin(i * 1.1)], 1),
            "sparse": np.stack(sparse, 1), "arr": np.stack([np.sin(i * 0.9), np.cos(i * 1.3)], 1),
            "num": (ids % 7).astype(np.float64) / 7.0}


def local_predictions(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    """The torch model itself on the rows of ``ids``, in this process."""
    feats = local_features(ids)
    model.eval()
    with torch.no_grad():
        out = model(*[torch.as_tensor(feats[c], dtype=torch.float32) for c in FEATURES])
    return out.numpy().astype(np.float64)


def model_from(net: torch.nn.Module, features: dict[str, int], labels: list[str]) -> Any:
    """The estimator's fitted-model class around ``net``, as ``fit`` builds it from a checkpoint."""
    from ringserve.spark.model import EstimatorModel
    from ringserve.spark.torch import TorchScorer

    buf = io.BytesIO()
    torch.save(net, buf)
    return EstimatorModel(checkpoint=buf.getvalue(), scorer=TorchScorer(None), history={"loss": [1.0]},
                          run_id="run-untrained", feature_cols=list(features),
                          feature_shapes=[(n,) if n else () for n in features.values()], label_cols=labels)


def untrained_model() -> Any:
    """The estimator's fitted-model class around ManyInputs' first weights, as ``fit`` builds it from
    a checkpoint (no ranks: the transform and persistence tests need no training)."""
    return model_from(ManyInputs(), FEATURES, ["label"])
