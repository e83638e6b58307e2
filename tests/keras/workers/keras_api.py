"""One rank of the Keras binding's API test; writes its results to OUT/rank<r>.pkl.

Run by tests/keras/test_keras_api.py under ``ringserve run -np 2`` with KERAS_BACKEND set.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np

import ringserve.keras as hvd


def model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])


def data(rank: int, n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(10 + rank)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    return x, (x.sum(axis=1, keepdims=True) * 0.5).astype(np.float32)


class Record(keras.callbacks.Callback):
    """Records the learning rate at every batch and the logs at every epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []
        self.logs: list[dict[str, float]] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.logs.append(dict(logs or {}))


class RankInLogs(keras.callbacks.Callback):
    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        logs["rank_value"] = float(hvd.rank())


def weights(m: keras.Model) -> list[np.ndarray]:
    return [np.array(w) for w in m.get_weights()]


def main(out: Path) -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    res: dict[str, Any] = {"rank": r, "size": n, "local_rank": hvd.local_rank(), "backend": keras.backend.backend()}

    # Collectives on backend tensors.
    t = keras.ops.convert_to_tensor(np.full((2, 3), r + 1, dtype=np.float32))
    res["allreduce"] = keras.ops.convert_to_numpy(hvd.allreduce(t))
    res["allreduce_sum"] = keras.ops.convert_to_numpy(hvd.allreduce(t, op=hvd.Sum))
    res["allreduce_type"] = type(hvd.allreduce(t)).__module__
    res["allgather"] = keras.ops.convert_to_numpy(hvd.allgather(keras.ops.ones((r + 1, 2)) * r))
    res["broadcast"] = keras.ops.convert_to_numpy(hvd.broadcast(t, root_rank=1))
    res["reducescatter"] = keras.ops.convert_to_numpy(hvd.reducescatter(keras.ops.ones((4, 2)) * (r + 1), op=hvd.Sum))
    res["grouped"] = [keras.ops.convert_to_numpy(a) for a in hvd.grouped_allreduce(
        [t, keras.ops.convert_to_tensor(np.arange(3, dtype=np.int32) * (r + 1))], op=hvd.Sum)]
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        @tf.function
        def traced(x: Any) -> Any:
            return hvd.allreduce(x * 2.0, op=hvd.Sum)

        res["traced_allreduce"] = traced(t).numpy()

    # model.fit: broadcast at start, averaged gradients, metric averaging, LR warmup.
    x, y = data(r)
    m = model(seed=r)
    res["initial_differs"] = weights(m)[0].sum()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    m.compile(optimizer=opt, loss="mse")
    record = Record()
    m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2),
                     RankInLogs(), hvd.callbacks.MetricAverageCallback(), record])
    res["fit_weights"] = weights(m)
    res["fit_lrs"] = record.lrs
    res["fit_logs"] = record.logs
    res["fit_iterations"] = int(keras.ops.convert_to_numpy(opt.iterations))
    res["fit_reductions"] = opt.reductions

    # backward_passes_per_step: 4 batches, 2 reductions, 2 applied steps.
    m2 = model(seed=5)
    opt2 = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2,
                                    average_aggregated_gradients=True)
    m2.compile(optimizer=opt2, loss="mse")
    m2.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    res["bpps_iterations"] = int(keras.ops.convert_to_numpy(opt2.iterations))
    res["bpps_reductions"] = opt2.reductions
    res["bpps_weights"] = weights(m2)

    # Compression: fp16 on the wire; every rank still ends with the same weights.
    m3 = model(seed=7)
    m3.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), compression=hvd.Compression.fp16),
               loss="mse")
    m3.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
           callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    res["fp16_weights"] = weights(m3)

    # LearningRateScheduleCallback: half the rate from epoch 1 on, with momentum correction.
    m4 = model(seed=9)
    opt4 = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    m4.compile(optimizer=opt4, loss="mse")
    record4 = Record()
    m4.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
           callbacks=[hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1), record4])
    res["schedule_lrs"] = record4.lrs

    # Elastic state: commit, restore, take rank 0's.
    state = hvd.elastic.KerasState(m4, epoch=0, batch=0)
    saved = weights(m4)
    m4.set_weights([w + 1.0 for w in saved])
    state.restore()
    res["restored_equal"] = all(np.array_equal(a, b) for a, b in zip(weights(m4), saved, strict=True))
    m4.set_weights([w + r for w in saved])
    state.epoch = 10 + r
    state.save()
    state.take(0)
    res["taken_weights"] = weights(m4)
    res["taken_epoch"] = state.epoch
    commits = state.commits
    m4.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
           callbacks=[hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                      hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])
    res["commits_in_fit"] = state.commits - commits
    res["epoch_after_fit"] = state.epoch

    (out / f"rank{r}.pkl").write_bytes(pickle.dumps(res))
    hvd.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
