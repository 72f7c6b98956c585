"""detsum.kernels.numba.rounding against torch's own CPU conversions, bit for bit.

torch's CPU ``.to(torch.bfloat16)`` / ``.to(torch.float16)`` round to nearest even, which is
what the contract calls RN. Upcasts are checked on all 65536 patterns; downcasts on millions of
random fp32 patterns plus every tie (the exact midpoint between two neighbouring 16-bit
values) and its two fp32 neighbours, carries, subnormal boundaries, max finite, +-inf, NaN.
NaN payloads differ between torch paths, so NaNs are compared by position only.
"""

import numpy as np
import pytest
import torch
from numba import njit

from detsum.kernels.numba import rounding
from detsum.kernels.numba.rounding import (
    bf16_bits_to_f32,
    f16_bits_to_f32,
    f32_to_bf16_bits,
    f32_to_f16_bits,
    round_f32_to_bf16,
    round_f32_to_f16,
)

FORMATS = {
    torch.bfloat16: (bf16_bits_to_f32, f32_to_bf16_bits, round_f32_to_bf16),
    torch.float16: (f16_bits_to_f32, f32_to_f16_bits, round_f32_to_f16),
}


# Array drivers for the scalar helpers (the kernels call them the same way, inside loops).
@njit
def _map_up(f, bits):
    out = np.empty(bits.size, np.float32)
    for i in range(bits.size):
        out[i] = f(bits[i])
    return out


@njit
def _map_down(f, x):
    out = np.empty(x.size, np.uint16)
    for i in range(x.size):
        out[i] = f(x[i])
    return out


@njit
def _map_round(f, x):
    out = np.empty(x.size, np.float32)
    for i in range(x.size):
        out[i] = f(x[i])
    return out


ALL16 = np.arange(1 << 16, dtype=np.uint16)


def _torch_from_bits(bits, dtype):
    return torch.from_numpy(bits.view(np.int16).copy()).view(dtype)


def _bits_of(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def _assert_same_f32(ours, ref):
    """fp32 arrays equal bit for bit, NaNs by position."""
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    bad = np.nonzero(ours.view(np.uint32)[~nan] != ref.view(np.uint32)[~nan])[0]
    assert bad.size == 0, (
        f"{bad.size} mismatches, e.g. {ours[~nan][bad[:5]]} vs {ref[~nan][bad[:5]]}"
    )


def _assert_same_16(ours_bits, ref_bits, dtype, x):
    ref_nan = _torch_from_bits(ref_bits, dtype).isnan().numpy()
    ours_nan = _torch_from_bits(ours_bits, dtype).isnan().numpy()
    np.testing.assert_array_equal(ours_nan, ref_nan)
    bad = np.nonzero(ours_bits[~ref_nan] != ref_bits[~ref_nan])[0]
    assert bad.size == 0, (
        f"{bad.size} mismatches, e.g. x={x[~ref_nan][bad[:5]]} "
        f"ours={ours_bits[~ref_nan][bad[:5]]} torch={ref_bits[~ref_nan][bad[:5]]}"
    )


def _special_f32(dtype):
    """Ties, their neighbours, carries, boundaries and non-finite values for ``dtype``."""
    vals = _torch_from_bits(ALL16, dtype).to(torch.float64).numpy()
    finite = np.sort(np.unique(vals[np.isfinite(vals)]))
    # Exact midpoints between neighbouring values (representable in fp32: 16-bit formats
    # have at most 11 significant bits), and the fp32 numbers on either side of each.
    mid = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (finite[:-1] + finite[1:]) / 2)
    inf = np.float32(np.inf)
    near = np.concatenate([mid, np.nextafter(mid, inf), np.nextafter(mid, -inf)])
    max16 = np.float32(finite[-1])
    edges = np.array(
        [
            0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan,
            np.finfo(np.float32).max, -np.finfo(np.float32).max,
            np.finfo(np.float32).tiny, np.finfo(np.float32).smallest_subnormal,
            max16, -max16,
            65504.0, 65519.0, 65519.996, 65520.0, 65520.004, 65536.0,  # fp16 overflow
            2.0**-14, 2.0**-15, 2.0**-24, 2.0**-25, 2.0**-26, 3 * 2.0**-26,  # fp16 subnormals
            2.0**-126, 2.0**-133, 2.0**-134, 2.0**-135,  # bf16 subnormals
        ],
        dtype=np.float32,
    )
    # NaNs with assorted payloads, both signs; every mantissa-all-ones carry pattern.
    nans = np.array(
        [0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00000, 0x7F80FFFF, 0x7FBF8000],
        dtype=np.uint32,
    ).view(np.float32)
    carries = (np.arange(256, dtype=np.uint32) << 23 | 0x7FFFFF).view(np.float32)
    out = np.concatenate([near, edges, nans, carries])
    return np.concatenate([out, -out])


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_upcast_all_patterns(dtype):
    up, _, _ = FORMATS[dtype]
    ours = _map_up(up, ALL16)
    ref = _torch_from_bits(ALL16, dtype).to(torch.float32).numpy()
    _assert_same_f32(ours, ref)


@njit
def _f16_bits_to_f32_integer(h):
    return rounding._f16_to_f32_integer(np.uint16(h))


def test_upcast_fp16_without_f16c():
    """The integer fp16 decode, used where the CPU lacks F16C, is checked here too."""
    ref = _torch_from_bits(ALL16, torch.float16).to(torch.float32).numpy()
    _assert_same_f32(_map_up(_f16_bits_to_f32_integer, ALL16), ref)


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_conversions_ignore_flush_denormal(dtype):
    """Subnormals convert the same with flush-to-zero and denormals-are-zero switched on."""
    up, down, rnd = FORMATS[dtype]
    ref_up = _torch_from_bits(ALL16, dtype).to(torch.float32).numpy()
    x = _special_f32(dtype)
    ref_t = torch.from_numpy(x).to(dtype)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        ours_up = _map_up(up, ALL16)
        ours_down = _map_down(down, x)
        ours_round = _map_round(rnd, x)
    finally:
        torch.set_flush_denormal(False)
    _assert_same_f32(ours_up, ref_up)
    _assert_same_16(ours_down, _bits_of(ref_t), dtype, x)
    _assert_same_f32(ours_round, ref_t.to(torch.float32).numpy())


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
@pytest.mark.parametrize("which", ["random", "special"])
def test_downcast(dtype, which):
    _, down, rnd = FORMATS[dtype]
    if which == "random":
        # Uniform bit patterns: every exponent, sign and NaN payload, 4 million of them.
        rng = np.random.default_rng(20240607)
        x = rng.integers(0, 1 << 32, size=4_000_000, dtype=np.uint64).astype(np.uint32)
        x = x.view(np.float32)
    else:
        x = _special_f32(dtype)
    ref_t = torch.from_numpy(x).to(dtype)
    _assert_same_16(_map_down(down, x), _bits_of(ref_t), dtype, x)
    # The fp32 -> fp32 rounding helper is the same rounding.
    _assert_same_f32(_map_round(rnd, x), ref_t.to(torch.float32).numpy())


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_roundtrip_is_identity(dtype):
    """Every non-NaN 16-bit pattern survives up then down unchanged (signed zeros too)."""
    up, down, _ = FORMATS[dtype]
    back = _map_down(down, _map_up(up, ALL16))
    keep = ~_torch_from_bits(ALL16, dtype).isnan().numpy()
    np.testing.assert_array_equal(back[keep], ALL16[keep])
    assert _torch_from_bits(back[~keep], dtype).isnan().all()


def test_nan_patterns():
    """bf16 NaN is 0x7FC0 (as torch's scalar conversion); fp16 NaN keeps its sign."""
    nan = np.array([np.nan, -np.nan], dtype=np.float32)
    assert list(_map_down(f32_to_bf16_bits, nan)) == [0x7FC0, 0x7FC0]
    assert list(_map_down(f32_to_f16_bits, nan)) == [0x7E00, 0xFE00]
