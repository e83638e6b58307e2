"""One rank of the TensorFlow binding's test; writes OUT/rank<r>.pkl (run by test_tensorflow.py)."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

import ringserve.tensorflow as hvd


def main(out: Path) -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    res: dict[str, Any] = {"rank": r}
    t = tf.fill((2, 3), float(r + 1))
    res["eager"] = hvd.allreduce(t).numpy()
    res["sum"] = hvd.allreduce(t, op=hvd.Sum).numpy()
    res["allgather"] = hvd.allgather(tf.ones((r + 1, 2)) * r).numpy()
    res["broadcast"] = hvd.broadcast(t, root_rank=1).numpy()
    res["reducescatter"] = hvd.reducescatter(tf.ones((4, 2)) * (r + 1), op=hvd.Sum).numpy()

    @tf.function
    def traced(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        return hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, root_rank=0)

    res["traced"] = [a.numpy() for a in traced(t)]

    # Differentiable: d/dx sum_ranks(x * w) with the upstream averaged.
    x = tf.Variable(tf.ones(3) * (r + 1))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.allreduce(x * 2.0, op=hvd.Sum))
    res["allreduce_grad"] = tape.gradient(y, x).numpy()

    # DistributedGradientTape in a tf.function step: every rank ends equal to one process on the
    # global batch (the mean of the ranks' mean gradients is the global mean gradient).
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((n * 8, 4)).astype(np.float32)
    ys = (xs @ np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32))[:, None]
    tf.random.set_seed(r)
    w = tf.Variable(tf.random.normal((4, 1)))
    emb = tf.Variable(tf.random.normal((5, 1)))
    opt = tf.keras.optimizers.SGD(0.05)
    hvd.broadcast_variables([w, emb], root_rank=0)
    res["w0"] = w.numpy()

    @tf.function
    def step(bx: tf.Tensor, by: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            # The embedding's gradient is a tf.IndexedSlices, gathered sparse; w's is dense.
            loss = tf.reduce_mean((bx @ w - by) ** 2) + 0.01 * tf.reduce_sum(tf.gather(emb, [r % 5]))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, [w, emb])
        opt.apply_gradients(zip(grads, [w, emb], strict=True))
        return loss

    mine = slice(r * 8, (r + 1) * 8)
    for _ in range(5):
        step(tf.constant(xs[mine]), tf.constant(ys[mine]))
    res["w"] = w.numpy()
    res["emb"] = emb.numpy()
    res["xs"], res["ys"] = xs, ys
    (out / f"rank{r}.pkl").write_bytes(pickle.dumps(res))
    hvd.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
