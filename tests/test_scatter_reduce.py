"""detsum.scatter_reduce: numba == reference bit for bit, equality with torch.scatter_reduce
where torch's CPU arithmetic is what a mode promises, accuracy, determinism and gradients.

Two index layouts: "row" (a 1-D index sends whole rows along dim; torch gets it expanded to
src's shape and made contiguous) and "elem" (an index of src's full shape, torch's own
semantics). The contiguous copy matters: torch's CPU fast path for an *expanded* dim-0 index
lets the later of a +0/-0 tie win in amax/amin (pinned in tests/test_reference.py).
"""

from __future__ import annotations

import itertools

import numba
import pytest
import torch

import detsum
from conftest import (
    DTYPES, MODE_REDUCTIONS, MODES, N, TRITON_ON_CPU, assert_same_bits, case_params, dtype_id,
    make_data, seed_of, strided_copy, with_rows)
from covering import pairwise
from detsum import reference

REDUCES = ("sum", "mean", "prod", "amax", "amin")
N_OUT = 7  # output rows along dim in the generated cases

# Row-wise index: (shape with N at dim, dim). "slice size" = elements after dim: the quantity
# that picks the kernel regime for whole-row scatters.
ROW_LAYOUTS = [
    pytest.param((N,), 0, "row", id="row-N-dim0"),  # 1-D: slice size 1, no outer dim
    pytest.param((N, 1), 0, "row", id="row-Nx1-dim0"),  # slice size 1, 2-D
    pytest.param((N, 8), 0, "row", id="row-Nx8-dim0"),  # slice size 8 <= 32
    pytest.param((N, 40), 0, "row", id="row-Nx40-dim0"),  # slice size 40 > 32
    pytest.param((5, N), 1, "row", id="row-5xN-dim1"),  # last dim of 2-D: slice 1, outer 5
    pytest.param((3, N, 11), -2, "row", id="row-3xNx11-dim-2"),  # middle dim, negative
    pytest.param((3, 4, N), -1, "row", id="row-3x4xN-dim-1"),  # last dim, negative, outer 12
]
# Element-wise index: every element is scattered on its own (detsum flattens the tensors and
# keys each element by (outer, index, inner)), so the layouts exercise the key mapping for each
# position of dim; they are narrow because the reference loops over columns in Python. (A 1-D
# index of a 1-D src is the row-wise case.)
ELEM_LAYOUTS = [
    pytest.param((N, 3), 0, "elem", id="elem-Nx3-dim0"),  # first dim
    pytest.param((4, N), 1, "elem", id="elem-4xN-dim1"),  # last dim of 2-D
    pytest.param((2, N, 3), -2, "elem", id="elem-2xNx3-dim-2"),  # middle dim, negative
    pytest.param((2, 3, N), -1, "elem", id="elem-2x3xN-dim-1"),  # last dim of 3-D, negative
]
LAYOUTS = ROW_LAYOUTS + ELEM_LAYOUTS

CASES = [
    "empty_segments",  # 24 source rows, only odd outputs of 7 receive any: others keep input
    "one_huge_segment",  # 100 source rows, ~90% into one output
    "zero_rows",  # no source rows at all
    "zero_columns",  # every row has 0 elements
    "noncontiguous",  # input, src and index are strided views with dims stored in reverse
    "special_values",  # NaN, +-inf, +-0 (ties for amax/amin, inf - inf for sums)
    "int32_index",  # int32 index (a covering of the matrix: test_int32_index_matches_reference)
]

# (reduce, mode) pairs of the numba == reference matrix. prod/amax/amin do not depend on the
# mode (the contract; the reference ignores it for them), so they run once here and
# test_prod_amax_amin_do_not_depend_on_mode checks that the kernels agree across modes.
REDUCE_MODES = [(r, m) for r in ("sum", "mean") for m in MODES] + [
    (r, "fp32") for r in ("prod", "amax", "amin")]
REDUCE_MODE_PARAMS = [pytest.param(r, m, id=f"{r}-{m}") for r, m in REDUCE_MODES]


def near_one(shape, dtype, seed):
    """Factors in [0.5, 2) of both signs with full mantissas: products of a hundred of them
    neither overflow nor underflow, and every multiply rounds."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    return (x * sign).to(dtype)


def special_values(shape, dtype, seed):
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 2.0,
                         -2.0, 0.5], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    return pool[torch.randint(0, len(pool), shape, generator=g)].to(dtype)


def values(shape, dtype, seed, reduce, case):
    if case == "special_values":
        return special_values(shape, dtype, seed)
    if reduce == "prod":
        return near_one(shape, dtype, seed)
    return make_data(shape, dtype, seed=seed, spread=True)


def make_index(kind, shape, dim, n_out, distribution, seed):
    """A 1-D index of length shape[dim] ("row") or one of src's shape ("elem")."""
    g = torch.Generator().manual_seed(seed)
    size = (shape[dim],) if kind == "row" else shape
    if distribution == "empty_segments":
        return 2 * torch.randint(0, n_out // 2, size, generator=g) + 1
    if distribution == "one_huge_segment":
        heavy = torch.rand(size, generator=g) < 0.9
        return torch.where(heavy, n_out // 2, torch.randint(0, n_out, size, generator=g))
    return torch.randint(0, n_out, size, generator=g)


def make_case(template, dim, kind, dtype, case, reduce):
    """(input, index, src) for one layout and case."""
    rows = {"zero_rows": 0, "one_huge_segment": 100}.get(case, 24)
    zero_columns = case == "zero_columns"
    seed = seed_of(template, dim, kind, dtype, case, reduce)
    src_shape = with_rows(template, rows, zero_columns=zero_columns)
    input = values(with_rows(template, N_OUT, zero_columns=zero_columns), dtype, seed, reduce,
                   case)
    src = values(src_shape, dtype, seed + 1, reduce, case)
    distribution = case if case in ("empty_segments", "one_huge_segment") else "uniform"
    index = make_index(kind, src_shape, dim % len(src_shape), N_OUT, distribution, seed + 2)
    if case == "int32_index":
        index = index.to(torch.int32)
    if case == "noncontiguous":
        input, src, index = strided_copy(input), strided_copy(src), strided_copy(index)
        assert not src.is_contiguous() and not index.is_contiguous()
        assert input.dim() == 1 or not input.is_contiguous()
    return input, index, src


def torch_index(index, dim, src):
    """torch.scatter_reduce's index: a row index expanded to src's shape, materialized
    (contiguous) so torch stays off its expanded-index fast path."""
    if index.dim() == src.dim() and index.shape == src.shape:
        return index.to(torch.int64)
    dim = dim % src.dim()
    view = [-1 if d == dim else 1 for d in range(src.dim())]
    return index.to(torch.int64).view(view).expand(src.shape).contiguous()


# ---------------------------------------------------------------------------------------------
# numba == reference, bit for bit
# ---------------------------------------------------------------------------------------------


CASE_PARAMS = list(case_params(LAYOUTS, [case for case in CASES if case != "int32_index"]))


def both_include_self(check):
    """Run ``check(include_self)`` both ways; a failure names the one that broke."""
    for include_self in (True, False):
        try:
            check(include_self)
        except AssertionError as e:
            raise AssertionError(f"include_self={include_self}: {e}") from e


@pytest.mark.parametrize("template,dim,kind,case", CASE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce,mode", REDUCE_MODE_PARAMS)
def test_numba_matches_reference(reduce, mode, dtype, template, dim, kind, case):
    numba_matches_reference(reduce, mode, dtype, template, dim, kind, case)


# An int32 index meets every (reduce, mode), dtype and layout, each (reduce, mode) and dtype
# in both index kinds, not every combination of them: each (reduce, mode, dtype) compiles
# kernels of their own for int32 (about a second each, 43 s in all for the whole matrix), and
# the index is read by code that no reduction or dtype changes.
@pytest.mark.parametrize("reduce,mode,dtype,template,dim,kind", [
    param for layouts in (ROW_LAYOUTS, ELEM_LAYOUTS)
    for param in pairwise([REDUCE_MODE_PARAMS, list(DTYPES), layouts], pairs=[])])
def test_int32_index_matches_reference(reduce, mode, dtype, template, dim, kind):
    numba_matches_reference(reduce, mode, dtype, template, dim, kind, "int32_index")


def numba_matches_reference(reduce, mode, dtype, template, dim, kind, case):
    input, index, src = make_case(template, dim, kind, dtype, case, reduce)

    def check(include_self):
        def run():
            return detsum.scatter_reduce(input, dim, index, src, reduce,
                                         include_self=include_self, mode=mode)

        with detsum.backend("numba"):
            got = run()
        with detsum.backend("reference"):
            expected = run()
        assert got.is_contiguous() and got.shape == input.shape
        assert_same_bits(got, expected)

    both_include_self(check)


@pytest.mark.parametrize("template,dim,kind", [pytest.param(*p.values, id=p.id) for p in LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce", ["prod", "amax", "amin"])
def test_prod_amax_amin_do_not_depend_on_mode(reduce, dtype, template, dim, kind):
    """The contract: prod is one serial product in the acc type in every mode; amax/amin are exact."""
    case = "one_huge_segment" if reduce == "prod" else "special_values"
    input, index, src = make_case(template, dim, kind, dtype, case, reduce)

    # "exact" has no product (test_exact_refuses_prod); amax/amin accept it.
    modes = [m for m in MODES if not (reduce == "prod" and m == "exact")]

    def check(include_self):
        results = {mode: detsum.scatter_reduce(input, dim, index, src, reduce,
                                               include_self=include_self, mode=mode)
                   for mode in modes}
        for mode in modes:
            assert_same_bits(results[mode], results["fp32"])

    both_include_self(check)


@pytest.mark.parametrize("reduce,mode", REDUCE_MODE_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,dim", [
    ((40, 1100), 0),  # rows wider than one kernel column chunk, 3 outputs
    ((2, 30, 300), 1),  # several column chunks per row, with an outer dim
])
def test_numba_matches_reference_wide_rows(shape, dim, dtype, reduce, mode):
    """Many columns and few outputs: the kernel splits rows into column chunks (sized by the
    thread count); the order inside each element must not notice."""
    seed = seed_of(shape, dim, dtype, reduce)
    out_shape = list(shape)
    out_shape[dim] = 3
    input = values(out_shape, dtype, seed, reduce, "wide")
    src = values(shape, dtype, seed + 1, reduce, "wide")
    index = make_index("row", shape, dim, 3, "uniform", seed + 2)

    def check(include_self):
        def run():
            return detsum.scatter_reduce(input, dim, index, src, reduce, mode=mode,
                                         include_self=include_self)

        with detsum.backend("numba"):
            got = run()
        with detsum.backend("reference"):
            expected = run()
        assert_same_bits(got, expected)

    both_include_self(check)


# ---------------------------------------------------------------------------------------------
# Equality with torch.scatter_reduce on CPU
# ---------------------------------------------------------------------------------------------

TORCH_CASES = ["empty_segments", "one_huge_segment", "zero_rows", "noncontiguous"]


def _torch_params():
    for layout in LAYOUTS:
        for case in TORCH_CASES:
            yield pytest.param(*layout.values, case, id=f"{layout.id}-{case}")


TORCH_PARAMS = list(_torch_params())


@pytest.mark.parametrize("template,dim,kind,case", TORCH_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce", ["sum", "prod"])
def test_fp32_mode_sum_prod_match_torch(reduce, dtype, template, dim, kind, case):
    """torch's CPU scatter_reduce sum/prod accumulate in a wide (fp32/fp64) buffer and round
    once, in every layout: the contract's "fp32" mode."""
    input, index, src = make_case(template, dim, kind, dtype, case, reduce)

    def check(include_self):
        expected = torch.scatter_reduce(input, dim, torch_index(index, dim, src), src, reduce,
                                        include_self=include_self)
        got = detsum.scatter_reduce(input, dim, index, src, reduce, include_self=include_self,
                                    mode="fp32")
        assert_same_bits(got, expected)

    both_include_self(check)


# torch's CPU mean rounds the wide sum to the dtype, then divides: that is "autograd" mode for
# every dtype, and for fp32/fp64 (where the first rounding is a no-op) also "fp32" mode. For
# bf16/fp16 "fp32" mode rounds once and differs (test_mean_double_rounding_tells_modes_apart).
MEAN_MODE_DTYPES = [pytest.param("autograd", d, id=f"autograd-{dtype_id(d)}") for d in DTYPES] + [
    pytest.param("fp32", d, id=f"fp32-{dtype_id(d)}") for d in (torch.float32, torch.float64)]


@pytest.mark.parametrize("template,dim,kind,case", TORCH_PARAMS)
@pytest.mark.parametrize("mode,dtype", MEAN_MODE_DTYPES)
def test_mean_matches_torch(mode, dtype, template, dim, kind, case):
    input, index, src = make_case(template, dim, kind, dtype, case, "mean")

    def check(include_self):
        expected = torch.scatter_reduce(input, dim, torch_index(index, dim, src), src, "mean",
                                        include_self=include_self)
        got = detsum.scatter_reduce(input, dim, index, src, "mean", include_self=include_self,
                                    mode=mode)
        assert_same_bits(got, expected)

    both_include_self(check)


def test_mean_double_rounding_tells_modes_apart():
    """Guard for test_mean_matches_torch: a bf16 segment where torch's two roundings differ
    from one. The fp32 sum 3 + 3 + (2**-6 + 2**-10) = 6.0166015625 lies just above the bf16
    tie between 6 and 6.03125; torch rounds it up, then 6.03125 / 3 rounds to 2.015625, while
    the correctly rounded mean ("fp32" mode) is 2.0."""
    src = torch.tensor([3.0, 3.0, 2.0**-6 + 2.0**-10], dtype=torch.bfloat16)
    index = torch.zeros(3, dtype=torch.long)
    input = torch.zeros(1, dtype=torch.bfloat16)
    expected = torch.scatter_reduce(input, 0, index, src, "mean", include_self=False)
    got = detsum.scatter_reduce(input, 0, index, src, "mean", include_self=False, mode="autograd")
    assert_same_bits(got, expected)
    wide = detsum.scatter_reduce(input, 0, index, src, "mean", include_self=False, mode="fp32")
    assert not torch.equal(wide, expected)


@pytest.mark.parametrize("template,dim,kind", [pytest.param(*p.values, id=p.id) for p in LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("mode", MODES)
def test_amax_amin_match_torch(mode, reduce, dtype, template, dim, kind):
    """NaN propagates; of equal values (+0.0 / -0.0) the earlier one stays, as in torch."""
    input, index, src = make_case(template, dim, kind, dtype, "special_values", reduce)

    def check(include_self):
        expected = torch.scatter_reduce(input, dim, torch_index(index, dim, src), src, reduce,
                                        include_self=include_self)
        got = detsum.scatter_reduce(input, dim, index, src, reduce, include_self=include_self,
                                    mode=mode)
        assert_same_bits(got, expected)

    both_include_self(check)


def test_amax_amin_zero_tie_keeps_earlier_value():
    """Hand-made ties, independent of any torch path: -0.0 then +0.0 keeps -0.0 and vice versa."""
    src = torch.tensor([-0.0, 0.0, 0.0, -0.0])
    index = torch.tensor([0, 0, 1, 1])
    input = torch.zeros(2)
    for reduce in ("amax", "amin"):
        out = detsum.scatter_reduce(input, 0, index, src, reduce, include_self=False)
        assert_same_bits(out, torch.tensor([-0.0, 0.0]))


@pytest.mark.parametrize("template,dim,kind", [pytest.param(*p.values, id=p.id)
                                                for p in ROW_LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_autograd_mode_sum_matches_torch_index_put(dtype, template, dim, kind):
    """Row-wise sum with include_self is index_add: "autograd" mode is torch's index_put_."""
    input, index, src = make_case(template, dim, kind, dtype, "one_huge_segment", "sum")
    d = dim % src.dim()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(dtype in (torch.float32, torch.float64))
    try:
        expected = torch.ops.aten.index_put_(input.clone(), [None] * d + [index], src, True)
    finally:
        torch.use_deterministic_algorithms(previous)
    got = detsum.scatter_reduce(input, dim, index, src, "sum", mode="autograd")
    assert_same_bits(got, expected)


@pytest.mark.parametrize("mode,reduce", MODE_REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_sorted_index_gives_same_bits(mode, dtype, reduce):
    """sorted=True (no order built: segments are contiguous runs) == sorted=False."""
    input, index, src = make_case((3, N, 11), 1, "row", dtype, "one_huge_segment", reduce)
    index = index.sort().values

    def check(include_self):
        kwargs = dict(include_self=include_self, mode=mode)
        unsorted = detsum.scatter_reduce(input, 1, index, src, reduce, sorted=False, **kwargs)
        promised = detsum.scatter_reduce(input, 1, index, src, reduce, sorted=True, **kwargs)
        assert_same_bits(promised, unsorted)

    both_include_self(check)


@pytest.mark.parametrize("backend", ["numba", TRITON_ON_CPU, "reference"])
@pytest.mark.parametrize("dtype,terms", [(torch.bfloat16, 258), (torch.bfloat16, 600),
                                         (torch.float16, 2049), (torch.float16, 3001)], ids=str)
def test_autograd_mean_counts_in_the_dtype(backend, dtype, terms):
    """"autograd" mode's mean is torch's, which counts in the dtype: a count past the dtype's
    integers (above 256 in bfloat16, 2048 in float16) is rounded to it, and the rounded sum
    divided by that. A row index, torch's expanded index and one of src's shape, with
    include_self or not, each give torch's bits, where dividing by the exact count would
    not."""
    gen = torch.Generator().manual_seed(terms)
    rows = torch.cat([torch.zeros(terms, dtype=torch.int64),
                      torch.ones(terms + 1, dtype=torch.int64), torch.full((3,), 2)])
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    src = torch.randn(rows.numel(), 8, generator=gen).to(dtype)
    input = torch.randn(3, 8, generator=gen).to(dtype)
    expanded = rows[:, None].expand(src.shape)
    for index, include_self in itertools.product(
            [rows, expanded, expanded.contiguous()], (True, False)):
        expected = torch.scatter_reduce(input, 0, expanded, src, "mean",
                                        include_self=include_self)
        with detsum.backend(backend):
            got = detsum.scatter_reduce(input, 0, index, src, "mean", mode="autograd",
                                        include_self=include_self)
        assert_same_bits(got, expected)
        exact_count = torch.tensor([terms, terms + 1, 3]) + int(include_self)
        total = torch.scatter_reduce(input.float(), 0, expanded, src.float(), "sum",
                                     include_self=include_self).to(dtype).float()
        assert not torch.equal((total / exact_count[:, None]).to(dtype), expected)


@pytest.mark.parametrize("backend", ["numba", TRITON_ON_CPU, "reference"])
def test_an_empty_index_promised_sorted_gives_torchs_result(backend):
    """No terms under sorted=True (an empty index is sorted): every mode and reduction gives
    torch's scatter_reduce, include_self or not, with an output of one row or many."""
    for (mode, reduce), shape in itertools.product(MODE_REDUCTIONS, [(1,), (3, 2)]):
        input = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
        index, src = torch.zeros(0, dtype=torch.int64), input.new_empty(0, *shape[1:])
        full_index = index.view(-1, *[1] * (len(shape) - 1)).expand(src.shape)
        for include_self in (True, False):
            with detsum.backend(backend):
                got = detsum.scatter_reduce(input, 0, index, src, reduce, sorted=True,
                                            include_self=include_self, mode=mode)
            expected = torch.scatter_reduce(input, 0, full_index, src, reduce,
                                            include_self=include_self)
            assert_same_bits(got, expected)


@pytest.mark.parametrize("output_rows", [3, 100], ids=["every-row", "few-rows-receive"])
def test_a_broken_sorted_promise_names_the_callers_values(output_rows):
    """The error of a decreasing index under sorted=True quotes the index's own values, also
    where few of the output's rows receive terms (those rows alone are reduced, by their
    positions among them)."""
    index = torch.tensor([0, 2, 1]) if output_rows == 3 else torch.tensor([7, 50, 30])
    input, before = torch.zeros(output_rows), torch.zeros(output_rows)
    first, second = index[1].item(), index[2].item()
    with pytest.raises(ValueError, match=rf"decreases at position 2 \({first} then {second}\)"):
        detsum.scatter_reduce(input, 0, index, torch.ones(3), "sum", sorted=True)
    assert torch.equal(input, before)


# ---------------------------------------------------------------------------------------------
# "kahan": within 1 ulp of the exactly rounded sum
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("include_self", [True, False], ids=["self", "noself"])
@pytest.mark.parametrize("kind", ["row", "elem"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_kahan_sum_within_one_ulp_of_exact(dtype, kind, include_self):
    """Data over many binades with both signs (cancellation); each output element is its input
    (with include_self) plus its source elements, summed exactly and rounded once."""
    seed = seed_of("kahan", dtype, kind)
    rows, n_out, cols = 200, 5, 4
    input = make_data((n_out, cols), dtype, seed=seed, spread=True)
    src = make_data((rows, cols), dtype, seed=seed + 1, spread=True)
    index = make_index(kind, (rows, cols), 0, n_out, "one_huge_segment", seed + 2)
    got = detsum.scatter_reduce(input, 0, index, src, "sum", include_self=include_self,
                                mode="kahan")
    full = torch_index(index, 0, src)
    for j in range(n_out):
        for c in range(cols):
            terms = src[:, c][full[:, c] == j]
            if include_self:
                terms = torch.cat([input[j:j + 1, c], terms])
            if terms.numel() == 0:
                assert_same_bits(got[j, c], input[j, c])
                continue
            exact = reference.exact_sum_rounded(terms)
            assert torch.isfinite(exact)
            ulps = reference.ulp_distance(got[j, c], exact).item()
            assert ulps <= 1, f"output ({j}, {c}): {ulps} ulps"


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["row", "elem"])
@pytest.mark.parametrize("reduce,mode", REDUCE_MODE_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_repeated_runs_and_thread_counts_give_same_bits(dtype, reduce, mode, kind):
    """2000 x 64 into 50 outputs, half of the rows into one: identical bits on every run and
    with 1 or all numba threads."""
    g = torch.Generator().manual_seed(41)
    src = values((2000, 64), dtype, 42, reduce, "large")
    input = values((50, 64), dtype, 43, reduce, "large")
    size = (2000,) if kind == "row" else (2000, 64)
    index = torch.where(torch.rand(size, generator=g) < 0.5, 7,
                        torch.randint(0, 50, size, generator=g))
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        first = detsum.scatter_reduce(input, 0, index, src, reduce, mode=mode)
        for _ in range(2):
            assert_same_bits(detsum.scatter_reduce(input, 0, index, src, reduce, mode=mode), first)
        numba.set_num_threads(1)
        assert_same_bits(detsum.scatter_reduce(input, 0, index, src, reduce, mode=mode), first)
    finally:
        numba.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


def _distinct(shape, seed):
    """float64 values with no ties (gaps >> gradcheck's eps) and no zeros, both signs."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    magnitudes = (torch.randperm(n, generator=g).double() + 1) / n + 0.5
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (magnitudes * signs).view(shape)


@pytest.mark.parametrize("kind", ["row", "elem"])
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("include_self", [True, False], ids=["self", "noself"])
def test_gradcheck(include_self, reduce, kind):
    """float64, data without ties (amax/amin) or zeros (prod); output row 0 receives nothing."""
    shape, dim, n_out = (2, 6, 2), 1, 3
    values_ = _distinct((2, 6 + n_out, 2), seed=seed_of(reduce, kind))
    input = values_[:, :n_out].clone().requires_grad_()
    src = values_[:, n_out:].clone().requires_grad_()
    g = torch.Generator().manual_seed(52)
    size = (6,) if kind == "row" else shape
    index = torch.randint(1, n_out, size, generator=g)
    assert torch.autograd.gradcheck(
        lambda i, s: detsum.scatter_reduce(i, dim, index, s, reduce, include_self=include_self),
        (input, src))


def _grads(fn, input, src, grad):
    input = input.clone().requires_grad_()
    src = src.clone().requires_grad_()
    fn(input, src).backward(grad)
    return input.grad, src.grad


@pytest.mark.parametrize("include_self", [True, False], ids=["self", "noself"])
@pytest.mark.parametrize("reduce", REDUCES)
def test_gradient_matches_torch(reduce, include_self):
    """Gradients with zeros in prod segments (one and two zeros, in src and in input) and ties
    in amax/amin (between terms, and with the input when it takes part) against
    torch.scatter_reduce's own."""
    input = torch.tensor([[1.5, 0.0], [2.0, 3.0], [0.0, -1.0], [4.0, 4.0]], dtype=torch.float64)
    if reduce in ("amax", "amin") and not include_self:
        # torch counts an excluded input that equals the result as a tie (see
        # test_amax_amin_gradient_without_self_splits_between_terms_only): keep clear of it.
        input = input - 10
    src = torch.tensor([[0.5, 2.0],  # row 0: one zero from input (column 1), ties below
                        [2.0, 3.0],  # row 1: ties with the input in amax (2.0, 3.0)
                        [0.0, 3.0],  # row 1: one zero in src (column 0)
                        [0.0, 0.0],  # row 2: two zeros with input's in column 0; column 1: one
                        [-3.0, 5.0],
                        [2.0, 3.0],  # row 1: a third member equal to the max
                        [0.5, 2.0]], dtype=torch.float64)  # row 0: tie with an earlier term
    index = torch.tensor([0, 1, 1, 2, 2, 1, 0])
    grad = torch.tensor([[1.0, -2.0], [0.25, 3.0], [5.0, 7.0], [-1.0, 0.5]], dtype=torch.float64)
    expected = _grads(lambda i, s: torch.scatter_reduce(
        i, 0, torch_index(index, 0, s), s, reduce, include_self=include_self), input, src, grad)
    got = _grads(lambda i, s: detsum.scatter_reduce(i, 0, index, s, reduce,
                                                    include_self=include_self), input, src, grad)
    for a, e in zip(got, expected):
        assert_same_bits(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_row_index_backward_counts_per_row_and_skips_an_input_without_grad(dtype, monkeypatch):
    """A sum into fresh zeros (a GNN aggregation) once spent most of its backward counting,
    element by element, where the terms land, for an input that needs no gradient, and a
    mean counted over every column of a row index. Neither runs the elementwise count now;
    the gradients are the upstream gradient (over the count) at each term's row."""
    import detsum.ops.scatter_reduce as scatter_reduce_module

    def elementwise_count(*args):
        raise AssertionError("the elementwise count ran")

    monkeypatch.setattr(scatter_reduce_module, "_count", elementwise_count)
    g = torch.Generator().manual_seed(61)
    index = torch.randint(0, 100, (2000,), generator=g)
    upstream = torch.randn(100, 16, generator=g).to(dtype)
    counts = torch.bincount(index, minlength=100).clamp_min(1).float().view(-1, 1)
    for reduce, share in (("sum", upstream), ("mean", (upstream / counts).to(dtype))):
        src = torch.randn(2000, 16, generator=g).to(dtype).requires_grad_()
        detsum.scatter_reduce(torch.zeros(100, 16, dtype=dtype), 0, index, src, reduce,
                              include_self=False).backward(upstream)
        assert_same_bits(src.grad, share.index_select(0, index))
    base = torch.randn(100, 16, generator=g).to(dtype).requires_grad_()
    detsum.scatter_reduce(base, 0, index, src.detach(), "sum", include_self=False).backward(
        upstream)
    received = (torch.bincount(index, minlength=100) > 0).view(-1, 1)
    assert_same_bits(base.grad, upstream.masked_fill(received, 0))


@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_amax_amin_gradient_without_self_splits_between_terms_only(reduce):
    """include_self=False: the input takes no part, so a tie with it does not count and the
    tied terms share the whole gradient. (torch 2.13 counts the excluded input as a tie and
    hands out only 2/3 of the gradient here.)"""
    input = torch.tensor([2.0], dtype=torch.float64)
    src = torch.tensor([2.0, 0.0 if reduce == "amax" else 5.0, 2.0], dtype=torch.float64)
    grad = torch.tensor([0.25], dtype=torch.float64)
    grad_input, grad_src = _grads(lambda i, s: detsum.scatter_reduce(
        i, 0, torch.zeros(3, dtype=torch.long), s, reduce, include_self=False), input, src, grad)
    assert_same_bits(grad_input, torch.zeros(1, dtype=torch.float64))
    assert_same_bits(grad_src, torch.tensor([0.125, 0.0, 0.125], dtype=torch.float64))


@pytest.mark.parametrize("n_zeros", [1, 2])
@pytest.mark.parametrize("include_self", [True, False], ids=["self", "noself"])
@pytest.mark.parametrize("kind", ["row", "elem"])
def test_prod_gradient_with_zeros_matches_torch(kind, include_self, n_zeros):
    """A prod segment with one zero: only the zero's member gets a gradient (the product of the
    others); with two zeros every gradient of the segment is 0."""
    g = torch.Generator().manual_seed(61 + n_zeros)
    input = near_one((3, 4), torch.float64, 62)
    src = near_one((8, 4), torch.float64, 63)
    index = torch.tensor([1, 2, 1, 1, 0, 2, 1, 2])
    zero_rows = [0, 3][:n_zeros]  # both go to output 1
    src[zero_rows] = 0.0
    if kind == "elem":
        index = index[:, None].expand(8, 4).contiguous()
        index[:, 1] = torch.randint(0, 3, (8,), generator=g)
    grad = make_data((3, 4), torch.float64, seed=64)
    expected = _grads(lambda i, s: torch.scatter_reduce(
        i, 0, torch_index(index, 0, s), s, "prod", include_self=include_self), input, src, grad)
    got = _grads(lambda i, s: detsum.scatter_reduce(i, 0, index, s, "prod",
                                                    include_self=include_self), input, src, grad)
    for a, e in zip(got, expected):
        assert_same_bits(a, e)
    if n_zeros == 2 and kind == "row":
        assert (got[1][zero_rows] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=dtype_id)
@pytest.mark.parametrize("include_self", [True, False], ids=["self", "noself"])
@pytest.mark.parametrize("kind", ["row", "elem"])
def test_prod_gradient_has_torchs_bits(kind, include_self, dtype):
    """torch's prod gradient, bit for bit, in every mode that has a product: grad * product /
    member (multiplied first), a lone zero's product of the others, and, without
    include_self, grad * input / input where no source lands. Random factors, zeros among
    the sources and the inputs, rows that receive nothing."""
    g = torch.Generator().manual_seed(71)
    for trial in range(6):
        input = torch.randn(6, 5, generator=g).to(dtype)
        src = torch.randn(12, 5, generator=g).to(dtype)
        src.view(-1)[torch.randint(0, src.numel(), (trial * 3,), generator=g)] = 0
        input.view(-1)[torch.randint(0, input.numel(), (trial,), generator=g)] = 0
        index = torch.randint(0, 5, (12,), generator=g)  # row 5 receives nothing
        if kind == "elem":
            index = torch.randint(0, 5, (12, 5), generator=g)
        grad = torch.randn(6, 5, generator=g).to(dtype)
        expected = _grads(lambda i, s: torch.scatter_reduce(
            i, 0, torch_index(index, 0, s), s, "prod", include_self=include_self),
            input, src, grad)
        for mode in ("autograd", "fp32", "kahan"):
            got = _grads(lambda i, s: detsum.scatter_reduce(
                i, 0, index, s, "prod", include_self=include_self, mode=mode), input, src, grad)
            for a, e in zip(got, expected):
                assert_same_bits(a, e)


# ---- the exact mean's term limit -----------------------------------------------------------------

def test_exact_mean_term_limit_counts_the_input_only_when_it_takes_part():
    """At most MAX_TERMS_PER_STATE = 2**30 - 1 terms per output element: the source terms, plus
    the input's own value with include_self (the kernels' base row). Checked on the pure
    functions: a call of 2**30 terms is too large for a test."""
    from detsum import _validation, kernels
    limit = kernels.MAX_TERMS_PER_STATE
    assert limit == 2**30 - 1
    _validation.check_exact_mean_terms("detsum.f", limit, "src.size(0)")
    with pytest.raises(ValueError, match=r"^detsum.f: reduce='mean' with mode='exact' sums at "
                                         r"most 1073741823 terms per output element; got up to "
                                         r"1073741824 \(src.size\(0\)\)"):
        _validation.check_exact_mean_terms("detsum.f", limit + 1, "src.size(0)")
    # The kernels' own check, on stride-0 views: shapes and offsets only, nothing summed.
    dtypes = (torch.float32,)
    one_segment = torch.tensor([0, limit])
    src = torch.zeros(1, 1, 1).expand(1, limit, 1)
    assert kernels.has_exact_work(src, None, one_segment, kernels.MEAN, dtypes, False)
    with pytest.raises(ValueError, match="an exact mean of 1073741824 terms"):
        kernels.has_exact_work(src, None, one_segment, kernels.MEAN, dtypes, True)
    # More positions than the limit in all, fewer in every segment.
    src = torch.zeros(1, 1, 1).expand(1, 2**30, 1)
    halves = torch.tensor([0, 2**29, 2**30])
    assert kernels.has_exact_work(src, None, halves, kernels.MEAN, dtypes, True)
    with pytest.raises(ValueError, match="an exact mean of 1073741824 terms"):
        kernels.has_exact_work(src, None, torch.tensor([0, 2**30]), kernels.MEAN, dtypes,
                               False)


def test_exact_mean_over_the_term_limit_is_refused_before_any_work(monkeypatch):
    """The bound is src.size(dim) (+1 with include_self), read from shapes: a stride-0 src
    one term over the limit is refused at once, in scatter_reduce's words."""
    def work_began(*args, **kwargs):
        raise AssertionError("the call began its work before refusing")

    monkeypatch.setattr(detsum.ops.scatter_reduce, "_run", work_began)
    limit = 2**30 - 1
    for rows, include_self, counted in (
            (limit + 1, False, r"src.size\(0\) = 1073741824"),
            (limit, True, r"src.size\(0\) = 1073741823 and input's own value, "
                          r"include_self=True")):
        src = torch.zeros(1, 3).expand(rows, 3)
        index = torch.zeros(1, dtype=torch.long).expand(rows)
        with pytest.raises(ValueError, match=r"^detsum.scatter_reduce: reduce='mean' with "
                                             r"mode='exact' sums at most 1073741823 terms per "
                                             r"output element; got up to 1073741824 "
                                             rf"\({counted}\)"):
            detsum.scatter_reduce(torch.zeros(1, 3), 0, index, src, "mean",
                                  include_self=include_self, mode="exact")
    # Every other mode has no such limit: it gets as far as its work.
    with pytest.raises(AssertionError, match="began its work"):
        detsum.scatter_reduce(torch.zeros(1, 3), 0, index, src, "mean", mode="fp32")


def test_a_bad_index_is_both_index_error_and_runtime_error():
    """torch.scatter_reduce raises RuntimeError for an index out of range, Python's lookups
    IndexError: detsum's error is both."""
    for call in (lambda: detsum.scatter_reduce(torch.zeros(2), 0, torch.tensor([0, 2]),
                                               torch.ones(2), "sum"),
                 lambda: detsum.index_add(torch.zeros(2), 0, torch.tensor([0, 2]),
                                          torch.ones(2)),
                 lambda: detsum.segment_sum(torch.ones(2), torch.tensor([0, 2]),
                                            perm=torch.tensor([0, 5]))):
        with pytest.raises(RuntimeError, match="is out of range") as raised:
            call()
        assert isinstance(raised.value, IndexError)
        assert type(raised.value) is detsum.IndexOutOfRangeError
