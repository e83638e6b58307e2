"""Wire compression, error feedback and the non-finite check, on real workers over loopback.

The bounds are the ones ringserve/codecs.py states: an allreduce over N ranks encodes each element
N times (N - 1 partial sums and the result), and no partial sum is larger than the sum of the
magnitudes of the inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import numpy_reduce
from worlds import start_world

from ringserve.codecs import INT8_BLOCK
from ringserve.errors import InvalidArgumentError, MismatchError, NonFiniteError

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

SIZES = [1, 2, 3, 4]
UNIT = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def inputs(n: int, count: int, seed: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(count) * rng.uniform(0.1, 10)).astype(dtype) for _ in range(n)]


def error_bound(codec: str, xs: list[np.ndarray], op: str) -> np.ndarray:
    """Per element: N encodings, each of a value no larger than the sum of the magnitudes."""
    n = len(xs)
    magnitude = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    if codec == "int8":
        # The largest magnitude in any block bounds every partial sum's block peak.
        peak = sum(np.abs(x.astype(np.float64)).max(initial=0) for x in xs)
        bound = np.full(magnitude.shape, n * peak / 254)
    else:
        bound = n * UNIT[codec] * magnitude
    bound += 1e-6 * magnitude  # float32 accumulation
    return bound / n if op == "average" else bound


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("n", SIZES)
async def test_compressed_allreduce_is_bit_identical_on_every_rank_and_within_the_codecs_bound(
    shared_worlds, n: int, codec: str
) -> None:
    world = await shared_worlds(n)
    for op in ("sum", "average"):
        for count in (0, 1, n + 1, 37, 3 * INT8_BLOCK + 5):
            xs = inputs(n, count, seed=count * 31 + n)
            outs = await world.map("allreduce", xs, op=op, name=f"{codec}/{op}/{count}", compression=codec)
            exact = numpy_reduce([x.astype(np.float64) for x in xs], op)
            for r, out in enumerate(outs):
                assert out.dtype == np.float32 and out.shape == (count,)
                assert out.tobytes() == outs[0].tobytes(), f"rank {r} differs from rank 0"
            err = np.abs(outs[0] - exact)
            assert np.all(err <= error_bound(codec, xs, op)), (op, count, err.max())


async def test_compression_cuts_the_bytes_on_the_wire() -> None:
    world = await start_world(2)
    x = np.ones(1 << 18, dtype=np.float32)  # 1 MiB
    sent = {}
    try:
        # The first collective of a view measures the links (ops/calibration.py): not counted here.
        await world.map("allreduce", [x[:1], x[:1]], name="bytes/warm-up")
        for codec in ("none", "fp16", "int8"):
            before = world.workers[0].counters.bytes_sent
            await world.map("allreduce", [x, x], name=f"bytes/{codec}", compression=codec)
            sent[codec] = world.workers[0].counters.bytes_sent - before
    finally:
        await world.close()
    assert 0.49 < sent["fp16"] / sent["none"] < 0.51
    assert 0.25 < sent["int8"] / sent["none"] < 0.26


@pytest.mark.parametrize("n", [2, 3])
async def test_error_feedback_loses_nothing_each_call_and_the_mean_converges(shared_worlds, n: int) -> None:
    """sum(input + residual before) == N * average + sum(residual after), for every call; so the
    running mean of the results approaches the exact average, which it does not without feedback."""
    world = await shared_worlds(n)
    xs = inputs(n, 300, seed=7)
    exact = numpy_reduce([x.astype(np.float64) for x in xs], "average")
    residuals = [np.zeros(300, dtype=np.float32) for _ in range(n)]
    with_feedback, without = [], []
    for k in range(40):
        before = [r.copy() for r in residuals]
        outs = await world.each(lambda w, k=k: w.allreduce(xs[w.rank], op="average", name=f"ef/{n}/{k}",
                                                           compression="int8", residual=residuals[w.rank]))
        assert all(o.tobytes() == outs[0].tobytes() for o in outs)
        went_in = np.sum([x.astype(np.float64) + b for x, b in zip(xs, before, strict=True)], axis=0)
        came_out = n * outs[0].astype(np.float64) + np.sum(residuals, axis=0, dtype=np.float64)
        assert np.allclose(went_in, came_out, rtol=0, atol=1e-4 * np.abs(went_in).max())
        with_feedback.append(outs[0])
        without.append((await world.map("allreduce", xs, op="average", name=f"plain/{n}/{k}", compression="int8"))[0])
    drift = np.abs(np.mean(with_feedback, axis=0) - exact).max()
    bias = np.abs(np.mean(without, axis=0) - exact).max()
    assert drift < bias / 5, (drift, bias)


async def test_a_non_finite_value_on_one_rank_raises_on_every_rank_with_and_without_compression(shared_worlds) -> None:
    world = await shared_worlds(3)
    for codec, bad in (("none", np.nan), ("int8", np.inf), ("fp16", 1e6)):
        xs = inputs(3, 50, seed=3)
        xs[1][17] = bad
        outcomes = await world.each_outcome(lambda w, xs=xs, codec=codec: w.allreduce(
            xs[w.rank], name=f"nonfinite/{codec}", compression=codec, check_finite=True))
        for r, outcome in enumerate(outcomes):
            assert isinstance(outcome, NonFiniteError), (codec, r, outcome)
            assert "holds NaN or Inf" in str(outcome)
    ok = await world.map("allreduce", inputs(3, 50, seed=4), name="finite", check_finite=True)
    assert all(np.isfinite(o).all() for o in ok)


async def test_ranks_that_disagree_on_compression_fail_with_a_mismatch_naming_the_codecs(shared_worlds) -> None:
    world = await shared_worlds(2)
    xs = inputs(2, 10, seed=5)
    outcomes = await world.each_outcome(lambda w: w.allreduce(xs[w.rank], name="codec-mismatch",
                                                              compression="int8" if w.rank else None))
    for outcome in outcomes:
        assert isinstance(outcome, MismatchError)
        assert "codec=int8" in str(outcome) and "rank 0: allreduce float32 (10,) op=average" in str(outcome)
        assert "rank 0: allreduce float32 (10,) op=average codec" not in str(outcome)


async def test_float16_and_float64_inputs_are_compressed_and_returned_in_their_dtype(shared_worlds) -> None:
    world = await shared_worlds(2)
    for dtype in (np.float16, np.float64):
        xs = inputs(2, 600, seed=6, dtype=dtype)
        outs = await world.map("allreduce", xs, op="sum", name=f"dtype/{np.dtype(dtype)}", compression="int8")
        assert outs[0].dtype == dtype and outs[0].tobytes() == outs[1].tobytes()
        assert np.allclose(outs[0], numpy_reduce([x.astype(np.float64) for x in xs], "sum"), atol=0.2)


async def test_compression_and_feedback_arguments_are_checked(shared_worlds) -> None:
    world = await shared_worlds(1)
    w = world.workers[0]
    with pytest.raises(InvalidArgumentError, match=r"needs a floating point array, not int32"):
        await w.allreduce(np.arange(4, dtype=np.int32), compression="fp16")
    with pytest.raises(InvalidArgumentError, match=r"'zstd' is not supported"):
        await w.allreduce(np.ones(4, np.float32), compression="zstd")
    with pytest.raises(InvalidArgumentError, match=r"residual must be a writeable C-contiguous float32 array of 4"):
        await w.allreduce(np.ones(4, np.float32), compression="int8", residual=np.zeros(3, np.float32))
    with pytest.raises(InvalidArgumentError, match=r"works with op sum or average, not 'max'"):
        await w.allreduce(np.ones(4, np.float32), op="max", compression="int8", residual=np.zeros(4, np.float32))
    with pytest.raises(InvalidArgumentError, match=r"needs a lossy compression"):
        await w.allreduce(np.ones(4, np.float32), residual=np.zeros(4, np.float32))


async def test_compressed_reduce_scatter_and_min_max(shared_worlds) -> None:
    world = await shared_worlds(3)
    xs = inputs(3, 9 * 4, seed=8)
    rows = [x.reshape(9, 4) for x in xs]
    parts = await world.map("reduce_scatter", rows, op="sum", name="rs/fp16", compression="fp16")
    exact = numpy_reduce([r.astype(np.float64) for r in rows], "sum")
    assert np.allclose(np.concatenate(parts), exact, rtol=3 * 2.0**-11 * 3, atol=1e-3)
    for op in ("min", "max"):
        outs = await world.map("allreduce", xs, op=op, name=f"{op}/bf16", compression="bf16")
        assert outs[0].tobytes() == outs[2].tobytes()
        assert np.allclose(outs[0], numpy_reduce(xs, op), rtol=2.0**-7)


async def test_a_non_finite_result_clears_the_error_feedback_residual_so_later_calls_recover(shared_worlds) -> None:
    world = await shared_worlds(2)
    residuals = [np.full(40, 0.01, dtype=np.float32) for _ in range(2)]
    xs = inputs(2, 40, seed=9)
    bad = [x.copy() for x in xs]
    bad[0][3] = np.inf
    for label, data in (("inf", bad), ("ok", xs)):
        outs = await world.each(lambda w, data=data, label=label: w.allreduce(
            data[w.rank], op="sum", name=f"residual/{label}", compression="fp16", residual=residuals[w.rank]))
        if label == "inf":
            assert not np.isfinite(outs[0]).all()
            assert all(not r.any() for r in residuals)
        else:
            assert np.isfinite(outs[0]).all() and all(np.isfinite(r).all() for r in residuals)
