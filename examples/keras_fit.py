"""Keras 3 model.fit on every rank, with gradients averaged by ringserve (Horovod's Keras recipe).

    KERAS_BACKEND=torch ringserve run -np 4 python examples/keras_fit.py
    KERAS_BACKEND=tensorflow ringserve run -np 4 python examples/keras_fit.py   # with ringserve[tensorflow]

Each rank trains on its slice of every global batch (rank r takes rows r*b..(r+1)*b of each batch of
size*b rows), so N ranks with batch b take the same steps as one process with batch N*b: the
learning rate is 0.01 * size, as in Horovod's examples. With --out DIR, every rank saves its final
weights to DIR/rank<r>.npz (the tests compare them across ranks and with one process).
"""

from __future__ import annotations

import argparse
import os

import keras
import numpy as np

import ringserve.keras as hvd


def make_data(n: int, features: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random features; the label is which side of a fixed random plane a point lies on."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    w = rng.standard_normal(features).astype(np.float32)
    y = (x @ w > 0).astype(np.int64)
    return x, y


def rank_slice(a: np.ndarray, batch: int, rank: int, size: int) -> np.ndarray:
    """This rank's rows of every global batch of size*batch rows (whole global batches only)."""
    steps = len(a) // (batch * size)
    a = a[: steps * batch * size]
    return a.reshape(steps, size, batch, *a.shape[1:])[:, rank].reshape(steps * batch, *a.shape[1:])


def build_model(features: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(2, activation="softmax"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=None, help="default 0.01 * size")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    hvd.init()
    x, y = make_data(args.samples, args.features, seed=1)
    x_rank = rank_slice(x, args.batch_size, hvd.rank(), hvd.size())
    y_rank = rank_slice(y, args.batch_size, hvd.rank(), hvd.size())

    # A different initialization on each rank: the broadcast callback makes them all rank 0's.
    model = build_model(args.features, seed=100 + hvd.rank())
    lr = args.lr if args.lr is not None else 0.01 * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=lr, momentum=0.9))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(
        x_rank, y_rank, batch_size=args.batch_size, epochs=args.epochs, shuffle=False,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()],
        verbose=2 if hvd.rank() == 0 else 0,
    )
    if hvd.rank() == 0:
        print(f"backend {keras.backend.backend()}, {hvd.size()} ranks: "
              f"accuracy {history.history['accuracy'][-1]:.4f}, loss {history.history['loss'][-1]:.4f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        weights = {f"w{i}": w for i, w in enumerate(model.get_weights())}
        np.savez(os.path.join(args.out, f"rank{hvd.rank()}.npz"), loss=np.array(history.history["loss"]), **weights)
    hvd.shutdown()


if __name__ == "__main__":
    main()
