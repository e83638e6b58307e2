"""ringserve.tensorflow on a real world of two processes (``ringserve run -np 2``): collectives eager
and in tf.function, a differentiable allreduce, DistributedGradientTape and broadcast_variables.
Marked ``tensorflow`` (scripts/test_tf.sh installs the extra and runs them)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from binding_worlds import run_script

pytestmark = [pytest.mark.tensorflow, pytest.mark.timeout(240)]
N = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("tf")
    run_script(Path(__file__).parent / "tf_worker.py", N, out, backend="tensorflow", timeout_s=200)
    return sorted((pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(N)), key=lambda d: d["rank"])


def test_collectives_reduce_eagerly_and_inside_tf_function(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        np.testing.assert_allclose(r["eager"], np.full((2, 3), 1.5))
        np.testing.assert_allclose(r["sum"], np.full((2, 3), 3.0))
        np.testing.assert_allclose(r["allgather"], [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_allclose(r["broadcast"], np.full((2, 3), 2.0))
        np.testing.assert_allclose(r["reducescatter"], np.full((2, 2), 3.0))
        np.testing.assert_allclose(r["traced"][0], np.full((2, 3), 3.0))
        np.testing.assert_allclose(r["traced"][1], np.concatenate([np.full((2, 3), 1.0), np.full((2, 3), 2.0)]))
        np.testing.assert_allclose(r["traced"][2], np.full((2, 3), 1.0))
        np.testing.assert_allclose(r["allreduce_grad"], np.full(3, 4.0))  # 2 * (sum over 2 ranks of 1)


def test_distributed_gradient_tape_trains_every_rank_to_one_process_on_the_global_batch(
        ranks: list[dict[str, Any]]) -> None:
    import tensorflow as tf

    np.testing.assert_array_equal(ranks[0]["w0"], ranks[1]["w0"])
    np.testing.assert_array_equal(ranks[0]["w"], ranks[1]["w"])
    np.testing.assert_array_equal(ranks[0]["emb"], ranks[1]["emb"])
    xs, ys = ranks[0]["xs"], ranks[0]["ys"]
    w = tf.Variable(ranks[0]["w0"])
    for _ in range(5):  # plain SGD at 0.05, as the ranks' optimizer (no keras: its backend may be torch here)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((xs @ w - ys) ** 2)
        w.assign_sub(0.05 * tape.gradient(loss, w))
    np.testing.assert_allclose(ranks[0]["w"], w.numpy(), rtol=1e-4, atol=1e-5)
