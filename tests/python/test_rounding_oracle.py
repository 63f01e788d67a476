"""DS4's scalar rounding primitives (src/core/rounding.c) against independent casts.

The round_tool test tool applies ds4_round_fp8_e4m3 / ds4_round_fp4_e2m1 /
ds4_round_f16 to a file of float32 values; the oracles are ml_dtypes'
float8_e4m3fn and float4_e2m1fn casts and numpy's float16 cast (all round to
nearest, ties to even). Within the formats' range (|x| <= 448 for E4M3FN,
|x| <= 6 for E2M1) the results must agree bit for bit, signed zeros included:
every code, every midpoint between neighbouring codes (and the floats just
either side of it), subnormals, and many random values.

Beyond the range the conventions differ, by design:
  - E4M3FN has no infinity. ml_dtypes rounds (448, 464] to 448 (464 is the
    tie between 448 and the NaN code's 480; 448 is the even code) and gives
    NaN from the next float above 464 on, and for +-inf. DS4 clamps to +-448
    before rounding (the KV round trip scales blocks so that |x| <= 448 anyway),
    so ours gives +-448 for every |x| > 448, inf included.
  - E2M1 has neither infinity nor NaN. ml_dtypes saturates to +-6 (inf
    included) like we do, but casts NaN to -0; ours keeps NaN.
  - NaN input to the FP8 cast: ml_dtypes NaN, ours NaN (ds4.c itself would
    give 448; see rounding.c).
test_beyond_range checks both sides of each of these statements.
"""
import ml_dtypes
import numpy as np
import pytest

from conftest import TOOLS, run

ROUND_TOOL = TOOLS / "round_tool"


def ours(tmp_path, mode, values):
    if not ROUND_TOOL.exists():
        pytest.fail(f"{ROUND_TOOL} is missing: run `make test-python` (it builds the test tools)")
    values = np.ascontiguousarray(values, dtype=np.float32)
    src, dst = tmp_path / f"{mode}.in", tmp_path / f"{mode}.out"
    values.tofile(src)
    r = run([ROUND_TOOL, mode, src, dst])
    assert r.returncode == 0, r.stderr.decode()
    out = np.fromfile(dst, dtype=np.float32)
    assert out.shape == values.shape
    return out


def oracle(mode, values):
    values = np.asarray(values, dtype=np.float32)
    dtype = {"fp8": ml_dtypes.float8_e4m3fn, "fp4": ml_dtypes.float4_e2m1fn, "f16": np.float16}[mode]
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(dtype).astype(np.float32)


def assert_bits_equal(values, got, want):
    bad = got.view(np.uint32) != want.view(np.uint32)
    if bad.any():
        i = np.flatnonzero(bad)[:10]
        pytest.fail(f"{bad.sum()} mismatches, e.g. x={values[i]} ours={got[i]} oracle={want[i]}")


def finite_codes(dtype):
    """Every finite value of a small float format, decoded by ml_dtypes, sorted, positive only."""
    bits = np.arange(256 if dtype == ml_dtypes.float8_e4m3fn else 16, dtype=np.uint8)
    vals = bits.view(dtype).astype(np.float32)
    vals = vals[np.isfinite(vals) & (vals >= 0)]
    return np.unique(vals)


def probe_values(dtype, top, rng):
    """Codes, midpoints and their neighbours, subnormal-range values and random values in [-top, top]."""
    codes = finite_codes(dtype)
    assert codes[-1] == top
    mids = (codes[:-1] + codes[1:]) / 2  # exact in float32: the formats have <= 4 significant bits
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    tiny = np.float32(codes[1]) * rng.uniform(0, 2, 20000).astype(np.float32)
    logu = np.exp(rng.uniform(np.log(codes[1]) - 4, np.log(top), 200000)).astype(np.float32)
    uni = rng.uniform(0, top, 200000).astype(np.float32)
    # random float32 bit patterns that land inside the range
    raw = rng.integers(0, 2**32, 400000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    raw = np.abs(raw[np.isfinite(raw)])
    raw = raw[raw <= top]
    pos = np.concatenate([codes, mids, near, tiny, logu, uni, raw, [0.0]]).astype(np.float32)
    pos = pos[pos <= top]
    return np.concatenate([pos, -pos]).astype(np.float32)


@pytest.mark.parametrize("mode,dtype,top", [("fp8", ml_dtypes.float8_e4m3fn, 448.0),
                                            ("fp4", ml_dtypes.float4_e2m1fn, 6.0)])
def test_in_range_bit_exact(tmp_path, mode, dtype, top):
    rng = np.random.default_rng(7 if mode == "fp8" else 8)
    values = probe_values(dtype, top, rng)
    assert_bits_equal(values, ours(tmp_path, mode, values), oracle(mode, values))


def test_midpoints_tie_to_even(tmp_path):
    """The midpoint cases on their own, with the expected even neighbour spelled out."""
    for mode, dtype in [("fp8", ml_dtypes.float8_e4m3fn), ("fp4", ml_dtypes.float4_e2m1fn)]:
        codes = finite_codes(dtype)  # index i = code i for these formats' positive half
        mids = ((codes[:-1] + codes[1:]) / 2).astype(np.float32)
        even = np.where(np.arange(len(mids)) % 2 == 0, codes[:-1], codes[1:]).astype(np.float32)
        got = ours(tmp_path, mode, mids)
        np.testing.assert_array_equal(got, even)
        np.testing.assert_array_equal(oracle(mode, mids), even)


def test_f16_bit_exact(tmp_path):
    rng = np.random.default_rng(9)
    raw = rng.integers(0, 2**32, 500000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    h = halves[np.isfinite(halves)]
    mids = ((h[:-1].astype(np.float64) + h[1:]) / 2).astype(np.float32)  # f16 midpoints are exact in f32
    near = np.concatenate([np.nextafter(mids, np.float32(-np.inf)), np.nextafter(mids, np.float32(np.inf))])
    special = np.array([65504, 65519.99, 65520, 1e10, np.inf, -np.inf, np.nan, 2.0**-24, 2.0**-25, 2.0**-26,
                        -0.0, 0.0], dtype=np.float32)
    values = np.concatenate([raw, h, mids, near, special, rng.standard_normal(100000).astype(np.float32)])
    values = values[~np.isnan(values)]  # NaN payloads: see test_nan below
    assert_bits_equal(values, ours(tmp_path, "f16", values), oracle("f16", values))


def test_nan(tmp_path):
    nan = np.array([np.nan, -np.nan], dtype=np.float32)
    for mode in ["fp8", "fp4", "f16"]:
        assert np.isnan(ours(tmp_path, mode, nan)).all()
    assert np.isnan(oracle("fp8", nan)).all() and np.isnan(oracle("f16", nan)).all()


def test_beyond_range(tmp_path):
    """Documents (and pins) how the two sides treat values beyond the formats' maxima."""
    big8 = np.array([448.01, 450, 463.99, 464, np.nextafter(np.float32(464), np.float32(np.inf)), 480, 1e6,
                     3e38, np.inf], dtype=np.float32)
    big8 = np.concatenate([big8, -big8])
    got = ours(tmp_path, "fp8", big8)
    np.testing.assert_array_equal(got, np.copysign(448.0, big8).astype(np.float32))
    ml = oracle("fp8", big8)
    upto_tie = np.abs(big8) <= 464
    np.testing.assert_array_equal(ml[upto_tie], got[upto_tie])  # (448, 464] rounds to 448 on both sides
    assert np.isnan(ml[~upto_tie]).all()  # ml_dtypes overflows to NaN, we saturate

    big4 = np.array([6.01, 7, 8, 1e30, np.inf], dtype=np.float32)
    big4 = np.concatenate([big4, -big4])
    np.testing.assert_array_equal(ours(tmp_path, "fp4", big4), np.copysign(6.0, big4).astype(np.float32))
    np.testing.assert_array_equal(oracle("fp4", big4), np.copysign(6.0, big4).astype(np.float32))
    # E2M1 has no NaN: ml_dtypes casts NaN to a zero, we keep NaN
    assert oracle("fp4", np.array([np.nan], dtype=np.float32))[0] == 0.0
