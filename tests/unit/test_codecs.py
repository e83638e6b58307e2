"""The wire codecs: sizes, the error bounds stated in ringserve/codecs.py, and non-finite values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ringserve.codecs import CODECS, INT8_BLOCK, codec
from ringserve.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

LOSSY = [c for c in CODECS.values() if c is not None]

finite32 = hnp.arrays(
    np.float32,
    st.integers(0, 3 * INT8_BLOCK + 7),
    elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
)


def roundtrip(name: str, x: np.ndarray) -> np.ndarray:
    c = codec(name)
    assert c is not None
    data = c.encode(x)
    assert data.dtype == np.uint8 and data.size == c.encoded_bytes(x.size)
    out = c.decode(data.tobytes(), x.size)
    assert out.dtype == np.float32 and out.shape == (x.size,)
    return out


@settings(max_examples=300, deadline=None)
@given(finite32)
def test_fp16_error_is_within_2_to_the_minus_11_relative_in_its_normal_range(x: np.ndarray) -> None:
    x = x[np.abs(x) <= 65504]
    err = np.abs(roundtrip("fp16", x).astype(np.float64) - x)
    normal = np.abs(x) >= 2.0**-14
    assert np.all(err[normal] <= 2.0**-11 * np.abs(x[normal]))
    assert np.all(err[~normal] <= 2.0**-25)


def test_fp16_overflows_to_inf_past_its_largest_value() -> None:
    out = roundtrip("fp16", np.array([65504, 65519, 65520, -1e6], dtype=np.float32))
    assert out.tolist() == [65504, 65504, np.inf, -np.inf]


@settings(max_examples=300, deadline=None)
@given(finite32)
def test_bf16_error_is_within_2_to_the_minus_8_relative(x: np.ndarray) -> None:
    out = roundtrip("bf16", x).astype(np.float64)
    finite = np.isfinite(out)
    assert np.all(np.abs(out[finite] - x[finite]) <= 2.0**-8 * np.abs(x[finite]) + 2.0**-133)
    # Only values within half a bf16 step of float32's largest become inf.
    assert np.all(np.abs(x[~finite]) > 3.38e38)


def test_bf16_rounds_to_nearest_even_and_keeps_nan_inf_and_sign() -> None:
    one_and_half_step = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8)], dtype=np.float32)
    assert roundtrip("bf16", one_and_half_step).tolist() == [1.0, 1 + 2 * 2.0**-7, -1.0]
    special = roundtrip("bf16", np.array([np.nan, np.inf, -np.inf, -0.0], dtype=np.float32))
    assert np.isnan(special[0]) and special[1] == np.inf and special[2] == -np.inf
    assert np.signbit(special[3])
    # A NaN whose payload sits in the low bits must not round into inf.
    quiet_low = np.array([0x7F800001, 0xFFFFFFFF], dtype=np.uint32).view(np.float32)
    assert np.isnan(roundtrip("bf16", quiet_low)).all()


@settings(max_examples=300, deadline=None)
@given(finite32)
def test_int8_error_is_within_a_254th_of_each_blocks_largest_magnitude(x: np.ndarray) -> None:
    x = x[np.abs(x) < 2.0**127]
    out = roundtrip("int8", x).astype(np.float64)
    for start in range(0, x.size, INT8_BLOCK):
        block = x[start : start + INT8_BLOCK].astype(np.float64)
        peak = np.abs(block).max()
        err = np.abs(out[start : start + INT8_BLOCK] - block)
        assert np.all(err <= peak * (1 / 254 + 2.0**-22) + 2.0**-142), (start, err.max(), peak)


def test_int8_error_bound_holds_halfway_between_two_steps() -> None:
    # 60 is 63.5 steps of 120/127: the float32 roundings of the scale and of 64 * scale put the error
    # just past half a step (found by hypothesis: 0.4724426 against 120/254 = 0.4724409).
    x = np.array([60.0, 120.0], dtype=np.float32)
    err = np.abs(roundtrip("int8", x).astype(np.float64) - x)
    assert err[0] > 120 / 254 and np.all(err <= 120 * (1 / 254 + 2.0**-22))


def test_int8_is_exact_on_block_peaks_and_zero_blocks_and_costs_about_a_byte_per_value() -> None:
    x = np.zeros(2 * INT8_BLOCK + 3, dtype=np.float32)
    x[INT8_BLOCK] = -5.0
    x[-1] = 2.5
    assert np.array_equal(roundtrip("int8", x), x)
    c = codec("int8")
    assert c is not None and c.encoded_bytes(10**6) == 10**6 + 4 * -(-(10**6) // INT8_BLOCK)


def test_int8_block_with_a_non_finite_value_decodes_as_nan_and_leaves_other_blocks_alone() -> None:
    x = np.ones(3 * INT8_BLOCK, dtype=np.float32)
    x[INT8_BLOCK + 7] = np.inf
    x[2 * INT8_BLOCK] = np.nan
    with np.errstate(invalid="raise", over="raise"):
        out = roundtrip("int8", x)
    assert np.array_equal(out[:INT8_BLOCK], x[:INT8_BLOCK])
    assert np.isnan(out[INT8_BLOCK:]).all()


@pytest.mark.parametrize("c", LOSSY, ids=lambda c: c.name)
def test_float64_input_is_accepted_and_empty_input_roundtrips(c) -> None:
    x = np.linspace(-3, 3, 1000)
    out = c.decode(c.encode(x), x.size)
    assert out.dtype == np.float32 and np.allclose(out, x, atol=0.03)
    assert c.decode(c.encode(np.zeros(0, np.float32)), 0).size == 0


def test_unknown_codec_is_rejected_by_name() -> None:
    assert codec(None) is None and codec("none") is None
    with pytest.raises(InvalidArgumentError, match=r"'int4' is not supported; use one of none, fp16, bf16, int8"):
        codec("int4")
