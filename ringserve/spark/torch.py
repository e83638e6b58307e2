"""TorchEstimator: fit a torch model on a Spark DataFrame with ringserve, in Horovod's shape.


```python
est = ringserve.spark.torch.TorchEstimator(
    model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01 * 4), loss=torch.nn.functional.cross_entropy,
    feature_cols=["features"], label_cols=["label"], batch_size=64, epochs=5, num_proc=4,
    store=ringserve.spark.Store.create("/tmp/rs-store"), validation=0.1)
fitted = est.fit(df)                  # a Spark ML Model
pred = fitted.transform(test_df)      # adds "label__output"
net = fitted.getModel()
```

Each barrier task builds the optimizer again for its copy of the model (the same class, its
param_groups' settings and state), wraps it in ``ringserve.torch.DistributedOptimizer``, takes rank
0's parameters, and trains on its shard: each feature column is one input of ``model(*features)``
(float32, shaped by ``input_shapes`` when given), the label column the loss's target (int64 for an
integer column, float32 otherwise). After every epoch the train and validation metrics are averaged
over the ranks, and rank 0 writes the model (``torch.save`` of the whole module) to the store.

Callbacks are objects with any of ``on_epoch_begin(epoch)`` and ``on_epoch_end(epoch, logs)``,
called on every rank (``logs`` holds the averaged metrics).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringserve.bindings import require
from ringserve.errors import InvalidArgumentError
from ringserve.spark._estimator import EstimatorBase, EstimatorParams, TrainSpec, weights_digest
from ringserve.spark.model import EstimatorModel, Predict
from ringserve.spark.store import Store

torch = require("torch", "torch")

__all__ = ["TorchEstimator", "TorchModel"]

TorchModel = EstimatorModel


class TorchTrainer:
    """The torch part of a run: pickled to every task with the model, optimizer and loss."""

    checkpoint_ext = "pt"

    def __init__(self, *, model: Any, optimizer: Any, loss: Callable[..., Any], metrics: Sequence[Callable[..., Any]],
                 input_shapes: list[list[int]] | None, callbacks: list[Any], backward_passes_per_step: int,
                 gradient_compression: Any) -> None:
        self.model = model
        self.optimizer_class = type(optimizer)
        self.optimizer_defaults = dict(optimizer.defaults)
        self.optimizer_state = optimizer.state_dict()
        self.loss = loss
        self.metrics = list(metrics)
        self.input_shapes = input_shapes
        self.callbacks = callbacks
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_compression = gradient_compression

    def _inputs(self, spec: TrainSpec, data: dict[str, np.ndarray], rows: Any) -> list[Any]:
        out = []
        for i, name in enumerate(spec.feature_cols):
            t = torch.as_tensor(np.asarray(data[name][rows], dtype=np.float32))
            if self.input_shapes is not None:
                t = t.reshape(len(t), *self.input_shapes[i][1:]) if self.input_shapes[i][0] == -1 else t.reshape(
                    *self.input_shapes[i])
            out.append(t)
        return out

    def _target(self, spec: TrainSpec, data: dict[str, np.ndarray], rows: Any) -> Any:
        targets = []
        for name in spec.label_cols:
            a = data[name][rows]
            targets.append(torch.as_tensor(a.astype(np.int64) if a.dtype.kind in "iub" else a.astype(np.float32)))
        return targets[0] if len(targets) == 1 else targets

    def _metrics(self, output: Any, target: Any, loss: Any) -> dict[str, float]:
        found = {"loss": float(loss)}
        for fn in self.metrics:
            found[getattr(fn, "__name__", type(fn).__name__)] = float(fn(output, target))
        return found

    def train(self, spec: TrainSpec, data: dict[str, np.ndarray],
              val: dict[str, np.ndarray] | None) -> tuple[dict[str, list[float]], str]:
        import ringserve.torch as hvd

        model = self.model
        optimizer = self.optimizer_class(model.parameters(), **self.optimizer_defaults)
        optimizer.load_state_dict(self.optimizer_state)  # each group's settings, and any state
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=self.gradient_compression or hvd.Compression.none,
                                             backward_passes_per_step=self.backward_passes_per_step)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        rows = len(next(iter(data.values())))
        steps = spec.steps_per_epoch()
        bpps = self.backward_passes_per_step
        steps -= steps % bpps if steps >= bpps else 0
        history: dict[str, list[float]] = {}
        for epoch in range(spec.epochs):
            for cb in self.callbacks:
                getattr(cb, "on_epoch_begin", lambda e: None)(epoch)
            order = np.random.default_rng((spec.random_seed, epoch, hvd.rank())).permutation(rows) \
                if spec.shuffle else np.arange(rows)
            model.train()
            totals: dict[str, float] = {}
            for step in range(steps):
                start = (step * spec.batch_size) % rows
                idx = order[np.arange(start, start + spec.batch_size) % rows] if spec.train_steps_per_epoch \
                    else order[start:start + spec.batch_size]
                output = model(*self._inputs(spec, data, idx))
                target = self._target(spec, data, idx)
                loss = self.loss(output, target)
                loss.backward()
                if (step + 1) % bpps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
                with torch.no_grad():
                    for k, v in self._metrics(output, target, loss).items():
                        totals[k] = totals.get(k, 0.0) + v
            logs = {k: v / steps for k, v in totals.items()}
            if val is not None:
                val_logs, val_rows = self._evaluate(spec, model, val)
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
                logs["__rows"] = val_rows
            logs = self._average(hvd, logs)
            for k, v in logs.items():
                history.setdefault(k, []).append(v)
            if hvd.rank() == 0:
                buf = io.BytesIO()
                torch.save(model, buf)
                spec.store.write(spec.store.get_checkpoint_path(spec.run_id, self.checkpoint_ext), buf.getvalue())
            for cb in self.callbacks:
                getattr(cb, "on_epoch_end", lambda e, logs: None)(epoch, logs)
            if spec.verbose and hvd.rank() == 0:
                print(f"epoch {epoch + 1}/{spec.epochs}: " + ", ".join(f"{k} {v:.4f}" for k, v in logs.items()))
        hvd.barrier()  # rank 0's last checkpoint is written before any rank reports
        digest = weights_digest([t.detach().cpu().numpy() for t in model.state_dict().values()])
        return history, digest

    def _evaluate(self, spec: TrainSpec, model: Any, val: dict[str, np.ndarray]) -> tuple[dict[str, float], float]:
        rows = len(next(iter(val.values())))
        model.eval()
        sums: dict[str, float] = {}
        seen = 0
        limit = rows if spec.validation_steps_per_epoch is None else min(rows, spec.validation_steps_per_epoch * spec.val_batch_size)
        with torch.no_grad():
            for start in range(0, limit, spec.val_batch_size):
                idx = np.arange(start, min(start + spec.val_batch_size, limit))
                output = model(*self._inputs(spec, val, idx))
                target = self._target(spec, val, idx)
                for k, v in self._metrics(output, target, self.loss(output, target)).items():
                    sums[k] = sums.get(k, 0.0) + v * len(idx)
                seen += len(idx)
        # Weighted by rows, so that ranks with more validation rows count for more in the average.
        return {k: v / max(seen, 1) for k, v in sums.items()}, float(seen)

    @staticmethod
    def _average(hvd: Any, logs: dict[str, float]) -> dict[str, float]:
        keys = sorted(logs)
        values = torch.tensor([logs[k] for k in keys], dtype=torch.float64)
        if "__rows" in logs:
            rows = logs["__rows"]
            weights = torch.tensor([rows if k.startswith("val_") else 1.0 for k in keys], dtype=torch.float64)
            total_rows = float(hvd.allreduce(torch.tensor([rows], dtype=torch.float64), op=hvd.Sum)[0])
            summed = hvd.allreduce(values * weights, op=hvd.Sum, name="ringserve.spark.metrics")
            size = hvd.size()
            averaged = [float(s) / (total_rows if k.startswith("val_") else size) for k, s in zip(keys, summed, strict=True)]
        else:
            averaged = [float(v) for v in hvd.allreduce(values, name="ringserve.spark.metrics")]
        return {k: v for k, v in zip(keys, averaged, strict=True) if k != "__rows"}

    def scorer(self) -> TorchScorer:
        return TorchScorer(self.input_shapes)


class TorchScorer:
    """Loads a ``torch.save`` checkpoint and predicts, with the estimator's ``input_shapes``."""

    def __init__(self, input_shapes: list[list[int]] | None) -> None:
        self.input_shapes = input_shapes

    def load(self, blob: bytes) -> Any:
        return torch.load(io.BytesIO(blob), weights_only=False)

    def predictor(self, model: Any, feature_cols: list[str]) -> Predict:
        shapes, features = self.input_shapes, list(feature_cols)

        def predict(batch: dict[str, np.ndarray]) -> list[np.ndarray]:
            inputs = []
            for i, name in enumerate(features):
                t = torch.as_tensor(np.asarray(batch[name], dtype=np.float32))
                if shapes is not None:
                    t = t.reshape(len(t), *shapes[i][1:])
                inputs.append(t)
            model.eval()
            with torch.no_grad():
                out = model(*inputs)
            outs = out if isinstance(out, list | tuple) else [out]
            return [o.detach().cpu().numpy() for o in outs]

        return predict


class TorchEstimator(EstimatorBase):
    """Trains a torch model on a DataFrame across ``num_proc`` Spark barrier tasks (Horovod's shape).

    Args:
        num_proc: the number of ranks (barrier tasks); by default the context's parallelism.
        model: a ``torch.nn.Module``.
        optimizer: an optimizer over ``model.parameters()``; each rank builds its class again over its
            own copy, with the same settings and state.
        loss: ``loss(output, target)`` (for instance ``torch.nn.functional.cross_entropy``).
        metrics: functions ``fn(output, target) -> number``, logged by their ``__name__``.
        store: a ``Store`` or a path/URL for ``Store.create``.
        feature_cols, label_cols: the input columns (numbers, arrays of numbers or ML vectors).
        input_shapes: one shape per feature column, with -1 for the batch (default: as stored).
        validation: a fraction of the rows held out at random, or a boolean column marking them.
        callbacks: objects with ``on_epoch_begin(epoch)`` / ``on_epoch_end(epoch, logs)``.
        batch_size, val_batch_size: rows per step on each rank (validation defaults to batch_size).
        epochs, shuffle, random_seed, verbose: as their names say.
        train_steps_per_epoch, validation_steps_per_epoch: default: one pass over the shard.
        transformation_fn: ``fn(pandas.DataFrame) -> pandas.DataFrame`` applied to each rank's rows.
        backward_passes_per_step: local backward passes per reduced step.
        gradient_compression: ``ringserve.torch.Compression.fp16`` and so on.
        run_id: names the run's data and checkpoints in the store (default: a new id).
    """

    def __init__(self, *, num_proc: int | None = None, model: Any = None, optimizer: Any = None,
                 loss: Callable[..., Any] | None = None, metrics: Sequence[Callable[..., Any]] = (),
                 store: Store | str | None = None, feature_cols: list[str] | None = None,
                 label_cols: list[str] | None = None, input_shapes: list[list[int]] | None = None,
                 validation: float | str | None = None, callbacks: list[Any] | None = None, batch_size: int = 32,
                 val_batch_size: int | None = None, epochs: int = 1, verbose: int = 1, shuffle: bool = True,
                 random_seed: int | None = None, train_steps_per_epoch: int | None = None,
                 validation_steps_per_epoch: int | None = None,
                 transformation_fn: Callable[[Any], Any] | None = None, backward_passes_per_step: int = 1,
                 gradient_compression: Any = None, run_id: str | None = None) -> None:
        super().__init__(EstimatorParams(
            num_proc=num_proc, store=store, feature_cols=list(feature_cols or []), label_cols=list(label_cols or []),
            validation=validation, callbacks=list(callbacks or []), batch_size=batch_size,
            val_batch_size=val_batch_size, epochs=epochs, verbose=verbose, shuffle=shuffle, random_seed=random_seed,
            train_steps_per_epoch=train_steps_per_epoch, validation_steps_per_epoch=validation_steps_per_epoch,
            transformation_fn=transformation_fn, run_id=run_id))
        self.model, self.optimizer, self.loss, self.metrics = model, optimizer, loss, list(metrics)
        self.input_shapes = input_shapes
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_compression = gradient_compression

    def _check_framework(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise InvalidArgumentError(f"model must be a torch.nn.Module, not {self.model!r}.")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"optimizer must be a torch.optim.Optimizer, not {self.optimizer!r}.")
        if not callable(self.loss):
            raise InvalidArgumentError(f"loss must be a function loss(output, target), not {self.loss!r}.")
        if not isinstance(self.backward_passes_per_step, int) or self.backward_passes_per_step < 1:
            raise InvalidArgumentError(
                f"backward_passes_per_step ({self.backward_passes_per_step!r}) must be a whole number of at least 1.")
        if self.input_shapes is not None and len(self.input_shapes) != len(self.params_.feature_cols):
            raise InvalidArgumentError(
                f"input_shapes has {len(self.input_shapes)} shapes for {len(self.params_.feature_cols)} feature columns.")

    def _trainer(self) -> TorchTrainer:
        assert self.loss is not None  # checked by _check_framework
        return TorchTrainer(model=self.model, optimizer=self.optimizer, loss=self.loss, metrics=self.metrics,
                            input_shapes=self.input_shapes, callbacks=self.params_.callbacks,
                            backward_passes_per_step=self.backward_passes_per_step,
                            gradient_compression=self.gradient_compression)
