"""The layout cuts a model into pieces so that each of S shards holds about 1/S of its bytes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ringserve.errors import InvalidArgumentError
from ringserve.ps.layout import TensorSpec, partition, specs_of

MODELS = {
    "mlp": [TensorSpec("w1", (784, 2048), "float32"), TensorSpec("b1", (2048,), "float32"),
            TensorSpec("w2", (2048, 2048), "float32"), TensorSpec("b2", (2048,), "float32"),
            TensorSpec("w3", (2048, 10), "float32"), TensorSpec("b3", (10,), "float32")],
    "mixed": [TensorSpec("a", (3,), "float16"), TensorSpec("b", (17, 5), "float64"), TensorSpec("c", (1,), "float32"),
              TensorSpec("d", (0, 4), "float32"), TensorSpec("e", (1001,), "float16")],
    "tiny": [TensorSpec("x", (1,), "float32"), TensorSpec("y", (2,), "float64")],
    "many": [TensorSpec(f"t{i}", (i + 1,), "float32") for i in range(40)],
}


@pytest.mark.parametrize(("name", "shards"), list(itertools.product(MODELS, [1, 2, 3, 4, 7])))
def test_every_element_of_every_tensor_is_held_by_exactly_one_piece(name: str, shards: int) -> None:
    layout = partition(MODELS[name], shards)
    assert len(layout.shards) == shards
    for spec in MODELS[name]:
        covered = np.zeros(spec.count, dtype=np.int64)
        for _, piece in layout.pieces_of(spec.key):
            covered[piece.start : piece.stop] += 1
        assert (covered == 1).all(), spec


@pytest.mark.parametrize(("name", "shards"), list(itertools.product(MODELS, [1, 2, 3, 4, 7])))
def test_each_shard_holds_a_share_of_the_bytes_to_within_one_element(name: str, shards: int) -> None:
    layout = partition(MODELS[name], shards)
    total = sum(s.nbytes for s in MODELS[name])
    widest = max(s.itemsize for s in MODELS[name])
    for held in layout.shard_bytes():
        assert abs(held - total / shards) <= widest, (layout.shard_bytes(), total / shards)


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_a_model_cut_into_s_shards_has_at_most_one_extra_piece_per_boundary(shards: int) -> None:
    layout = partition(MODELS["mlp"], shards)
    assert sum(len(p) for p in layout.shards) <= len(MODELS["mlp"]) + shards - 1


def test_two_workers_with_the_same_tensors_compute_the_same_layout() -> None:
    rng = np.random.default_rng(0)
    a = specs_of([("w", rng.standard_normal((5, 4)).astype(np.float32)), ("b", np.zeros(4, np.float32))])
    b = specs_of([("w", np.ones((5, 4), np.float32)), ("b", np.ones(4, np.float32))])
    assert partition(a, 3) == partition(b, 3)


@pytest.mark.parametrize(("specs", "named"), [
    ([TensorSpec("w", (2,), "int64")], "int64"),
    ([TensorSpec("w", (2,), "float32"), TensorSpec("w", (3,), "float32")], "'w' is given twice"),
    ([TensorSpec("", (2,), "float32")], "non-empty key"),
    ([TensorSpec("w", (-1,), "float32")], "negative dimension"),
])
def test_a_bad_tensor_is_refused_with_a_sentence_naming_it(specs: list[TensorSpec], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        partition(specs, 2)


def test_zero_shards_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"\(0\) must be at least 1"):
        partition(MODELS["tiny"], 0)
