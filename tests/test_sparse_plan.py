"""Outputs with far more rows than the source: planned over the rows that receive terms.

The plan over all S output rows costs O(S) time and memory (an input of shape [2**26, 0], with
nothing to compute, took 0.9 s and 1 GiB; 1000 rows into 2**24 rows of 4 took 3.5 s). Rows
that receive no term are the base row, copied; the others are computed on their own, so the
bits must equal the plan over every row, which these tests check by forcing each path.

The plans are positions, the same for every mode and dtype: on Numba the sweeps take every
combination of mode, dtype, reduction and include_self; on Triton's interpreter a covering
(tests/covering.py), whose comment says what it meets; on a GPU every combination.
"""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import (DTYPES, HAS_CUDA, MODE_REDUCTIONS, MODES, assert_same_bits,
                      backend_device, dtype_id, make_data)
from covering import pairwise
from detsum import _segments

BACKENDS = ["numba"]
try:
    import triton  # noqa: F401
    BACKENDS.append("triton")
except ImportError:
    pass


def _both_plans(fn, monkeypatch, backend_name):
    """``fn()`` planned over every output row, then over the rows with terms alone."""
    results = []
    for threshold in (10**9, 0):  # never sparse, always sparse
        monkeypatch.setattr(_segments, "SPARSE_ROWS_PER_SOURCE_ROW", threshold)
        with detsum.backend(backend_name):
            results.append(fn())
    return results


def _case(dtype, n_out, backend_name, inner=3):
    """Rows around the chunk boundary (257 terms into one row), specials, empty rows, and a
    transposed input, on ``backend_name``'s device."""
    index = torch.cat([torch.full((257,), 7), torch.tensor([2, 9, 2, 0]),
                       torch.full((3,), n_out - 1)])[torch.randperm(264, generator=torch.Generator().manual_seed(0))]
    source = make_data((index.numel(), inner), dtype, seed=1, spread=True)
    source[5, 1] = float("nan")
    source[6, 2] = float("inf")
    input = make_data((inner, n_out), dtype, seed=2, spread=True).t()
    device = backend_device(backend_name)
    return input.to(device), index.to(device), source.to(device)


def _index_add_cases(backend_name):
    """On the interpreter "fp32" with every dtype and each other mode once: an "exact" case
    costs seconds there, and as the plan is the same Python for every kernel and the exact
    kernel ignores the order of its terms, its one case (fp32) checks that the plans meet."""
    if backend_name == "triton" and not HAS_CUDA:
        cases = [("fp32", dtype) for dtype in DTYPES] + [
            ("autograd", torch.bfloat16), ("kahan", torch.float16), ("exact", torch.float32)]
    else:
        cases = [(mode, dtype) for mode in MODES for dtype in DTYPES]
    return [pytest.param(mode, dtype, backend_name, id=f"{mode}-{dtype_id(dtype)}-{backend_name}")
            for mode, dtype in cases]


@pytest.mark.parametrize("mode,dtype,backend_name",
                         [p for backend in BACKENDS for p in _index_add_cases(backend)])
def test_index_add_sparse_plan_gives_the_dense_bits(mode, dtype, backend_name, monkeypatch):
    """Also with 7 terms, few enough for the triton backend to take the index unsorted
    (``_segments.scans_index``): out of place it launches over every row either way; in
    place the rows with terms still go on their own, their positions unsorted."""
    input, index, source = _case(dtype, 40, backend_name)
    for terms in (index.numel(), 7):
        dense, sparse = _both_plans(
            lambda: detsum.index_add(input, 0, index[:terms], source[:terms], alpha=0.3,
                                     mode=mode), monkeypatch, backend_name)
        assert_same_bits(sparse, dense)
        in_place = input.clone()
        monkeypatch.setattr(_segments, "SPARSE_ROWS_PER_SOURCE_ROW", 0)
        with detsum.backend(backend_name):
            detsum.index_add_(in_place, 0, index[:terms], source[:terms], alpha=0.3, mode=mode)
        assert_same_bits(in_place, dense)


def _scatter_reduce_cases(backend_name):
    """amax and amin run the same kernel in fp32, kahan and exact mode: fp32 covers them. On
    the interpreter "fp32" takes every reduction and the other modes their sum (the two plans
    are positions, the same for every mode and for include_self, whose every pair with a
    reduction Numba meets), include_self taken in turn."""
    axes = [list(MODES), ["sum", "mean", "prod", "amax", "amin"], [True, False], [backend_name]]
    interpreted = backend_name == "triton" and not HAS_CUDA

    def allowed(mode, reduce, include_self, backend):
        if reduce in ("amax", "amin") and mode in ("kahan", "exact"):
            return False
        return (mode, reduce) in MODE_REDUCTIONS and (
            not interpreted or mode == "fp32" or reduce == "sum")

    return pairwise(axes, allowed=allowed, pairs=[(0, 1)], everything=not interpreted)


@pytest.mark.parametrize("mode,reduce,include_self,backend_name",
                         [p for backend in BACKENDS for p in _scatter_reduce_cases(backend)])
def test_scatter_reduce_sparse_plan_gives_the_dense_bits(mode, include_self, reduce,
                                                         backend_name, monkeypatch):
    input, index, source = _case(torch.bfloat16, 40, backend_name)
    if reduce == "prod":
        source = (1 + source.float() / 2**40).to(torch.bfloat16)
    for promise_sorted in (False, True):
        idx = index.sort().values if promise_sorted else index
        dense, sparse = _both_plans(
            lambda: detsum.scatter_reduce(input, 0, idx, source, reduce,
                                          include_self=include_self, mode=mode,
                                          sorted=promise_sorted),
            monkeypatch, backend_name)
        assert_same_bits(sparse, dense)


def test_nothing_is_planned_over_every_output_row(monkeypatch):
    planned = []
    plan_from_index, plan_from_keys = _segments.plan_from_index, _segments.plan_from_keys

    def recording_plan_from_index(caller, index, num_segments, **kwargs):
        planned.append(num_segments)
        return plan_from_index(caller, index, num_segments, **kwargs)

    def recording_plan_from_keys(keys, num_segments, backend_name, **kwargs):
        planned.append(num_segments)
        return plan_from_keys(keys, num_segments, backend_name, **kwargs)

    monkeypatch.setattr(_segments, "plan_from_index", recording_plan_from_index)
    monkeypatch.setattr(_segments, "plan_from_keys", recording_plan_from_keys)
    out = detsum.index_add(torch.zeros(2**20, 2), 0, torch.tensor([7, 2**20 - 1, 7]),
                           torch.ones(3, 2))
    assert planned == [2]  # the two rows with terms
    assert out[7].tolist() == [2.0, 2.0] and out[-1].tolist() == [1.0, 1.0]
    assert int(out.count_nonzero()) == 4
    planned.clear()
    detsum.index_add(torch.zeros(2**26, 0), 0, torch.zeros(0, dtype=torch.long),
                     torch.zeros(0, 0))
    assert planned == [0]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("rows", [0, 3])
def test_int32_and_empty_indexes_take_the_sparse_plan(rows, index_dtype):
    """An int32 index once reached index_copy_, which takes int64 only (found by the fuzz
    test with an empty index)."""
    index = torch.tensor([1, 5, 1][:rows], dtype=index_dtype)
    x = make_data((100, 2), torch.float32, seed=3)
    source = make_data((rows, 2), torch.float32, seed=4)
    expected = x.index_add(0, index.long(), source)
    assert_same_bits(detsum.index_add(x, 0, index, source), expected)
    assert_same_bits(detsum.scatter_reduce(x, 0, index, source, "sum"), expected)
    in_place = x.clone()
    detsum.index_add_(in_place, 0, index, source)
    assert_same_bits(in_place, expected)


@pytest.mark.parametrize("bad", [-1, 2**20])
def test_sparse_plan_still_checks_every_index_value(bad):
    x = torch.zeros(2**20, 2)
    with pytest.raises(IndexError, match=rf"index\[1\] = {bad} is out of range"):
        detsum.index_add_(x, 0, torch.tensor([3, bad, 5]), torch.ones(3, 2))
    assert not x.any()
    with pytest.raises(IndexError, match=rf"index\[1\] = {bad}"):
        detsum.scatter_reduce(x, 0, torch.tensor([3, bad, 5]), torch.ones(3, 2), "sum")
