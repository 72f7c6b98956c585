"""detsum's torch_scatter-compatible functions (detsum/scatter_compat.py).

The first half runs torch_scatter's own test tables (tests/torch_scatter_tables.py: its inputs
and expected outputs) and its broadcasting, zero-size and composite cases, checked the way
torch_scatter checks them. The second half checks what detsum adds: the modes' bits against the
reference backend, the same bits whatever the layout of the index, first-occurrence arguments,
IEEE special values, compile, and errors that leave every tensor untouched.
"""

from __future__ import annotations

import contextlib
import unittest.mock

import pytest
import torch
from torch.autograd import gradcheck

import detsum
from conftest import DTYPES, assert_same_bits, dtype_id, host_reads, make_data
from detsum import _segments
from torch_scatter_tables import GATHER_TABLES, SCATTER_TABLES, SEGMENT_TABLES

TABLE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
                torch.int64]
SEGMENT_REDUCES = ["sum", "add", "mean", "min", "max"]
SCATTER_REDUCES = SEGMENT_REDUCES + ["mul"]
FLOAT_MODES = ["fp32", "kahan", "autograd", "exact"]


def table_modes(dtype):
    """Integer tables run in every mode (integer arithmetic is exact in any order, so every
    mode gives torch_scatter's integers, products included); float ones in the default mode
    (the float modes are checked against the reference below)."""
    return ["fp32"] if dtype.is_floating_point else FLOAT_MODES


def tensor(values, dtype):
    return torch.tensor(values).to(dtype)


def table_id(table_list):
    return [f"table{i}" for i in range(len(table_list))]


# ---- torch_scatter's tables ---------------------------------------------------------------------

@pytest.mark.parametrize("reduce", SCATTER_REDUCES)
@pytest.mark.parametrize("table", SCATTER_TABLES, ids=table_id(SCATTER_TABLES))
def test_scatter_table(table, reduce):
    for dtype in TABLE_DTYPES:
        for mode in table_modes(dtype):
            check_scatter_table(table, reduce, dtype, mode)


def check_scatter_table(table, reduce, dtype, mode):
    src, index = tensor(table["src"], dtype), tensor(table["index"], torch.long)
    expected = tensor(table[reduce], dtype)
    for layout in ("contiguous", "transposed"):
        if layout == "transposed":
            # A non-contiguous src and index (torch_scatter's test_non_contiguous).
            if src.dim() > 1:
                src = src.transpose(0, 1).contiguous().transpose(0, 1)
            if index.dim() > 1:
                index = index.transpose(0, 1).contiguous().transpose(0, 1)
        result = getattr(detsum, f"scatter_{reduce}")(src, index, table["dim"], mode=mode)
        if reduce in ("min", "max"):
            result, arg = result
            assert torch.equal(arg, tensor(table[f"arg_{reduce}"], torch.long)), (dtype, mode)
        assert torch.equal(result, expected), (dtype, mode)
        generic = detsum.scatter(src, index, table["dim"], reduce=reduce, mode=mode)
        assert torch.equal(generic, expected), (dtype, mode)


@pytest.mark.parametrize("reduce", SCATTER_REDUCES)
@pytest.mark.parametrize("table", SCATTER_TABLES, ids=table_id(SCATTER_TABLES))
def test_scatter_table_out(table, reduce):
    for dtype in TABLE_DTYPES:
        for mode in table_modes(dtype):
            check_scatter_table_out(table, reduce, dtype, mode)


def check_scatter_table_out(table, reduce, dtype, mode):
    """out= takes part and is written in place (torch_scatter's test_out, where it can test)."""
    src, index = tensor(table["src"], dtype), tensor(table["index"], torch.long)
    expected = tensor(table[reduce], dtype)
    out = torch.full_like(expected, -2)
    returned = getattr(detsum, f"scatter_{reduce}")(src, index, table["dim"], out, mode=mode)
    if reduce in ("min", "max"):
        returned = returned[0]
    assert returned is out, dtype
    if reduce in ("sum", "add"):
        assert torch.equal(out, expected - 2), dtype
    elif reduce == "min":
        assert torch.equal(out, torch.full_like(expected, -2)), dtype
    elif reduce == "max":
        assert torch.equal(out, expected.masked_fill(expected == 0, -2)), dtype
    elif reduce == "mul":
        # Starting from -2, and -2 where nothing lands (the table's 1).
        assert torch.equal(out, expected * -2), dtype


@pytest.mark.parametrize("reduce", SCATTER_REDUCES)
@pytest.mark.parametrize("table", SCATTER_TABLES, ids=table_id(SCATTER_TABLES))
def test_scatter_table_gradcheck(table, reduce):
    src = tensor(table["src"], torch.float64).requires_grad_()
    index = tensor(table["index"], torch.long)
    assert gradcheck(detsum.scatter, (src, index, table["dim"], None, None, reduce))


@pytest.mark.parametrize("reduce", SEGMENT_REDUCES)
@pytest.mark.parametrize("table", SEGMENT_TABLES, ids=table_id(SEGMENT_TABLES))
def test_segment_table(table, reduce):
    for dtype in TABLE_DTYPES:
        for mode in table_modes(dtype):
            check_segment_table(table, reduce, dtype, mode)


def check_segment_table(table, reduce, dtype, mode):
    src = tensor(table["src"], dtype)
    index, indptr = tensor(table["index"], torch.long), tensor(table["indptr"], torch.long)
    expected = tensor(table[reduce], dtype)
    for layout in ("contiguous", "transposed"):
        if layout == "transposed":
            src, index, indptr = (t.transpose(0, 1).contiguous().transpose(0, 1)
                                  if t.dim() > 1 else t for t in (src, index, indptr))
        for kind, pointer in (("csr", indptr), ("coo", index)):
            result = getattr(detsum, f"segment_{reduce}_{kind}")(src, pointer, mode=mode)
            if reduce in ("min", "max"):
                result, arg = result
                assert torch.equal(arg, tensor(table[f"arg_{reduce}"], torch.long)), (kind, dtype)
            assert torch.equal(result, expected), (kind, dtype, mode)
            generic = getattr(detsum, f"segment_{kind}")(src, pointer, reduce=reduce, mode=mode)
            assert torch.equal(generic, expected), (kind, dtype, mode)


@pytest.mark.parametrize("reduce", SEGMENT_REDUCES)
@pytest.mark.parametrize("table", SEGMENT_TABLES, ids=table_id(SEGMENT_TABLES))
def test_segment_table_out(table, reduce):
    for dtype in TABLE_DTYPES:
        check_segment_table_out(table, reduce, dtype)


def check_segment_table_out(table, reduce, dtype):
    """segment_csr overwrites out; segment_coo reduces into it (torch_scatter's test_out)."""
    src = tensor(table["src"], dtype)
    index, indptr = tensor(table["index"], torch.long), tensor(table["indptr"], torch.long)
    expected = tensor(table[reduce], dtype)
    out = torch.full_like(expected, -2)
    getattr(detsum, f"segment_{reduce}_csr")(src, indptr, out)
    assert torch.equal(out, expected), dtype
    out.fill_(-2)
    getattr(detsum, f"segment_{reduce}_coo")(src, index, out)
    if reduce in ("sum", "add"):
        assert torch.equal(out, expected - 2), dtype
    elif reduce == "min":
        assert torch.equal(out, torch.full_like(expected, -2)), dtype
    elif reduce == "max":
        assert torch.equal(out, expected.masked_fill(expected == 0, -2)), dtype


@pytest.mark.parametrize("reduce", SEGMENT_REDUCES)
@pytest.mark.parametrize("table", SEGMENT_TABLES, ids=table_id(SEGMENT_TABLES))
def test_segment_table_gradcheck(table, reduce):
    src = tensor(table["src"], torch.float64).requires_grad_()
    index, indptr = tensor(table["index"], torch.long), tensor(table["indptr"], torch.long)
    assert gradcheck(detsum.segment_csr, (src, indptr, None, reduce))
    assert gradcheck(detsum.segment_coo, (src, index, None, None, reduce))


@pytest.mark.parametrize("table", GATHER_TABLES, ids=table_id(GATHER_TABLES))
def test_gather_table(table):
    for dtype in TABLE_DTYPES:
        check_gather_table(table, dtype)


def check_gather_table(table, dtype):
    src, expected = tensor(table["src"], dtype), tensor(table["expected"], dtype)
    index, indptr = tensor(table["index"], torch.long), tensor(table["indptr"], torch.long)
    assert torch.equal(detsum.gather_csr(src, indptr), expected), dtype
    assert torch.equal(detsum.gather_coo(src, index), expected), dtype
    out = torch.full_like(expected, -2)
    assert detsum.gather_csr(src, indptr, out) is out and torch.equal(out, expected), dtype
    out.fill_(-2)
    assert detsum.gather_coo(src, index, out) is out and torch.equal(out, expected), dtype
    if src.dim() > 1:
        src, index, indptr = (t.transpose(0, 1).contiguous().transpose(0, 1)
                              if t.dim() > 1 else t for t in (src, index, indptr))
        assert torch.equal(detsum.gather_csr(src, indptr), expected), dtype
        assert torch.equal(detsum.gather_coo(src, index), expected), dtype


@pytest.mark.parametrize("table", GATHER_TABLES, ids=table_id(GATHER_TABLES))
def test_gather_table_gradcheck(table):
    src = tensor(table["src"], torch.float64).requires_grad_()
    index, indptr = tensor(table["index"], torch.long), tensor(table["indptr"], torch.long)
    assert gradcheck(detsum.gather_csr, (src, indptr, None))
    assert gradcheck(detsum.gather_coo, (src, index, None))


@pytest.mark.parametrize("reduce", SCATTER_REDUCES)
def test_index_broadcasting(reduce):
    """torch_scatter's test_broadcasting: a 1-D index along dim 2, and a [B, 1, H, W] one."""
    batch, channels, height, width = 4, 3, 8, 8
    g = torch.Generator().manual_seed(0)
    src = torch.randn((batch, channels, height, width), generator=g)
    for index in (torch.randint(0, height, (height,), generator=g),
                  torch.randint(0, height, (batch, 1, height, width), generator=g)):
        out = detsum.scatter(src, index, dim=2, dim_size=height, reduce=reduce)
        assert out.shape == (batch, channels, height, width)
        # The broadcast index, materialised, gives the same bits.
        full = (index if index.dim() == 4 else index.view(1, 1, -1, 1)).expand(src.shape)
        full = full.contiguous()
        assert_same_bits(detsum.scatter(src, full, dim=2, dim_size=height, reduce=reduce), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("reduce", SEGMENT_REDUCES)
def test_zero_elements(reduce, dtype):
    """torch_scatter's test_zero_tensors: every function on a [0, 0, 0, 16] tensor, backward
    included."""
    x = torch.randn(0, 0, 0, 16, dtype=dtype, requires_grad=True)
    index = torch.tensor([], dtype=torch.long)
    indptr = torch.tensor([], dtype=torch.long)
    for out in (detsum.scatter(x, index, dim=0, dim_size=0, reduce=reduce),
                detsum.segment_coo(x, index, dim_size=0, reduce=reduce),
                detsum.gather_coo(x, index),
                detsum.segment_csr(x, indptr, reduce=reduce),
                detsum.gather_csr(x, indptr)):
        out.backward(torch.randn_like(out))
        assert out.shape == (0, 0, 0, 16), dtype


def _groups(src: torch.Tensor, index: torch.Tensor, groups: int) -> list[torch.Tensor]:
    return [src[index == g] for g in range(groups)]


def test_softmax_and_log_softmax():
    """torch_scatter's test_softmax / test_log_softmax data, each group against torch."""
    src = torch.tensor([0.2, 0, 0.2, -2.1, 3.2, 7, -1, float("-inf")], requires_grad=True)
    index = torch.tensor([0, 1, 0, 1, 1, 2, 4, 4])
    for ours, theirs in ((detsum.scatter_softmax, torch.softmax),
                         (detsum.scatter_log_softmax, torch.log_softmax)):
        out = ours(src, index)
        expected = torch.empty_like(out)
        for g in range(5):
            if (index == g).any():
                expected[index == g] = theirs(src.detach()[index == g], dim=-1)
        assert torch.allclose(out, expected)
        out.backward(torch.randn_like(out))
        assert torch.isfinite(src.grad[:7]).all()
        src.grad = None


def test_logsumexp():
    """torch_scatter's test_logsumexp: each group equals torch.logsumexp, an empty one is 0."""
    inputs = torch.tensor([0.5, 0.5, 0.0, -2.1, 3.2, 7.0, -1.0, -100.0], requires_grad=True)
    index = torch.tensor([0, 0, 1, 1, 1, 2, 4, 4])
    outputs = detsum.scatter_logsumexp(inputs, index)
    for group, out in zip(inputs.split([2, 3, 1, 0, 2]), outputs.unbind()):
        if group.numel():
            assert out.tolist() == torch.logsumexp(group, dim=0).tolist()
        else:
            assert out.item() == 0.0
    outputs.backward(torch.randn_like(outputs))


def test_logsumexp_out():
    """torch_scatter's test_logsumexp_out: out joins the sum, keeps its value where the result
    is not finite, and holds the result."""
    out = torch.tensor([-10.0, -10.0])
    returned = detsum.scatter_logsumexp(src=torch.tensor([-1.0, -50.0]),
                                        index=torch.tensor([0, 0]), out=out)
    assert returned is out
    assert out.allclose(torch.tensor([-0.9999, -10.0]), atol=1e-4)


def test_std():
    """torch_scatter's test_std."""
    src = torch.tensor([[2, 0, 1, 4, 3], [0, 2, 1, 3, 4]], dtype=torch.float, requires_grad=True)
    index = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    out = detsum.scatter_std(src, index, dim=-1, unbiased=True)
    std = src.std(dim=-1, unbiased=True)[0]
    assert torch.allclose(out, torch.tensor([[std, 0], [0, std]]))
    out.backward(torch.randn_like(out))


# ---- what detsum adds ---------------------------------------------------------------------------

def _scatter_cases():
    """(src, index, dim) in the layouts that pick different paths: a 1-D index (whole rows), a
    broadcast [B, 1, N] index, and a full per-element index; heavy repeats."""
    g = torch.Generator().manual_seed(7)
    yield "rows", (40, 6), torch.randint(0, 5, (40,), generator=g), 0
    yield "broadcast", (3, 40, 6), torch.randint(0, 5, (3, 40, 1), generator=g), 1
    yield "elements", (40, 6), torch.randint(0, 5, (40, 6), generator=g), 0


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce", ["sum", "mean", "mul", "min", "max"])
def test_scatter_modes_match_the_reference(reduce, dtype, mode):
    """Every layout of the index, in every mode, equals detsum.scatter_reduce on the
    reference backend (the oracle) bit for bit."""
    if reduce == "mul" and mode == "exact":
        pytest.skip("no exact product")
    for name, shape, index, dim in _scatter_cases():
        src = make_data(shape, dtype, seed=3, spread=reduce != "mul")
        if reduce == "mul":
            src = 1 + src / 8
        got = detsum.scatter(src, index, dim, dim_size=6, reduce=reduce, mode=mode)
        lined_up = index.view(-1, 1) if index.dim() == 1 else index
        full = lined_up.expand(shape).contiguous()
        primitive = {"sum": "sum", "mean": "mean", "mul": "prod", "min": "amin",
                     "max": "amax"}[reduce]
        base = torch.full(got.shape, 1 if reduce == "mul" else 0, dtype=dtype)
        with detsum.backend("reference"):
            expected = detsum.scatter_reduce(base, dim, full, src, primitive,
                                             include_self=reduce == "mul", mode=mode)
        assert_same_bits(got, expected)


@pytest.mark.parametrize("mode", FLOAT_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_segment_csr_equals_scatter_of_its_index(dtype, mode):
    """segment_csr (its own segment_sum path, batched pointers, rows outside every segment)
    gives the bits of scatter with the index the pointers describe."""
    src = make_data((2, 30, 5), dtype, seed=11, spread=True)
    indptr = torch.tensor([[2, 5, 5, 17, 29], [0, 0, 9, 30, 30]])
    for reduce in ("sum", "mean", "min", "max"):
        for pointer in (indptr[:1], indptr):
            got = detsum.segment_csr(src, pointer, reduce=reduce, mode=mode)
            for b in range(2):
                p = pointer[min(b, pointer.shape[0] - 1)]
                rows = src[b, p[0]:p[-1]]
                index = torch.repeat_interleave(torch.arange(4), p.diff())
                expected = detsum.scatter(rows, index, 0, dim_size=4, reduce=reduce, mode=mode)
                assert_same_bits(got[b], expected)


def test_min_max_take_the_first_of_equal_values_and_propagate_nan():
    src = torch.tensor([1.0, 3.0, 3.0, -0.0, 0.0, float("nan"), 2.0, float("nan"),
                        float("-inf")])
    index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])
    values, arg = detsum.scatter_max(src, index, dim_size=5)
    assert values[:2].tolist() == [3.0, 0.0] and torch.isnan(values[2])
    assert values[3].item() == float("-inf") and values[4].item() == 0.0
    assert torch.signbit(values[1])  # -0.0 came first: it is the maximum kept
    assert arg.tolist() == [1, 3, 5, 8, 9]
    values, arg = detsum.scatter_min(src, index, dim_size=5)
    assert arg.tolist() == [0, 3, 5, 8, 9]


def test_max_gradient_goes_to_the_first_maximum_alone():
    src = torch.tensor([1.0, 3.0, 3.0, 2.0], requires_grad=True)
    detsum.scatter_max(src, torch.tensor([0, 0, 0, 1]))[0].sum().backward()
    assert src.grad.tolist() == [0.0, 1.0, 0.0, 1.0]


def test_max_with_out_keeps_out_where_it_wins():
    out = torch.tensor([5.0, -1.0, 0.0])
    values, arg = detsum.scatter_max(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([0, 1, 0]),
                                     out=out)
    assert values is out and out.tolist() == [5.0, 2.0, 0.0]
    assert arg.tolist() == [3, 1, 3]  # a tie with out keeps out's value: no source position


def test_max_with_out_passes_the_gradient_to_whichever_value_stayed():
    start = torch.tensor([5.0, -1.0, 0.0], requires_grad=True)
    src = torch.tensor([1.0, 2.0, 5.0], requires_grad=True)
    out = start * 1
    for want_arg in (True, False):
        start.grad = src.grad = None
        out = start * 1
        if want_arg:
            detsum.scatter_max(src, torch.tensor([0, 1, 0]), out=out)
        else:
            detsum.scatter(src, torch.tensor([0, 1, 0]), out=out, reduce="max")
        (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        assert start.grad.tolist() == [1.0, 0.0, 3.0]  # out's 5 ties the source's: out stays
        assert src.grad.tolist() == [0.0, 2.0, 0.0]


def test_mean_with_out_sums_out_but_does_not_count_it():
    out = torch.tensor([1.0, 10.0, 4.0])
    detsum.scatter_mean(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]), out=out)
    assert out.tolist() == [2.0, 13.0, 4.0]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64], ids=str)
def test_integer_dtypes_are_exact(dtype):
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 100, (50, 3), generator=g).to(dtype)
    index = torch.randint(0, 7, (50,), generator=g)
    wide = src.to(torch.int64)
    for reduce in ("sum", "mul", "min", "max", "mean"):
        got = detsum.scatter(src, index, 0, dim_size=8, reduce=reduce)
        assert got.dtype == dtype
        for row in range(8):
            members = wide[index == row]
            if members.numel() == 0:
                expected = torch.full((3,), 1 if reduce == "mul" else 0)
            elif reduce == "sum":
                expected = members.sum(0)
            elif reduce == "mul":
                expected = members.prod(0)
            elif reduce == "min":
                expected = members.min(0).values
            elif reduce == "max":
                expected = members.max(0).values
            else:  # the sum wraps in the dtype, then divides (torch_scatter's order)
                expected = members.sum(0).to(dtype).div(members.shape[0], rounding_mode="floor")
            assert torch.equal(got[row], expected.to(dtype)), (reduce, row)


@pytest.mark.parametrize("mode", ["fp32", "exact"])
def test_same_bits_for_one_and_two_threads(mode):
    g = torch.Generator().manual_seed(5)
    src = torch.randn(20000, 16, generator=g).to(torch.bfloat16)
    index = torch.randint(0, 300, (20000,), generator=g)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append([detsum.scatter_mean(src, index, 0, dim_size=300, mode=mode),
                            detsum.scatter_max(src, index, 0, dim_size=300, mode=mode)[1],
                            detsum.segment_coo(src, index.sort().values, dim_size=300,
                                               mode=mode)])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert_same_bits(a, b)


def test_gather_backward_is_the_deterministic_segment_sum():
    src = make_data((6, 4), torch.float32, seed=2).requires_grad_()
    indptr = torch.tensor([0, 3, 3, 7, 8, 12, 20])
    grad = make_data((20, 4), torch.float32, seed=4, spread=True)
    detsum.gather_csr(src, indptr, mode="exact").backward(grad)
    assert_same_bits(src.grad, detsum.segment_csr(grad, indptr, mode="exact"))


def _torch_sums_in_backward(output: torch.Tensor) -> list[str]:
    """The autograd nodes behind ``output`` whose backward sums terms with torch's own scatter
    add (atomics on a GPU): an index_select, an advanced index, or a gather that reads some
    source element more than once. (scatter_max's gather at ``arg`` reads each element at most
    once: its backward adds one term per element, so it has no order to get wrong.)"""
    seen, stack, found = set(), [output.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name in ("IndexSelectBackward0", "IndexBackward0"):
            found.append(name)
        if name == "GatherBackward0":
            index = node._saved_index.movedim(node._saved_dim, 0)
            if (index.sort(dim=0).values.diff(dim=0) == 0).any():
                found.append(name)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


COMPOSITES = {
    "scatter_softmax": lambda src, index, mode: detsum.scatter_softmax(src, index, 0, mode=mode),
    "scatter_log_softmax": lambda src, index, mode: detsum.scatter_log_softmax(
        src, index, 0, mode=mode),
    "scatter_logsumexp": lambda src, index, mode: detsum.scatter_logsumexp(
        src, index, 0, mode=mode),
    "scatter_std": lambda src, index, mode: detsum.scatter_std(src, index, 0, mode=mode),
}


@pytest.mark.parametrize("name", COMPOSITES)
def test_composites_sum_their_gradients_deterministically(name):
    """The composites' gradients go through detsum's sums alone: torch's gather backward (a
    scatter_add with atomics on a GPU) once summed the gradient of each group's maximum and
    total. In mode="exact" every sum has no order, so the gradient of a permuted input is the
    permuted gradient, bit for bit."""
    g = torch.Generator().manual_seed(13)
    src = torch.randn(4000, 3, generator=g)
    index = torch.randint(0, 20, (4000,), generator=g)
    upstream = torch.randn(20 if name in ("scatter_logsumexp", "scatter_std") else 4000, 3,
                           generator=g)
    permutation = torch.randperm(4000, generator=g)
    grads = []
    for order in (torch.arange(4000), permutation):
        leaf = src[order].clone().requires_grad_()
        out = COMPOSITES[name](leaf, index[order], "exact")
        assert _torch_sums_in_backward(out) == []
        out.backward(upstream if out.shape[0] == 20 else upstream[order])
        restored = torch.empty_like(leaf.grad)
        restored[order] = leaf.grad
        grads.append(restored)
    assert_same_bits(grads[1], grads[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select_copies_forward_and_sums_backward_in_mode(dim, dtype):
    """The forward is torch's index_select; the gradient is detsum.index_add into zeros, in
    every mode; "autograd" gives the gradient torch computes for ``src[index]``."""
    g = torch.Generator().manual_seed(17)
    src = make_data((30, 7, 5), dtype, seed=5)
    index = torch.randint(0, src.shape[dim], (300,), generator=g)
    expected_rows = src.index_select(dim, index)
    grad = make_data(expected_rows.shape, dtype, seed=6, spread=True)
    for mode in FLOAT_MODES:
        leaf = src.clone().requires_grad_()
        rows = detsum.index_select(leaf, dim, index, mode=mode)
        assert_same_bits(rows, expected_rows)
        rows.backward(grad)
        assert_same_bits(leaf.grad, detsum.index_add(torch.zeros_like(src), dim, index, grad,
                                                     mode=mode))
    leaf = src.clone().requires_grad_()
    leaf[(slice(None),) * (dim % 3) + (index,)].backward(grad)
    via_autograd = src.clone().requires_grad_()
    detsum.index_select(via_autograd, dim, index, mode="autograd").backward(grad)
    assert_same_bits(via_autograd.grad, leaf.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_index_select_fp32_mode_has_torchs_cpu_backward_bits_along_dim0(dtype):
    """On a CPU, torch's own index_select backward (index_add_ along the first dim) sums each
    row's gradients in fp32 in order of appearance, rounded once: "fp32" mode's bits, for
    rows that receive at most 256 terms (longer ones detsum sums in chunks)."""
    g = torch.Generator().manual_seed(19)
    src = make_data((500, 16), dtype, seed=8)
    index = torch.randint(0, 500, (20000,), generator=g)  # about 40 terms per row
    grad = make_data((20000, 16), dtype, seed=9, spread=True)
    ours, theirs = src.clone().requires_grad_(), src.clone().requires_grad_()
    detsum.index_select(ours, 0, index).backward(grad)
    theirs.index_select(0, index).backward(grad)
    assert_same_bits(ours.grad, theirs.grad)


def test_index_select_gradcheck_integers_and_empty():
    src = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([5, 0, 0, 2, 5, 5])
    assert gradcheck(lambda s: detsum.index_select(s, 0, index), (src,))
    assert gradcheck(lambda s: detsum.index_select(s, 1, torch.tensor([2, 2, 0]), mode="exact"),
                     (src,))
    integers = torch.arange(12).view(4, 3)
    assert torch.equal(detsum.index_select(integers, 0, index[:3] % 4),
                       integers.index_select(0, index[:3] % 4))
    empty = detsum.index_select(src, 0, torch.tensor([], dtype=torch.long))
    assert empty.shape == (0, 3)
    empty.sum().backward()
    assert torch.equal(src.grad, torch.zeros(6, 3, dtype=torch.float64))


def test_index_select_errors_name_the_argument():
    src = torch.ones(4, 3)
    with pytest.raises(IndexError, match=r"detsum.index_select: index\[1\] = 4 is out of range "
                                         r"for src.size\(0\) = 4"):
        detsum.index_select(src, 0, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="detsum.index_select"):
        detsum.index_select(src, 0, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="mode='fast' is not a detsum mode"):
        detsum.index_select(src, 0, torch.tensor([0]), mode="fast")


def test_compiled_functions_give_eager_bits():
    g = torch.Generator().manual_seed(9)
    src = torch.randn(64, 8, generator=g).to(torch.bfloat16)
    index = torch.randint(0, 10, (64,), generator=g)
    indptr = torch.tensor([0, 10, 10, 40, 64])

    def run(src, index, indptr):
        # gather_csr's output size is indptr's last value: under fullgraph, out= gives it.
        return (detsum.scatter(src, index, 0, dim_size=10, reduce="mean"),
                detsum.scatter_max(src, index, 0, dim_size=10)[0],
                detsum.segment_csr(src, indptr, reduce="sum"),
                detsum.segment_coo(src, index.sort().values, dim_size=10, reduce="mean"),
                detsum.gather_csr(src[:4], indptr, src.new_empty(64, 8)))

    def composites(src, index):
        return (detsum.scatter_softmax(src, index, 0, dim_size=10),
                detsum.scatter_logsumexp(src, index, 0, dim_size=10),
                detsum.scatter_std(src, index, 0, dim_size=10))

    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True)
    for got, expected in zip(compiled(src, index, indptr), run(src, index, indptr)):
        assert_same_bits(got, expected)
    # The composites' exp, log and sqrt are torch's elementwise ops, which inductor generates
    # code for (its exp can differ from eager's in the last bit); captured whole and run by
    # eager kernels, they give eager's bits.
    captured = torch.compile(composites, fullgraph=True, backend="aot_eager")
    wide = src.float()
    for got, expected in zip(captured(wide, index), composites(wide, index)):
        assert_same_bits(got, expected)


@pytest.mark.parametrize("form", ["materialised rows", "elements"])
def test_compiled_backward_of_an_index_of_src_shape_gives_eager_bits(form):
    """A materialised 2-D index (the rows repeated in memory, or any values): eager code's
    backward compares it with its first slice to take the row path, a compiled backward
    (whose index is traced: no values to compare) takes the element path, with the same
    bits."""
    g = torch.Generator().manual_seed(13)
    src = torch.randn(50, 4, generator=g)
    index = (torch.randint(0, 10, (50, 1), generator=g).expand(50, 4).contiguous()
             if form == "materialised rows" else torch.randint(0, 10, (50, 4), generator=g))
    upstream = torch.randn(10, 4, generator=g)

    def scatter(src):
        return detsum.scatter_sum(src, index, dim=0, dim_size=10) * 3

    torch._dynamo.reset()
    results = []
    # Traced here, not taken from a cache that an earlier compilation filled; AOTAutograd's
    # tracing of the backward is what failed, with any backend.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        for fn in (torch.compile(scatter, fullgraph=True, backend="aot_eager"), scatter):
            leaf = src.clone().requires_grad_()
            out = fn(leaf)
            out.backward(upstream)
            results.append((out.detach(), leaf.grad))
    for got, expected in zip(*results):
        assert_same_bits(got, expected)


def test_compiled_sizes_from_the_index_without_dim_size():
    """What docs/switching.md says of dim_size under fullgraph: the scatter functions and
    gather_coo need none (eager's bits, and a new size where the index grows); segment_coo
    needs dim_size or out, gather_csr out."""
    g = torch.Generator().manual_seed(3)
    src = torch.randn(64, 8, generator=g)
    index = torch.randint(0, 10, (64,), generator=g)
    sized = (lambda src, index: detsum.scatter(src, index, 0, reduce="mean"),
             lambda src, index: detsum.scatter_max(src, index, 0)[0],
             lambda src, index: detsum.gather_coo(src[:10], index.sort().values))
    for fn in sized:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        assert_same_bits(compiled(src, index), fn(src, index))
        grown = index.clone()
        grown[0] = 12
        if fn is not sized[2]:  # gather_coo's source has 10 rows
            assert_same_bits(compiled(src, grown), fn(src, grown))
    # Two sizes read from one index in one graph, forward and backward, along dim 0 and 1
    # (torch's own pass once merged the two reads and lost the second size).
    for dim, shape in ((0, (64, 8)), (1, (3, 64, 2))):
        index_along = index if dim == 0 else index.view(1, -1, 1).expand(shape)
        data = torch.randn(shape, generator=g)
        upstream = [torch.randn(shape[:dim] + (10,) + shape[dim + 1:], generator=g)
                    for _ in range(2)]

        def pair(src, index=index_along, dim=dim):
            return (detsum.scatter_sum(src, index, dim=dim),
                    detsum.scatter_max(src, index, dim=dim)[0])

        torch._dynamo.reset()
        with torch._functorch.config.patch(enable_autograd_cache=False):  # traced here
            for fn in (torch.compile(pair, fullgraph=True), pair):
                leaf = data.clone().requires_grad_()
                outputs = fn(leaf)
                torch.autograd.backward(outputs, upstream)
                if fn is not pair:
                    compiled_bits = [*outputs, leaf.grad]
        for got, expected in zip(compiled_bits, [*outputs, leaf.grad]):
            assert_same_bits(got.detach(), expected.detach())
    unsized = (lambda src, index: detsum.segment_coo(src, index.sort().values),
               lambda src, index: detsum.gather_csr(src[:2], torch.tensor([0, 10, 64])))
    for fn in unsized:
        torch._dynamo.reset()
        with pytest.raises(Exception, match="data-dependent"):
            torch.compile(fn, fullgraph=True)(src, index)


def test_errors_name_the_argument_and_change_nothing():
    src = torch.ones(4, 3)
    out = torch.zeros(2, 3)
    before = out.clone()
    index = torch.tensor([0, 1, 0, 5])
    with pytest.raises(IndexError, match=r"detsum.scatter_sum: index\[3\] = 5 is out of range "
                                         r"for out.size\(0\) = 2"):
        detsum.scatter_sum(src, index, 0, out)
    with pytest.raises(ValueError, match="reduce='prod' is not supported"):
        detsum.scatter(src, index, 0, reduce="prod")
    with pytest.raises(ValueError, match="reduce='mul' has no mode='exact'"):
        detsum.scatter_mul(src, torch.tensor([0, 1, 0, 1]), 0, mode="exact")
    with pytest.raises(ValueError, match="dim_size=-1; expected None or an int >= 0"):
        detsum.scatter(src, torch.tensor([0, 1, 0, 1]), 0, dim_size=-1)
    for dim_size in (2.0, "2", True):
        with pytest.raises(TypeError, match=f"detsum.scatter_sum: dim_size={dim_size!r} is a "
                                            f"{type(dim_size).__name__}; expected None or an "
                                            f"int >= 0"):
            detsum.scatter_sum(src, torch.tensor([0, 1, 0, 1]), 0, dim_size=dim_size)
    for name in ("scatter_log_softmax", "scatter_logsumexp"):
        with pytest.raises(TypeError, match=f"detsum.{name}: eps must be a real number, got "
                                            f"'x'"):
            getattr(detsum, name)(src, torch.tensor([0, 1, 0, 1]), 0, eps="x")
    with pytest.raises(ValueError, match="does not broadcast to src's shape"):
        detsum.scatter(src, torch.tensor([0, 1]), 0)
    with pytest.raises(ValueError, match=r"index decreases after its flat position 1 \(1 then "
                                         r"0\); segment_coo needs an index sorted"):
        detsum.segment_coo(src, torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match=r"indptr decreases after its flat position 1 \(3 then "
                                         r"2\)"):
        detsum.segment_csr(src, torch.tensor([0, 3, 2, 4]))
    with pytest.raises(ValueError, match=r"indptr decreases after its flat position 3 \(3 then "
                                         r"1\)"):  # two rows: the second row's second step
        detsum.segment_csr(src.expand(2, 4, 3), torch.tensor([[0, 2, 4], [0, 3, 1]]))
    with pytest.raises(IndexError, match="indptr"):
        detsum.segment_csr(src, torch.tensor([0, 3, 5]))
    with pytest.raises(TypeError, match="src has dtype torch.bool"):
        detsum.scatter(src.bool(), index, 0)
    with pytest.raises(ValueError, match="expected a floating-point dtype"):
        detsum.scatter_softmax(src.long(), torch.tensor([0, 1, 0, 1]), 0)
    assert torch.equal(out, before)


# ---- errors in the caller's words ---------------------------------------------------------------

def test_pointer_errors_name_the_bound_they_break():
    """Each message names the bound as the caller's arguments give it, with its real value:
    indptr may reach src.size(dim) in segment_csr, the output's size (indptr's last value, or
    out's size) in gather_csr."""
    with pytest.raises(IndexError, match=r"detsum.gather_csr: indptr\[1, 1\] = 8 is out of range "
                                         r"for the output's size along dim 1, indptr\[-1, -1\] = "
                                         r"6 \(expected 0 <= indptr <= 6\)$"):
        detsum.gather_csr(torch.ones(3, 1), torch.tensor([[3, 6], [6, 8], [2, 6]]))
    with pytest.raises(IndexError, match=r"detsum.gather_csr: indptr\[2\] = 6 is out of range for "
                                         r"out.size\(0\) = 5 \(expected 0 <= indptr <= 5\)$"):
        detsum.gather_csr(torch.ones(2), torch.tensor([0, 2, 6]), torch.zeros(5))
    with pytest.raises(IndexError, match=r"detsum.segment_sum_csr: indptr\[2\] = 6 is out of "
                                         r"range for src.size\(0\) = 5 \(expected 0 <= indptr "
                                         r"<= 5\)$"):
        detsum.segment_sum_csr(torch.ones(5), torch.tensor([0, 3, 6]))
    with pytest.raises(IndexError, match=r"detsum.segment_csr: indptr\[0, 0\] = -1 is out of "
                                         r"range for src.size\(1\) = 4 "):
        detsum.segment_csr(torch.ones(2, 4), torch.tensor([[-1, 4]]))
    with pytest.raises(IndexError, match=r"detsum.segment_coo: index\[0\] = -1 is out of range "
                                         r"for the output's size, index's largest last value "
                                         r"\+ 1 = 2 "):
        detsum.segment_coo(torch.ones(3), torch.tensor([-1, 0, 1]))
    with pytest.raises(IndexError, match=r"detsum.gather_coo: index\[1\] = 3 is out of range for "
                                         r"src.size\(0\) = 3 "):
        detsum.gather_coo(torch.ones(3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"detsum.segment_csr: out has size 3 along dim 0; "
                                         r"expected max\(indptr.size\(-1\) - 1, 0\) = 2$"):
        detsum.segment_csr(torch.ones(4), torch.tensor([0, 2, 4]), torch.zeros(3))
    with pytest.raises(ValueError, match=r"detsum.gather_coo: out has size 3 along dim 0; "
                                         r"expected index.size\(0\) = 2$"):
        detsum.gather_coo(torch.ones(4), torch.tensor([0, 2]), torch.zeros(3))
    with pytest.raises(ValueError, match=r"detsum.gather_csr: out has dtype torch.float64 but "
                                         r"src has torch.float32"):
        detsum.gather_csr(torch.ones(2), torch.tensor([0, 1, 2]),
                          torch.zeros(2, dtype=torch.float64))


def test_composites_name_themselves_and_the_bound_their_caller_gave():
    src = torch.ones(4)
    index = torch.tensor([0, 1, 0, 3])
    with pytest.raises(IndexError, match=r"detsum.scatter_softmax: index\[3\] = 3 is out of range "
                                         r"for dim_size = 2 "):
        detsum.scatter_softmax(src, index, dim_size=2)
    with pytest.raises(IndexError, match=r"detsum.scatter_logsumexp: index\[3\] = 3 is out of "
                                         r"range for out.size\(0\) = 2 "):
        detsum.scatter_logsumexp(src, index, out=torch.zeros(2))
    with pytest.raises(IndexError, match=r"detsum.scatter_std: index\[0\] = -1 is out of range "
                                         r"for index.max\(\) \+ 1 = 4 "):
        detsum.scatter_std(src, torch.tensor([-1, 1, 0, 3]))


# One call per function of the torch_scatter API that takes an index or indptr, each with one
# value out of range.
_SRC4 = torch.ones(4, 2)
_BAD_INDEX = torch.tensor([0, 1, 0, 7])
_BAD_SORTED = torch.tensor([0, 1, 1, 7])
BAD_INDEX_CALLS = {
    "scatter": lambda: detsum.scatter(_SRC4, _BAD_INDEX, 0, dim_size=3),
    **{f"scatter_{r}": (lambda r=r: getattr(detsum, f"scatter_{r}")(_SRC4, _BAD_INDEX, 0,
                                                                  dim_size=3))
       for r in SCATTER_REDUCES},
    "segment_coo": lambda: detsum.segment_coo(_SRC4, _BAD_SORTED, dim_size=3),
    **{f"segment_{r}_coo": (lambda r=r: getattr(detsum, f"segment_{r}_coo")(
        _SRC4, _BAD_SORTED, dim_size=3)) for r in SEGMENT_REDUCES},
    "segment_csr": lambda: detsum.segment_csr(_SRC4, torch.tensor([0, 2, 5])),
    **{f"segment_{r}_csr": (lambda r=r: getattr(detsum, f"segment_{r}_csr")(
        _SRC4, torch.tensor([0, 2, 5]))) for r in SEGMENT_REDUCES},
    "gather_coo": lambda: detsum.gather_coo(_SRC4, torch.tensor([0, 4])),
    "gather_csr": lambda: detsum.gather_csr(_SRC4, torch.tensor([0, 1, 2, 3, 9]),
                                            torch.zeros(5, 2)),
    "index_select": lambda: detsum.index_select(_SRC4, 0, torch.tensor([4])),
    "scatter_softmax": lambda: detsum.scatter_softmax(_SRC4, _BAD_INDEX, 0, dim_size=3),
    "scatter_log_softmax": lambda: detsum.scatter_log_softmax(_SRC4, _BAD_INDEX, 0,
                                                              dim_size=3),
    "scatter_logsumexp": lambda: detsum.scatter_logsumexp(_SRC4, _BAD_INDEX, 0, dim_size=3),
    "scatter_std": lambda: detsum.scatter_std(_SRC4, _BAD_INDEX, 0, dim_size=3),
}


def test_every_index_taking_function_is_listed():
    assert set(BAD_INDEX_CALLS) == set(detsum.scatter_compat.__all__)


@pytest.mark.parametrize("name", sorted(BAD_INDEX_CALLS))
def test_a_bad_index_is_caught_as_runtime_error_and_as_index_error(name):
    """torch_scatter's callers catch RuntimeError (its kernels' error for a bad index); code
    written for detsum or Python lookups catches IndexError: one exception serves both."""
    call = BAD_INDEX_CALLS[name]
    try:
        call()
    except RuntimeError as error:
        assert isinstance(error, IndexError)
        assert isinstance(error, detsum.IndexOutOfRangeError)
        assert str(error).startswith(f"detsum.{name}: "), str(error)
        assert "is out of range for" in str(error)
    else:
        raise AssertionError(f"detsum.{name} accepted an index out of range")
    with pytest.raises(IndexError):
        call()


def test_exact_mul_of_integers_gives_the_other_modes_integers():
    g = torch.Generator().manual_seed(3)
    src = torch.randint(-9, 10, (40, 3), generator=g)
    index = torch.randint(0, 6, (40,), generator=g)
    for dtype in (torch.uint8, torch.int8, torch.int32, torch.int64):
        values = src.abs().to(dtype) if dtype is torch.uint8 else src.to(dtype)
        expected = detsum.scatter_mul(values, index, 0, dim_size=7)
        assert torch.equal(detsum.scatter_mul(values, index, 0, dim_size=7, mode="exact"),
                           expected), dtype
        assert torch.equal(detsum.scatter(values, index, 0, dim_size=7, reduce="mul",
                                          mode="exact"), expected), dtype
    with pytest.raises(ValueError, match=r"detsum.scatter_mul: reduce='mul' has no "
                                         r"mode='exact' for src of dtype torch.float64: "):
        detsum.scatter_mul(src.double(), index, 0, mode="exact")


# ---- out= sharing memory with the inputs ---------------------------------------------------------

def _aliasing_cases():
    """(name, call(src, out)) for every function with out=, on a [4, 3] src whose out has its
    shape, so that out=src is a valid call."""
    index = torch.tensor([2, 0, 3, 0])
    sorted_index = torch.tensor([0, 0, 2, 3])
    indptr = torch.tensor([0, 2, 2, 3, 4])
    cases = [(f"scatter_{r}", lambda src, out, r=r: getattr(detsum, f"scatter_{r}")(
        src, index, 0, out)) for r in SCATTER_REDUCES]
    cases += [(f"scatter-{r}", lambda src, out, r=r: detsum.scatter(src, index, 0, out,
                                                                     reduce=r))
              for r in SCATTER_REDUCES]
    cases += [(f"segment_{r}_coo", lambda src, out, r=r: getattr(detsum, f"segment_{r}_coo")(
        src, sorted_index, out)) for r in SEGMENT_REDUCES]
    cases += [(f"segment_{r}_csr", lambda src, out, r=r: getattr(detsum, f"segment_{r}_csr")(
        src, indptr, out)) for r in SEGMENT_REDUCES]
    cases += [("gather_coo", lambda src, out: detsum.gather_coo(src, index, out)),
              ("gather_csr", lambda src, out: detsum.gather_csr(src, indptr, out)),
              ("scatter_logsumexp", lambda src, out: detsum.scatter_logsumexp(src, index, 0,
                                                                              out)),
              ("scatter_std", lambda src, out: detsum.scatter_std(src, index, 0, out))]
    return cases


ALIASING_CASES = _aliasing_cases()


@pytest.mark.parametrize("name,call", ALIASING_CASES, ids=[n for n, _ in ALIASING_CASES])
def test_out_sharing_memory_with_src_gives_the_bits_of_a_separate_out(name, call):
    """One rule for the whole API: out may share memory with src (out=src, or overlapping
    views); every input is read as it was before out is written."""
    values = torch.randn(5, 3, generator=torch.Generator().manual_seed(5))

    def run(src, out):
        result = call(src, out)
        return result[0] if isinstance(result, tuple) else result

    x = values[:4].clone()
    separate_out = x.clone()
    expected = run(x.clone(), separate_out)
    assert_same_bits(run(x, x), expected)
    assert_same_bits(x, separate_out)
    # Overlapping views of one buffer: out starts one row after src.
    buffer = values.clone()
    src_view, out_view = buffer[:4], buffer[1:]
    separate_out = out_view.clone()
    expected = run(src_view.clone(), separate_out)
    assert_same_bits(run(src_view, out_view), expected)
    assert_same_bits(out_view, separate_out)


def test_out_sharing_memory_with_src_compiled():
    """The same rule under torch.compile, where the graph's inputs alias (inductor runs an
    in-place operator on the caller's own tensor)."""
    index = torch.tensor([2, 0, 3, 0])
    values = torch.randn(4, 3, generator=torch.Generator().manual_seed(7))

    def sum_into_src(x):
        return detsum.scatter_sum(x, index, 0, out=x)

    expected = sum_into_src(values.clone()).clone()
    torch._dynamo.reset()
    x = values.clone()
    assert_same_bits(torch.compile(sum_into_src, fullgraph=True)(x), expected)
    assert_same_bits(x, expected)


def test_out_sharing_memory_with_src_keeps_the_gradient():
    """The gradient of out=src is that of a separate out holding src's values."""
    leaf = torch.randn(4, 3, generator=torch.Generator().manual_seed(6), requires_grad=True)
    index = torch.tensor([2, 0, 3, 0])
    x = leaf * 1
    detsum.scatter_max(x, index, 0, out=x)
    x.sum().backward()
    aliased, leaf.grad = leaf.grad, None
    src, out = leaf * 1, leaf * 1
    detsum.scatter_max(src, index, 0, out=out)
    out.sum().backward()
    assert torch.equal(aliased, leaf.grad)


def test_out_whose_elements_share_memory_is_refused_in_the_callers_words():
    src = torch.ones(4, 3)
    expanded = torch.zeros(1, 3).expand(2, 3)
    index = torch.tensor([0, 1, 0, 1])
    for name, call in (("scatter_sum", lambda: detsum.scatter_sum(src, index, 0, expanded)),
                       ("scatter_max", lambda: detsum.scatter_max(src, index, 0, expanded)),
                       ("segment_sum_csr", lambda: detsum.segment_sum_csr(
                           src, torch.tensor([0, 2, 4]), expanded)),
                       ("gather_coo", lambda: detsum.gather_coo(src, torch.tensor([0, 3]),
                                                                expanded))):
        with pytest.raises(ValueError, match=rf"^detsum.{name}: out has elements that share "
                                             rf"memory .* pass out.clone\(\)$"):
            call()
    assert torch.equal(expanded, torch.zeros(2, 3))


def test_exact_mean_over_the_term_limit_is_refused_before_any_work(monkeypatch):
    """An exact mean divides by at most 2**30 - 1 terms; the bound is read from src's shape,
    so a stride-0 src of 2**30 rows is refused at once, naming the function called."""
    def work_began(*args, **kwargs):
        raise AssertionError("the call began its work before refusing")

    for name in ("scatter_reduce", "_check_index_values", "_check_indptr_values",
                 "_check_sorted", "_segment_of_position"):
        monkeypatch.setattr(detsum.scatter_compat, name, work_began)
    rows = 2**30
    src = torch.zeros(1, 2).expand(rows, 2)
    index = torch.zeros(1, dtype=torch.long).expand(rows)
    expected = (r"reduce='mean' with mode='exact' sums at most 1073741823 terms per output "
                r"element; got up to 1073741824 \(src.size\(0\) = 1073741824\)")
    for name, call in (
            ("scatter_mean", lambda: detsum.scatter_mean(src, index, 0, dim_size=1,
                                                         mode="exact")),
            ("scatter", lambda: detsum.scatter(src, index, 0, dim_size=1, reduce="mean",
                                               mode="exact")),
            ("segment_mean_coo", lambda: detsum.segment_mean_coo(src, index, dim_size=1,
                                                                 mode="exact")),
            ("segment_csr", lambda: detsum.segment_csr(src, torch.tensor([0, rows]),
                                                       reduce="mean", mode="exact"))):
        with pytest.raises(ValueError, match=rf"^detsum.{name}: {expected}"):
            call()


# ---- host reads on a GPU's path ------------------------------------------------------------------

@contextlib.contextmanager
def _gpu_path():
    """CPU tensors on a GPU's path: the triton backend, values checked as on a GPU."""
    with detsum.backend("triton"), unittest.mock.patch.object(_segments, "GPU_CHECKS_ON_CPU",
                                                              True):
        yield


@pytest.mark.interpreter
@pytest.mark.parametrize("reduce", ["sum", "mean", "min", "max"])
def test_on_a_gpu_an_index_is_read_back_once_or_not_at_all(reduce):
    """torch_scatter's API reads its index back once, for its size and its check together,
    and not at all when the size is given (then it checks on the device): the bits of the CPU's
    path either way, and a bad value refused in the caller's words."""
    g = torch.Generator().manual_seed(31)
    src = torch.randn(40, 3, generator=g)
    index = torch.randint(0, 6, (40,), generator=g)
    expected = detsum.scatter(src, index, 0, reduce=reduce)
    expected_sized = detsum.scatter(src, index, 0, dim_size=8, reduce=reduce)
    with _gpu_path():
        for dim_size, want, reads_allowed in ((None, expected, 1), (8, expected_sized, 0)):
            reads = []
            with host_reads(lambda name, where: reads.append(where)):
                got = detsum.scatter(src, index, 0, dim_size=dim_size, reduce=reduce)
            assert len(reads) <= reads_allowed, reads
            assert_same_bits(got, want)
        bad = index.clone()
        bad[5] = -1
        with pytest.raises(IndexError, match=r"detsum.scatter: index\[5\] = -1 is out of "
                                             r"range"):
            detsum.scatter(src, bad, 0, reduce=reduce)
        # On a GPU, at the next synchronisation; on the CPU, at once.
        with pytest.raises(RuntimeError, match=r"detsum.scatter: index has a value outside "
                                               r"\[0, dim_size = 8\)"):
            detsum.scatter(src, bad, 0, dim_size=8, reduce=reduce)
