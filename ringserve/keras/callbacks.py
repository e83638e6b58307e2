"""Horovod's Keras callbacks: ``hvd.callbacks.BroadcastGlobalVariablesCallback`` and the others.

- ``BroadcastGlobalVariablesCallback(root_rank)``: every rank starts from root's model and optimizer.
- ``MetricAverageCallback()``: the epoch's metrics are averaged over the ranks (put it before the
  callbacks that read them: checkpoints, early stopping, schedules on plateaus).
- ``LearningRateWarmupCallback(initial_lr, ...)``: Goyal et al.'s warmup, from initial_lr / size to
  initial_lr over the first epochs, step by step.
- ``LearningRateScheduleCallback(initial_lr, multiplier, ...)``: initial_lr times a multiplier (a
  number, or a function of the epoch) from start_epoch to end_epoch.

Momentum correction: when the learning rate changes from ``old`` to ``new``, the velocity of a
momentum optimizer, which holds past gradients scaled by ``old``, is scaled by ``new / old``
(Goyal et al., section 2.1). Horovod does it by changing the momentum coefficient for one batch;
here the optimizer's ``momentums`` variables are scaled directly, which is the same update and works
on a compiled TensorFlow step too, where a changed Python coefficient would not be seen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from ringserve import bindings
from ringserve.errors import InvalidArgumentError
from ringserve.keras import _backend
from ringserve.keras.optimizer import DistributedOptimizer


def model_variables(model: keras.Model) -> list[Any]:
    """The model's variables, then its optimizer's (built first if it can be), in a fixed order."""
    found = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built and model.built:
            optimizer.build(model.trainable_variables)
        found += list(optimizer.variables)
    return found


def broadcast_variables(variables: list[Any], root_rank: int, name: str = "ringserve.keras.broadcast") -> None:
    """Overwrites every variable with root_rank's value, in one broadcast per dtype (eagerly).

    Raises:
        MismatchError: the ranks hold variables of different shapes or dtypes.
    """
    arrays = [_backend.to_numpy(v) for v in variables]
    for variable, value in zip(variables, bindings.fused_broadcast(arrays, root=root_rank, name=name), strict=True):
        variable.assign(value)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's and the optimizer's variables from ``root_rank`` when training begins,
    so that every rank starts from the same state (random initializations differ by rank).

    A model that is not built when training begins (a subclassed model with no input shape) is
    broadcast after its first batch instead, as Horovod does.
    """

    def __init__(self, root_rank: int = 0, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def _broadcast(self) -> None:
        broadcast_variables(model_variables(self.model), self.root_rank, name="ringserve.keras.broadcast_global")
        self.broadcast_done = True

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's metrics (every numeric entry of ``logs``) over the ranks at epoch end,
    in one allreduce; every rank then logs the same numbers."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.size(v) == 1 and np.issubdtype(np.asarray(v).dtype, np.number))
        values = np.array([float(np.asarray(logs[k])) for k in keys], dtype=np.float64)
        # The names travel too: ranks logging different metrics must fail, not sum unlike numbers.
        name = "ringserve.keras.metrics." + ",".join(keys)
        averaged = bindings.fused_allreduce([values], op=bindings.Average, name=name)[0]
        for key, value in zip(keys, averaged, strict=True):
            logs[key] = float(value)


def _optimizer(model: keras.Model) -> keras.optimizers.Optimizer:
    opt = model.optimizer
    if opt is None:
        raise InvalidArgumentError("The learning rate callbacks need a compiled model (model.optimizer is None).")
    return opt


def _set_lr(optimizer: keras.optimizers.Optimizer, new_lr: float, momentum_correction: bool) -> None:
    old_lr = float(_backend.to_numpy(optimizer.learning_rate))
    optimizer.learning_rate = new_lr
    inner = optimizer.inner_optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    momentums = getattr(inner, "momentums", None)
    if momentum_correction and momentums and old_lr > 0 and float(getattr(inner, "momentum", 0.0) or 0.0) > 0:
        for m in momentums:
            m.assign(_backend.to_numpy(m) * (new_lr / old_lr))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier`` for epochs ``start_epoch`` to ``end_epoch``.

    Args:
        initial_lr: the learning rate the multiplier scales (Horovod asks for it explicitly, since
            the optimizer's own may already have been changed).
        multiplier: a number, or a function of the epoch (a float epoch, fractional between epoch
            boundaries when ``staircase`` is False).
        start_epoch: the first epoch it applies to.
        end_epoch: the epoch it stops before (None: to the end).
        staircase: change once per epoch (True) or every batch (False).
        momentum_correction: scale a momentum optimizer's velocity with the learning rate.
        steps_per_epoch: batches per epoch, for ``staircase=False``; by default from ``fit``'s params.
        verbose: print the learning rate when it changes at an epoch's start.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__()
        if initial_lr is None or initial_lr <= 0:
            raise InvalidArgumentError(f"initial_lr ({initial_lr}) must be a learning rate greater than zero.")
        self.initial_lr = float(initial_lr)
        self.multiplier: Callable[[float], float] = (
            multiplier if callable(multiplier) else (lambda _epoch, m=float(multiplier): m))  # type: ignore[misc]
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _steps(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise InvalidArgumentError(
                "staircase=False needs steps_per_epoch: fit() did not say how many batches an epoch has.")
        return int(steps)

    def _adjust(self, epoch: float) -> None:
        _set_lr(_optimizer(self.model), self.initial_lr * self.multiplier(epoch), self.momentum_correction)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch
        if self._active(epoch) and self.staircase:
            self._adjust(float(epoch))
            if self.verbose and bindings.rank() == 0:
                lr = float(_backend.to_numpy(_optimizer(self.model).learning_rate))
                print(f"\nEpoch {epoch + 1}: learning rate {lr:g}.")

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._active(self.current_epoch) and not self.staircase:
            self._adjust(self.current_epoch + batch / self._steps())

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(_backend.to_numpy(_optimizer(self.model).learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Warms the learning rate up from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``,
    batch by batch (Goyal et al., "Accurate, Large Minibatch SGD"): ``initial_lr`` is the rate
    already scaled by the number of ranks, which is too large for the first steps.

    Args:
        initial_lr: the scaled learning rate reached at the end of the warmup.
        warmup_epochs: how many epochs the warmup lasts.
        momentum_correction, steps_per_epoch, verbose: as LearningRateScheduleCallback.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # From 1/size at epoch 0 to 1 at warmup_epochs, linearly (Horovod's formula).
            size = bindings.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == self.warmup_epochs - 1:
            # The last batch set initial_lr * (1 - 1/steps); the warmup ends at initial_lr itself.
            _set_lr(_optimizer(self.model), self.initial_lr, self.momentum_correction)
            if self.verbose > 0 and bindings.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished the learning rate warmup to {self.initial_lr:g}.")
        super().on_epoch_end(epoch, logs)
