"""KerasEstimator: fit a Keras 3 model on a Spark DataFrame with ringserve, in Horovod's shape.


```python
model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
est = ringserve.spark.keras.KerasEstimator(
    model=model, optimizer=keras.optimizers.SGD(0.01 * 4), loss="sparse_categorical_crossentropy",
    metrics=["accuracy"], feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=5,
    num_proc=4, store=ringserve.spark.Store.create("/tmp/rs-store"), validation=0.1)
fitted = est.fit(df)
pred = fitted.transform(test_df)      # adds "label__output" (the class probabilities)
```

Each barrier task unpickles the model, builds the optimizer again from its config, compiles with
``ringserve.keras.DistributedOptimizer``, and runs ``model.fit`` on its shard with the broadcast and
metric-averaging callbacks, then the estimator's own callbacks; rank 0 saves the model (``.keras``)
to the store after every epoch. The tasks use the driver's Keras backend (KERAS_BACKEND).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from ringserve.bindings import require
from ringserve.errors import InvalidArgumentError
from ringserve.spark._estimator import EstimatorBase, EstimatorParams, TrainSpec, weights_digest
from ringserve.spark.model import EstimatorModel, Predict
from ringserve.spark.store import Store

keras = require("keras", "keras")

__all__ = ["KerasEstimator", "KerasModel"]

KerasModel = EstimatorModel


def _inputs(spec: TrainSpec, data: dict[str, np.ndarray], rows: Any) -> Any:
    xs = [np.asarray(data[c][rows], dtype=np.float32) for c in spec.feature_cols]
    return xs[0] if len(xs) == 1 else xs


def _targets(spec: TrainSpec, data: dict[str, np.ndarray], rows: Any) -> Any:
    ys = [data[c][rows] for c in spec.label_cols]
    ys = [y.astype(np.int64) if y.dtype.kind in "iub" else y.astype(np.float32) for y in ys]
    return ys[0] if len(ys) == 1 else ys


class _Batches(keras.utils.PyDataset):  # type: ignore[name-defined]
    """A rank's shard in batches: the same number of steps on every rank, reshuffled every epoch."""

    def __init__(self, spec: TrainSpec, data: dict[str, np.ndarray], rank: int) -> None:
        super().__init__()
        self.spec, self.data, self.rank = spec, data, rank
        self.rows = len(next(iter(data.values())))
        self.epoch = 0
        self.order = self._order()

    def _order(self) -> np.ndarray:
        if not self.spec.shuffle:
            return np.arange(self.rows)
        return np.random.default_rng((self.spec.random_seed, self.epoch, self.rank)).permutation(self.rows)

    def __len__(self) -> int:
        return self.spec.steps_per_epoch()

    def __getitem__(self, step: int) -> tuple[Any, Any]:
        start = (step * self.spec.batch_size) % self.rows
        if self.spec.train_steps_per_epoch is not None:
            idx = self.order[np.arange(start, start + self.spec.batch_size) % self.rows]
        else:
            idx = self.order[start:start + self.spec.batch_size]
        return _inputs(self.spec, self.data, idx), _targets(self.spec, self.data, idx)

    def on_epoch_end(self) -> None:
        self.epoch += 1
        self.order = self._order()


def _model_bytes(model: Any) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def _load_model(blob: bytes, custom_objects: dict[str, Any] | None) -> Any:
    import ringserve.keras  # noqa: F401  (registers DistributedOptimizer for loading)

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        with open(path, "wb") as f:
            f.write(blob)
        return keras.saving.load_model(path, custom_objects=custom_objects, compile=False)


class KerasTrainer:
    """The Keras part of a run: pickled to every task with the model and the compile settings."""

    checkpoint_ext = "keras"

    def __init__(self, *, model: Any, optimizer: Any, loss: Any, loss_weights: Any, metrics: list[Any],
                 callbacks: list[Any], custom_objects: dict[str, Any] | None, gradient_compression: Any,
                 backward_passes_per_step: int, backend: str) -> None:
        self.model_blob = _model_bytes(model)
        self.optimizer_config = keras.optimizers.serialize(optimizer)
        self.loss, self.loss_weights, self.metrics = loss, loss_weights, metrics
        self.callbacks = callbacks
        self.custom_objects = custom_objects
        self.gradient_compression = gradient_compression
        self.backward_passes_per_step = backward_passes_per_step
        self.backend = backend

    def train(self, spec: TrainSpec, data: dict[str, np.ndarray],
              val: dict[str, np.ndarray] | None) -> tuple[dict[str, list[float]], str]:
        if os.environ.get("KERAS_BACKEND", self.backend) != self.backend:
            raise InvalidArgumentError(
                f"This task's KERAS_BACKEND is {os.environ['KERAS_BACKEND']!r}, the driver's {self.backend!r}.")
        os.environ["KERAS_BACKEND"] = self.backend
        import ringserve.keras as hvd

        model = _load_model(self.model_blob, self.custom_objects)
        optimizer = keras.optimizers.deserialize(self.optimizer_config, custom_objects=self.custom_objects)
        kwargs = {} if self.gradient_compression is None else {"compression": self.gradient_compression}
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer, backward_passes_per_step=self.backward_passes_per_step,
                                                         **kwargs),
                      loss=self.loss, loss_weights=self.loss_weights, metrics=self.metrics)
        rank = hvd.rank()
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                     *self.callbacks]
        if rank == 0:
            callbacks.append(_Checkpoint(spec))
        validation_data = None
        if val is not None and len(next(iter(val.values()))):
            validation_data = (_inputs(spec, val, slice(None)), _targets(spec, val, slice(None)))
        history = model.fit(_Batches(spec, data, rank), epochs=spec.epochs, validation_data=validation_data,
                            validation_batch_size=spec.val_batch_size,
                            validation_steps=spec.validation_steps_per_epoch, callbacks=callbacks,
                            verbose=spec.verbose if rank == 0 else 0)
        hvd.barrier()  # rank 0's last checkpoint is written before any rank reports
        logs = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        return logs, weights_digest([np.asarray(w) for w in model.get_weights()])

    def scorer(self) -> KerasScorer:
        return KerasScorer(self.custom_objects, self.backend)


class KerasScorer:
    """Loads a ``.keras`` checkpoint and predicts, with the custom objects and the driver's backend."""

    def __init__(self, custom_objects: dict[str, Any] | None, backend: str) -> None:
        self.custom_objects, self.backend = custom_objects, backend

    def load(self, blob: bytes) -> Any:
        return _load_model(blob, self.custom_objects)

    def predictor(self, model: Any, feature_cols: list[str]) -> Predict:
        blob, custom, backend, features = _model_bytes(model), self.custom_objects, self.backend, list(feature_cols)
        loaded: list[Any] = []

        def predict(batch: dict[str, np.ndarray]) -> list[np.ndarray]:
            if not loaded:  # once per Spark task, on the executor
                os.environ.setdefault("KERAS_BACKEND", backend)
                loaded.append(_load_model(blob, custom))
            xs = [np.asarray(batch[c], dtype=np.float32) for c in features]
            out = loaded[0].predict(xs[0] if len(xs) == 1 else xs, verbose=0, batch_size=max(1, len(xs[0])))
            return [np.asarray(o) for o in (out if isinstance(out, list | tuple) else [out])]

        return predict


class _Checkpoint(keras.callbacks.Callback):  # type: ignore[name-defined]
    """Rank 0's: the model, saved to the store after every epoch."""

    def __init__(self, spec: TrainSpec) -> None:
        super().__init__()
        self.spec = spec

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.spec.store.write(self.spec.store.get_checkpoint_path(self.spec.run_id, KerasTrainer.checkpoint_ext),
                              _model_bytes(self.model))


class KerasEstimator(EstimatorBase):
    """Trains a Keras 3 model on a DataFrame across ``num_proc`` Spark barrier tasks (Horovod's shape).

    Args:
        num_proc: the number of ranks (barrier tasks); by default the context's parallelism.
        model: a Keras 3 model (built: with an Input, or called once).
        optimizer: a Keras 3 optimizer (its config travels; each rank builds its own).
        loss, loss_weights, metrics: as ``model.compile`` takes them.
        store: a ``Store`` or a path/URL for ``Store.create``.
        feature_cols, label_cols: the columns (numbers, arrays of numbers or ML vectors); several
            feature columns are several model inputs.
        validation: a fraction of the rows held out at random, or a boolean column marking them.
        callbacks: Keras callbacks, run on every rank after the broadcast and metric averaging.
        custom_objects: your own layers, losses and so on, for loading the model in the tasks.
        batch_size, val_batch_size, epochs, shuffle, random_seed, verbose: as their names say.
        train_steps_per_epoch, validation_steps_per_epoch: default: one pass over the shard.
        transformation_fn: ``fn(pandas.DataFrame) -> pandas.DataFrame`` applied to each rank's rows.
        gradient_compression: ``ringserve.keras.Compression.fp16`` and so on.
        backward_passes_per_step: local passes per reduced step (DistributedOptimizer's).
        run_id: names the run's data and checkpoints in the store (default: a new id).
    """

    def __init__(self, *, num_proc: int | None = None, model: Any = None, optimizer: Any = None, loss: Any = None,
                 loss_weights: Any = None, metrics: list[Any] | None = None, store: Store | str | None = None,
                 feature_cols: list[str] | None = None, label_cols: list[str] | None = None,
                 validation: float | str | None = None, callbacks: list[Any] | None = None,
                 custom_objects: dict[str, Any] | None = None, batch_size: int = 32, val_batch_size: int | None = None,
                 epochs: int = 1, verbose: int = 1, shuffle: bool = True, random_seed: int | None = None,
                 train_steps_per_epoch: int | None = None, validation_steps_per_epoch: int | None = None,
                 transformation_fn: Callable[[Any], Any] | None = None, gradient_compression: Any = None,
                 backward_passes_per_step: int = 1, run_id: str | None = None) -> None:
        super().__init__(EstimatorParams(
            num_proc=num_proc, store=store, feature_cols=list(feature_cols or []), label_cols=list(label_cols or []),
            validation=validation, callbacks=list(callbacks or []), batch_size=batch_size,
            val_batch_size=val_batch_size, epochs=epochs, verbose=verbose, shuffle=shuffle, random_seed=random_seed,
            train_steps_per_epoch=train_steps_per_epoch, validation_steps_per_epoch=validation_steps_per_epoch,
            transformation_fn=transformation_fn, run_id=run_id))
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.loss_weights, self.metrics = loss_weights, list(metrics or [])
        self.custom_objects = custom_objects
        self.gradient_compression = gradient_compression
        self.backward_passes_per_step = backward_passes_per_step

    def _check_framework(self) -> None:
        if not isinstance(self.model, keras.Model):
            raise InvalidArgumentError(f"model must be a Keras 3 model (keras.Model), not {self.model!r}.")
        if not self.model.built:
            raise InvalidArgumentError("The model is not built: give it an Input (or call it once) before fit.")
        if not isinstance(self.optimizer, keras.optimizers.Optimizer):
            raise InvalidArgumentError(f"optimizer must be a Keras 3 optimizer, not {self.optimizer!r}.")
        if self.loss is None:
            raise InvalidArgumentError("The estimator needs a loss (a name such as \"mse\", or a Keras loss).")

    def _trainer(self) -> KerasTrainer:
        return KerasTrainer(model=self.model, optimizer=self.optimizer, loss=self.loss, loss_weights=self.loss_weights,
                            metrics=self.metrics, callbacks=self.params_.callbacks,
                            custom_objects=self.custom_objects, gradient_compression=self.gradient_compression,
                            backward_passes_per_step=self.backward_passes_per_step,
                            backend=str(keras.backend.backend()))
