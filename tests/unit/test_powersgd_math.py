"""PowerSGD's pure pieces: which tensors it compresses, its orthogonalization, and its rounds over
simulated ranks (the allreduce is an average handed to every rank as the same bytes, as the ring's is)."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.errors import InvalidArgumentError
from ringserve.powersgd import PowerSGD, Round, low_rank_product, orthogonalize, plan, should_compress

pytestmark = pytest.mark.timeout(120)

SHAPES = [(64, 32), (64,), (8, 3, 2, 2), (64, 32), (10, 64), (3,)]


def average(payloads: list[np.ndarray]) -> np.ndarray:
    return np.mean(np.stack(payloads), axis=0, dtype=np.float64).astype(np.float32)


def reduce_all(compressors: list[PowerSGD], inputs: list[np.ndarray], key: str = "b", exact: int = 0) -> list[np.ndarray]:
    """One round on every simulated rank; returns each rank's result."""
    rounds: list[Round] = [c.begin(key, x, SHAPES, exact=exact) for c, x in zip(compressors, inputs, strict=True)]
    first = average([r.first for r in rounds])
    seconds = [r.second(first.copy()) for r in rounds]
    second = None if seconds[0] is None else average([s for s in seconds if s is not None])
    return [r.finish(None if second is None else second.copy()) for r in rounds]


def gradients(rng: np.random.Generator, ranks: int, exact: int = 0) -> list[np.ndarray]:
    numel = sum(int(np.prod(s)) for s in SHAPES) + exact
    return [rng.standard_normal(numel).astype(np.float32) for _ in range(ranks)]


def test_a_matrix_is_compressed_only_when_its_factors_are_smaller_by_the_minimum_rate() -> None:
    assert should_compress(64, 32, 4, 2.0)  # (96 * 4) * 2 = 768 < 2048
    assert not should_compress(10, 10, 4, 2.0)  # 160 >= 100
    layout = plan(SHAPES, rank=4, min_compression_rate=2.0, exact=5)
    compressed = [(m.rows, m.cols) for m in layout.matrices]
    # Grouped by shape in order of first appearance, as torch's hook orders them; vectors whole;
    # the 8 x 12 conv kernel ((8 + 12) * 4 * 2 = 160 >= 96) whole.
    assert compressed == [(64, 32), (64, 32), (10, 64)]
    assert [m.start for m in layout.matrices] == [0, 64 * 32 + 64 + 96, 64 * 32 + 64 + 96 + 2048]
    assert layout.p_size == 4 * (64 + 64 + 10) and layout.q_size == 4 * (32 + 32 + 64)
    assert layout.uncompressed[-1] == (layout.numel - 5, layout.numel)
    assert layout.plain_size == 64 + 96 + 3 + 5


def test_orthogonalize_makes_orthonormal_columns_and_leaves_a_zero_column_zero() -> None:
    rng = np.random.default_rng(1)
    p = rng.standard_normal((300, 4)).astype(np.float32)
    orthogonalize(p)
    np.testing.assert_allclose(p.T @ p, np.eye(4), atol=1e-5)
    z = np.zeros((50, 2), dtype=np.float32)
    orthogonalize(z)
    assert not z.any()
    e = np.zeros((50, 2), dtype=np.float32)
    orthogonalize(e, epsilon=1e-8)
    assert np.isfinite(e).all()


def test_orthogonalize_and_the_product_give_the_same_bytes_for_the_same_input_in_any_memory_layout() -> None:
    rng = np.random.default_rng(2)
    p = rng.standard_normal((513, 3)).astype(np.float32)
    a, b = p.copy(), np.asfortranarray(p.copy())
    orthogonalize(a)
    orthogonalize(b)
    assert a.tobytes() == np.ascontiguousarray(b).tobytes()
    q = rng.standard_normal((77, 3)).astype(np.float32)
    out1, out2 = np.empty((513, 77), np.float32), np.empty((513, 77), np.float32)
    low_rank_product(a, q, out1)
    low_rank_product(np.asfortranarray(a), np.asfortranarray(q), out2)
    assert out1.tobytes() == out2.tobytes()
    np.testing.assert_allclose(out1, a @ q.T, rtol=1e-5, atol=1e-6)


def test_before_start_powersgd_iter_the_average_is_exact_and_nothing_is_fed_back() -> None:
    rng = np.random.default_rng(3)
    compressors = [PowerSGD(2, start_powerSGD_iter=2) for _ in range(3)]
    for _ in range(2):
        inputs = gradients(rng, 3)
        results = reduce_all(compressors, inputs)
        np.testing.assert_array_equal(results[0], average(inputs))
        assert all(c.error("b") is None for c in compressors)
    results = reduce_all(compressors, gradients(rng, 3))
    assert compressors[0].error("b") is not None


def test_error_feedback_keeps_the_sum_of_inputs_equal_to_the_results_plus_the_new_errors() -> None:
    """sum over ranks of (gradient + old error) == N x result + sum of new errors, every step."""
    rng = np.random.default_rng(4)
    ranks, exact = 4, 3
    compressors = [PowerSGD(2, start_powerSGD_iter=0, random_seed=7) for _ in range(ranks)]
    for _ in range(6):
        inputs = gradients(rng, ranks, exact)
        old = [c.error("b") for c in compressors]
        fed = [x + (0 if e is None else e) for x, e in zip(inputs, old, strict=True)]
        results = reduce_all(compressors, inputs, exact=exact)
        assert all(r.tobytes() == results[0].tobytes() for r in results)  # the same bytes on every rank
        new = [c.error("b") for c in compressors]
        assert all(e is not None for e in new)
        lhs = np.sum(np.stack(fed), axis=0, dtype=np.float64)
        rhs = ranks * results[0].astype(np.float64) + np.sum(np.stack(new), axis=0, dtype=np.float64)
        np.testing.assert_allclose(lhs, rhs, rtol=0, atol=2e-5 * np.abs(lhs).max())
        # The exact tail (flags) is averaged exactly and feeds nothing back.
        np.testing.assert_array_equal(results[0][-exact:], average(inputs)[-exact:])
        assert all(not e[-exact:].any() for e in new if e is not None)


def test_a_gradient_of_rank_r_the_same_on_every_rank_comes_back_as_it_was() -> None:
    rng = np.random.default_rng(5)
    compressors = [PowerSGD(2, start_powerSGD_iter=0) for _ in range(2)]
    numel = sum(int(np.prod(s)) for s in SHAPES)
    flat = np.zeros(numel, dtype=np.float32)
    layout = compressors[0].plan(SHAPES)
    for m in layout.matrices:
        low_rank = rng.standard_normal((m.rows, 2)) @ rng.standard_normal((2, m.cols))
        flat[m.start : m.start + m.rows * m.cols] = low_rank.astype(np.float32).reshape(-1)
    for a, b in layout.uncompressed:
        flat[a:b] = rng.standard_normal(b - a)
    results = reduce_all(compressors, [flat, flat.copy()])
    np.testing.assert_allclose(results[0], flat, rtol=1e-4, atol=1e-4)


def test_warm_start_keeps_q_and_without_it_each_call_draws_a_fresh_one() -> None:
    rng = np.random.default_rng(6)
    warm = [PowerSGD(1, start_powerSGD_iter=0)]
    cold = [PowerSGD(1, start_powerSGD_iter=0, warm_start=False)]
    inputs = gradients(rng, 1)
    reduce_all(warm, inputs)
    reduce_all(cold, inputs)
    assert warm[0]._states["b"].q is not None and cold[0]._states["b"].q is None


def test_bad_knobs_and_a_bucket_given_other_shapes_fail_naming_the_value() -> None:
    with pytest.raises(InvalidArgumentError, match=r"matrix_approximation_rank \(0\)"):
        PowerSGD(0)
    with pytest.raises(InvalidArgumentError, match=r"min_compression_rate \(0\)"):
        PowerSGD(1, min_compression_rate=0)
    c = PowerSGD(1, start_powerSGD_iter=0)
    c.begin("k", np.zeros(6, np.float32), [(2, 3)])
    with pytest.raises(InvalidArgumentError, match="'k' was reduced with shapes"):
        c.begin("k", np.zeros(6, np.float32), [(3, 2)])
    with pytest.raises(InvalidArgumentError, match="needs 6 of them, not 5 of float32"):
        PowerSGD(1).begin("j", np.zeros(5, np.float32), [(2, 3)])
