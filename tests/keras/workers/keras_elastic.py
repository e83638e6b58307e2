"""One worker of the Keras elastic test: ``model.fit`` under ``hvd.elastic.run`` with KerasState.

Run by tests/keras/test_keras_elastic.py under ``ringserve run --min-np 2 --restart-failed``.
The first process that has rank 2 of a world of 3 kills itself (SIGKILL) in the middle of epoch 1
(or later, if the world was not whole by then); the others go
back to their last commit and go on, and the launcher's replacement joins at a commit and takes
the state. Each process that finishes writes ``done-<pid>.pkl``: its weights, its epoch, the epoch
it started at, and the world's size at each epoch's end. Batches are slowed while the world has fewer
than 3 workers, so that late starters and the replacement join before the last epoch.

Args (argv): OUT (a directory), EPOCHS.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np

import ringserve.keras as hvd


class KillOnce(keras.callbacks.Callback):
    """Kills this process at the first batch from ``batch`` of ``epoch`` on, if it is rank 2 of a
    whole world and no process was killed before (a marker file says)."""

    def __init__(self, marker: Path, state: Any, epoch: int, batch: int) -> None:
        super().__init__()
        self.marker, self.state, self.epoch, self.batch = marker, state, epoch, batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if hvd.size() == 3 and hvd.rank() == 2 and (self.state.epoch, batch) >= (self.epoch, self.batch):
            try:
                self.marker.touch(exist_ok=False)
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)


class Sizes(keras.callbacks.Callback):
    """Records the world's size at each epoch's end."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = sizes

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.sizes.append(hvd.size())


class AwaitReplacement(keras.callbacks.Callback):
    """Slows each batch while the world has fewer than 3 workers, so that a worker still importing
    Keras at the start, and the launcher's replacement after the kill, join before training ends."""

    def __init__(self, pause_s: float) -> None:
        super().__init__()
        self.pause_s = pause_s

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if hvd.size() < 3:
            time.sleep(self.pause_s)


def main(out: Path, epochs: int) -> None:
    hvd.init()
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)),
                  loss="mse")
    rng = np.random.default_rng(100 + os.getpid())
    x = rng.standard_normal((96, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32)).astype(np.float32)

    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    first_epoch: list[int] = []
    sizes: list[int] = []

    @hvd.elastic.run
    def train(state: Any) -> None:
        first_epoch.append(int(state.epoch))
        model.fit(x, y, batch_size=8, epochs=epochs - state.epoch, shuffle=False, verbose=0,
                  callbacks=[hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=4),
                             KillOnce(out / "killed", state, epoch=1, batch=5),
                             AwaitReplacement(pause_s=0.5), Sizes(sizes)])

    train(state)
    done = {"weights": [np.array(w) for w in model.get_weights()], "epoch": int(state.epoch),
            "first_epoch": first_epoch[0], "sizes": sizes, "resets": resets, "rank": hvd.rank()}
    (out / f"done-{os.getpid()}.pkl").write_bytes(pickle.dumps(done))
    hvd.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
