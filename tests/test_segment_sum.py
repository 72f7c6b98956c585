"""detsum.segment_sum: numba == reference bit for bit, "autograd" == torch, accuracy,
determinism and gradients.

The reference backend (``detsum.reference``, run through the same public function) is the
oracle for every mode; "autograd" mode is also checked against torch's own accumulation
(``index_put_(accumulate=True)`` of the gathered rows, by segment id), and "kahan" against the
exactly rounded sum.
"""

from __future__ import annotations

import numba
import pytest
import torch

import detsum
from conftest import (
    DTYPES, LAYOUTS, MODES, N, assert_same_bits, case_params, dtype_id, make_data, seed_of,
    strided_copy, torch_deterministic, with_rows)
from detsum import reference

# Segment lengths per case (None: drawn at random). Cases with "perm" read rows through perm.
LENGTHS = {
    "uniform": None,  # 7 segments of random length 0..10
    "empty_segments": [0, 5, 0, 0, 9, 3, 0],  # empty first, middle and last segments
    "one_huge_segment": [0, 300, 2],  # one long segment between a short and an empty one
    "zero_rows": [0, 0, 0],  # N = 0: three empty segments
    "no_segments": [],  # N = 0 and offsets == [0]: an output of size 0 along dim
    "zero_columns": [3, 0, 6],  # rows of 0 elements
    "noncontiguous": [4, 0, 7, 1],  # src is a strided view with its dims stored in reverse
    "perm": [6, 0, 10, 4],  # a random permutation gathers the rows
    "perm_with_repeats": [6, 0, 10, 4],  # perm draws rows with replacement
    "int32_offsets": [3, 8, 0, 5],  # int32 offsets and perm
}
CASES = list(LENGTHS)


def make_case(template, dim, dtype, case):
    """(src, offsets, perm) for one layout and case; spread data so every rounding shows."""
    seed = seed_of(template, dim, dtype, case)
    g = torch.Generator().manual_seed(seed)
    lengths = LENGTHS[case]
    if lengths is None:
        lengths = torch.randint(0, 11, (7,), generator=g).tolist()
    rows = sum(lengths)
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    src = make_data(with_rows(template, rows, zero_columns=case == "zero_columns"), dtype,
                    seed=seed + 1, spread=True)
    perm = None
    if case in ("perm", "int32_offsets"):
        perm = torch.randperm(rows, generator=g)
    elif case == "perm_with_repeats":
        perm = torch.randint(0, rows, (rows,), generator=g)
    if case == "int32_offsets":
        offsets, perm = offsets.to(torch.int32), perm.to(torch.int32)
    if case == "noncontiguous":
        src = strided_copy(src)
        assert not src.is_contiguous()
    return src, offsets, perm


def segment_ids(offsets: torch.Tensor) -> torch.Tensor:
    """The segment of each position p: s with offsets[s] <= p < offsets[s+1]."""
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def gathered(src, dim, perm):
    dim = dim % src.dim()
    return src if perm is None else src.index_select(dim, perm.to(torch.int64))


def out_shape(src, dim, offsets):
    shape = list(src.shape)
    shape[dim] = offsets.numel() - 1
    return shape


# ---------------------------------------------------------------------------------------------
# numba == reference, bit for bit, every mode
# ---------------------------------------------------------------------------------------------


CASE_PARAMS = list(case_params(LAYOUTS, CASES))


@pytest.mark.parametrize("template,dim,case", CASE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_numba_matches_reference(mode, dtype, template, dim, case):
    src, offsets, perm = make_case(template, dim, dtype, case)
    with detsum.backend("numba"):
        got = detsum.segment_sum(src, offsets, dim=dim, perm=perm, mode=mode)
    with detsum.backend("reference"):
        expected = detsum.segment_sum(src, offsets, dim=dim, perm=perm, mode=mode)
    assert got.is_contiguous() and list(got.shape) == out_shape(src, dim % src.dim(), offsets)
    assert_same_bits(got, expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,dim,lengths", [
    ((50, 1100), 0, [20, 30]),  # rows wider than one kernel column chunk, 2 segments
    ((2, 50, 300), 1, [10, 0, 40]),  # several column chunks per row, with an outer dim
])
def test_numba_matches_reference_wide_rows(mode, dtype, shape, dim, lengths):
    src = make_data(shape, dtype, seed=seed_of(shape, dtype), spread=True)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    perm = torch.randperm(shape[dim], generator=torch.Generator().manual_seed(3))
    with detsum.backend("numba"):
        got = detsum.segment_sum(src, offsets, dim=dim, perm=perm, mode=mode)
    with detsum.backend("reference"):
        expected = detsum.segment_sum(src, offsets, dim=dim, perm=perm, mode=mode)
    assert_same_bits(got, expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_numba_matches_reference_special_values(mode, dtype):
    """NaN, +-inf (inf - inf in one segment) and signed zeros; a segment of -0.0 only."""
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 3.5])
    g = torch.Generator().manual_seed(9)
    src = pool[torch.randint(0, len(pool), (40, 6), generator=g)].to(dtype)
    src[36:] = -0.0
    offsets = torch.tensor([0, 3, 3, 10, 20, 36, 40])
    with detsum.backend("numba"):
        got = detsum.segment_sum(src, offsets, mode=mode)
    with detsum.backend("reference"):
        expected = detsum.segment_sum(src, offsets, mode=mode)
    assert_same_bits(got, expected)


@pytest.mark.parametrize("mode", MODES)
def test_numba_matches_reference_noncontiguous_offsets_and_perm(mode):
    """offsets and perm as strided views (one dtype: the kernel's index handling does not
    depend on the data's dtype)."""
    src, offsets, perm = make_case((N, 8), 0, torch.float32, "perm")
    offsets, perm = strided_copy(offsets), strided_copy(perm)
    assert not offsets.is_contiguous() and not perm.is_contiguous()
    with detsum.backend("numba"):
        got = detsum.segment_sum(src, offsets, perm=perm, mode=mode)
    with detsum.backend("reference"):
        expected = detsum.segment_sum(src, offsets, perm=perm, mode=mode)
    assert_same_bits(got, expected)


# ---------------------------------------------------------------------------------------------
# "autograd" mode == torch; and segment_sum == index_add onto zeros
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template,dim,case", CASE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_autograd_mode_matches_torch_index_put(dtype, template, dim, case):
    """zeros.index_put_((..., segment_id), src rows gathered by perm, accumulate=True)."""
    src, offsets, perm = make_case(template, dim, dtype, case)
    d = dim % src.dim()
    zeros = torch.zeros(out_shape(src, d, offsets), dtype=dtype)
    indices = [None] * d + [segment_ids(offsets)]
    values = gathered(src, d, perm)
    if dtype in (torch.float32, torch.float64):
        with torch_deterministic():
            expected = torch.ops.aten.index_put_(zeros, indices, values, True)
    else:
        expected = torch.ops.aten.index_put_(zeros, indices, values, True)
    got = detsum.segment_sum(src, offsets, dim=dim, perm=perm, mode="autograd")
    assert_same_bits(got, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_autograd_mode_data_tells_the_modes_apart(dtype):
    """Guard for the test above: on its data the wide sum differs from torch's rounding after
    every add, so matching torch means something."""
    src, offsets, _ = make_case((N, 8), 0, dtype, "one_huge_segment")
    zeros = torch.zeros(out_shape(src, 0, offsets), dtype=dtype)
    expected = zeros.index_put_((segment_ids(offsets),), src, accumulate=True)
    assert_same_bits(detsum.segment_sum(src, offsets, mode="autograd"), expected)
    assert not torch.equal(detsum.segment_sum(src, offsets, mode="fp32"), expected)


@pytest.mark.parametrize("case", ["uniform", "empty_segments", "perm", "perm_with_repeats"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_equals_index_add_onto_zeros(mode, dtype, case):
    """A segment sum is index_add of the gathered rows onto zeros by segment id, in every mode
    (both start from +0.0 and take the rows in the same order)."""
    src, offsets, perm = make_case((3, N, 5), 1, dtype, case)
    zeros = torch.zeros(out_shape(src, 1, offsets), dtype=dtype)
    expected = detsum.index_add(zeros, 1, segment_ids(offsets), gathered(src, 1, perm), mode=mode)
    assert_same_bits(detsum.segment_sum(src, offsets, dim=1, perm=perm, mode=mode), expected)


# ---------------------------------------------------------------------------------------------
# "kahan": within 1 ulp of the exactly rounded sum
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_perm", [False, True], ids=["no_perm", "perm"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_kahan_within_one_ulp_of_exact(dtype, dim, with_perm):
    """Data over many binades with both signs (cancellation), segments of 0 to 150 rows."""
    src = make_data((300, 5), dtype, seed=seed_of("kahan", dtype, dim), spread=True)
    lengths = [0, 1, 150, 7, 0, 2, 60, 80]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(4)) if with_perm else None
    rows = gathered(src, 0, perm)
    got = detsum.segment_sum(src.movedim(0, dim), offsets, dim=dim, perm=perm,
                             mode="kahan").movedim(dim, 0)
    exact = torch.stack([reference.exact_sum_rounded(rows[a:b]) for a, b in
                         zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    assert torch.isfinite(exact).all()
    ulps = reference.ulp_distance(got, exact)
    assert ulps.max().item() <= 1, f"max {ulps.max().item()} ulps"


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_perm", [False, True], ids=["no_perm", "perm"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_repeated_runs_and_thread_counts_give_same_bits(dtype, mode, with_perm):
    """2000 x 64 rows, skewed: one segment of 1000 rows, 40 short ones, some empty."""
    src = make_data((2000, 64), dtype, seed=12, spread=True)
    g = torch.Generator().manual_seed(13)
    short = torch.randint(0, 50, (40,), generator=g)
    short = (short * 1000 / short.sum()).floor().long()
    short[-1] += 1000 - short.sum()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long),
                         torch.cat([torch.tensor([1000]), short]).cumsum(0)])
    perm = torch.randperm(2000, generator=g) if with_perm else None
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        first = detsum.segment_sum(src, offsets, perm=perm, mode=mode)
        for _ in range(2):
            assert_same_bits(detsum.segment_sum(src, offsets, perm=perm, mode=mode), first)
        numba.set_num_threads(1)
        assert_same_bits(detsum.segment_sum(src, offsets, perm=perm, mode=mode), first)
    finally:
        numba.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("perm_kind", ["no_perm", "perm", "perm_with_repeats"])
@pytest.mark.parametrize("shape,dim", [((10, 3), 0), ((2, 10, 3), -2), ((10,), 0)])
@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(mode, shape, dim, perm_kind):
    src = make_data(shape, torch.float64, seed=21).requires_grad_()
    offsets = torch.tensor([0, 3, 3, 9, 10])
    g = torch.Generator().manual_seed(22)
    perm = {"no_perm": None, "perm": torch.randperm(10, generator=g),
            "perm_with_repeats": torch.randint(0, 10, (10,), generator=g)}[perm_kind]
    assert torch.autograd.gradcheck(
        lambda s: detsum.segment_sum(s, offsets, dim=dim, perm=perm, mode=mode), (src,))


@pytest.mark.parametrize("with_perm", [False, True], ids=["no_perm", "perm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_gradient_is_exact_gather(mode, dtype, with_perm):
    """Each source row receives its segment's gradient row, bit for bit, in every dtype."""
    src = make_data((12, 4), dtype, seed=31).requires_grad_()
    offsets = torch.tensor([0, 5, 5, 12])
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(32)) if with_perm else None
    grad = make_data((3, 4), dtype, seed=33, spread=True)
    detsum.segment_sum(src, offsets, perm=perm, mode=mode).backward(grad)
    per_position = grad[segment_ids(offsets)]
    expected = per_position if perm is None else torch.empty_like(per_position).index_copy_(
        0, perm, per_position)
    assert_same_bits(src.grad, expected)
