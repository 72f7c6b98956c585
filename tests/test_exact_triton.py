"""The EXACT rule on the Triton backend: the exact sum (or mean) rounded once, bit for bit.

Each test launches the Triton kernel (in the interpreter without a GPU: conftest sets
TRITON_INTERPRET=1) and the Numba one on the same arguments, into NaN-poisoned outputs, and
holds both to the oracle, ``reference.exact_sum_rounded`` and, for means,
``reference.round_exact`` of the exact quotient: the two backends agree to the bit.

In the interpreter the sweep over dtype, reduction, use of the base row and layout runs a
covering of them (tests/covering.py): every pair of their values meets, not every
combination; on a GPU every combination.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch

from conftest import (DTYPES, HAS_CUDA, assert_same_bits, dtype_id, fp64_midpoint_means,
                      midpoint_means, pair_quotient_cases, seed_of, strided_copy)
from covering import pairwise
from detsum import kernels, reference
from detsum.kernels.numba import segment as numba_segment

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

if HAS_TRITON:
    from detsum.kernels.triton.exact import _pair_quotient

    @triton.jit
    def _pair_quotient_kernel(hi_ptr, lo_ptr, count_ptr, value_ptr, decided_ptr, cases,
                              BLOCK: tl.constexpr):
        """``_pair_quotient`` of each case, as the exact kernel calls it."""
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = at < cases
        value, decided = _pair_quotient(tl.load(hi_ptr + at, mask=mask, other=1.0),
                                        tl.load(lo_ptr + at, mask=mask, other=0.0),
                                        tl.load(count_ptr + at, mask=mask, other=1))
        tl.store(value_ptr + at, value, mask=mask)
        tl.store(decided_ptr + at, decided.to(tl.int8), mask=mask)

pytestmark = [
    pytest.mark.skipif(
        not HAS_TRITON or not (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
        reason="needs triton, and a GPU or TRITON_INTERPRET=1"),
    # The interpreter converts with NumPy, which warns where a value rounds to fp16's inf (as
    # the sums past its range do on purpose), and computes the fp64 fast path's TwoSum and
    # certificate past fp64's range where the certificate then fails.
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in add:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
]

DEVICE = "cuda" if HAS_CUDA else "cpu"
SUM, MEAN = kernels.SUM, kernels.MEAN
INF, NAN = math.inf, math.nan

# (exponent of the smallest subnormal, largest exponent, significant bits) of each dtype.
FORMATS = {
    torch.float32: (-149, 127, 24),
    torch.bfloat16: (-133, 127, 8),
    torch.float16: (-24, 15, 11),
    torch.float64: (-1074, 1023, 53),
}


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- running both backends, and the oracle ----------------------------------------------------

def launch(backend, src, order, offsets, base, *, reduce, alpha, include_base, out=None):
    """One EXACT launch into a NaN-poisoned output (on the device for triton); CPU result."""
    from detsum.kernels.triton import segment as triton_segment

    outer, _, inner = src.shape
    if out is None:
        out = torch.full((outer, offsets.shape[0] - 1, inner), NAN, dtype=src.dtype)
    if backend == "triton":
        def dev(t):
            return None if t is None else t.to(DEVICE)
        out_dev = dev(out)
        triton_segment.segment_reduce(dev(src), dev(order), dev(offsets), dev(base), out_dev,
                                      reduce=reduce, rule=kernels.EXACT, alpha=alpha,
                                      include_base=include_base)
        return out_dev.cpu()
    numba_segment.segment_reduce(src, order, offsets, base, out, reduce=reduce,
                                 rule=kernels.EXACT, alpha=alpha, include_base=include_base)
    return out


def segment_terms(src, order, offsets, base, alpha, include_base):
    """Per (outer, segment, column): the terms as Python floats, the base row's first (None for
    an empty segment that copies its base row)."""
    acc = acc_dtype(src.dtype)
    terms = src.to(acc)
    if alpha != 1:
        terms = terms * torch.tensor(alpha, dtype=acc)  # one rounding per term, as the contract
    outer, _, inner = src.shape
    use_base = base is not None and include_base
    for o in range(outer):
        for s in range(offsets.shape[0] - 1):
            p0, p1 = int(offsets[s]), int(offsets[s + 1])
            rows = order[p0:p1] if order is not None else torch.arange(p0, p1)
            for j in range(inner):
                if p0 == p1 and not use_base:
                    yield (o, s, j), None
                    continue
                values = terms[o, rows, j].double().tolist()
                if use_base:
                    values = [float(base[o, s, j].to(acc))] + values
                yield (o, s, j), values


def exact_mean(values, dtype):
    if any(not math.isfinite(v) for v in values) or all(v == 0 for v in values):
        return reference.exact_sum_rounded(values, dtype)  # inf, NaN or a signed zero: as the sum
    return reference.round_exact(sum(map(Fraction, values)) / len(values), dtype)


def oracle(src, order, offsets, base, *, reduce, alpha, include_base):
    outer, _, inner = src.shape
    out = torch.empty((outer, offsets.shape[0] - 1, inner), dtype=src.dtype)
    for at, values in segment_terms(src, order, offsets, base, alpha, include_base):
        if values is None:
            out[at] = base[at] if base is not None else 0
        elif reduce == SUM:
            out[at] = reference.exact_sum_rounded(values, src.dtype)
        else:
            out[at] = exact_mean(values, src.dtype)
    return out


def check(src, order, offsets, base, *, reduce, alpha, include_base):
    """Triton and Numba both equal the oracle, to the bit."""
    args = dict(reduce=reduce, alpha=alpha, include_base=include_base)
    expected = oracle(src, order, offsets, base, **args)
    got = launch("triton", src, order, offsets, base, **args)
    assert_same_bits(got, expected)
    assert_same_bits(launch("numba", src, order, offsets, base, **args), expected)
    return got


# ---- data --------------------------------------------------------------------------------------

SIZES = (0, 6, 1, 0, 9, 4)  # segments of 0 terms first, inner and last-but-one


def wide(g, n, dtype, low=None, high=None):
    """``n`` values of either sign with exponents drawn over [low, high] (default: the dtype's
    whole range, subnormals included), in fp64."""
    lo, hi, _ = FORMATS[dtype]
    exponents = torch.randint(lo if low is None else low, (hi if high is None else high) + 1,
                              (n,), generator=g)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return torch.ldexp(signs * (1 + torch.rand(n, generator=g, dtype=torch.float64)), exponents)


def column_values(kind, g, n, dtype):
    """A segment's ``n`` values of one column kind, in fp64 (the dtype rounds them)."""
    lo, _, bits = FORMATS[dtype]
    if kind == "tame":  # the fast path's certificate holds
        return torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "wide":  # the whole exponent range: the certificate fails
        return wide(g, n, dtype)
    if kind == "cancel":  # x and -x over the whole range, and one value near the bottom
        half = wide(g, n // 2, dtype).to(dtype).double()
        tail = wide(g, n % 2, dtype, lo, lo + bits)
        return torch.cat([half, -half, tail])
    if kind == "zero":  # x and -x (an exact zero, +0.0) and signed zeros
        half = wide(g, n // 2, dtype).to(dtype).double()
        return torch.cat([half, -half, torch.tensor([-0.0] * (n % 2))])
    if kind == "neg_zero":  # every term (and the base row) -0.0: the sum is -0.0
        return torch.full((n,), -0.0, dtype=torch.float64)
    if kind == "special":  # inf, -inf and NaN among wide values
        values = wide(g, n, dtype)
        pick = torch.rand(n, generator=g)
        values[pick < 0.3] = INF
        values[(pick >= 0.3) & (pick < 0.5)] = -INF
        values[(pick >= 0.5) & (pick < 0.55)] = NAN
        return values
    if kind == "subnormal":  # the dtype's subnormals and the smallest normals
        return wide(g, n, dtype, lo, lo + bits)
    raise ValueError(kind)


KINDS = ("tame", "wide", "cancel", "zero", "neg_zero", "special", "subnormal")


def make_case(dtype, *, seed, with_order, strided, outer=2, sizes=SIZES, kinds=KINDS):
    """src [outer, rows, len(kinds)] whose every segment holds, per column, a set of values of
    that column's kind; the rows of a segment are scattered by ``order`` when given; a base row
    per segment of the same kinds."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    order = torch.randperm(rows, generator=g) if with_order else None
    position_rows = order if with_order else torch.arange(rows)
    src = torch.empty((outer, rows, len(kinds)), dtype=dtype)
    base = torch.empty((outer, len(sizes), len(kinds)), dtype=dtype)
    for o in range(outer):
        for s, (p0, n) in enumerate(zip(offsets.tolist(), sizes)):
            for j, kind in enumerate(kinds):
                values = column_values(kind, g, n + 1, dtype).to(dtype)
                values = values[torch.randperm(n + 1, generator=g)]
                if kind == "neg_zero":
                    values[:] = -0.0
                base[o, s, j] = values[n]
                src[o, position_rows[p0:p0 + n], j] = values[:n]
    if strided:
        src, base = strided_copy(src), strided_copy(base)
    return src, order, offsets, base


# ---- tests -------------------------------------------------------------------------------------

BASES = [  # (base given, include_base)
    pytest.param(False, False, id="no_base"),
    pytest.param(True, False, id="base_kept_if_empty"),
    pytest.param(True, True, id="base_included"),
]


REDUCTIONS = [  # (reduce, alpha): alpha scales sums only (index_add)
    pytest.param(SUM, 1.0, id="sum"),
    pytest.param(SUM, 0.3, id="sum-alpha"),
    pytest.param(MEAN, 1.0, id="mean"),
]


LAYOUTS = [pytest.param(False, id="contiguous"),
           pytest.param(True, id="shuffled-strided")]  # rows in a shuffled order, strided tensors


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Chunks of 4 terms: SIZES' segments of 6 and 9 terms are split, over chunk programs that
    own one chunk start or two; the others are whole."""
    from detsum.kernels.triton import exact

    monkeypatch.setattr(exact, "_EXACT_CHUNK_TERMS", 4)


def tickets_left():
    from detsum.kernels.triton import chunks

    # A launch's device, as its tensors name it (``cuda:0``: a stream needs the index).
    device = torch.empty(0, device=DEVICE).device
    return chunks.ticket_counters(device, 1).any().item()


# Every pair of dtype, reduction, use of the base row and layout: each dtype with every
# reduction, base use and layout; each reduction with every base use and layout.
@pytest.mark.parametrize("dtype,reduce,alpha,has_base,include_base,scattered", pairwise(
    [list(DTYPES), REDUCTIONS, BASES, LAYOUTS], everything=HAS_CUDA))
def test_matches_oracle_and_numba(tiny_chunks, dtype, reduce, alpha, has_base, include_base,
                                  scattered):
    """Every column kind side by side in one tile (so the fast path's certificate holds for
    some columns and fails for others), every dtype, both reductions, both alphas, every use
    of the base row, contiguous rows and a shuffled order over strided tensors; segments of at
    most a chunk whole, the longer ones split into chunks (each chunk's exact sum, the fast
    path's or its terms', added in the fold with the base row). The tickets are left at 0."""
    seed = seed_of("exact-triton", dtype, reduce, alpha, has_base, include_base)
    src, order, offsets, base = make_case(dtype, seed=seed, with_order=scattered,
                                          strided=scattered)
    check(src, order, offsets, base if has_base else None, reduce=reduce, alpha=alpha,
          include_base=include_base)
    assert not tickets_left()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_transposed_output_and_several_column_blocks(dtype, monkeypatch):
    """A transposed src and out, columns spread over several blocks (the fast path passes in
    some blocks and not in others), programs looping over blocks and outer indices, and the
    limbs carried every 3 terms: none of it changes a bit."""
    from detsum.kernels.triton import exact

    kinds = ("tame",) * 17 + ("wide", "tame", "cancel") + ("tame",) * 12 + ("special",)
    src, order, offsets, base = make_case(dtype, seed=seed_of("exact-blocks", dtype),
                                          with_order=True, strided=False, outer=2,
                                          sizes=(7, 0, 3), kinds=kinds)
    src = src.transpose(0, 2).contiguous().transpose(0, 2)
    out = torch.full((len(kinds), 3, 2), NAN, dtype=dtype).transpose(0, 2)
    monkeypatch.setattr(exact, "_ROW_BYTES", 16 * src.element_size())
    monkeypatch.setattr(exact, "_MAX_GRID_YZ", 1)
    monkeypatch.setattr(exact, "_NORMALISE_EVERY", 3)
    for reduce in (SUM, MEAN):
        args = dict(reduce=reduce, alpha=1.0, include_base=True)
        got = launch("triton", src, order, offsets, base, out=out.clone(), **args)
        assert_same_bits(got, oracle(src, order, offsets, base, **args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=dtype_id)
def test_in_place(dtype):
    """out is base (index_add_): the limb pass reads the base row of the columns the fast pass
    could not certify after that pass has written the others."""
    from detsum.kernels.triton import segment

    src, order, offsets, base = make_case(dtype, seed=seed_of("exact-in-place", dtype),
                                          with_order=True, strided=False, sizes=(4, 0, 2),
                                          kinds=("tame", "wide", "special", "tame"))
    for reduce in (SUM, MEAN):
        args = dict(reduce=reduce, alpha=1.0, include_base=True)
        expected = oracle(src, order, offsets, base, **args)
        buffer = base.to(DEVICE)
        segment.segment_reduce(src.to(DEVICE), order.to(DEVICE), offsets.to(DEVICE), buffer,
                               buffer, rule=kernels.EXACT, **args)
        assert_same_bits(buffer.cpu(), expected)


def one_column(values, dtype, *, reduce=SUM, alpha=1.0):
    src = torch.tensor(values, dtype=torch.float64).to(dtype).view(1, -1, 1)
    return src, None, torch.tensor([0, len(values)]), None, dict(reduce=reduce, alpha=alpha,
                                                                  include_base=False)


SPECIAL_CASES = [  # (values, what the sum is)
    pytest.param([INF, 1.0, -2.0], id="inf-wins"),
    pytest.param([INF, 0.0, INF], id="only-inf-nonzero"),  # a fast path must not take it
    pytest.param([-INF, 3.0, -INF], id="minus-inf-wins"),
    pytest.param([INF, -INF, 1.0], id="inf-minus-inf-is-nan"),
    pytest.param([NAN, INF, 1.0], id="nan-wins"),
    pytest.param([-0.0, -0.0, -0.0], id="all-minus-zero"),
    pytest.param([-0.0, 0.0, -0.0], id="mixed-zeros-plus-zero"),
    pytest.param([5.0, -5.0], id="exact-cancellation-plus-zero"),
    pytest.param([-1.0, 1.0, -0.0], id="cancellation-then-minus-zero-plus-zero"),
]


@pytest.mark.parametrize("values", SPECIAL_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_special_values(dtype, values):
    src, order, offsets, base, args = one_column(values, dtype)
    assert_same_bits(launch("triton", src, order, offsets, base, **args),
                     reference.exact_sum_rounded(values, dtype).view(1, 1, 1))
    check(src, order, offsets, base, **args)
    check(src, order, offsets, base, **dict(args, reduce=MEAN))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rounding_edges(dtype):
    """Sums whose fp64 value would double-round (a tie in the dtype plus a tiny remainder),
    sums past the dtype's largest value, and a nonzero sum below the smallest subnormal's half
    that rounds to a zero of its own sign."""
    lo, hi, bits = FORMATS[dtype]
    tiny = 2.0**lo
    one_ulp = 2.0**(1 - bits)
    top = 2.0**hi * (2 - 2 * one_ulp)  # the largest finite value
    cases = [
        [1.0, one_ulp / 2, tiny],  # just above a tie: rounds up
        [1.0, one_ulp / 2, -tiny],  # just below: rounds down
        [1.0, one_ulp / 2],  # the tie itself: to even
        [top, top * one_ulp / 4, top * one_ulp / 4],  # reaches the midpoint: to even (inf)
        [top, top * one_ulp / 4, -tiny],  # stays below the midpoint: the largest value
        [tiny, -tiny / 2] if dtype == torch.float16 else [tiny, -tiny],
    ]
    for values in cases:
        values = [float(torch.tensor(v).to(dtype)) for v in values]
        src, order, offsets, base, args = one_column(values, dtype)
        assert_same_bits(launch("triton", src, order, offsets, base, **args),
                         reference.exact_sum_rounded(values, dtype).view(1, 1, 1))
        check(src, order, offsets, base, **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
def test_means_at_and_near_the_dtypes_midpoints(dtype):
    """Means at and just off the dtype's midpoints (``conftest.midpoint_means``), whose fp64
    quotient the kernel rounds once more (a certified sum over a small count): a tie goes to
    even, a quotient just off one to its side, never rounded twice."""
    index, src, expected = midpoint_means(dtype)
    offsets = torch.arange(0, index.numel() + 1, 4)
    got = launch("triton", src.unsqueeze(0), None, offsets, None, reduce=MEAN, alpha=1.0,
                 include_base=False)
    assert_same_bits(got, expected.unsqueeze(0))


def test_fp64_pair_quotient_against_fractions():
    """``_pair_quotient`` (the fp64 mean of a certified TwoSum pair, Dekker's exact products
    in place of fused multiply-adds) against fractions, on the Numba test's cases
    (``conftest.pair_quotient_cases``) with divisors below 2**30 (a count's range): decided
    everywhere but near the subnormals and near fp64's top, correctly rounded, signed zeros
    kept."""
    cases = [(hi, lo, n % 2**30 or 1, total) for hi, lo, n, total in pair_quotient_cases()]
    cases += [(-0.0, 0.0, 3, Fraction(0)), (0.0, 0.0, 1, Fraction(0)),
              (2.0**-1000, 0.0, 3, Fraction(2.0**-1000))]
    hi = torch.tensor([c[0] for c in cases], dtype=torch.float64, device=DEVICE)
    lo = torch.tensor([c[1] for c in cases], dtype=torch.float64, device=DEVICE)
    counts = torch.tensor([c[2] for c in cases], dtype=torch.int64, device=DEVICE)
    value = torch.full_like(hi, NAN)
    decided = torch.full(hi.shape, -1, dtype=torch.int8, device=DEVICE)
    _pair_quotient_kernel[(triton.cdiv(len(cases), 256),)](hi, lo, counts, value, decided,
                                                           len(cases), BLOCK=256)
    settled = 0
    for (h, l, n, total), got, ok in zip(cases, value.cpu().tolist(), decided.cpu().tolist()):
        if not ok:
            assert abs(total / n) < 2.0**-958 or abs(h) >= 2.0**993, (h, l, n)
            continue
        expected = float(total / n) if total else math.copysign(0.0, h)
        assert got == expected and math.copysign(1, got) == math.copysign(1, expected), (
            h, l, n, got, expected)
        settled += 1
    assert settled > 1500
    assert decided[-1] == 0 and math.copysign(1, value[-3].item()) < 0


@pytest.mark.parametrize("scale", [1.0, 2.0**-500, 2.0**600], ids=["1", "2^-500", "2^600"])
def test_fp64_means_at_and_beside_the_midpoints(scale):
    """The Numba test's fp64 means at and beside the midpoints
    (``conftest.fp64_midpoint_means``) through the Triton kernel, against fractions. In the
    interpreter without the second column (inf in every other segment: the limbs there, which
    the interpreter runs for minutes) and the segments of 1001 terms; on a GPU with both."""
    if HAS_CUDA:
        index, src, expected = fp64_midpoint_means(scale)
    else:
        index, src, expected = fp64_midpoint_means(scale, sizes=(2, 3, 4, 7, 8, 100))
        src, expected = src[:, :1].contiguous(), expected[:, :1].contiguous()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.bincount(index).cumsum(0)])
    got = launch("triton", src.unsqueeze(0), None, offsets, None, reduce=MEAN, alpha=1.0,
                 include_base=False)
    assert_same_bits(got, expected.unsqueeze(0))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_means_near_the_smallest_subnormal(dtype):
    """k smallest subnormals (either sign) over a count of 1 to 6: the quotient's rounding bit
    and sticky bit lie below the unit, and ties go to even."""
    lo = FORMATS[dtype][0]
    ks = torch.arange(-10, 11, dtype=torch.float64)
    counts = range(1, 7)
    rows = [torch.ldexp(ks, torch.tensor(lo)) if i == 0 else torch.zeros_like(ks)
            for c in counts for i in range(c)]
    src = torch.stack(rows).to(dtype).unsqueeze(0)
    offsets = torch.tensor([0, *torch.tensor(list(counts)).cumsum(0).tolist()])
    check(src, None, offsets, None, reduce=MEAN, alpha=1.0, include_base=False)


def test_fast_path_certificate_edges():
    """fp32 terms whose spread is just inside and just outside what fp64 holds exactly: the
    result is the correctly rounded sum either way (a wrong certificate would round twice)."""
    for spread in range(26, 34):
        values = [2.0**spread, 1 + 2.0**-23, -(2.0**spread), 2.0**spread, 2.0**-24 * 3]
        src, order, offsets, base, args = one_column(values, torch.float32)
        for alpha in (1.0, 0.3):
            args["alpha"] = alpha
            check(src, order, offsets, base, **args)


def test_fp64_fast_path_certificate_edges():
    """fp64 terms of two magnitudes 2**k apart, with full significands, so that TwoSum's
    rounded sum rounds at every step and its errors add up, for spreads on both sides of the
    fp64 certificate (count**2 * largest <= smallest * 2**52: 2**46 for 8 terms): the
    correctly rounded sum and mean either way (a certificate too generous would round the
    errors' sum, or overflow it)."""
    g = torch.Generator().manual_seed(11)
    for k in range(38, 54, 3):
        values = torch.cat([wide(g, 4, torch.float64, k, k), wide(g, 4, torch.float64, 0, 0)])
        values = values[torch.randperm(8, generator=g)].tolist()
        for reduce in (SUM, MEAN):
            for alpha in (1.0, 0.3):
                src, order, offsets, base, args = one_column(values, torch.float64,
                                                             reduce=reduce, alpha=alpha)
                check(src, order, offsets, base, **args)
    top = 2.0**1023 * 1.5  # sums past fp64's range: inf, never an overflowed TwoSum's NaN
    for values in ([top, top, -top / 4], [top, -top, top, 2.0**-1074]):
        src, order, offsets, base, args = one_column(values, torch.float64)
        check(src, order, offsets, base, **args)


def test_long_segment_of_cancelling_terms():
    """More terms than CHUNK_TERMS (where the rules that split cut; EXACT's chunks are longer)
    that cancel down to the smallest subnormals: bf16 data, with and without the fast path."""
    g = torch.Generator().manual_seed(3)
    x = wide(g, kernels.CHUNK_TERMS // 2 + 2, torch.bfloat16, -60, 60).to(torch.bfloat16).double()
    values = torch.cat([x, -x, torch.tensor([2.0**-133, 2.0**-130])])
    values = values[torch.randperm(values.shape[0], generator=g)]
    src = torch.stack([values, torch.randn(values.shape[0], generator=g, dtype=torch.float64)],
                      -1).to(torch.bfloat16).unsqueeze(0)
    offsets = torch.tensor([0, values.shape[0]])
    for reduce in (SUM, MEAN):
        check(src, None, offsets, None, reduce=reduce, alpha=1.0, include_base=False)


# ---- long segments split over chunk programs -------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=dtype_id)
def test_split_segments_over_column_blocks_and_outer_loops(tiny_chunks, dtype, monkeypatch):
    """Chunk programs and folds that loop over column blocks (the last one partial) and outer
    indices (grid capped at one), in place (out is base): the whole segments' bits, and the
    tickets set back for the next launch. bf16 takes the fast path, fp64 the limbs alone."""
    from detsum.kernels.triton import exact, segment

    kinds = ("tame", "wide", "cancel", "special", "zero", "tame")
    src, order, offsets, base = make_case(dtype, seed=seed_of("exact-split-blocks", dtype),
                                          with_order=True, strided=False, outer=2,
                                          sizes=(9, 0, 3, 6), kinds=kinds)
    monkeypatch.setattr(exact, "_ROW_BYTES", 4 * src.element_size())  # blocks of 4 columns
    monkeypatch.setattr(exact, "_MAX_GRID_YZ", 1)
    for reduce in (SUM, MEAN):
        args = dict(reduce=reduce, alpha=1.0, include_base=True)
        buffer = base.clone().to(DEVICE)
        segment.segment_reduce(src.to(DEVICE), order.to(DEVICE), offsets.to(DEVICE), buffer,
                               buffer, rule=kernels.EXACT, **args)
        assert_same_bits(buffer.cpu(), oracle(src, order, offsets, base, **args))
        assert not tickets_left()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_chunks_the_fast_path_certifies_alone_but_not_together(tiny_chunks, dtype):
    """Each chunk's spread fits fp64 (so its fast-path sum is exact), the segment's does not
    (2**100 against 2**-100): adding the chunks' fp64 sums in fp64 would round; the parts are
    added as integers. With a mean, and with the chunks' order reversed."""
    big, small = 2.0**100, 2.0**-100
    for values in ([big, -big, big, 3.0, small, small, -small, small * 3],
                   [small, small, -small, small * 3, big, 1.0, big, -big, small]):
        for reduce in (SUM, MEAN):
            src, order, offsets, base, args = one_column(values, dtype, reduce=reduce)
            check(src, order, offsets, base, **args)


def test_split_is_spared_where_a_plan_found_no_long_segment(monkeypatch):
    """chunks=(..., 0), a plan's word that no segment is longer than CHUNK_TERMS: no chunk
    programs (the launch's grid is its segments), the same bits."""
    from detsum.kernels.triton import exact, segment

    src, order, offsets, base = make_case(torch.float32, seed=5, with_order=True,
                                          strided=False, sizes=(3, 5, 2))
    monkeypatch.setattr(exact, "_EXACT_CHUNK_TERMS", 4)
    grids = []
    launch_exact = exact._launch_exact

    def recorded(grid, *args, **kwargs):
        grids.append(grid)
        launch_exact(grid, *args, **kwargs)

    monkeypatch.setattr(exact, "_launch_exact", recorded)
    args = dict(reduce=SUM, alpha=1.0, include_base=True)
    expected = oracle(src, order, offsets, base, **args)
    for chunks in (None, (None, 0)):
        out = torch.full_like(base, NAN).to(DEVICE)
        segment.segment_reduce(src.to(DEVICE), order.to(DEVICE), offsets.to(DEVICE),
                               base.to(DEVICE), out, rule=kernels.EXACT, chunks=chunks, **args)
        assert_same_bits(out.cpu(), expected)
    assert [grid[0] for grid in grids] == [3 + 3, 3]  # 10 positions: 3 chunk programs


def test_refusals():
    from detsum.kernels.triton import segment

    src = torch.ones(1, 3, 2)
    offsets = torch.tensor([0, 3])
    out = torch.empty(1, 1, 2)
    for reduce in (kernels.PROD, kernels.AMAX, kernels.AMIN):
        with pytest.raises(ValueError, match="EXACT rule sums"):
            segment.segment_reduce(src, None, offsets, None, out, reduce=reduce,
                                   rule=kernels.EXACT, alpha=1.0, include_base=False)
    with pytest.raises(ValueError, match="takes no carry"):
        segment.segment_reduce(src, None, offsets, out, out, reduce=SUM, rule=kernels.EXACT,
                               alpha=1.0, include_base=True, carry=torch.zeros_like(out))
