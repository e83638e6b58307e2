"""What TorchEstimator and KerasEstimator share: the checks made before any task starts, the one
write of the DataFrame to Parquet in the store, and the barrier run (the fitted model and its
transform are in ``model.py``).

A framework module gives a ``Trainer`` (what each barrier task runs on its shard, and the
``Scorer`` that loads the final checkpoint and predicts); everything else is here. The per-task
part reads only the store and the Parquet footers, so ``fit_on_parquet`` runs on data written
earlier without Spark writing again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ringserve.bindings import require
from ringserve.errors import InvalidArgumentError, RingserveError
from ringserve.spark import data as datasets
from ringserve.spark.columns import check_dataframe, check_uniform, column_kind
from ringserve.spark.model import EstimatorModel, Scorer
from ringserve.spark.store import Store

require("pyspark", "spark")
require("pyarrow", "spark")

from pyspark.ml import Estimator  # noqa: E402

log = logging.getLogger("ringserve.spark")

VAL_COLUMN = "__ringserve_validation"


@dataclass(frozen=True)
class TrainSpec:
    """Everything one barrier task needs besides the framework's own objects (pickled to it)."""

    store: Store
    run_id: str
    train: datasets.Dataset
    val: datasets.Dataset | None
    feature_cols: list[str]
    label_cols: list[str]
    batch_size: int
    val_batch_size: int
    epochs: int
    shuffle: bool
    random_seed: int
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    transformation_fn: Callable[[Any], Any] | None
    verbose: int
    num_proc: int

    def steps_per_epoch(self) -> int:
        """Train steps per epoch, the same on every rank: the shard in whole and partial batches."""
        if self.train_steps_per_epoch is not None:
            return self.train_steps_per_epoch
        return max(1, -(-(self.train.rows // self.num_proc) // self.batch_size))


class Trainer(Protocol):
    """The framework's part: train on this rank's shard; its Scorer loads the final model and predicts."""

    checkpoint_ext: str

    def train(self, spec: TrainSpec, rank_data: dict[str, np.ndarray],
              val_data: dict[str, np.ndarray] | None) -> tuple[dict[str, list[float]], str]: ...

    def scorer(self) -> Scorer: ...


def weights_digest(arrays: list[np.ndarray]) -> str:
    """A hash of the model's values, bit for bit (equal on every rank when training kept them equal)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def apply_transformation(fn: Callable[[Any], Any] | None, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``transformation_fn`` on a shard as a pandas DataFrame (array columns hold one array per row)."""
    if fn is None or not arrays:
        return arrays
    import pandas as pd

    frame = pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in arrays.items()})
    out = fn(frame)
    return {k: np.stack(out[k].to_numpy()) if arrays[k].ndim > 1 else out[k].to_numpy(dtype=arrays[k].dtype)
            for k in arrays}


def run_task(trainer: Trainer, spec: TrainSpec) -> dict[str, Any]:
    """The body of every barrier task: read this rank's shard, train, report."""
    from ringserve import api

    api.init()
    try:
        rank, size = api.rank(), api.size()
        shard = apply_transformation(spec.transformation_fn, datasets.read_shard(spec.store, spec.train, rank, size))
        val = None
        if spec.val is not None:
            val = apply_transformation(spec.transformation_fn,
                                       datasets.read_shard(spec.store, spec.val, rank, size, even=False))
        history, digest = trainer.train(spec, shard, val)
        if rank == 0:
            spec.store.write(spec.store.get_history_path(spec.run_id), json.dumps(history).encode())
        return {"rank": rank, "history": history, "digest": digest, "rows": len(next(iter(shard.values())))}
    finally:
        api.shutdown()


@dataclass
class EstimatorParams:
    """The parameters both estimators take, with Horovod's names."""

    num_proc: int | None = None
    store: Store | str | None = None
    feature_cols: list[str] = field(default_factory=list)
    label_cols: list[str] = field(default_factory=list)
    validation: float | str | None = None
    callbacks: list[Any] = field(default_factory=list)
    batch_size: int = 32
    val_batch_size: int | None = None
    epochs: int = 1
    verbose: int = 1
    shuffle: bool = True
    random_seed: int | None = None
    train_steps_per_epoch: int | None = None
    validation_steps_per_epoch: int | None = None
    transformation_fn: Callable[[Any], Any] | None = None
    run_id: str | None = None

    def check(self) -> Store:
        """Checks every parameter that needs no data; returns the store.

        Raises:
            InvalidArgumentError: naming the parameter and its bad value.
        """
        for name in ("feature_cols", "label_cols"):
            cols = getattr(self, name)
            if isinstance(cols, str):
                cols = [cols]
                setattr(self, name, cols)
            if not cols or not all(isinstance(c, str) for c in cols):
                raise InvalidArgumentError(f"{name} must be a non-empty list of column names, not {cols!r}.")
        for name in ("batch_size", "epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} ({value!r}) must be a whole number of at least 1.")
        for name in ("val_batch_size", "train_steps_per_epoch", "validation_steps_per_epoch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(f"{name} ({value!r}) must be None or a whole number of at least 1.")
        v = self.validation
        if v is not None and not isinstance(v, str) and not (isinstance(v, float) and 0.0 < v < 1.0):
            raise InvalidArgumentError(
                f"validation ({v!r}) must be a column name or a fraction between 0 and 1 (exclusive).")
        if self.store is None:
            raise InvalidArgumentError("The estimator needs a store: store=ringserve.spark.Store.create(path).")
        return self.store if isinstance(self.store, Store) else Store.create(self.store)


def write_parquet(df: Any, store: Store, run_id: str, columns: list[str], vectors: list[str],
                  validation: float | str | None, num_proc: int, seed: int) -> tuple[str, str | None]:
    """Writes the DataFrame's columns once, to the store's train (and validation) Parquet, then
    checks the array columns there (a pass over those columns of the Parquet alone).

    Raises:
        InvalidArgumentError: an array or vector column with nulls, or with rows of different lengths.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    for name in vectors:
        df = df.withColumn(name, vector_to_array(F.col(name), "float32"))
    train_path, val_path = store.get_train_data_path(run_id), None
    if validation is None:
        train = df.select(*columns)
    else:
        flag = F.col(validation).cast("boolean") if isinstance(validation, str) else F.rand(seed) < F.lit(validation)
        marked = df.withColumn(VAL_COLUMN, flag).select(*columns, VAL_COLUMN)
        train = marked.where(~F.col(VAL_COLUMN)).drop(VAL_COLUMN)
        val_path = store.get_val_data_path(run_id)
        marked.where(F.col(VAL_COLUMN)).drop(VAL_COLUMN).write.mode("overwrite").parquet(store.spark_url(val_path))
    train.repartition(num_proc).write.mode("overwrite").parquet(store.spark_url(train_path))
    arrays = [c for c in columns if column_kind(df, c) != "number"]
    for path in [train_path] + ([val_path] if val_path else []):
        check_uniform(df.sparkSession.read.parquet(store.spark_url(path)), arrays)
    return train_path, val_path


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


class EstimatorBase(Estimator):
    """``fit(df)``: checks, writes Parquet once, trains in num_proc barrier tasks, returns a model."""

    def __init__(self, params: EstimatorParams) -> None:
        super().__init__()
        self.params_ = params

    def _trainer(self) -> Trainer:
        raise NotImplementedError

    def _check_framework(self) -> None:
        """Framework checks of the model, optimizer and loss, before any data is touched."""

    def _fit(self, dataset: Any) -> EstimatorModel:
        from ringserve.spark import _check_local_slots, _spark_context

        p = self.params_
        store = p.check()
        self._check_framework()
        vectors = check_dataframe(dataset, p.feature_cols + p.label_cols, p.validation)
        sc = _spark_context(dataset.sparkSession.sparkContext)
        num_proc = self._num_proc(sc)
        _check_local_slots(sc, num_proc)
        store.check_writable()
        run_id = p.run_id or new_run_id()
        seed = p.random_seed if p.random_seed is not None else 0
        train_path, val_path = write_parquet(dataset, store, run_id, p.feature_cols + p.label_cols, vectors,
                                             p.validation, num_proc, seed)
        return self.fit_on_parquet(train_path, val_path, run_id=run_id)

    def _num_proc(self, sc: Any) -> int:
        n = self.params_.num_proc if self.params_.num_proc is not None else sc.defaultParallelism
        if not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"The number of processes (num_proc={n!r}) must be a whole number of at least 1.")
        return n

    def fit_on_parquet(self, train_path: str | None = None, val_path: str | None = None, *,
                       run_id: str | None = None) -> EstimatorModel:
        """Trains on Parquet already in the store (written by an earlier ``fit``, or by you), with no
        write: ``train_path`` and ``val_path`` default to the store's paths for ``run_id``."""
        from ringserve.spark import _check_local_slots, _spark_context, run

        p = self.params_
        store = p.check()
        self._check_framework()
        sc = _spark_context(None)
        num_proc = self._num_proc(sc)
        _check_local_slots(sc, num_proc)
        run_id = run_id or p.run_id or new_run_id()
        names = p.feature_cols + p.label_cols
        train = datasets.describe(store, train_path or store.get_train_data_path(p.run_id), names)
        if train.rows < num_proc:
            raise InvalidArgumentError(f"The training data has {train.rows} rows, fewer than num_proc={num_proc}.")
        val = None
        if val_path is not None or (p.validation is not None and store.exists(store.get_val_data_path(p.run_id))):
            val = datasets.describe(store, val_path or store.get_val_data_path(p.run_id), names)
        spec = TrainSpec(store=store, run_id=run_id, train=train, val=val, feature_cols=p.feature_cols,
                         label_cols=p.label_cols, batch_size=p.batch_size, val_batch_size=p.val_batch_size or p.batch_size,
                         epochs=p.epochs, shuffle=p.shuffle, random_seed=p.random_seed or 0,
                         train_steps_per_epoch=p.train_steps_per_epoch,
                         validation_steps_per_epoch=p.validation_steps_per_epoch,
                         transformation_fn=p.transformation_fn, verbose=p.verbose, num_proc=num_proc)
        trainer = self._trainer()
        results = run(run_task, args=(trainer, spec), num_proc=num_proc, spark_context=sc)
        digests = {r["digest"] for r in results}
        if len(digests) != 1:
            raise RingserveError(f"The ranks of run {run_id} ended with {len(digests)} different sets of weights; "
                                 "they must be identical (please report this).")
        scorer = trainer.scorer()
        checkpoint = store.read(store.get_checkpoint_path(run_id, trainer.checkpoint_ext))
        shapes = [train.columns[n].shape for n in p.feature_cols]
        log.info("ringserve.spark: run %s trained on %d ranks, weights %s", run_id, num_proc, next(iter(digests))[:12])
        return EstimatorModel(checkpoint=checkpoint, scorer=scorer, history=results[0]["history"], run_id=run_id,
                              feature_cols=p.feature_cols, feature_shapes=shapes, label_cols=p.label_cols)
