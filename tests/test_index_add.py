"""detsum.index_add / index_add_: numba == reference bit for bit, "autograd" == torch, accuracy,
determinism, in-place semantics and gradients.

The reference backend (``detsum.reference``, run through the same public function) is the
oracle for every mode; "autograd" mode is also checked against torch itself (CPU
``index_put_(accumulate=True)`` and the gradient of ``x[index]``), and "kahan" against the
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

HALF_DTYPES = (torch.float16, torch.bfloat16)
N_OUT = 7  # output rows along dim in the generated cases
# Cases: what the index and the tensors look like (see make_case).
CASES = [
    "uniform",  # 37 source rows spread uniformly over 7 outputs
    "empty_segments",  # only odd outputs receive rows: first, last and inner outputs get none
    "one_huge_segment",  # 300 source rows, ~90% into one output
    "zero_rows",  # no source rows at all (index is empty)
    "zero_columns",  # every row has 0 elements
    "noncontiguous",  # input, source and index are strided views with dims stored in reverse
    "alpha",  # alpha = 0.3: the scaled term is rounded on its own, never fused into the add
    "int32_index",  # int32 index
]


def make_index(kind: str, n: int, n_out: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "empty_segments":
        return 2 * torch.randint(0, n_out // 2, (n,), generator=g) + 1
    if kind == "one_huge_segment":
        heavy = torch.rand(n, generator=g) < 0.9
        return torch.where(heavy, n_out // 2, torch.randint(0, n_out, (n,), generator=g))
    return torch.randint(0, n_out, (n,), generator=g)


def make_case(template, dim, dtype, case):
    """(input, index, source, alpha) for one layout and case; spread data so that every
    rounding step shows in the bits."""
    rows = {"zero_rows": 0, "one_huge_segment": 300}.get(case, 37)
    zero_columns = case == "zero_columns"
    seed = seed_of(template, dim, dtype, case)
    input = make_data(with_rows(template, N_OUT, zero_columns=zero_columns), dtype, seed=seed,
                      spread=True)
    source = make_data(with_rows(template, rows, zero_columns=zero_columns), dtype,
                       seed=seed + 1, spread=True)
    index = make_index(case, rows, N_OUT, seed + 2)
    if case == "int32_index":
        index = index.to(torch.int32)
    if case == "noncontiguous":
        input, source, index = strided_copy(input), strided_copy(source), strided_copy(index)
        assert not source.is_contiguous() and not index.is_contiguous()
        assert input.dim() == 1 or not input.is_contiguous()
    alpha = 0.3 if case == "alpha" else 1
    return input, index, source, alpha


def both_backends(fn):
    with detsum.backend("numba"):
        got = fn()
    with detsum.backend("reference"):
        expected = fn()
    return got, expected


def index_put_accumulate(input, dim, index, values):
    """What autograd runs for the gradient of x[index] (and the contract's "autograd" definition)."""
    dim = dim % input.dim()
    indices = [None] * dim + [index]
    if input.dtype in (torch.float32, torch.float64):
        with torch_deterministic():
            return torch.ops.aten.index_put_(input.clone(), indices, values, True)
    return torch.ops.aten.index_put_(input.clone(), indices, values, True)


# ---------------------------------------------------------------------------------------------
# numba == reference, bit for bit, every mode
# ---------------------------------------------------------------------------------------------


CASE_PARAMS = list(case_params(LAYOUTS, CASES))


@pytest.mark.parametrize("template,dim,case", CASE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_numba_matches_reference(mode, dtype, template, dim, case):
    input, index, source, alpha = make_case(template, dim, dtype, case)
    got, expected = both_backends(
        lambda: detsum.index_add(input, dim, index, source, alpha=alpha, mode=mode))
    assert got.is_contiguous() and got.shape == input.shape
    assert_same_bits(got, expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,dim,n_out", [
    ((50, 1100), 0, 2),  # rows wider than one kernel column chunk, few outputs
    ((2, 50, 300), 1, 3),  # several column chunks per output row, with an outer dim
])
def test_numba_matches_reference_wide_rows(mode, dtype, shape, dim, n_out):
    """Many columns: the kernel splits a row into column chunks; the order inside each element
    must not notice."""
    seed = seed_of(shape, dim, dtype)
    out_shape = list(shape)
    out_shape[dim] = n_out
    input = make_data(out_shape, dtype, seed=seed, spread=True)
    source = make_data(shape, dtype, seed=seed + 1, spread=True)
    index = make_index("uniform", shape[dim], n_out, seed + 2)
    got, expected = both_backends(
        lambda: detsum.index_add(input, dim, index, source, alpha=-2.5, mode=mode))
    assert_same_bits(got, expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_numba_matches_reference_special_values(mode, dtype):
    """NaN, +-inf and signed zeros in input and source, including inf - inf in one segment and
    outputs that receive nothing (their -0.0 and NaN must come back unchanged)."""
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 3.5])
    g = torch.Generator().manual_seed(7)
    input = pool[torch.randint(0, len(pool), (9, 6), generator=g)].to(dtype)
    source = pool[torch.randint(0, len(pool), (40, 6), generator=g)].to(dtype)
    index = torch.randint(0, 6, (40,), generator=g)  # outputs 6..8 receive nothing
    got, expected = both_backends(lambda: detsum.index_add(input, 0, index, source, mode=mode))
    assert_same_bits(got, expected)
    assert_same_bits(got[6:], input[6:])


# ---------------------------------------------------------------------------------------------
# "autograd" mode == torch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template,dim,case", CASE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_autograd_mode_matches_torch_index_put(dtype, template, dim, case):
    input, index, source, alpha = make_case(template, dim, dtype, case)
    # torch (and autograd) scale in the dtype before accumulating.
    scaled = source * alpha if alpha != 1 else source
    expected = index_put_accumulate(input, dim, index, scaled)
    got = detsum.index_add(input, dim, index, source, alpha=alpha, mode="autograd")
    assert_same_bits(got, expected)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_autograd_mode_data_tells_the_modes_apart(dtype):
    """Guard for the test above: on its data the wide sum differs from torch's rounding after
    every add, so matching torch means something."""
    input, index, source, _ = make_case((N, 8), 0, dtype, "one_huge_segment")
    expected = index_put_accumulate(input, 0, index, source)
    assert_same_bits(detsum.index_add(input, 0, index, source, mode="autograd"), expected)
    assert not torch.equal(detsum.index_add(input, 0, index, source, mode="fp32"), expected)


def _grad_of_indexing(x_shape, dim, index, grad, dtype):
    x = torch.zeros(x_shape, dtype=dtype, requires_grad=True)
    selector = (slice(None),) * (dim % len(x_shape)) + (index,)
    if dtype in (torch.float32, torch.float64):
        with torch_deterministic():
            x[selector].backward(grad)
    else:
        x[selector].backward(grad)
    return x.grad


@pytest.mark.parametrize("template,dim", [pytest.param(*p.values, id=p.id) for p in LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_autograd_mode_matches_gradient_of_indexing(dtype, template, dim):
    """index_add(zeros, dim, idx, g, mode="autograd") is x.grad after
    x[..., idx, ...].backward(g)."""
    seed = seed_of("grad", template, dim, dtype)
    x_shape = with_rows(template, N_OUT)
    index = make_index("one_huge_segment", 120, N_OUT, seed)
    grad = make_data(with_rows(template, 120), dtype, seed=seed + 1, spread=True)
    expected = _grad_of_indexing(x_shape, dim, index, grad, dtype)
    got = detsum.index_add(torch.zeros(x_shape, dtype=dtype), dim, index, grad, mode="autograd")
    assert_same_bits(got, expected)


@pytest.mark.parametrize("topk", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
def test_autograd_mode_matches_moe_gather_gradient(dtype, topk):
    """The seed case: the gradient of an MoE token gather X[gather_indices // topk]."""
    seq_len, hidden, num_experts = 32, 64, 4
    torch.manual_seed(1000 + topk)
    gather_indices = torch.randint(0, num_experts, (seq_len, topk)).view(-1).argsort()
    tokens = gather_indices // topk
    X = torch.randn(seq_len, hidden, dtype=dtype, requires_grad=True)
    grad = torch.randn(seq_len * topk, hidden, dtype=dtype)
    with torch_deterministic():
        X[tokens].backward(grad)
    got = detsum.index_add(torch.zeros(seq_len, hidden, dtype=dtype), 0, tokens, grad,
                           mode="autograd")
    assert_same_bits(got, X.grad)


# ---------------------------------------------------------------------------------------------
# "kahan": within 1 ulp of the exactly rounded sum
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_kahan_within_one_ulp_of_exact(dtype, dim):
    """Data over many binades, both signs (cancellation); every output row is input row + its
    source rows, summed exactly and rounded once."""
    seed = seed_of("kahan", dtype, dim)
    rows, n_out, cols = 200, 6, 5
    input = make_data((n_out, cols), dtype, seed=seed, spread=True)
    source = make_data((rows, cols), dtype, seed=seed + 1, spread=True)
    index = make_index("one_huge_segment", rows, n_out, seed + 2)
    got = detsum.index_add(input.movedim(0, dim), dim, index, source.movedim(0, dim),
                           mode="kahan").movedim(dim, 0)
    exact = torch.stack([
        reference.exact_sum_rounded(torch.cat([input[j:j + 1], source[index == j]]))
        for j in range(n_out)])
    assert torch.isfinite(exact).all()
    ulps = reference.ulp_distance(got, exact)
    assert ulps.max().item() <= 1, f"max {ulps.max().item()} ulps"


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------


def _large_case(dtype, kind):
    """"skewed": 2000 x 64 source rows into 50 outputs, half of them into output 7 (one long
    segment that a parallel split would have to divide). "few_wide_outputs": 600 x 300 into 3
    outputs, where the kernel sizes its column chunks by the thread count."""
    g = torch.Generator().manual_seed(5)
    rows, cols, n_out = (2000, 64, 50) if kind == "skewed" else (600, 300, 3)
    source = make_data((rows, cols), dtype, seed=6, spread=True)
    input = make_data((n_out, cols), dtype, seed=8, spread=True)
    index = torch.randint(0, n_out, (rows,), generator=g)
    if kind == "skewed":
        index = torch.where(torch.rand(rows, generator=g) < 0.5, 7, index)
    return input, index, source


@pytest.mark.parametrize("kind", ["skewed", "few_wide_outputs"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_repeated_runs_and_thread_counts_give_same_bits(dtype, mode, kind):
    input, index, source = _large_case(dtype, kind)

    def run():
        return detsum.index_add(input, 0, index, source, alpha=0.3, mode=mode)

    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        first = run()
        for _ in range(2):
            assert_same_bits(run(), first)
        numba.set_num_threads(1)
        assert_same_bits(run(), first)
    finally:
        numba.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------
# index_add_ in place
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided_slice"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_index_add_inplace_returns_input_and_equals_index_add(mode, dtype, layout):
    base = make_data((6, 10), dtype, seed=11, spread=True)
    source = make_data((30, 10), dtype, seed=12, spread=True)
    index = make_index("uniform", 30, 6, 13)
    parent = None
    if layout == "contiguous":
        target = base.clone()
    elif layout == "transposed":
        target = base.t().contiguous().t()  # same values, column-major
    else:  # every other column of a wider parent
        parent = make_data((6, 20), dtype, seed=14)
        parent[:, ::2] = base
        target = parent[:, ::2]
    assert target.is_contiguous() == (layout == "contiguous")
    parent_before = None if parent is None else parent.clone()
    expected = detsum.index_add(base, 0, index, source, alpha=0.3, mode=mode)
    returned = detsum.index_add_(target, 0, index, source, alpha=0.3, mode=mode)
    assert returned is target
    assert_same_bits(target, expected)
    if parent is not None:  # the columns between the slice's are untouched
        assert_same_bits(parent[:, 1::2], parent_before[:, 1::2])


@pytest.mark.parametrize("mode", MODES)
def test_index_add_inplace_with_source_requiring_grad(mode):
    """The in-place call on a graph: its value equals index_add and gradients reach source."""
    base = make_data((4, 3), torch.float64, seed=21)
    source = make_data((9, 3), torch.float64, seed=22).requires_grad_()
    index = make_index("uniform", 9, 4, 23)
    target = base.clone()
    out = detsum.index_add_(target, 0, index, source, alpha=2.5, mode=mode)
    assert out is target
    assert_same_bits(out.detach(), detsum.index_add(base, 0, index, source.detach(), alpha=2.5,
                                                   mode=mode))
    grad = make_data((4, 3), torch.float64, seed=24)
    out.backward(grad)
    assert_same_bits(source.grad, grad[index] * 2.5)


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1, 2.5])
@pytest.mark.parametrize("shape,dim", [((12, 3), 0), ((2, 12, 3), -2), ((12,), 0)])
@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(mode, shape, dim, alpha):
    out_shape = list(shape)
    out_shape[dim] = 5
    input = make_data(out_shape, torch.float64, seed=31).requires_grad_()
    source = make_data(shape, torch.float64, seed=32).requires_grad_()
    index = make_index("uniform", shape[dim], 5, 33)

    def f(input, source):
        return detsum.index_add(input, dim, index, source, alpha=alpha, mode=mode)

    assert torch.autograd.gradcheck(f, (input, source))
