"""mode="exact": the exact sum rounded once, whatever the order, split, thread count or backend.

The oracle is Fraction arithmetic (``detsum.reference``, itself checked on hand-made sums
here). Data spans each dtype's whole range: random bit patterns hit every exponent, the
subnormals included, as often as the normals.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numba
import pytest
import torch

import detsum
from detsum import kernels, reference
from detsum.kernels.numba import common as numba_common
from conftest import (DTYPES, assert_same_bits, dtype_id, fp64_midpoint_means, midpoint_means,
                      pair_quotient_cases)

BACKENDS = ("numba", "reference")
_BITS = {torch.float16: (torch.int16, 10, 5), torch.bfloat16: (torch.int16, 7, 8),
         torch.float32: (torch.int32, 23, 8), torch.float64: (torch.int64, 52, 11)}


def whole_range(shape, dtype, seed):
    """Uniformly random bit patterns of finite values: every exponent, sign and subnormal."""
    int_dtype, mantissa_bits, exponent_bits = _BITS[dtype]
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(int_dtype)
    bits = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64)
    bits = bits.to(int_dtype)
    exponent = (bits.to(torch.int64) >> mantissa_bits) & ((1 << exponent_bits) - 1)
    bits = torch.where(exponent == (1 << exponent_bits) - 1, torch.zeros_like(bits), bits)
    return bits.view(dtype)


def cancelling(shape, dtype, seed):
    """Terms that cancel almost completely: +-x pairs of wide range plus a few small ones, so
    the exact sum is many orders of magnitude below the terms (and often a tie to break)."""
    rows = shape[0]
    half = whole_range((rows // 2,) + tuple(shape[1:]), dtype, seed)
    finite_big = torch.where(half.abs() > 1, half, torch.ones_like(half))
    small = whole_range((rows - 2 * (rows // 2),) + tuple(shape[1:]), dtype, seed + 1)
    values = torch.cat([finite_big, -finite_big, small])
    g = torch.Generator().manual_seed(seed + 2)
    return values[torch.randperm(rows, generator=g)]


def with_specials(shape, dtype, seed):
    """Mostly whole-range values with NaN, +-inf and -0.0 columns mixed in."""
    values = whole_range(shape, dtype, seed)
    g = torch.Generator().manual_seed(seed + 3)
    pick = torch.randint(0, 12, shape, generator=g)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    values = torch.where(pick < 4, specials[pick.clamp_max(3)], values)
    if values.dim() > 1 and values.shape[1] > 1:
        values[:, 0] = -0.0  # a column of -0.0 only: its exact sum is -0.0
    return values


DATA = {"whole_range": whole_range, "cancelling": cancelling, "specials": with_specials}

# Segment lengths: empty, single, short, longer than a chunk of the other modes (256), and
# a long one that no fast-path tile certificate covers on whole-range data.
LENGTHS = [0, 1, 2, 7, 40, 300]


def offsets_of(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0)


# ---- the oracle ----------------------------------------------------------------------------


def test_reference_on_hand_made_sums():
    """Sums whose correctly rounded value is known, and that "fp32" mode gets wrong."""
    bf16 = torch.bfloat16
    cases = [
        # 1 + 2**-8 is a bf16 tie; the 2**-30 decides it upward. An fp32 sum loses the
        # 2**-30 and then ties to even, down.
        (torch.tensor([1.0, 2.0**-8, 2.0**-30]), bf16, 1.0 + 2.0**-7, 1.0),
        # The partial sum overflows fp32; the exact sum does not.
        (torch.tensor([3.0e38, 3.0e38, -3.0e38]), torch.float32, 3.0e38, math.inf),
        # fp64: the same, and three of the smallest subnormal.
        (torch.tensor([1e308, 1e308, -1e308], dtype=torch.float64), torch.float64, 1e308,
         math.inf),
        (torch.tensor([5e-324] * 3, dtype=torch.float64), torch.float64, 3 * 5e-324,
         3 * 5e-324),
    ]
    for terms, dtype, exact, wide in cases:
        src = terms.to(dtype).unsqueeze(1)
        offsets = torch.tensor([0, len(terms)])
        for backend in BACKENDS:
            with detsum.backend(backend):
                got = detsum.segment_sum(src, offsets, mode="exact")
                fp32 = detsum.segment_sum(src, offsets, mode="fp32")
            assert_same_bits(got, torch.tensor([[exact]], dtype=dtype))
            assert_same_bits(fp32, torch.tensor([[wide]], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_decided_far_below_fp32(backend, dtype):
    """1 + half an ulp is a tie; a term 2**-k, for k down to far below fp32's 24 bits, decides
    it. The fast path's fp64 sum holds it; its rounding to the dtype must not lose it in fp32
    on the way (round to odd)."""
    stored_bits = _BITS[dtype][1]  # significand bits after the leading one
    half_ulp = 2.0 ** -(stored_bits + 1)
    columns, expected = [], []
    smallest = -math.log2(torch.finfo(dtype).smallest_normal) + stored_bits  # subnormal 2**-k
    for k in range(stored_bits + 2, int(min(smallest, 60)) + 1):
        for sign in (1, -1):
            columns.append([1.0, half_ulp, sign * 2.0**-k])
            expected.append(1.0 + 2 * half_ulp if sign > 0 else 1.0)
    src = torch.tensor(columns, dtype=torch.float64).T.to(dtype)
    with detsum.backend(backend):
        got = detsum.segment_sum(src, torch.tensor([0, 3]), mode="exact")
    assert_same_bits(got[0], torch.tensor(expected, dtype=dtype))


def test_reference_mean_is_one_rounding():
    """bf16 mean of [1, 2**-8, 2**-8, 2**-8]... checked against Fraction by hand."""
    terms = [1.0, 2.0**-7, 2.0**-7, 2.0**-20]
    exact = sum(Fraction(t) for t in terms) / len(terms)
    expected = reference.round_exact(exact, torch.bfloat16)
    src = torch.tensor(terms, dtype=torch.bfloat16).unsqueeze(1)
    for backend in BACKENDS:
        with detsum.backend(backend):
            got = detsum.scatter_reduce(torch.zeros(1, 1, dtype=torch.bfloat16), 0,
                                        torch.zeros(4, dtype=torch.long), src, "mean",
                                        include_self=False, mode="exact")
        assert_same_bits(got, expected.view(1, 1))


# ---- every primitive, every backend, against the oracle ------------------------------------


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_segment_sum_is_correctly_rounded(dtype, data):
    src = DATA[data]((sum(LENGTHS), 6), dtype, seed=len(data))
    offsets = offsets_of(LENGTHS)
    with detsum.backend("reference"):
        expected = detsum.segment_sum(src, offsets, mode="exact")
    for s in range(len(LENGTHS)):
        # The reference is the Fraction sum of the segment's terms, segment by segment.
        terms = src[offsets[s]:offsets[s + 1]]
        oracle = (reference.exact_sum_rounded(terms, dtype) if len(terms)
                  else torch.zeros(6, dtype=dtype))
        assert_same_bits(expected[s], oracle)
    with detsum.backend("numba"):
        assert_same_bits(detsum.segment_sum(src, offsets, mode="exact"), expected)


@pytest.mark.parametrize("alpha", [1.0, 0.3, -1e30])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_index_add_is_correctly_rounded(dtype, alpha):
    """Init plus terms RN_acc(x * alpha), each rounded on its own, then one rounding."""
    g = torch.Generator().manual_seed(7)
    source = whole_range((120, 5), dtype, seed=11)
    index = torch.randint(0, 9, (120,), generator=g)
    input = whole_range((9, 5), dtype, seed=12)
    with detsum.backend("reference"):
        expected = detsum.index_add(input, 0, index, source, alpha=alpha, mode="exact")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for row in range(9):
        terms = [input[row].to(acc)] + [source[k].to(acc) * torch.tensor(alpha, dtype=acc)
                                        for k in range(120) if index[k] == row]
        assert_same_bits(expected[row], reference.exact_sum_rounded(torch.stack(terms), dtype))
    with detsum.backend("numba"):
        assert_same_bits(detsum.index_add(input, 0, index, source, alpha=alpha, mode="exact"),
                         expected)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_scatter_reduce_is_correctly_rounded(dtype, data, reduce, include_self):
    src = DATA[data]((200, 4), dtype, seed=3)
    g = torch.Generator().manual_seed(5)
    index = torch.randint(0, 6, (200,), generator=g)
    input = DATA[data]((7, 4), dtype, seed=4)  # row 6 receives nothing
    run = lambda: detsum.scatter_reduce(input, 0, index, src, reduce,  # noqa: E731
                                        include_self=include_self, mode="exact")
    with detsum.backend("reference"):
        expected = run()
    with detsum.backend("numba"):
        assert_same_bits(run(), expected)
    # Element-wise index (the kernels see one-element rows as columns).
    elementwise = index.unsqueeze(1).expand(-1, 4).contiguous()
    with detsum.backend("numba"):
        assert_same_bits(detsum.scatter_reduce(input, 0, elementwise, src, reduce,
                                               include_self=include_self, mode="exact"),
                         expected)


def test_mean_rounds_the_quotient_once():
    """An fp32 mean of terms spanning 60 binades: their fp32 sum loses the small ones, so
    dividing a rounded sum can land on the other side of the quotient's rounding point."""
    terms = [1.0, 2.0**-24 + 2.0**-47, 2.0**-60]
    src = torch.tensor(terms, dtype=torch.float32).unsqueeze(1)
    exact = sum(Fraction(t) for t in src[:, 0].tolist()) / 3
    got = detsum.scatter_reduce(torch.zeros(1, 1), 0, torch.zeros(3, dtype=torch.long), src,
                                "mean", include_self=False, mode="exact")
    assert_same_bits(got, reference.round_exact(exact, torch.float32).view(1, 1))


@pytest.mark.parametrize("include_self", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
def test_means_of_narrow_data_round_their_ties_and_zeros(dtype, include_self):
    """Multiples of one power of two, in segments of 1 to 9 terms: their sums are exact
    in fp64 (the kernels' fast path), and many quotients are exact ties of the dtype, or
    zeros of either sign, where the fp64 quotient's neighbours round apart."""
    g = torch.Generator().manual_seed(11)
    sizes = [1 + k % 9 for k in range(90)]
    index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    bits = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}[dtype]

    def values(rows):
        """Integers of the dtype's full precision, times 2**-16, of either sign."""
        magnitude = torch.randint(2**(bits - 1), 2**bits, (rows, 3), generator=g)
        sign = torch.randint(0, 8, (rows, 3), generator=g).ne(0).double() * 2 - 1
        return (magnitude * sign * 2.0**-16).to(dtype)

    src = values(len(index))
    src[index == 3] = -0.0  # every term -0.0: the mean is -0.0
    src[index == 4] = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 1.0, -0.0]] * 3, dtype=dtype)[:5]
    input = values(len(sizes))
    with detsum.backend("numba"):
        got = detsum.scatter_reduce(input, 0, index, src, "mean", include_self=include_self,
                                    mode="exact")
    expected = torch.empty_like(input)
    ties = 0
    tiny = Fraction(1, 2**400)
    for row in range(len(sizes)):
        for col in range(3):
            terms = [Fraction(t) for t in src[index == row, col].double().tolist()]
            if include_self:
                terms.append(Fraction(input[row, col].item()))
            mean = sum(terms, Fraction(0)) / len(terms)
            all_negative_zero = all(math.copysign(1.0, float(t)) < 0 and t == 0 for t in
                                    src[index == row, col].double().tolist()
                                    + ([input[row, col].item()] if include_self else []))
            expected[row, col] = -0.0 if all_negative_zero else reference.round_exact(mean, dtype)
            below, above = (reference.round_exact(mean + d, dtype) for d in (-tiny, tiny))
            ties += not torch.equal(below, above) and float(below) != mean
    assert_same_bits(got, expected)
    assert ties >= 10  # the data reach what the test is for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
def test_means_at_and_near_the_dtypes_midpoints(dtype):
    """Means at and just off the dtype's midpoints (``conftest.midpoint_means``). The Numba
    kernels round the fp64 quotient of a certified sum (proved right: ``rounded_quotient``)
    and take the others to the limbs; both against fractions (the Triton kernel:
    tests/test_exact_triton.py)."""
    index, src, expected = midpoint_means(dtype)
    for backend in BACKENDS:
        with detsum.backend(backend):
            got = detsum.scatter_reduce(torch.zeros_like(expected), 0, index, src, "mean",
                                        include_self=False, mode="exact")
        assert_same_bits(got, expected)


def test_fp64_pair_quotient_against_fractions():
    """``pair_quotient``: the quotient of an exact fp64 pair (hi, lo) by n, rounded once
    (``conftest.pair_quotient_cases``); where it declines (quotients near the subnormals) the
    limbs decide. The Triton kernel's: tests/test_exact_triton.py."""
    from detsum.kernels.numba.exact import pair_quotient

    decided = 0
    for hi, lo, n, total in pair_quotient_cases():
        value, ok = pair_quotient(hi, lo, float(n))
        if not ok:  # only near the subnormals
            assert abs(total / n) < 2.0**-958, (hi, lo, n)
            continue
        expected = float(total / n)  # Fraction to float: correctly rounded
        assert value == expected and math.copysign(1, value) == math.copysign(1, expected), (
            hi, lo, n, value, expected)
        decided += 1
    assert decided > 1500
    assert pair_quotient(-0.0, 0.0, 3.0) == (-0.0, True)
    assert math.copysign(1, pair_quotient(-0.0, 0.0, 3.0)[0]) < 0
    assert not pair_quotient(2.0**-1000, 0.0, 3.0)[1]  # near the subnormals: the limbs


@pytest.mark.parametrize("scale", [1.0, 2.0**-500, 2.0**600], ids=["1", "2^-500", "2^600"])
def test_fp64_means_at_and_beside_the_midpoints(scale):
    """fp64 means at and beside the midpoints (``conftest.fp64_midpoint_means``), in both
    tiers of the certificate. Against fractions, on the Numba kernels and the reference."""
    index, src, expected = fp64_midpoint_means(scale)
    for backend in BACKENDS:
        with detsum.backend(backend):
            got = detsum.scatter_reduce(torch.zeros_like(expected), 0, index, src, "mean",
                                        include_self=False, mode="exact")
        assert_same_bits(got, expected)


MEANS_BELOW_THE_UNIT = [
    # (dtype, terms, mean): the quotient's rounding bit lies below the smallest subnormal.
    (torch.float32, [3 * 2.0**-149, 0.0], 2 * 2.0**-149),  # 1.5 units: a tie, to even
    (torch.float32, [2 * 2.0**-149, 0.0, 0.0], 2.0**-149),  # 2/3 of a unit: up
    (torch.float32, [2.0**-149, 0.0, 0.0], 0.0),  # 1/3 of a unit: down
    (torch.float32, [-5 * 2.0**-149, 0.0], -2 * 2.0**-149),  # -2.5 units: a tie, to even
    (torch.float64, [3 * 2.0**-1074, 0.0], 2 * 2.0**-1074),
    (torch.bfloat16, [3 * 2.0**-133, 0.0], 2 * 2.0**-133),
    (torch.float16, [2.0**-24, 0.0, 0.0], 0.0),
]


@pytest.mark.parametrize("dtype,terms,mean", MEANS_BELOW_THE_UNIT)
def test_means_below_the_unit(dtype, terms, mean):
    """Found by the Triton port: a mean whose rounding bit lies below the unit of the sum."""
    src = torch.tensor(terms, dtype=torch.float64).to(dtype).unsqueeze(1)
    expected = torch.tensor([[mean]], dtype=dtype)
    for backend in BACKENDS:
        with detsum.backend(backend):
            got = detsum.scatter_reduce(torch.zeros(1, 1, dtype=dtype), 0,
                                        torch.zeros(len(terms), dtype=torch.long), src, "mean",
                                        include_self=False, mode="exact")
        assert_same_bits(got, expected)
    running = detsum.RunningSum((1,), dtype=dtype, mode="exact")
    running.add(src)
    assert_same_bits(running.mean(), expected[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_means_of_infinities(dtype):
    """Columns whose only nonzero terms are infinite (a fast-path certificate once took them)."""
    inf = float("inf")
    src = torch.tensor([[inf, -inf, inf], [0.0, -inf, -inf]], dtype=dtype)
    expected = torch.tensor([[inf, -inf, float("nan")]], dtype=dtype)
    for reduce in ("sum", "mean"):
        got = detsum.scatter_reduce(torch.zeros(1, 3, dtype=dtype), 0,
                                    torch.zeros(2, dtype=torch.long), src, reduce,
                                    include_self=False, mode="exact")
        assert_same_bits(got, expected)


# ---- no order ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_any_order_of_the_terms_gives_the_same_bits(backend, dtype):
    source = cancelling((64, 3), dtype, seed=21)
    index = torch.arange(64) % 4
    input = whole_range((4, 3), dtype, seed=22)
    g = torch.Generator().manual_seed(23)
    with detsum.backend(backend):
        first = detsum.index_add(input, 0, index, source, mode="exact")
        for _ in range(3):
            perm = torch.randperm(64, generator=g)
            assert_same_bits(detsum.index_add(input, 0, index[perm], source[perm],
                                              mode="exact"), first)


@pytest.mark.parametrize("min_block_elements", (1, None), ids=("64-blocks-a-thread", "default"))
def test_same_bits_for_any_thread_count(min_block_elements, monkeypatch):
    if min_block_elements is not None:
        monkeypatch.setattr(numba_common, "_MIN_BLOCK_ELEMENTS", min_block_elements)
    src = whole_range((5000, 33), torch.bfloat16, seed=31)
    g = torch.Generator().manual_seed(32)
    index = torch.randint(0, 50, (5000,), generator=g)
    base = torch.zeros(50, 33, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in sorted({1, 2, numba.config.NUMBA_NUM_THREADS}):
            torch.set_num_threads(threads)
            results.append(detsum.index_add(base, 0, index, src, mode="exact"))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        assert_same_bits(r, results[0])


# ---- the kernels' three ways to the same bits ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=dtype_id)
def test_tiles_that_fail_the_fast_certificate(dtype):
    """One tile of ordinary columns (certified as a whole), one where a single column is
    wide (the tile fails, the other columns pass one by one) and one column whose terms need
    the integer limbs: every column correctly rounded."""
    g = torch.Generator().manual_seed(41)
    ordinary = (torch.randn(30, 64, generator=g) * 3).to(dtype)
    mixed = ordinary.clone()
    tiny = torch.finfo(dtype).tiny
    mixed[0, 5] = tiny  # far below the others: no fp64 sum of this column is exact
    mixed[1, 9] = -tiny * 3
    src = torch.cat([ordinary, mixed])
    offsets = torch.tensor([0, 30, 60])
    with detsum.backend("numba"):
        got = detsum.segment_sum(src, offsets, mode="exact")
    assert_same_bits(got[0], reference.exact_sum_rounded(ordinary, dtype))
    assert_same_bits(got[1], reference.exact_sum_rounded(mixed, dtype))


def test_a_segment_longer_than_a_normalisation_step():
    """2**20 + 3 terms in one column through the limbs: +-2**100 pairs cancel, 2**-100 terms
    add up; the limbs are normalised every NORMALISE_EVERY terms on the way."""
    n = kernels.NORMALISE_EVERY + 3
    pairs = (n - 3) // 2
    column = torch.tensor([2.0**100, -2.0**100] * pairs + [2.0**-100] * (n - 2 * pairs))
    column[::1001] = 2.0**-100  # some of the cancelling pairs lose their big part
    expected_value = sum(Fraction(v) for v in column.tolist())
    got = detsum.segment_sum(column.unsqueeze(1), torch.tensor([0, n]), mode="exact")
    assert_same_bits(got, reference.round_exact(expected_value, torch.float32).view(1, 1))


# ---- what "exact" refuses, and where it is the same as the others ------------------------------


def test_prod_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="reduce='prod' has no mode='exact'.*fixed state"):
        detsum.scatter_reduce(torch.ones(2), 0, torch.tensor([0, 1]), torch.ones(2), "prod",
                              mode="exact")


# ---- RunningSum: pieces, merges and the integer state -----------------------------------------


def _pieces(rows, cuts):
    edges = [0] + list(cuts) + [rows.shape[0]]
    return [rows[a:b] for a, b in zip(edges[:-1], edges[1:])]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_running_sum_equals_segment_sum_in_any_pieces_and_merges(dtype):
    rows = with_specials((90, 2, 3), dtype, seed=51)
    rows[:, 1] = cancelling((90, 3), dtype, seed=52)  # finite column pairs too
    expected = detsum.segment_sum(rows, torch.tensor([0, 90]), mode="exact")[0]
    one = detsum.RunningSum((2, 3), dtype=dtype, mode="exact")
    one.add(rows)
    assert_same_bits(one.sum(), expected)
    # Pieces added to three sums in scrambled order, merged in another order.
    parts = _pieces(rows, [1, 17, 40, 41, 77])
    sums = [detsum.RunningSum((2, 3), dtype=dtype, mode="exact") for _ in range(3)]
    for i, part in enumerate(reversed(parts)):
        sums[i % 3].add(part)
    sums[2].merge(sums[0])
    sums[1].merge(sums[2])
    assert sums[1].count == 90
    assert_same_bits(sums[1].sum(), expected)
    with detsum.backend("reference"):
        mean = detsum.scatter_reduce(torch.zeros(1, 2, 3, dtype=dtype), 0,
                                     torch.zeros(90, dtype=torch.long), rows, "mean",
                                     include_self=False, mode="exact")[0]
    assert_same_bits(sums[1].mean(), mean)


def test_running_sum_states_add_up_like_an_all_reduce():
    """The integer sum of the states (what all_reduce(SUM) computes) is the merged state."""
    rows = whole_range((40, 5), torch.float32, seed=61)
    ranks = [detsum.RunningSum((5,), mode="exact") for _ in range(4)]
    for r, running in enumerate(ranks):
        running.add(rows[r::4])
    reduced = torch.stack([running.state() for running in ranks]).sum(0)
    total = detsum.RunningSum((5,), mode="exact")
    total.load_state(reduced)
    assert total.count == 40
    assert_same_bits(total.sum(),
                     detsum.segment_sum(rows, torch.tensor([0, 40]), mode="exact")[0])
    merged = detsum.RunningSum((5,), mode="exact")
    for running in ranks:
        merged.merge(running)
    assert torch.equal(merged.state(), total.state())  # normalised: one representation


def test_running_sum_state_errors():
    running = detsum.RunningSum((3,), mode="exact")
    state = running.state()
    with pytest.raises(ValueError, match=r"state has shape \(5,\); expected \(" +
                       str(state.numel()) + r",\)"):
        running.load_state(state[:5])
    with pytest.raises(TypeError, match="state must be an int64 tensor, got torch.float32"):
        running.load_state(state.float())
    summed = detsum.RunningSum((3,), mode="exact")
    summed.add(torch.ones(2, 3))
    uncounted = summed.state()
    uncounted[0] = 0  # its sum would read as 0 (the sum of no rows)
    with pytest.raises(ValueError, match="state counts 0 rows but holds a nonzero sum"):
        running.load_state(uncounted)
    with pytest.raises(ValueError, match="other has .* expected"):
        running.merge(detsum.RunningSum((4,), mode="exact"))
    with pytest.raises(ValueError, match="only mode='exact' sums can be merged"):
        detsum.RunningSum((3,), mode="fp32").merge(running)
    with pytest.raises(ValueError, match="only mode='exact'"):
        detsum.RunningSum((3,), mode="kahan").state()
    assert torch.equal(running.state(), state)  # nothing refused changed anything


def test_running_sum_mean_refuses_a_count_it_cannot_divide_by():
    running = detsum.RunningSum((2,), mode="exact")
    running.add(torch.ones(3, 2))
    state = running.state()
    state[0] = kernels.MAX_TERMS_PER_STATE + 1  # as if that many rows had been added
    running.load_state(state)
    assert_same_bits(running.sum(), torch.tensor([3.0, 3.0]))
    with pytest.raises(ValueError, match="an exact mean divides by at most"):
        running.mean()


def test_running_sum_before_any_row():
    running = detsum.RunningSum((2,), dtype=torch.bfloat16, mode="exact")
    assert_same_bits(running.sum(), torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no rows were added"):
        running.mean()
