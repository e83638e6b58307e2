"""Elastic training for Keras, in Horovod's shape, reachable as ``hvd.elastic``:

```python
import ringserve.keras as hvd

state = hvd.elastic.KerasState(model, batch=0, epoch=0)
state.register_reset_callbacks([lambda: setattr(model.optimizer, "learning_rate", 0.01 * hvd.size())])
callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
             hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

@hvd.elastic.run
def train(state):
    model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)

train(state)
```

``run`` is ``ringserve.elastic.run`` (which also sees a ringserve error that TensorFlow reported as
its own from inside ``model.fit``'s graph: see ringserve/graph_ops.py): on a recoverable error (a rank died) the state goes back to its
last commit, the wrapper waits for the next view, every rank takes the state of the rank holding the
furthest commit, the reset callbacks run, and the function is called again. Workers that wait to
join are admitted at a commit and receive the state before their first step.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from ringserve import api
from ringserve.elastic import ObjectState, State
from ringserve.graph_ops import run
from ringserve.keras import _backend
from ringserve.keras.callbacks import broadcast_variables
from ringserve.keras.optimizer import DistributedOptimizer

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "ObjectState",
    "State",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


class KerasState(ObjectState):
    """A Keras model, its optimizer and picklable extras, committed, restored and synced together.

    Args:
        model: the model whose variables (weights and non-trainable state) are kept.
        optimizer: its optimizer; by default ``model.optimizer`` (the compiled one).
        backend: accepted for Horovod's signature (Keras 3 has one backend per process).
        **kwargs: extra values (epoch, batch, ...) reachable as attributes; each must be picklable.
    """

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None,
                 backend: object = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._variables_saved: list[np.ndarray] = []
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        found = list(self.model.variables)
        if self.optimizer is not None:
            if not self.optimizer.built and self.model.built:
                self.optimizer.build(self.model.trainable_variables)
            found += list(self.optimizer.variables)
        return found

    def save(self) -> None:
        super().save()
        self._variables_saved = [_backend.to_numpy(v).copy() for v in self._variables()]

    def restore(self) -> None:
        super().restore()
        if isinstance(self.optimizer, DistributedOptimizer):
            self.optimizer.reset()
        variables = self._variables()
        if len(variables) == len(self._variables_saved):
            for variable, value in zip(variables, self._variables_saved, strict=True):
                variable.assign(value)

    def take(self, root: int) -> None:
        broadcast_variables(self._variables(), root, name="ringserve.keras.elastic.sync")
        payload = _sync_object((self.commits, self.lineage, self._saved), root)
        self.commits, self.lineage, self._saved = payload
        ObjectState.restore(self)
        self.save()

    def snapshot(self) -> object:
        return {"values": self._saved, "variables": self._variables_saved}

    def load_snapshot(self, snapshot: object) -> None:
        assert isinstance(snapshot, dict)
        self._saved = snapshot["values"]
        self._variables_saved = snapshot["variables"]


def _sync_object(payload: tuple[int, int, dict[str, Any]], root: int) -> tuple[int, int, dict[str, Any]]:
    taken = api.broadcast_object(payload, root=root, name="ringserve.keras.elastic.sync_values")
    assert isinstance(taken, tuple)
    return taken


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches; put it after the Update*StateCallbacks,
    so that a commit holds the batch and epoch they have just recorded."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit ({batches_per_commit}) must be at least 1.")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the number of batches done in the current epoch."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of epochs done, across calls of ``fit`` that start again
    at epoch 0 after a reset."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = int(state.epoch)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_epoch = int(self.state.epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
