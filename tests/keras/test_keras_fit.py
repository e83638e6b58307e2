"""``ringserve run -np 4`` of examples/keras_fit.py: every rank ends with identical weights, equal
within float tolerance to one process trained on the global batch (4x the batch, the same rate).

Both are marked (the torch one ``slow``: four Keras processes take a minute on 2 cores; the TensorFlow
one ``tensorflow``); ``scripts/test_tf.sh`` runs both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from keras_worlds import REPO, run_script

EXAMPLE = REPO / "examples" / "keras_fit.py"
N, BATCH, EPOCHS = 4, 16, 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.slow), pytest.param("tensorflow", marks=pytest.mark.tensorflow)])
def test_four_ranks_of_model_fit_match_one_process_on_the_global_batch(tmp_path: Path, backend: str) -> None:
    common = ["--epochs", str(EPOCHS), "--samples", "1024", "--lr", "0.04"]
    run_script(EXAMPLE, N, tmp_path / "four", ["--out", str(tmp_path / "four"), "--batch-size", str(BATCH), *common],
               backend=backend, timeout_s=240, pass_out_dir=False)
    run_script(EXAMPLE, 1, tmp_path / "one", ["--out", str(tmp_path / "one"), "--batch-size", str(BATCH * N), *common],
               backend=backend, timeout_s=120, pass_out_dir=False)
    ranks = [np.load(tmp_path / "four" / f"rank{r}.npz") for r in range(N)]
    one = np.load(tmp_path / "one" / "rank0.npz")
    keys = [k for k in one.files if k.startswith("w")]
    assert len(keys) == 4
    for k in keys:
        for r in range(1, N):
            np.testing.assert_array_equal(ranks[r][k], ranks[0][k], err_msg=f"rank {r} {k}")
        np.testing.assert_allclose(ranks[0][k], one[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # It learned: the loss fell from the first epoch to the last.
    assert ranks[0]["loss"][-1] < ranks[0]["loss"][0]
