"""The Keras binding on a real world of two processes (``ringserve run -np 2``), on each backend.

One run of ``workers/keras_api.py`` per backend exercises the collectives, model.fit with the
callbacks, backward_passes_per_step, compression and the elastic state; each test checks one part.
The torch backend runs by default; the TensorFlow one is marked ``tensorflow`` (scripts/test_tf.sh).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from keras_worlds import WORKERS, run_script

N = 2
BACKENDS = [pytest.param("torch"), pytest.param("tensorflow", marks=pytest.mark.tensorflow)]

pytestmark = pytest.mark.timeout(240)

Ranks = Callable[[str], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Ranks:
    runs: dict[str, list[dict[str, Any]]] = {}

    def get(backend: str) -> list[dict[str, Any]]:
        if backend not in runs:
            out = tmp_path_factory.mktemp(f"keras_api_{backend}")
            run_script(WORKERS / "keras_api.py", N, out, backend=backend, timeout_s=200)
            got = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(N)]
            runs[backend] = sorted(got, key=lambda res: res["rank"])
        return runs[backend]

    return get


def same(ranks: list[dict[str, Any]], key: str) -> Any:
    first = ranks[0][key]
    for other in ranks[1:]:
        for a, b in zip(first, other[key], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=key)
    return first


@pytest.mark.parametrize("backend", BACKENDS)
def test_collectives_return_backend_tensors_reduced_over_the_ranks(ranks: Ranks, backend: str) -> None:
    rs = ranks(backend)
    assert [r["backend"] for r in rs] == [backend] * N
    assert [r["size"] for r in rs] == [N] * N
    for r in rs:
        assert r["allreduce_type"].startswith("torch" if backend == "torch" else "tensorflow")
        np.testing.assert_allclose(r["allreduce"], np.full((2, 3), 1.5))
        np.testing.assert_allclose(r["allreduce_sum"], np.full((2, 3), 3.0))
        np.testing.assert_allclose(r["allgather"], np.array([[0, 0], [1, 1], [1, 1]], dtype=np.float32))
        np.testing.assert_allclose(r["broadcast"], np.full((2, 3), 2.0))
        np.testing.assert_allclose(r["reducescatter"], np.full((2, 2), 3.0))
        np.testing.assert_allclose(r["grouped"][0], np.full((2, 3), 3.0))
        np.testing.assert_array_equal(r["grouped"][1], np.arange(3) * 3)
        assert r["grouped"][1].dtype == np.int32
        if backend == "tensorflow":
            np.testing.assert_allclose(r["traced_allreduce"], np.full((2, 3), 6.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_ends_with_identical_weights_from_differently_initialized_ranks(ranks: Ranks, backend: str) -> None:
    rs = ranks(backend)
    assert rs[0]["initial_differs"] != rs[1]["initial_differs"]
    same(rs, "fit_weights")
    same(rs, "fp16_weights")
    # 32 rows per rank in batches of 8, 2 epochs: every step reduced and applied once.
    assert [r["fit_iterations"] for r in rs] == [8] * N
    assert [r["fit_reductions"] for r in rs] == [8] * N


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_passes_per_step_reduces_and_applies_once_per_that_many_batches(ranks: Ranks, backend: str) -> None:
    rs = ranks(backend)
    assert [(r["bpps_iterations"], r["bpps_reductions"]) for r in rs] == [(2, 2)] * N
    same(rs, "bpps_weights")


@pytest.mark.parametrize("backend", BACKENDS)
def test_metric_average_callback_gives_every_rank_the_mean_of_the_ranks_metrics(ranks: Ranks, backend: str) -> None:
    rs = ranks(backend)
    for r in rs:
        assert [logs["rank_value"] for logs in r["fit_logs"]] == [0.5, 0.5]
    assert rs[0]["fit_logs"] == rs[1]["fit_logs"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_warmup_goes_from_lr_over_size_to_lr_and_the_schedule_multiplies_from_its_epoch(
        ranks: Ranks, backend: str) -> None:
    rs = ranks(backend)
    lrs = rs[0]["fit_lrs"]  # 4 batches per epoch, 2 warmup epochs
    expected = [0.1 / N * (e * (N - 1) / 2 + 1) for e in (0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-6)
    assert rs[0]["fit_logs"][-1]["lr"] == pytest.approx(0.1)
    np.testing.assert_allclose(rs[0]["schedule_lrs"], [0.1] * 4 + [0.05] * 4, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_state_restores_its_commit_and_takes_rank_zeros_state(ranks: Ranks, backend: str) -> None:
    rs = ranks(backend)
    assert all(r["restored_equal"] for r in rs)
    same(rs, "taken_weights")
    assert [r["taken_epoch"] for r in rs] == [10, 10]
    # 4 batches, a commit every 2; the epoch callback counts on from the taken epoch.
    assert [r["commits_in_fit"] for r in rs] == [2, 2]
    assert [r["epoch_after_fit"] for r in rs] == [11, 11]
