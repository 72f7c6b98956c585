"""detsum.scatter_reduce with torch's own index form: an index of src's shape.

An index that broadcasts a row index over the other dims (a stride-0 view, or the same values
materialised) takes the row path; a truly elementwise one runs without a plan on the Numba
backend (kernels/numba/scatter.py). Both are rewrites of the schedule only: every output
element reduces the same terms in the same order, so each result here must equal, bit for bit
(``torch.equal`` on the bit patterns; NaNs by position, as everywhere in the suite: which
NaN's payload a sum of two NaNs carries follows the operand order the compiler picked, and is
no part of the contract), the elementwise plan that ran before (forced by turning both
rewrites off) and the reference's loops over the index as given (the oracle); gradients
likewise.
"""

from __future__ import annotations

import contextlib
import itertools
import types
import unittest.mock

import pytest
import torch

import detsum
from conftest import (MODE_REDUCTIONS, N, assert_same_bits, dtype_id, make_data, seed_of,
                      strided_copy, with_rows)
from covering import covering
from detsum import _segments, reference
from detsum.ops import scatter_reduce as scatter_reduce_module

N_OUT = 5
# (src shape with N at dim, dim): the index's other dims before, after and around dim, and a
# size-one dim (broadcast by its size, whatever its stride).
SHAPES = [
    pytest.param((N, 6), 0, id="Nx6-dim0"),
    pytest.param((4, N), 1, id="4xN-dim1"),
    pytest.param((2, N, 3), -2, id="2xNx3-dim-2"),
    pytest.param((2, 3, N), -1, id="2x3xN-dim-1"),
    pytest.param((N, 1, 3), 0, id="Nx1x3-dim0"),
]
# Index forms that broadcast a row index: the row path must take them.
BROADCAST_FORMS = ["expanded", "materialised", "materialised-strided", "partly-expanded"]
# Index forms that do not: the elementwise path, without a plan on the Numba backend.
ELEMENTWISE_FORMS = ["elementwise", "nearly-broadcast"]
# "short": 24 rows, outputs 0 and 3 receive nothing; "long": 600 rows, about 520 into output
# 2 (three chunks of 256 terms, the last one shorter) beside short segments.
CASES = ["short", "long"]
MODE_REDUCTION_PARAMS = [pytest.param(m, r, id=f"{r}-{m}") for m, r in MODE_REDUCTIONS]


def assert_equal_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    try:
        assert_same_bits(actual, expected)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from e


def row_index(case: str, rows_seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows_seed)
    if case == "short":
        return torch.tensor([1, 2, 4])[torch.randint(0, 3, (24,), generator=g)]
    heavy = torch.rand(600, generator=g) < 0.87
    return torch.where(heavy, 2, torch.randint(0, N_OUT, (600,), generator=g))


def index_of_form(form: str, rows: torch.Tensor, shape: tuple, dim: int, seed: int
                  ) -> torch.Tensor:
    """An index of ``shape`` built from the row index ``rows`` (along ``dim``) in ``form``."""
    view = [-1 if d == dim else 1 for d in range(len(shape))]
    expanded = rows.view(view).expand(shape)
    if form == "expanded":
        return expanded
    if form == "materialised":
        return expanded.contiguous()
    if form == "materialised-strided":
        return strided_copy(expanded.contiguous())
    if form == "partly-expanded":
        # Stride 0 along the last other dim, materialised along the others.
        last_other = max(d for d in range(len(shape)) if d != dim)
        return expanded.narrow(last_other, 0, 1).contiguous().expand(shape)
    columns = torch.stack([
        rows[torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(seed + c))]
        for c in range(expanded.movedim(dim, -1).shape[:-1].numel())])
    if form == "elementwise":
        # Every column has the same segment lengths, each in its own order.
        return columns.view(*expanded.movedim(dim, -1).shape).movedim(-1, dim).contiguous()
    assert form == "nearly-broadcast"
    # Equal along the other dims except the last element: elementwise after all.
    nearly = expanded.contiguous()
    last = nearly.view(-1)
    last[-1] = (last[-1] + 1) % N_OUT
    return nearly


def values(shape, dtype, seed, reduce, specials):
    """Data over many binades, with NaN, infinities and signed zeros where ``specials`` (a
    long segment would then almost surely be NaN or inf, whatever its chunks)."""
    if reduce == "prod":  # factors near one: products of hundreds stay finite, every one rounds
        return (1 + make_data(shape, torch.float64, seed=seed) / 64).to(dtype)
    x = make_data(shape, dtype, seed=seed, spread=True)
    if not specials:
        return x
    g = torch.Generator().manual_seed(seed + 1)
    pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")]).to(dtype)
    picks = pool[torch.randint(0, len(pool), shape, generator=g)]
    return torch.where(torch.rand(shape, generator=g) < 0.04, picks, x)


def make_case(template, dim, form, case, dtype, reduce, index_dtype=torch.int64):
    seed = seed_of(template, dim, form, case, dtype_id(dtype), reduce)
    rows = row_index(case, seed)
    shape = with_rows(template, rows.numel())
    d = dim % len(shape)
    index = index_of_form(form, rows.to(index_dtype), shape, d, seed)
    input = values(with_rows(template, N_OUT), dtype, seed + 2, reduce, case == "short")
    return input, index, values(shape, dtype, seed + 3, reduce, case == "short")


@contextlib.contextmanager
def previous_elementwise_path():
    """Every index of src's shape planned element by element, as before the row form and the
    plan-free kernel existed."""
    with unittest.mock.patch.object(scatter_reduce_module, "_broadcast_rows",
                                    lambda *args: None, create=True), \
            unittest.mock.patch.object(scatter_reduce_module, "_streams", lambda *args: False,
                                       create=True):
        yield


@contextlib.contextmanager
def elementwise_path_refused():
    def refuse(*args, **kwargs):
        raise AssertionError("an index that broadcasts a row index took the elementwise path")

    with unittest.mock.patch.object(scatter_reduce_module, "_elementwise_plan", refuse), \
            unittest.mock.patch.object(scatter_reduce_module, "_stream_elements", refuse,
                                       create=True):
        yield


def check_every_path(input, dim, index, src, reduce, mode, *, row_path: bool):
    for include_self in (True, False):
        def run():
            return detsum.scatter_reduce(input, dim, index, src, reduce,
                                         include_self=include_self, mode=mode)

        what = f"include_self={include_self}"
        with contextlib.ExitStack() as stack:
            if row_path:
                stack.enter_context(elementwise_path_refused())
            got = run()
        with previous_elementwise_path():
            before = run()
        oracle = reference.scatter_reduce(input, dim, index, src, reduce,
                                          include_self=include_self, mode=mode)
        assert_equal_bits(got, before, f"{what}, against the elementwise plan")
        assert_equal_bits(got, oracle, f"{what}, against the reference")


@pytest.mark.parametrize(
    "mode,reduce,dtype,form,case,template,dim",
    covering([MODE_REDUCTION_PARAMS, [torch.float32, torch.bfloat16], BROADCAST_FORMS, CASES],
             SHAPES))
def test_a_broadcast_row_index_takes_the_row_path_with_the_same_bits(
        mode, reduce, dtype, form, case, template, dim):
    input, index, src = make_case(template, dim, form, case, dtype, reduce)
    check_every_path(input, dim, index, src, reduce, mode, row_path=True)


def int32_index_params() -> list:
    """An int32 index with every (mode, reduction) in both cases (the long one is read again
    in chunks) in float32, with every other dtype once, and every form in every shape: not
    every (mode, reduction) in every dtype, each of which compiles kernels of its own for
    int32 (two seconds each, 57 s of compiling in all for the whole matrix), where the index
    is read by code that no reduction or dtype changes."""
    rows = [(m, r, torch.float32, case) for m, r in MODE_REDUCTIONS
            for case in ("short-int32", "long-int32")]
    rows += [("fp32", "sum", dtype, "long-int32")
             for dtype in (torch.bfloat16, torch.float16, torch.float64)]
    placements = itertools.cycle(itertools.product(ELEMENTWISE_FORMS, SHAPES))
    params = []
    for (mode, reduce, dtype, case), (form, shape) in zip(rows, placements):
        template, dim = shape.values
        params.append(pytest.param(mode, reduce, dtype, form, case, template, dim,
                                   id=f"{reduce}-{mode}-{dtype_id(dtype)}-{form}-{case}-"
                                      f"{shape.id}"))
    return params


@pytest.mark.parametrize(
    "mode,reduce,dtype,form,case,template,dim",
    covering([MODE_REDUCTION_PARAMS,
              [torch.float32, torch.bfloat16, torch.float16, torch.float64], ELEMENTWISE_FORMS,
              CASES], SHAPES) + int32_index_params())
def test_an_elementwise_index_without_a_plan_gives_the_plan_bits(
        mode, reduce, dtype, form, case, template, dim):
    index_dtype = torch.int32 if case.endswith("int32") else torch.int64
    input, index, src = make_case(template, dim, form, case.removesuffix("-int32"), dtype,
                                  reduce, index_dtype)
    check_every_path(input, dim, index, src, reduce, mode, row_path=False)


@pytest.mark.parametrize("form", ["expanded", "materialised", "elementwise"])
@pytest.mark.parametrize("src_shape", [(0, 4), (24, 0)], ids=["zero_rows", "zero_columns"])
@pytest.mark.parametrize("mode,reduce", MODE_REDUCTION_PARAMS)
def test_empty_tensors_in_every_form(mode, reduce, src_shape, form):
    rows = torch.randint(0, N_OUT, (src_shape[0],), generator=torch.Generator().manual_seed(5))
    index = rows.view(-1, 1).expand(src_shape)
    if form != "expanded":
        index = index.contiguous() if form == "materialised" else torch.zeros(src_shape).long()
    input = make_data((N_OUT, src_shape[1]), torch.float32, seed=6)
    src = make_data(src_shape, torch.float32, seed=7)
    check_every_path(input, 0, index, src, reduce, mode, row_path=False)


def test_the_materialised_comparison_is_a_host_read_and_only_under_host():
    """A stride-0 broadcast is seen from the strides at every check level; the comparison of
    a materialised index reads values (a host read on a GPU): "host" only."""
    rows = torch.tensor([3, 0, 3, 1])
    expanded = rows.view(-1, 1).expand(4, 5)
    materialised = expanded.contiguous()
    for check in ("host", "device", "off"):
        assert torch.equal(scatter_reduce_module._broadcast_rows(expanded, 0, check), rows)
    assert torch.equal(scatter_reduce_module._broadcast_rows(materialised, 0, "host"), rows)
    assert scatter_reduce_module._broadcast_rows(materialised, 0, "device") is None
    assert scatter_reduce_module._broadcast_rows(materialised, 0, "off") is None
    elementwise = materialised.clone()
    elementwise[2, 4] = 0
    assert scatter_reduce_module._broadcast_rows(elementwise, 0, "host") is None
    # Expanded along dim itself: one value for every position, still a row index.
    along = torch.tensor(2).expand(4, 5)
    assert torch.equal(scatter_reduce_module._broadcast_rows(along, 1, "off"),
                       torch.full((5,), 2))


def test_autograd_sums_on_cuda_follow_torchs_slice_size():
    """torch's CUDA index_put_ picks its arithmetic by slice size. Its deterministic scatter
    indexes rows (a slice of 40 here) for a stride-0 broadcast along every other dim and
    flattens every other index (a slice of 1): "autograd" sums follow it, every other rule
    takes the row path for both."""
    cuda_input = types.SimpleNamespace(device=torch.device("cuda"), shape=torch.Size([3, 40]))
    rows = torch.tensor([0, 2])
    expanded = rows.view(-1, 1).expand(2, 40)
    materialised = expanded.contiguous()
    assert torch.equal(scatter_reduce_module._as_rows(cuda_input, 0, expanded, "sum",
                                                      "autograd", "off", "triton"), rows)
    assert scatter_reduce_module._as_rows(cuda_input, 0, materialised, "sum", "autograd",
                                          "host", "triton") is materialised
    # A size-1 dim with a nonzero stride: torch flattens, detsum sees a row index.
    cuda_input3 = types.SimpleNamespace(device=torch.device("cuda"),
                                        shape=torch.Size([1, 3, 40]))
    size_one = rows.view(1, -1, 1).expand(1, 2, 40)
    assert size_one.stride(0) != 0
    assert scatter_reduce_module._as_rows(cuda_input3, 1, size_one, "sum", "autograd",
                                          "off", "triton") is size_one
    for mode, reduce in [("fp32", "sum"), ("autograd", "mean"), ("autograd", "amax")]:
        for index in (expanded, materialised):
            assert scatter_reduce_module._as_rows(cuda_input, 0, index, reduce, mode,
                                                  "host", "triton").dim() == 1


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("form", BROADCAST_FORMS + ELEMENTWISE_FORMS)
@pytest.mark.parametrize("template,dim", SHAPES)
def test_autograd_sums_and_means_match_torchs_deterministic_scatter_on_cuda(template, dim,
                                                                             form, dtype):
    """"autograd" sums and means of every index form against torch's own ``scatter_add``
    and ``scatter_reduce`` under ``use_deterministic_algorithms(True)`` on the GPU (about
    520 terms into one output element, where the slice size's kernels part ways)."""
    input, index, src = (t.cuda() for t in make_case(template, dim, form, "long", dtype,
                                                       "sum"))
    calls = {}
    for reduce in ("sum", "mean"):
        for include_self in (True, False):
            calls[f"scatter_reduce {reduce} include_self={include_self}"] = (
                lambda r=reduce, s=include_self: input.scatter_reduce(dim, index, src, r,
                                                                      include_self=s))
    calls["scatter_add"] = lambda: input.scatter_add(dim, index, src)
    torch.use_deterministic_algorithms(True)
    try:
        expected = {name: call() for name, call in calls.items()}
    finally:
        torch.use_deterministic_algorithms(False)
    for reduce in ("sum", "mean"):
        for include_self in (True, False):
            name = f"scatter_reduce {reduce} include_self={include_self}"
            got = detsum.scatter_reduce(input, dim, index, src, reduce,
                                        include_self=include_self, mode="autograd")
            assert_equal_bits(got.cpu(), expected[name].cpu(), name)
    if dtype == torch.float32:  # the switch leaves half-precision "autograd" sums to torch
        with detsum.deterministic("autograd"):
            for name, call in calls.items():
                assert_equal_bits(call().cpu(), expected[name].cpu(), f"{name}, switched")


@pytest.mark.parametrize("backend", ["numba", "triton"])
@pytest.mark.parametrize("n", [4, 300], ids=["scanned", "sorted"])
def test_a_bad_value_is_named_where_the_caller_put_it(backend, n, monkeypatch):
    """The row path would name the position in the row index: a bad value gets the
    elementwise path's message, with the position in the index as passed. On the triton
    backend (a GPU's checks) the row path runs and finds it itself, in the read of its
    launch's verdict (an index of at most 256 values, scanned) or of the sorted rows' ends:
    a valid index costs that read alone, where a read of the rows' range before it made two;
    on the Numba backend the rows' range is read first."""
    from launch_counter import count, gpu_path

    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
    rows = torch.arange(n) % 5
    good = index_of_form("expanded", rows, (n, 3), 0, 0)
    bad_rows = rows.clone()
    bad_rows[2] = 9
    for form in ("expanded", "materialised"):
        index = index_of_form(form, bad_rows, (n, 3), 0, 0)
        with detsum.backend(backend), pytest.raises(
                IndexError, match=r"index\[2, 0\] = 9 is out of range for input\.size\(0\) = 5"):
            detsum.scatter_reduce(torch.zeros(5, 3), 0, index, torch.ones(n, 3), "sum")
    if backend == "triton":
        with gpu_path():
            counted = count(lambda: detsum.scatter_reduce(torch.zeros(5, 3), 0, good,
                                                          torch.ones(n, 3), "sum"))
        assert len(counted.host_reads) == 1, counted.host_reads
    index = torch.zeros(4, 3, dtype=torch.long)
    index[3, 1], index[1, 2] = -1, 7
    with pytest.raises(IndexError, match=r"index\[1, 2\] = 7 is out of range"):
        detsum.scatter_reduce(torch.zeros(5, 3), 0, index, torch.ones(4, 3), "amax")


@pytest.mark.parametrize("form", BROADCAST_FORMS + ELEMENTWISE_FORMS)
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "amax", "amin"])
def test_gradients_equal_the_elementwise_path(reduce, include_self, form):
    """The same gradients, bit for bit; a broadcast index gathers by rows (index_select) in
    the backward too, never element by element."""
    rows = torch.tensor([1, 2, 4, 2, 2, 1, 4, 2, 0, 2])
    shape = (2, 10, 3)
    index = index_of_form(form, rows, shape, 1, 3)
    src = make_data(shape, torch.float64, seed=8)
    src[0, 3, 1] = 0.0  # a zero factor, and ties for amax/amin below
    src[1, 5, 2] = src[1, 1, 2]
    input = make_data((2, N_OUT, 3), torch.float64, seed=9)
    upstream = make_data((2, N_OUT, 3), torch.float64, seed=10)

    def gradients():
        leaves = [input.clone().requires_grad_(), src.clone().requires_grad_()]
        detsum.scatter_reduce(leaves[0], 1, index, leaves[1], reduce,
                              include_self=include_self).backward(upstream)
        return [leaf.grad for leaf in leaves]

    taken = []
    take = scatter_reduce_module._take

    def recording_take(t, dim, idx):
        taken.append(idx.dim())
        return take(t, dim, idx)

    with unittest.mock.patch.object(scatter_reduce_module, "_take", recording_take):
        got = gradients()
    with previous_elementwise_path():
        before = gradients()
    for name, g, b in zip(("input", "src"), got, before):
        assert_equal_bits(g, b, f"gradient of {name}")
    if form in BROADCAST_FORMS:
        assert taken and set(taken) == {1}


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["expanded", "materialised", "elementwise"])
@pytest.mark.parametrize("mode,reduce", [("fp32", "sum"), ("kahan", "mean"), ("fp32", "amax"),
                                         ("autograd", "sum"), ("autograd", "prod"),
                                         ("exact", "sum")])
def test_triton_backend_gives_the_same_bits(mode, reduce, form):
    pytest.importorskip("triton")
    input, index, src = make_case((2, N, 3), -2, form, "short", torch.float32, reduce)
    for include_self in (True, False):
        def run():
            return detsum.scatter_reduce(input, -2, index, src, reduce,
                                         include_self=include_self, mode=mode)

        with detsum.backend("triton"):
            got = run()
            with previous_elementwise_path():
                before = run()
        assert_equal_bits(got, before, f"include_self={include_self}, triton")
        assert_equal_bits(got, run(), f"include_self={include_self}, triton against numba")


@pytest.mark.interpreter
@pytest.mark.parametrize("check", ["host", "device", "off"])
def test_gpu_check_levels_on_an_expanded_index(check):
    """On a GPU's path (Triton's interpreter, values checked as on a GPU) a stride-0 index
    takes the row path at every level; a value outside the output under "off" leaves its
    elements out, as the elementwise path does."""
    pytest.importorskip("triton")
    rows = torch.tensor([1, 0, 4, 1, 3] + ([7, -1] if check == "off" else []))
    index = rows.view(-1, 1).expand(-1, 3)
    src = make_data((rows.numel(), 3), torch.float32, seed=11)
    input = make_data((N_OUT, 3), torch.float32, seed=12)
    with detsum.backend("triton"), \
            unittest.mock.patch.object(_segments, "GPU_CHECKS_ON_CPU", True):
        with elementwise_path_refused():
            got = detsum.scatter_reduce(input, 0, index, src, "mean", check=check)
        with previous_elementwise_path():
            before = detsum.scatter_reduce(input, 0, index, src, "mean", check=check)
    assert_equal_bits(got, before, check)


def test_the_kernel_gives_the_same_bits_on_any_thread_count():
    """Two thread blocks or one: each output element is one item's, summed in order."""
    g = torch.Generator().manual_seed(13)
    index = torch.randint(0, 7, (400, 500), generator=g)
    src = make_data((400, 500), torch.float32, seed=14, spread=True)
    input = make_data((7, 500), torch.float32, seed=15)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(detsum.scatter_reduce(input, 0, index, src, "sum", mode="kahan"))
    finally:
        torch.set_num_threads(threads)
    assert_equal_bits(results[0], results[1], "1 against 2 threads")


def test_an_elementwise_index_is_not_planned_on_the_numba_backend(monkeypatch):
    """A plan keyed by (outer, index, inner) over every element took seconds at 1M x 64
    elements: the Numba backend streams the elements instead, for every rule but the exact
    sums' (amax and amin are exact in every mode, and take the common rule)."""
    planned = []
    elementwise_plan = scatter_reduce_module._elementwise_plan

    def recording_plan(input3, *args, **kwargs):
        planned.append(input3.numel())
        return elementwise_plan(input3, *args, **kwargs)

    monkeypatch.setattr(scatter_reduce_module, "_elementwise_plan", recording_plan)
    input, index, src = make_case((N, 6), 0, "elementwise", "short", torch.float32, "sum")
    for mode, reduce in MODE_REDUCTIONS:
        detsum.scatter_reduce(input, 0, index, src, reduce, mode=mode)
        exact_sum = mode == "exact" and reduce in ("sum", "mean")
        assert planned == ([N_OUT * 6] if exact_sum else []), (mode, reduce)
        planned.clear()
