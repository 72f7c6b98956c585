"""Shared lists and helpers: every test file draws its dtypes, modes and comparisons from here."""

from __future__ import annotations

import pytest
import torch

import detsum
from detsum import _segments

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MODES = detsum.MODES
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def poison_outputs():
    """NaN-fill every kernel output before it is written: an unwritten element fails equality."""
    _segments.POISON_OUTPUTS = True
    yield
    _segments.POISON_OUTPUTS = False


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit equality, except that NaNs compare by position (torch paths differ in NaN payloads)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), "NaN positions differ"
    a = actual.masked_fill(nan_a, 0)
    e = expected.masked_fill(nan_e, 0)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a_bits, e_bits = a.contiguous().view(bits), e.contiguous().view(bits)
    if not torch.equal(a_bits, e_bits):
        differ = (a_bits != e_bits).nonzero()
        first = tuple(differ[0].tolist())
        raise AssertionError(
            f"{differ.shape[0]} of {a.numel()} elements differ; first at {first}: "
            f"{a[first].item()!r} vs {e[first].item()!r}")


def make_data(shape, dtype, *, seed=0, spread=False):
    """Random data; ``spread`` draws magnitudes over many binades with both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if spread:
        max_exp = {torch.float16: 6, torch.bfloat16: 30, torch.float32: 30, torch.float64: 60}[dtype]
        x = x * torch.exp2(torch.randint(-max_exp, max_exp + 1, shape, generator=g).double())
    return x.to(dtype)
