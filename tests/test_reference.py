"""The oracle itself: detsum.reference checked against torch (bit for bit) and exact arithmetic.

Every other test trusts ``detsum.reference``; this file is why. Three kinds of checks:

1. "autograd" mode against the torch computation it claims to reproduce: CPU
   ``index_put_(accumulate=True)`` and the autograd gradient of ``x[index]``.
2. Where torch's own CPU ``scatter_reduce`` / ``scatter_add`` / ``index_add`` agree with a detsum
   mode, and where they do not (the ``test_torch_*`` tests pin each finding, so a torch upgrade
   that changes one fails here first).
3. "kahan" against the exactly rounded sum, and the yardstick helpers on hand-made cases.

Comparisons are bitwise (``assert_same_bits``: ``torch.equal`` alone calls +0.0 and -0.0 equal),
NaNs by position.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from conftest import DTYPES, assert_same_bits, seed_of, torch_deterministic
import detsum
from detsum import reference as ref

HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_EXP = {torch.float16: 4, torch.bfloat16: 12, torch.float32: 12, torch.float64: 12}


def data(shape, dtype, seed):
    """Values over several binades (max 2**MAX_EXP, so fp16 sums of ~100 terms stay finite),
    both signs: enough mantissa bits that every rounding step shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    e = MAX_EXP[dtype]
    return (x * torch.exp2(torch.randint(-e, e + 1, shape, generator=g).double())).to(dtype)


def indices(n, n_out, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return torch.randint(0, n_out, (n,), generator=g)
    # duplicate-heavy: ~90% of the terms go to output 1 (and output 0 gets none)
    heavy = torch.rand(n, generator=g) < 0.9
    return torch.where(heavy, 1, torch.randint(2, n_out, (n,), generator=g))


def index_tuple(dim, index, ndim):
    """``(None,)*dim + (index,)``: the ``x[:, ..., index]`` of aten.index_put_ (the Python
    binding of ``Tensor.index_put_`` takes no slices, the aten op takes None for ':')."""
    return [None] * (dim % ndim) + [index]


def index_put_accumulate(input, dim, index, values):
    indices = index_tuple(dim, index, input.dim())
    return torch.ops.aten.index_put_(input.clone(), indices, values, True)


def expand_rows(index, dim, shape):
    """A 1-D row index as torch.scatter wants it: expanded to the source's shape."""
    view = [-1 if d == dim % len(shape) else 1 for d in range(len(shape))]
    return index.view(view).expand(shape)


# (source shape, dim): slice sizes 1, <= 32 and > 32, and every position of dim. The indexed
# dim has 100 rows.
AUTOGRAD_LAYOUTS = [
    ((100,), 0),  # 1-D: slice size 1
    ((100, 1), 0),  # slice size 1, 2-D
    ((100, 7), 0),  # small stride
    ((100, 32), 0),  # the CUDA small-stride limit
    ((100, 33), 0),  # just above it
    ((100, 70), 0),
    ((4, 100), 1),  # last dim of 2-D
    ((4, 100), -1),
    ((3, 100, 5), 1),  # middle dim
    ((3, 5, 100), -1),  # last dim of 3-D
    ((100, 3, 4), 0),
]


# ---------------------------------------------------------------------------------------------
# 1. "autograd" mode is torch's CPU index_put_(accumulate=True)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1, 0.1])
@pytest.mark.parametrize("kind", ["uniform", "heavy"])
@pytest.mark.parametrize("shape,dim", AUTOGRAD_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_matches_cpu_index_put(dtype, shape, dim, kind, alpha):
    n_out = 6
    out_shape = list(shape)
    out_shape[dim] = n_out
    seed = seed_of(dtype, shape, dim, kind)
    input = data(out_shape, dtype, seed)
    source = data(shape, dtype, seed + 1)
    index = indices(shape[dim], n_out, kind, seed + 2)
    # torch's index_add(alpha) and autograd both scale in the dtype first; so does "autograd".
    scaled = source * alpha if alpha != 1 else source
    with torch_deterministic():
        expected = index_put_accumulate(input, dim, index, scaled)
    actual = ref.index_add(input, dim, index, source, alpha=alpha, mode="autograd")
    assert_same_bits(actual, expected)
    if dtype in HALF_DTYPES:
        # The data must tell the rules apart, or this test would prove nothing.
        wide = ref.index_add(input, dim, index, source, alpha=alpha, mode="fp32")
        assert not torch.equal(wide, expected)


def test_autograd_matches_cpu_index_put_large_fp32():
    """120,000 elements: torch's default path would use atomics; deterministic mode is serial."""
    shape, n_out = (3000, 40), 50
    input, source = data((n_out, 40), torch.float32, 1), data(shape, torch.float32, 2)
    index = indices(shape[0], n_out, "uniform", 3)
    with torch_deterministic():
        expected = index_put_accumulate(input, 0, index, source)
    assert_same_bits(ref.index_add(input, 0, index, source, mode="autograd"), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000])
@pytest.mark.parametrize("slice_size", [1, 8, 32, 33, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_matches_cuda_index_put(dtype, slice_size, n):
    """The contract's CUDA rows were read from Indexing.cu and then confirmed on an H100; this is
    the reference's side of that check. n terms go to row 1, shuffled among 5 terms for rows 0 and 2; the
    reference runs on CPU with the CUDA rules (device_type="cuda")."""
    g = torch.Generator().manual_seed(n * 10_000 + slice_size)
    input = data((3, slice_size), dtype, 1)
    source = data((n + 5, slice_size), dtype, 2)
    index = torch.cat([torch.ones(n, dtype=torch.long), torch.tensor([0, 2, 0, 2, 2])])
    index = index[torch.randperm(n + 5, generator=g)]
    expected = index_put_accumulate(input.cuda(), 0, index.cuda(), source.cuda()).cpu()
    actual = ref.index_add(input, 0, index, source, mode="autograd", device_type="cuda")
    assert_same_bits(actual, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("shape,dim", [((4, 100), -1), ((3, 100, 5), 1), ((100, 3, 4), 0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_matches_cuda_index_put_layouts(dtype, shape, dim):
    """Slice size is what follows the indexed dim: 1 for the last dim, 5 for [3, N, 5] dim 1."""
    out_shape = list(shape)
    out_shape[dim] = 6
    input, source = data(out_shape, dtype, 3), data(shape, dtype, 4)
    index = indices(shape[dim], 6, "heavy", 5)  # ~90 terms in one segment: the warp tree
    expected = index_put_accumulate(input.cuda(), dim, index.cuda(), source.cuda()).cpu()
    actual = ref.index_add(input, dim, index, source, mode="autograd", device_type="cuda")
    assert_same_bits(actual, expected)


def _grad_of_indexing(x_shape, dim, index, grad, dtype):
    x = torch.zeros(x_shape, dtype=dtype, requires_grad=True)
    x[(slice(None),) * (dim % len(x_shape)) + (index,)].backward(grad)
    return x.grad


@pytest.mark.parametrize(
    "shape,dim", [((16, 40), 0), ((4, 16), 1), ((3, 16, 5), 1), ((3, 5, 16), -1), ((16,), 0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_matches_gradient_of_indexing(dtype, shape, dim):
    n_terms = 200
    grad_shape = list(shape)
    grad_shape[dim] = n_terms
    index = indices(n_terms, shape[dim], "uniform", 7)
    grad = data(grad_shape, dtype, 8)
    with torch_deterministic():
        expected = _grad_of_indexing(shape, dim, index, grad, dtype)
    actual = ref.index_add(torch.zeros(shape, dtype=dtype), dim, index, grad, mode="autograd")
    assert_same_bits(actual, expected)


@pytest.mark.parametrize("topk", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_autograd_matches_moe_gather_gradient(dtype, topk):
    """The seed case: the gradient of an MoE token gather X[gather_indices // topk]."""
    seq_len, hidden, num_experts = 32, 64, 4
    g = torch.Generator().manual_seed(topk)
    gather_indices = torch.randint(0, num_experts, (seq_len, topk), generator=g).view(-1).argsort()
    tokens = gather_indices // topk
    X = torch.randn(seq_len, hidden, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(seq_len * topk, hidden, generator=g).to(dtype)
    with torch_deterministic():
        X[tokens].backward(grad)
    zeros = torch.zeros(seq_len, hidden, dtype=dtype)
    actual = ref.index_add(zeros, 0, tokens, grad, mode="autograd")
    assert_same_bits(actual, X.grad)


# ---------------------------------------------------------------------------------------------
# 2. Torch's other CPU accumulations, layout by layout
# ---------------------------------------------------------------------------------------------

# (source shape, dim, index kind): "row" is a 1-D index (expanded for torch), "elem" an index of
# src's full shape. The indexed dim has 30 rows (1-D: 120), scattered into rows 1..4 of 5.
SCATTER_LAYOUTS = [
    ((120,), 0, "row"),  # 1-D: longer, so the 4 outputs see enough roundings
    ((30, 5), 0, "row"),
    ((30, 5), 0, "elem"),
    ((5, 30), -1, "row"),
    ((5, 30), -1, "elem"),
    ((3, 30, 4), 1, "row"),
    ((3, 30, 4), 1, "elem"),
    ((30, 40), 0, "row"),  # rows wider than a vector register
]


def _scatter_case(dtype, shape, dim, kind, seed, *, values=None):
    """Input, src and index for torch (expanded) and for the reference. Output row 0 receives
    no term, so include_self=False must leave it alone."""
    n_out = 5
    out_shape = list(shape)
    out_shape[dim] = n_out
    make = values or (lambda s, k: data(s, dtype, k))
    input, src = make(out_shape, seed), make(shape, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    if kind == "row":
        index = torch.randint(1, n_out, (shape[dim],), generator=g)
        torch_index = expand_rows(index, dim, shape)
    else:
        index = torch_index = torch.randint(1, n_out, shape, generator=g)
    return input, src, index, torch_index


def _near_one(dtype):
    """Factors in [0.5, 2) with both signs and full mantissas: products neither overflow nor
    underflow over a segment, and every multiply rounds."""
    def make(shape, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.exp2(torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1)
        sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
        return (x * sign).to(dtype)
    return make


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "prod"])
@pytest.mark.parametrize("shape,dim,kind", SCATTER_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_scatter_reduce_sum_prod_is_wide(dtype, shape, dim, kind, reduce, include_self):
    """CPU scatter_reduce sum/prod accumulate in the acc type and round once, in every layout
    (row-expanded and element-wise index alike): that is "fp32" mode (and "autograd" for prod)."""
    values = _near_one(dtype) if reduce == "prod" else None
    input, src, index, torch_index = _scatter_case(dtype, shape, dim, kind, 11, values=values)
    expected = torch.scatter_reduce(input, dim, torch_index, src, reduce, include_self=include_self)
    def ours(mode):
        return ref.scatter_reduce(
            input, dim, index, src, reduce, include_self=include_self, mode=mode)

    assert_same_bits(ours("fp32"), expected)
    if reduce == "prod":
        assert_same_bits(ours("kahan"), expected)
        assert_same_bits(ours("autograd"), expected)
    if dtype in HALF_DTYPES:
        # ... and the data tell wide from rounding every step.
        if reduce == "sum":
            assert not torch.equal(ours("autograd"), expected)
        else:
            assert not torch.equal(_prod_round_each(input, dim, index, src, include_self), expected)


def _prod_round_each(input, dim, index, src, include_self):
    """Counter-model for the prod test: multiply in fp32, round to the dtype after every step."""
    out = input.clone()
    d = dim % input.dim()
    full = expand_rows(index, d, src.shape) if index.dim() == 1 and src.dim() > 1 else index
    acc = {}
    for pos in itertools.product(*[range(s) for s in src.shape]):
        target = list(pos)
        target[d] = int(full[tuple(pos)])
        target = tuple(target)
        start = input[target] if include_self else torch.ones((), dtype=input.dtype)
        acc[target] = (acc.get(target, start).float() * src[tuple(pos)].float()).to(input.dtype)
    for target, value in acc.items():
        out[target] = value
    return out


@pytest.mark.parametrize("shape,dim,kind", SCATTER_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_scatter_add_is_wide(dtype, shape, dim, kind):
    input, src, index, torch_index = _scatter_case(dtype, shape, dim, kind, 12)
    assert_same_bits(
        ref.scatter_reduce(input, dim, index, src, "sum", mode="fp32"),
        input.scatter_add(dim, torch_index, src))


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("shape,dim,kind", SCATTER_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_scatter_reduce_mean(dtype, shape, dim, kind, include_self):
    """CPU mean, every layout: "autograd" mode equals torch bit for bit. torch rounds the fp32 sum
    to the dtype first, then divides in fp32 by the count it keeps in the dtype and rounds
    again; for fp32/fp64 that is the "fp32" mode's single rounding."""
    input, src, index, torch_index = _scatter_case(dtype, shape, dim, kind, 13)
    expected = torch.scatter_reduce(input, dim, torch_index, src, "mean", include_self=include_self)

    def reference(mode):
        return ref.scatter_reduce(input, dim, index, src, "mean", include_self=include_self,
                                  mode=mode)

    assert_same_bits(reference("autograd"), expected)
    if dtype not in HALF_DTYPES:
        assert_same_bits(reference("fp32"), expected)


def test_torch_scatter_reduce_mean_double_rounding_example():
    """One bf16 segment where the two roundings differ. The fp32 sum 3 + 3 + (2**-6 + 2**-10) =
    6.0166015625 lies just above the bf16 tie between 6 and 6.03125. torch and "autograd":
    6.03125 / 3 = 2.0104... rounds to 2.015625. "fp32"/"kahan": 6.0166015625 / 3 = 2.00553...
    rounds to 2.0, the correctly rounded mean."""
    src = torch.tensor([3.0, 3.0, 2.0**-6 + 2.0**-10], dtype=torch.bfloat16)
    index = torch.zeros(3, dtype=torch.long)
    input = torch.zeros(1, dtype=torch.bfloat16)
    torch_mean = torch.scatter_reduce(input, 0, index, src, "mean", include_self=False)
    assert torch_mean.item() == 2.015625
    expected = {"fp32": 2.0, "kahan": 2.0, "autograd": 2.015625}
    for mode, value in expected.items():
        ours = ref.scatter_reduce(input, 0, index, src, "mean", include_self=False, mode=mode)
        assert ours.item() == value


def _specials(dtype):
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 2.0, -2.0, 0.5],
                        dtype=torch.float64)

    def make(shape, seed):
        g = torch.Generator().manual_seed(seed)
        return pool[torch.randint(0, len(pool), shape, generator=g)].to(dtype)
    return make


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["amax", "amin", "sum", "prod"])
@pytest.mark.parametrize("shape,dim,kind", SCATTER_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_scatter_reduce_special_values(dtype, shape, dim, kind, reduce, include_self):
    """NaN, +-inf and +-0: amax/amin propagate NaN and keep the earlier of a +0/-0 tie in every
    mode; sum/prod give torch's infinities, NaNs and signs of zero."""
    input, src, index, torch_index = _scatter_case(
        dtype, shape, dim, kind, 14, values=_specials(dtype))
    expected = torch.scatter_reduce(input, dim, torch_index, src, reduce, include_self=include_self)
    modes = ("fp32", "kahan", "autograd") if reduce in ("amax", "amin") else ("fp32",)
    for mode in modes:
        actual = ref.scatter_reduce(
            input, dim, index, src, reduce, include_self=include_self, mode=mode)
        if reduce in ("amax", "amin") and _expanded_fast_path(shape, dim, kind):
            # Same values and NaNs; only the sign of a +0/-0 tie differs (next test).
            assert torch.equal(actual.isnan(), expected.isnan())
            assert torch.equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0))
        else:
            assert_same_bits(actual, expected)


def _expanded_fast_path(shape, dim, kind):
    """torch's CPU scatter_reduce takes a sorted fast path for an index that is a dim-0 row index
    expanded (stride 0) over at least 16 trailing elements."""
    return kind == "row" and dim == 0 and len(shape) > 1 and math.prod(shape[1:]) >= 16


@pytest.mark.parametrize("trailing", [(15,), (16,), (40,), (4, 4), (1, 16)])
@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_amax_amin_zero_tie_on_expanded_index(dtype, reduce, trailing):
    """A +0/-0 tie: torch keeps the EARLIER zero (as detsum does), except on its CPU fast path
    for a dim-0 row index expanded over >= 16 trailing elements, where the LATER zero wins.
    A materialized (contiguous) copy of the same index keeps the earlier one."""
    src = torch.tensor([-0.0, 0.0, 0.0, -0.0], dtype=dtype).view((4,) + (1,) * len(trailing))
    src = src.expand((4,) + trailing).contiguous()
    index = torch.tensor([0, 0, 1, 1])
    expanded = expand_rows(index, 0, src.shape)
    input = torch.full((2,) + trailing, 1.0 if reduce == "amin" else -1.0, dtype=dtype)
    expected_earlier = torch.tensor([-0.0, 0.0], dtype=dtype).view((2,) + (1,) * len(trailing))
    expected_earlier = expected_earlier.expand(input.shape)
    expected_later = -expected_earlier
    ours = ref.scatter_reduce(input, 0, index, src, reduce)
    assert_same_bits(ours, expected_earlier.contiguous())
    materialized = torch.scatter_reduce(input, 0, expanded.contiguous(), src, reduce)
    assert_same_bits(materialized, expected_earlier.contiguous())
    fast = torch.scatter_reduce(input, 0, expanded, src, reduce)
    later_wins = math.prod(trailing) >= 16
    assert_same_bits(fast, (expected_later if later_wins else expected_earlier).contiguous())


def test_amax_amin_tie_and_nan_order():
    """Hand-made: the earlier of -0/+0 wins; NaN wins over everything; NaN as init stays."""
    input = torch.tensor([-0.0, 0.0, math.nan, 1.0])
    src = torch.tensor([0.0, -0.0, 5.0, math.nan, 2.0])
    index = torch.tensor([0, 1, 2, 3, 3])
    amax = ref.scatter_reduce(input, 0, index, src, "amax")
    assert_same_bits(amax, torch.tensor([-0.0, 0.0, math.nan, math.nan]))
    amin = ref.scatter_reduce(input, 0, index, src, "amin", include_self=False)
    assert_same_bits(amin, torch.tensor([0.0, -0.0, 5.0, math.nan]))


# index_add_ (alpha == 1) on CPU: wide when dim is the first or the last dim (any ndim, any
# contiguity), round-every-add on a 1-D tensor and on a middle dim.
INDEX_ADD_LAYOUTS = [
    ((40,), 0, "round_each"),
    ((40, 7), 0, "wide"),
    ((5, 40), 1, "wide"),
    ((40, 3, 4), 0, "wide"),
    ((3, 40, 4), 1, "round_each"),
    ((3, 4, 40), 2, "wide"),
    ((2, 2, 40, 2), 2, "round_each"),
    ((1, 40, 1), 1, "round_each"),
    ((40, 1), 0, "wide"),
]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape,dim,rule", INDEX_ADD_LAYOUTS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_torch_index_add_alpha1(dtype, shape, dim, rule, transposed):
    n_out = 6
    out_shape = list(shape)
    out_shape[dim] = n_out
    input, source = data(out_shape, dtype, 21), data(shape, dtype, 22)
    index = indices(shape[dim], n_out, "uniform", 23)
    if transposed and len(shape) > 1:  # same values, non-contiguous strides
        input = input.transpose(0, -1).contiguous().transpose(0, -1)
        source = source.transpose(0, -1).contiguous().transpose(0, -1)
    mode = "fp32" if rule == "wide" else "autograd"
    expected = input.index_add(dim, index, source)
    assert_same_bits(ref.index_add(input, dim, index, source, mode=mode), expected)
    other = "autograd" if mode == "fp32" else "fp32"
    assert not torch.equal(ref.index_add(input, dim, index, source, mode=other), expected)


@pytest.mark.parametrize("shape,dim", [((40,), 0), ((40, 7), 0), ((3, 40, 4), 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_torch_index_add_fp32_fp64(dtype, shape, dim):
    """fp32/fp64, alpha == 1: a serial sum from the input in canonical order; all three of
    wide, round_each and torch agree."""
    out_shape = list(shape)
    out_shape[dim] = 6
    input, source = data(out_shape, dtype, 31), data(shape, dtype, 32)
    index = indices(shape[dim], 6, "heavy", 33)
    expected = input.index_add(dim, index, source)
    for mode in ("fp32", "autograd"):
        assert_same_bits(ref.index_add(input, dim, index, source, mode=mode), expected)


def _fma(x, a, c, dtype):
    return ref.round_exact(Fraction(x) * Fraction(a) + Fraction(c), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_torch_index_add_alpha_is_fused_on_2d(dtype):
    """torch's CPU index_add_ with alpha != 1 on a 2-D tensor computes acc = fma(x, alpha, acc)
    per add (one rounding for multiply and add), unlike both detsum's separate RN(x * alpha) and
    torch's own index_put_ after ``source * alpha``. (On a 1-D tensor it multiplies
    separately.) So "index_add_ with alpha" is no reference for any detsum mode."""
    alpha = 0.1
    input, source = data((3, 5), dtype, 41), data((12, 5), dtype, 42)
    index = indices(12, 3, "uniform", 43)
    expected = input.index_add(0, index, source, alpha=alpha)
    a = torch.tensor(alpha, dtype=dtype).item()
    fused = input.clone()
    for i, j in enumerate(index.tolist()):
        for c in range(5):
            fused[j, c] = _fma(source[i, c].item(), a, fused[j, c].item(), dtype)
    assert_same_bits(fused, expected)
    ours = ref.index_add(input, 0, index, source, alpha=alpha, mode="fp32")
    assert not torch.equal(ours, expected)
    one_d = input[:, 0].index_add(0, index, source[:, 0], alpha=alpha)
    ours_1d = ref.index_add(input[:, 0], 0, index, source[:, 0], alpha=alpha, mode="fp32")
    assert_same_bits(ours_1d, one_d)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_torch_index_add_alpha_rounds_alpha_to_dtype(dtype):
    """bf16/fp16, alpha != 1, narrow rows (scalar path): torch rounds alpha itself to the dtype,
    then acc = RN(acc + RN(x * RN(alpha))). Rows as wide as a vector register take yet another
    path (unrounded product added in fp32), so torch's result even depends on the column."""
    alpha = 0.1
    input, source = data((5, 7), dtype, 51), data((40, 7), dtype, 52)
    index = indices(40, 5, "uniform", 53)
    expected = input.index_add(0, index, source, alpha=alpha)
    alpha_in_dtype = torch.tensor(alpha).to(dtype).item()
    assert alpha_in_dtype != torch.tensor(alpha, dtype=torch.float32).item()
    def ours(a):
        return ref.index_add(input, 0, index, source, alpha=a, mode="autograd")

    assert_same_bits(ours(alpha_in_dtype), expected)
    assert not torch.equal(ours(alpha), expected)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_torch_gradients_that_autograd_mode_does_and_does_not_match(dtype):
    """On CPU, the gradients of x[idx] and of embedding round every add ("autograd" mode); the
    gradients of index_select, gather and take_along_dim go through index_add_/scatter_add_ with
    an fp32 buffer ("fp32" mode)."""
    n, h, m = 16, 40, 200
    index = indices(m, n, "uniform", 61)
    grad = data((m, h), dtype, 62)
    zeros = torch.zeros(n, h, dtype=dtype)
    rounded = ref.index_add(zeros, 0, index, grad, mode="autograd")
    wide = ref.index_add(zeros, 0, index, grad, mode="fp32")

    def grad_of(f):
        x = torch.zeros(n, h, dtype=dtype, requires_grad=True)
        f(x).backward(grad)
        return x.grad

    assert_same_bits(grad_of(lambda x: x[index]), rounded)
    assert_same_bits(grad_of(lambda x: torch.nn.functional.embedding(index, x)), rounded)
    assert_same_bits(grad_of(lambda x: x.index_select(0, index)), wide)
    assert_same_bits(grad_of(lambda x: x.gather(0, index[:, None].expand(m, h))), wide)
    assert_same_bits(grad_of(lambda x: torch.take_along_dim(x, index[:, None], 0)), wide)


# ---------------------------------------------------------------------------------------------
# The reference's own semantics and rules
# ---------------------------------------------------------------------------------------------


def test_sum_rule_table():
    f32 = torch.float32
    for dtype in DTYPES:
        assert ref.sum_rule("fp32", dtype, "cuda", 1, 100) == "wide"
        assert ref.sum_rule("kahan", dtype, "cpu", 1, 100) == "kahan"
        assert ref.sum_rule("autograd", dtype, "cpu", 1, 100) == "round_each"
        assert ref.sum_rule("autograd", dtype, "cpu", 4096, 1) == "round_each"
    assert ref.sum_rule("autograd", f32, "cuda", 4096, 5) == "round_each"
    assert ref.sum_rule("autograd", f32, "cuda", 33, 5) == "round_each"
    assert ref.sum_rule("autograd", f32, "cuda", 32, 5) == "cuda_small_stride"
    assert ref.sum_rule("autograd", f32, "cuda", 2, 1000) == "cuda_small_stride"
    assert ref.sum_rule("autograd", f32, "cuda", 1, 31) == "cuda_small_stride"
    assert ref.sum_rule("autograd", f32, "cuda", 1, 32) == "cuda_warp_tree"
    assert ref.sum_rule("autograd", f32, "cuda", 1, 1000) == "cuda_warp_tree"
    assert ref.sum_rule("exact", f32, "cuda", 1, 100) == "exact"
    with pytest.raises(ValueError):
        ref.sum_rule("fast", f32, "cpu", 1, 1)
    with pytest.raises(NotImplementedError):
        ref.sum_rule("autograd", f32, "mps", 1, 1)


def _warp_tree_by_lanes(init, terms):
    """The contract's stride-1 CUDA kernel simulated literally: all 32 lanes, and a shuffle-down where a
    lane whose partner is out of range reads its own value (as __shfl_down_sync does)."""
    n, p = len(terms), len(terms) // 32
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    lanes = [f32(0.0) for _ in range(32)]
    for i in range(p):
        lanes = [lanes[l] + f32(terms[32 * i + l]) for l in range(32)]
    for off in (16, 8, 4, 2, 1):
        lanes = [lanes[l] + (lanes[l + off] if l + off < 32 else lanes[l]) for l in range(32)]
    g = lanes[0]
    for i in range(32 * p, n):
        g = g + f32(terms[i])
    return (f32(init) + g).item()


def _sum_one_segment(terms, device, init=0.0, dtype=torch.float32):
    """One fp32 segment through the reference's "autograd" mode as it would run on ``device``."""
    n = len(terms)
    src = torch.tensor(terms, dtype=dtype).view(n, 1)
    base = torch.tensor([[init]], dtype=dtype)
    # slice size 1 (one column, dim 0 of [n, 1]): on "cuda", the stride-1 kernel.
    index = torch.zeros(n, dtype=torch.long)
    return ref.index_add(base, 0, index, src, mode="autograd", device_type=device)[0, 0].item()


def test_cuda_rules_hand_made():
    """2**24 + 31 ones: the serial fp32 rules lose every 1 (each 2**24 + 1 is a tie to even);
    the warp tree adds the ones in pairs first and gets 2**24 + 30."""
    terms = [2.0**24] + [1.0] * 31
    assert _sum_one_segment(terms, "cpu") == 2.0**24  # round_each
    assert _sum_one_segment(terms, "cuda") == 2.0**24 + 30  # 32 terms, slice size 1: warp tree
    assert _warp_tree_by_lanes(0.0, terms) == 2.0**24 + 30
    # small stride: the init is added last, the terms first: 2**24 + (1 + 1) vs (2**24 + 1) + 1.
    assert _sum_one_segment([1.0, 1.0], "cuda", init=2.0**24) == 2.0**24 + 2
    assert _sum_one_segment([1.0, 1.0], "cpu", init=2.0**24) == 2.0**24
    # dim -1 has slice size 1 too: the warp tree runs per row.
    src = torch.tensor([terms, terms[::-1]])
    out = ref.index_add(torch.zeros(2, 1), 1, torch.zeros(32, dtype=torch.long), src,
                        mode="autograd", device_type="cuda")
    assert out[0, 0].item() == 2.0**24 + 30
    assert out[1, 0].item() == _warp_tree_by_lanes(0.0, terms[::-1])


@pytest.mark.parametrize("n", [1, 31, 32, 33, 64, 100, 200])
def test_cuda_warp_tree_matches_literal_lane_simulation(n):
    g = torch.Generator().manual_seed(n)
    scale = torch.exp2(torch.randint(-20, 21, (n,), generator=g).double())
    terms = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(torch.float32).tolist()
    init = 3.0
    assert _sum_one_segment(terms, "cuda", init=init) == _warp_tree_by_lanes(init, terms)
    if n < 32:  # no full warp pass: the tree adds zeros and lane 0 sums serially (small stride)
        serial = torch.tensor(0.0)
        for t in terms:
            serial = serial + t
        assert _warp_tree_by_lanes(init, terms) == (torch.tensor(init) + serial).item()


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_small_stride_rounds_once(dtype):
    """Slice size 2..32 on CUDA: terms summed in fp32 from 0, init added last, one rounding."""
    g = torch.Generator().manual_seed(5)
    src = data((50, 8), dtype, 71)
    init = data((3, 8), dtype, 72)
    index = torch.randint(0, 3, (50,), generator=g)
    out = ref.index_add(init, 0, index, src, mode="autograd", device_type="cuda")
    for j in range(3):
        total = torch.zeros(8)
        for i in (index == j).nonzero().view(-1).tolist():
            total = total + src[i].float()
        expected = (init[j].float() + total).to(dtype) if (index == j).any() else init[j]
        assert_same_bits(out[j], expected)


def test_segment_sum_semantics():
    """CSR offsets, perm, empty segments (+0.0), dims: integer data so every order is exact."""
    src = torch.arange(24, dtype=torch.float64).view(6, 4) - 10
    offsets = torch.tensor([0, 2, 2, 5, 6])
    out = ref.segment_sum(src, offsets)
    expected = torch.stack([src[0:2].sum(0), torch.zeros(4), src[2:5].sum(0), src[5:6].sum(0)])
    assert_same_bits(out, expected)
    perm = torch.tensor([5, 0, 3, 1, 2, 4])
    assert_same_bits(ref.segment_sum(src, offsets, perm=perm), ref.segment_sum(src[perm], offsets))
    assert_same_bits(ref.segment_sum(src.t(), offsets, dim=1), expected.t())
    assert_same_bits(ref.segment_sum(src.t(), offsets, dim=-1), expected.t())
    for mode in ("fp32", "kahan", "autograd"):
        neg_zero = torch.full((3, 2), -0.0)
        empty = ref.segment_sum(neg_zero, torch.tensor([0, 0, 3]), mode=mode)
        assert_same_bits(empty, torch.zeros(2, 2))  # +0.0, also where -0.0 terms were summed


@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_segment_sum_is_index_add_onto_zeros(dtype, mode):
    src = data((40, 3, 5), dtype, 81)
    lengths = [0, 7, 1, 20, 0, 12]
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for dim in (0, 1, 2):
        s = src.movedim(0, dim)
        zeros_shape = list(s.shape)
        zeros_shape[dim] = len(lengths)
        zeros = torch.zeros(zeros_shape, dtype=dtype)
        expected = ref.index_add(zeros, dim, segment_ids, s, mode=mode)
        assert_same_bits(ref.segment_sum(s, offsets, dim=dim, mode=mode), expected)


def test_index_add_alpha_term_is_separate_multiply():
    """fp32 mode: term = RN_acc(x * alpha), then add; a fused multiply-add would differ here."""
    x = torch.tensor([[1.0 + 2.0**-12]])
    alpha = 1.0 + 2.0**-12
    base = torch.tensor([[-1.0]])
    out = ref.index_add(base, 0, torch.tensor([0]), x, alpha=alpha, mode="fp32")
    # x * alpha = 1 + 2**-11 + 2**-24: a tie in fp32, to even 1 + 2**-11; minus 1 is 2**-11.
    assert out.item() == 2.0**-11
    assert _fma(x.item(), alpha, -1.0, torch.float32).item() == 2.0**-11 + 2.0**-24


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("mode", ["fp32", "autograd"])
def test_rows_without_terms_keep_input_bits(mode, device):
    """-0.0 and NaN in rows no term reaches come back unchanged, as from torch's kernels, which
    never visit them. ("kahan" is the exception: see the next test.)"""
    input = torch.tensor([[-0.0, math.nan], [-0.0, 1.0], [2.0, -0.0]])
    index = torch.tensor([2, 2])
    source = torch.ones(2, 2)
    out = ref.index_add(input, 0, index, source, mode=mode, device_type=device)
    assert_same_bits(out[:2], input[:2])
    if device == "cpu" and mode == "autograd":
        assert_same_bits(out, index_put_accumulate(input, 0, index, source))
    for reduce in ("sum", "mean", "prod", "amax", "amin"):
        for include_self in (True, False):
            out = ref.scatter_reduce(input, 0, index, source, reduce, include_self=include_self,
                                     mode=mode, device_type=device)
            assert_same_bits(out[:2], input[:2])


def test_kahan_non_finite_and_signed_zero():
    def kahan(values, init=0.0, dtype=torch.float32):
        n = len(values)
        return ref.index_add(torch.tensor([init], dtype=dtype), 0, torch.zeros(n, dtype=torch.long),
                             torch.tensor(values, dtype=dtype), mode="kahan")

    assert kahan([math.inf, 1.0]).item() == math.inf  # c is nan here, and must not leak
    assert kahan([3e38, 3e38, -1.0]).item() == math.inf  # overflow in s
    assert kahan([-math.inf, 1.0, 5.0]).item() == -math.inf
    assert math.isnan(kahan([math.inf, -math.inf]).item())
    assert math.isnan(kahan([1.0, math.nan]).item())
    assert kahan([1.0, 2.0**-30, -1.0]).item() == 2.0**-30  # the compensation at work
    assert kahan([1.0, 2.0**-30, -1.0], dtype=torch.bfloat16).item() == 2.0**-30
    # c == 0 returns s itself, so a sum of -0.0 stays -0.0 as in a plain sum (s + (+0.0) would
    # make it +0.0).
    assert_same_bits(kahan([], init=-0.0), torch.tensor([-0.0]))
    assert_same_bits(kahan([-0.0], init=-0.0), torch.tensor([-0.0]))
    minus_zero = torch.tensor([-0.0])
    fp32 = ref.index_add(minus_zero, 0, torch.tensor([0]), minus_zero, mode="fp32")
    assert_same_bits(fp32, torch.tensor([-0.0]))


# ---------------------------------------------------------------------------------------------
# 3. Accuracy: "kahan" within 1 ulp of the exactly rounded sum, and within its stated bound
# ---------------------------------------------------------------------------------------------

# Per dtype: the exponent span of the data, and how many binades the cancelling pairs sit above
# it. fp16's range allows little; for bf16/fp16 the fp32 accumulator has 13+ spare bits, for
# fp32/fp64 data Neumaier works in the data's own precision (see test_kahan_limit_fp32).
WILD = {
    torch.float16: ((-14, 4), 9),
    torch.bfloat16: ((-40, 40), 40),
    torch.float32: ((-40, 40), 20),
    torch.float64: ((-200, 200), 40),
}


def wild_segments(dtype, seed, *, cancel=None, n_segments=24, columns=6):
    """Segments over many orders of magnitude with cancellation: random signs, plus pairs
    (x * 2**cancel, -x * 2**cancel) that cancel exactly (even-length segments) or up to a
    random 2**-6 part (odd ones), shuffled in, so the sum is far below the largest terms."""
    g = torch.Generator().manual_seed(seed)
    (lo, hi), default_cancel = WILD[dtype]
    cancel = default_cancel if cancel is None else cancel
    lengths = torch.randint(1, 80, (n_segments,), generator=g)
    rows = []
    for length in lengths.tolist():
        base = torch.randn(length, columns, generator=g, dtype=torch.float64)
        base = base * torch.exp2(torch.randint(lo, hi + 1, (length, columns), generator=g).double())
        big = base[: max(1, length // 4)] * 2.0**cancel
        near = -big * (1 + torch.rand(big.shape, generator=g, dtype=torch.float64) * 2.0**-6)
        seg = torch.cat([base, big, near if length % 2 else -big])
        seg = seg[torch.randperm(seg.shape[0], generator=g)]
        rows.append(seg.to(dtype))
    offsets = torch.tensor([0] + torch.tensor([r.shape[0] for r in rows]).cumsum(0).tolist())
    return torch.cat(rows), offsets


def _ulps_against_exact(src, offsets, mode):
    exact = torch.stack([ref.exact_sum_rounded(src[a:b], dim=0)
                         for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    assert torch.isfinite(src).all() and torch.isfinite(exact).all()
    return ref.ulp_distance(ref.segment_sum(src, offsets, mode=mode), exact)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kahan_within_one_ulp_of_exact(dtype, record_property):
    src, offsets = wild_segments(dtype, seed=91)
    kahan_ulps = _ulps_against_exact(src, offsets, "kahan")
    assert kahan_ulps.max().item() <= 1, kahan_ulps.max().item()
    # For information: how far the plain wide sum strays on the same data (max ulps seen when
    # this was written: fp16 1, bf16 43956, fp32 7553627, fp64 1.7e12; kahan: 0, 1, 1, 0).
    wide_ulps = _ulps_against_exact(src, offsets, "fp32")
    record_property("kahan_max_ulps", kahan_ulps.max().item())
    record_property("fp32_max_ulps", wide_ulps.max().item())
    record_property("kahan_exact_fraction", (kahan_ulps == 0).double().mean().item())
    record_property("fp32_exact_fraction", (wide_ulps == 0).double().mean().item())
    assert wide_ulps.max().item() >= kahan_ulps.max().item()


def test_kahan_limit_fp32():
    """Where "kahan"'s 1 ulp stops: the compensation is itself summed in the acc type, so its
    error grows like N**2 * u**2 * sum|x| (the stated bound, tested below). Pairs cancelling
    2**40 above the surviving terms (condition number ~2**45) leave errors of thousands of
    ulps in fp32 data."""
    src, offsets = wild_segments(torch.float32, seed=91, cancel=40)
    assert _ulps_against_exact(src, offsets, "kahan").max().item() > 1000


# The stated bound (docs/determinism.md, "Accuracy"): for N values x_i (the init and the terms
# as the mode forms them, acc-type numbers) with exact sum S and no partial sum overflowing,
#     |out - S| <= ulp_dtype(out) + 2 N**2 u**2 sum|x_i|,   u = 2**-24 (fp32 acc), 2**-53 (fp64),
# for N u <= 1/4. Each Neumaier step's error e_j is exact, so S = s + sum e_j; c is a rounded
# sum of the N - 1 errors, each at most u times a partial sum (|e_j| <= u (1 + gamma) sum|x|),
# which it misses by at most gamma_{N-2} sum|e_j|; RN_acc(s + c) then RN_dtype add at most half
# an ulp of the acc type and of the dtype.
ACC_UNIT = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-24, torch.float32: 2.0**-24,
            torch.float64: 2.0**-53}


#: Cancelling pairs further above the surviving terms than in WILD (fp16's range allows no more).
FAR_CANCEL = {torch.float16: 9, torch.bfloat16: 80, torch.float32: 40, torch.float64: 80}


def _spacing(value: float, dtype: torch.dtype) -> Fraction:
    """ulp_dtype(value): the distance between consecutive values of ``dtype`` at |value| (the
    subnormal spacing near zero)."""
    info = torch.finfo(dtype)
    digits = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}[dtype]
    smallest = Fraction(info.tiny) * Fraction(info.eps)  # the subnormal spacing
    if value == 0:
        return smallest
    _, exponent = math.frexp(abs(value))  # |value| in [2**(exponent-1), 2**exponent)
    return max(smallest, Fraction(2) ** (exponent - digits))


def _assert_kahan_bound(out: torch.Tensor, values: list[list[float]], dtype: torch.dtype
                        ) -> float:
    """Check the bound for each column (``values[j]``: column j's N acc-type values) and
    return the largest error seen, in ulps of the dtype at the result."""
    u = Fraction(ACC_UNIT[dtype])
    worst = 0.0
    for column, result in zip(values, out.tolist()):
        n = len(column)
        assert n * u <= Fraction(1, 4)
        exact = sum(map(Fraction, column), Fraction(0))
        magnitude = sum((abs(Fraction(x)) for x in column), Fraction(0))
        spacing = _spacing(result, dtype)
        error = abs(Fraction(result) - exact)
        assert error <= spacing + 2 * n * n * u * u * magnitude, (
            dtype, n, float(error), float(spacing), float(magnitude))
        worst = max(worst, float(error / spacing))
    return worst


def _adversarial_segments(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Segments (fp64 columns, exactly representable in ``dtype``) made to break the bound:
    huge terms that cancel to leave tiny survivors, and long runs of terms far below a large
    partial sum, whose rounding errors all land in the compensation, across the chunk
    boundary (CHUNK_TERMS = 256)."""
    g = torch.Generator().manual_seed(seed)
    top = {torch.float16: 14, torch.bfloat16: 60, torch.float32: 60, torch.float64: 500}[dtype]
    digits = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}[dtype]
    big = 2.0 ** (top // 2)
    small = 2.0 ** -(top // 2)
    # The shape: [B, 1, b, -B, -1] with b far below 1, and its mirror images.
    segments = [torch.tensor([[big], [1.0], [small], [-big], [-1.0]], dtype=torch.float64),
                torch.tensor([[-1.0], [big], [small], [1.0], [-big]], dtype=torch.float64)]
    for length in (3, 17, 255, 256, 257, 600):
        for _ in range(4):
            head = 2.0 ** torch.randint(top // 4, top // 2 + 1, (1, 3), generator=g).double()
            # Terms a few ulps of the head in size, with random mantissas: each add rounds.
            below = head * 2.0 ** -(digits - 3)
            mantissas = torch.rand(length, 3, generator=g, dtype=torch.float64) * 2 - 1
            terms = below * torch.round(mantissas * 2.0 ** (digits - 1)) * 2.0 ** -(digits - 1)
            rows = torch.cat([head, terms, -head])
            segments.append(rows[torch.randperm(rows.shape[0], generator=g)])
    return [seg.to(dtype).to(torch.float64) for seg in segments]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kahan_error_within_the_stated_bound(dtype):
    """Try to break the stated "kahan" bound: cancellation far beyond what 1 ulp survives,
    long runs that load the compensation, segments across the chunk boundary, an init and a
    scaled source (index_add's alpha, whose terms are RN_acc(x * alpha)); on the reference
    and on the default backend, which must agree bit for bit."""
    acc = ref.acc_dtype(dtype)
    worst = 0.0
    segments = _adversarial_segments(dtype, seed=seed_of("kahan-bound", str(dtype)))
    wild, wild_offsets = wild_segments(dtype, seed=7, cancel=FAR_CANCEL[dtype])
    wild = wild.double()
    segments += [wild[a:b] for a, b in zip(wild_offsets[:-1].tolist(),
                                           wild_offsets[1:].tolist())]
    for seg in segments:
        src = seg.to(dtype)
        offsets = torch.tensor([0, src.shape[0]])
        out = ref.segment_sum(src, offsets, mode="kahan")
        assert_same_bits(detsum.segment_sum(src, offsets, mode="kahan"), out)
        worst = max(worst, _assert_kahan_bound(out[0], src.to(acc).T.tolist(), dtype))
        # The same values through index_add, from an init, with alpha: the terms are the
        # products rounded to the acc type.
        init, alpha = src[:1], 0.75
        index = torch.zeros(src.shape[0] - 1, dtype=torch.int64)
        out = ref.index_add(init, 0, index, src[1:], alpha=alpha, mode="kahan")
        assert_same_bits(detsum.index_add(init, 0, index, src[1:], alpha=alpha, mode="kahan"),
                         out)
        terms = src[1:].to(acc) * torch.tensor(alpha, dtype=acc)  # RN_acc(x * alpha)
        columns = torch.cat([init.to(acc), terms]).T.tolist()
        worst = max(worst, _assert_kahan_bound(out[0], columns, dtype))
    # The cases do break the old promise of 1 ulp (not in fp16: fp16's 40 binades leave its
    # rounding errors in an fp32 sum few enough bits for the fp32 compensation to hold them).
    assert worst > 1 or dtype == torch.float16, worst


# ---------------------------------------------------------------------------------------------
# The yardstick helpers on hand-made cases
# ---------------------------------------------------------------------------------------------


def _next_up(x: torch.Tensor) -> torch.Tensor:
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return (x.view(bits) + 1).view(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ulp_distance(dtype):
    t = lambda *v: torch.tensor(v, dtype=dtype)  # noqa: E731
    one = t(1.0)
    assert ref.ulp_distance(one, _next_up(one)).item() == 1
    assert ref.ulp_distance(_next_up(_next_up(one)), one).item() == 2
    assert ref.ulp_distance(t(0.0), t(-0.0)).item() == 0
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # smallest subnormal
    assert ref.ulp_distance(t(tiny), t(-tiny)).item() == 2  # across zero: -tiny, 0, +tiny
    assert ref.ulp_distance(t(torch.finfo(dtype).max), t(math.inf)).item() == 1
    assert ref.ulp_distance(t(math.inf), t(math.inf)).item() == 0
    # 1 and -1: twice the number of floats in (0, 1]
    int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[one.element_size()]
    n_below_one = one.view(int_type).item()
    assert ref.ulp_distance(t(1.0), t(-1.0)).item() == float(2 * n_below_one)
    nan_cases = ref.ulp_distance(t(math.nan, math.nan, 1.0), t(math.nan, 1.0, math.nan))
    assert nan_cases.tolist() == [0.0, math.inf, math.inf]
    assert ref.ulp_distance(t(1.0, 2.0), t(1.0)).shape == (2,)  # broadcasts


def test_ulp_distance_fp64_extremes_and_types():
    big = torch.tensor([torch.finfo(torch.float64).max], dtype=torch.float64)
    d = ref.ulp_distance(big, -big)
    assert d.item() == float(2**63 - 1)  # saturated, not wrapped
    with pytest.raises(TypeError):
        ref.ulp_distance(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))


def test_exact_sum_rounded_hand_made():
    f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
    assert ref.exact_sum_rounded([1e16, 1.0, -1e16]).item() == 1.0  # naive: 0.0
    assert ref.exact_sum_rounded([0.1] * 10).item() == 1.0  # math.fsum; naive: 0.9999999999999999
    # Once, not twice: 1 + 2**-8 + 2**-30 rounds up to 1 + 2**-7 in bf16; via fp64 (exact here)
    # and fp32 (1 + 2**-8, a tie) torch's conversions would give 1.0.
    assert ref.exact_sum_rounded([1.0, 2.0**-8, 2.0**-30], bf16).item() == 1.0 + 2.0**-7
    assert torch.tensor(1.0 + 2.0**-8 + 2.0**-30, dtype=f64).to(bf16).item() == 1.0
    assert ref.exact_sum_rounded([1.0, 2.0**-11, 2.0**-40], f16).item() == 1.0 + 2.0**-10
    assert ref.exact_sum_rounded([1.0, 2.0**-24, 2.0**-80], f32).item() == 1.0 + 2.0**-23
    # The same, where fp64 itself is inexact: 2**-80 and 2**-200 survive only as a sticky bit.
    assert ref.exact_sum_rounded([1.0, 2.0**-24, 2.0**-200], f32).item() == 1.0 + 2.0**-23
    # exact ties go to even
    assert ref.exact_sum_rounded([1.0, 2.0**-8], bf16).item() == 1.0
    assert ref.exact_sum_rounded([1.0 + 2.0**-7, 2.0**-8], bf16).item() == 1.0 + 2.0**-6
    # signed zeros
    assert_same_bits(ref.exact_sum_rounded([-0.0, -0.0]), torch.tensor(-0.0, dtype=f64))
    assert_same_bits(ref.exact_sum_rounded([0.0, -0.0]), torch.tensor(0.0, dtype=f64))
    assert_same_bits(ref.exact_sum_rounded([1.0, -1.0], f32), torch.tensor(0.0))
    assert_same_bits(ref.exact_sum_rounded([]), torch.tensor(0.0, dtype=f64))
    # non-finite and overflow
    assert ref.exact_sum_rounded([math.inf, 1.0]).item() == math.inf
    assert math.isnan(ref.exact_sum_rounded([math.inf, -math.inf]).item())
    assert math.isnan(ref.exact_sum_rounded([math.nan, 1.0]).item())
    big = torch.finfo(f64).max
    assert ref.exact_sum_rounded([big, big]).item() == math.inf
    assert ref.exact_sum_rounded([big, big, -big]).item() == big  # math.fsum raises here
    assert ref.exact_sum_rounded([3e38, 3e38], bf16).item() == math.inf
    # subnormal results
    tiny = torch.finfo(f32).tiny * torch.finfo(f32).eps
    assert ref.exact_sum_rounded([tiny, tiny, -tiny], f32).item() == tiny


def test_exact_sum_rounded_tensor_form():
    x = data((7, 3, 4), torch.bfloat16, 101)
    for dim in (0, 1, 2, -1):
        out = ref.exact_sum_rounded(x, dim=dim)
        assert out.dtype == torch.bfloat16
        moved = x.movedim(dim, 0)
        assert out.shape == moved.shape[1:]
        for pos in itertools.product(*[range(s) for s in moved.shape[1:]]):
            column = moved[(slice(None),) + tuple(pos)].tolist()
            exact = sum(Fraction(v) for v in column)
            assert out[tuple(pos)].item() == ref.round_exact(exact, torch.bfloat16).item()
    assert ref.exact_sum_rounded(x, torch.float64, dim=0).dtype == torch.float64


def test_round_exact():
    third = torch.tensor(1 / 3, dtype=torch.float32).item()  # no tie anywhere: one rounding
    assert ref.round_exact(Fraction(1, 3), torch.float32).item() == third
    # just above a bf16 tie, by less than an fp64 ulp
    v = Fraction(1) + Fraction(1, 2**8) + Fraction(1, 2**300)
    assert ref.round_exact(v, torch.bfloat16).item() == 1.0 + 2.0**-7
    assert ref.round_exact(v, torch.float64).item() == 1.0 + 2.0**-8
    v = Fraction(1) + Fraction(1, 2**8) - Fraction(1, 2**300)
    assert ref.round_exact(v, torch.bfloat16).item() == 1.0
    assert ref.round_exact(Fraction(10**400), torch.float32).item() == math.inf
    assert ref.round_exact(-Fraction(10**400), torch.float64).item() == -math.inf
