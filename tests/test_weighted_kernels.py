"""kernels/numba/weighted.py: the weighted MoE combination and its weight gradient give the bits
of segment_sum over the products they never form."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DTYPES, assert_same_bits, dtype_id, make_data
from detsum.kernels import CHUNK_TERMS, KAHAN, WIDE
from detsum.kernels.numba import weighted

RULES = {"fp32": WIDE, "kahan": KAHAN}
# (tokens, topk, features): one feature chunk, several (the last partial), a feature count
# that is a whole number of chunks, topk 1, and empty cases.
SHAPES = [(7, 3, 5), (9, 8, 2 * CHUNK_TERMS + 37), (3, 1, CHUNK_TERMS), (4, 2, 0), (0, 4, 6)]


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def problem(tokens, topk, features, dtype, seed):
    rows = tokens * topk
    y = make_data((rows, features), dtype, seed=seed, spread=True)
    positions = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    weights = make_data((rows,), acc_of(dtype), seed=seed + 1, spread=True)
    grad = make_data((tokens, features), acc_of(dtype), seed=seed + 2, spread=True)
    owners = torch.randint(0, max(tokens, 1), (rows,), generator=torch.Generator().manual_seed(seed))
    return y, positions, weights, grad, owners


def formed_forward(y, positions, weights, tokens, topk, mode):
    products = y.index_select(0, positions).to(weights.dtype) * weights.unsqueeze(1)
    offsets = torch.arange(tokens + 1) * topk
    return detsum.segment_sum(products, offsets, mode=mode)


def formed_dots(grad, owners, y, mode):
    products = grad.index_select(0, owners) * y.to(grad.dtype)
    features = products.shape[1]
    return detsum.segment_sum(products.T.contiguous(), torch.tensor([0, features]),
                              mode=mode).view(-1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", list(RULES))
def test_kernels_give_the_bits_of_the_formed_products(mode, dtype, shape):
    tokens, topk, features = shape
    y, positions, weights, grad, owners = problem(tokens, topk, features, dtype, seed=sum(shape))
    assert_same_bits(weighted.gather_scale_sum(y, positions, weights, topk, RULES[mode]),
                     formed_forward(y, positions, weights, tokens, topk, mode))
    if tokens:
        assert_same_bits(weighted.row_dots(grad, owners, y, RULES[mode]),
                         formed_dots(grad, owners, y, mode))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", list(RULES))
def test_special_values(mode, dtype):
    """-0.0 products (a sum from +0.0 makes them +0.0), infinities, NaN, and a compensation
    that must not be added to an infinite sum."""
    big = torch.finfo(dtype).max
    y = torch.tensor([[-0.0, 1.0, big], [0.0, float("inf"), big], [float("nan"), -1.0, 1.0],
                      [-0.0, 1.0, -big]], dtype=dtype)
    weights = torch.tensor([1.0, 2.0, -1.0, 1.0], dtype=acc_of(dtype))
    grad = torch.tensor([[1.0, -0.0, 2.0], [float("inf"), 1.0, 0.5]], dtype=acc_of(dtype))
    positions, owners = torch.tensor([3, 0, 1, 2]), torch.tensor([0, 1, 1, 0])
    assert_same_bits(weighted.gather_scale_sum(y, positions, weights, 2, RULES[mode]),
                     formed_forward(y, positions, weights, 2, 2, mode))
    assert_same_bits(weighted.row_dots(grad, owners, y, RULES[mode]),
                     formed_dots(grad, owners, y, mode))


@pytest.mark.parametrize("mode", list(RULES))
def test_same_bits_on_any_thread_count(mode, monkeypatch):
    monkeypatch.setattr(weighted, "_MIN_PARALLEL_PRODUCTS", 1)
    y, positions, weights, grad, owners = problem(33, 4, 300, torch.bfloat16, seed=5)
    want = (formed_forward(y, positions, weights, 33, 4, mode), formed_dots(grad, owners, y, mode))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert_same_bits(weighted.gather_scale_sum(y, positions, weights, 4, RULES[mode]),
                             want[0])
            assert_same_bits(weighted.row_dots(grad, owners, y, RULES[mode]), want[1])
    finally:
        torch.set_num_threads(threads)


def test_bad_arguments_are_refused():
    y, positions, weights, grad, owners = problem(2, 2, 3, torch.float32, seed=1)
    with pytest.raises(ValueError, match="rule"):
        weighted.gather_scale_sum(y, positions, weights, 2, 99)
    with pytest.raises(ValueError, match="exceeds one chunk"):
        weighted.gather_scale_sum(y.repeat(CHUNK_TERMS, 1), torch.arange(4 * CHUNK_TERMS),
                                  weights.repeat(CHUNK_TERMS), 2 * CHUNK_TERMS, WIDE)
    with pytest.raises(IndexError, match=r"positions holds 0 .. 4; expected row numbers in \[0, 4\)"):
        weighted.gather_scale_sum(y, torch.tensor([0, 1, 2, 4]), weights, 2, WIDE)
    with pytest.raises(IndexError, match=r"tokens holds -1 .. 1"):
        weighted.row_dots(grad, torch.tensor([0, 1, -1, 0]), y, WIDE)
