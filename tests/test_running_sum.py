"""detsum.RunningSum and the kernels' carried compensation: pieces give the bits of one call."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DTYPES, HAS_CUDA, assert_same_bits, dtype_id, make_data
from detsum import _segments, reference
from detsum.kernels import CHUNK_TERMS, KAHAN

SPLIT_MODES = ("fp32", "kahan", "exact")
# 600 rows: chunk 0, a whole later chunk and a partial one.
ROWS = 2 * CHUNK_TERMS + 88
# The triton backend runs CUDA tensors on a GPU, CPU tensors in the interpreter (conftest).
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


def rows_over_many_binades(n, shape, dtype, seed):
    """Rows whose magnitudes grow over 6 decades: late chunks dwarf early ones, so any change
    in the order or the fold shows in the bits."""
    scale = torch.logspace(-3, 3, n, dtype=torch.float64).view(n, *([1] * len(shape)))
    return (make_data((n, *shape), torch.float64, seed=seed) * scale).to(dtype)


def add_in_pieces(rows, piece, mode, **kwargs):
    running = detsum.RunningSum(rows.shape[1:], dtype=rows.dtype, mode=mode, **kwargs)
    for start in range(0, rows.shape[0], piece):
        running.add(rows[start:start + piece])
    return running


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_any_split_gives_the_bits_of_one_segment_sum(mode, dtype):
    rows = rows_over_many_binades(ROWS, (4, 3), dtype, seed=len(mode))
    offsets = torch.tensor([0, ROWS])
    whole = detsum.segment_sum(rows, offsets, mode=mode)[0]
    mean = detsum.scatter_reduce(torch.zeros(1, 4, 3, dtype=dtype), 0,
                                 torch.zeros(ROWS, 4, 3, dtype=torch.long), rows, "mean",
                                 include_self=False, mode=mode)[0]
    for piece in (1, 3, CHUNK_TERMS - 1, CHUNK_TERMS, CHUNK_TERMS + 1, ROWS):
        running = add_in_pieces(rows, piece, mode)
        assert running.count == ROWS
        assert_same_bits(running.sum(), whole)
        assert_same_bits(running.mean(), mean)
    with detsum.backend("reference"):
        assert_same_bits(add_in_pieces(rows, 100, mode).sum(), whole)


@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_a_result_midway_leaves_the_sum_running(mode):
    rows = rows_over_many_binades(ROWS, (5,), torch.float32, seed=7)
    running = detsum.RunningSum((5,), mode=mode)
    for start in range(0, ROWS, 50):
        running.add(rows[start:start + 50])
        end = min(start + 50, ROWS)
        assert_same_bits(running.sum(),
                         detsum.segment_sum(rows[:end], torch.tensor([0, end]), mode=mode)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
def test_carried_compensation_launch_matches_the_reference(dtype):
    """The kernels' carry, straight: a 600-term segment (split into chunks inside the kernel)
    resumed from a nonzero (s, c), into a NaN-filled output distinct from the base row."""
    rows = rows_over_many_binades(ROWS, (6,), dtype, seed=11)
    s0 = make_data((6,), dtype, seed=12)
    c0 = make_data((6,), dtype, seed=13) * 1e-9
    want_s, want_c = reference.resume_sum(s0, c0, list(rows))
    backends = ["numba"]
    try:
        import triton  # noqa: F401

        backends.append("triton")
    except ImportError:
        pass
    for backend_name in backends:
        device = TRITON_DEVICE if backend_name == "triton" else "cpu"
        out = torch.full((1, 1, 6), float("nan"), dtype=dtype, device=device)
        carry = c0.clone().view(1, 1, 6).to(device)
        _segments.launch(backend_name, rows.unsqueeze(0).to(device), None,
                         torch.tensor([0, ROWS], device=device), s0.view(1, 1, 6).to(device), out,
                         reduce="sum", rule=KAHAN, alpha=1.0, include_base=True, carry3=carry)
        assert_same_bits(out.view(6).cpu(), want_s)
        assert_same_bits(carry.view(6).cpu(), want_c)


@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_triton_running_sum(mode):
    pytest.importorskip("triton")
    rows = rows_over_many_binades(ROWS, (3,), torch.float32, seed=5)
    whole = detsum.segment_sum(rows, torch.tensor([0, ROWS]), mode=mode)[0]
    with detsum.backend("triton"):
        pieces = add_in_pieces(rows.to(TRITON_DEVICE), 300, mode, device=TRITON_DEVICE)
        assert_same_bits(pieces.sum().cpu(), whole)


@pytest.mark.parametrize("device", ["cpu:0", "cuda", "cuda:0"])
def test_a_device_named_without_or_with_an_index_takes_its_rows(device):
    """RunningSum(device="cuda") once refused rows on cuda:0 (the device tensors report)."""
    if device.startswith("cuda") and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    rows = rows_over_many_binades(5, (3,), torch.float32, seed=3).to(device)
    running = detsum.RunningSum((3,), device=device)
    running.add(rows)
    assert running.device == rows.device
    assert_same_bits(running.sum().cpu(), detsum.segment_sum(
        rows.cpu(), torch.tensor([0, 5]))[0])


def test_special_values():
    rows = torch.tensor([[1.0, -0.0, 1.0], [float("inf"), -0.0, float("nan")], [1.0, -0.0, 2.0]])
    for mode in SPLIT_MODES:
        running = add_in_pieces(rows, 1, mode)
        assert_same_bits(running.sum(), detsum.segment_sum(rows, torch.tensor([0, 3]),
                                                           mode=mode)[0])
        assert running.sum()[0] == float("inf")


def test_empty_sum_and_empty_pieces():
    running = detsum.RunningSum((2,), mode="kahan")
    running.add(torch.empty(0, 2))
    assert running.count == 0
    assert_same_bits(running.sum(), torch.zeros(2))
    with pytest.raises(ValueError, match="no rows were added"):
        running.mean()


def test_bad_input_is_refused_and_changes_nothing():
    running = detsum.RunningSum((2, 3))
    running.add(torch.ones(4, 2, 3))
    before = running.sum()
    with pytest.raises(TypeError, match=r"rows has dtype torch.float64; expected torch.float32"):
        running.add(torch.ones(1, 2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"rows has shape \(1, 3, 2\); expected \[k, 2, 3\]"):
        running.add(torch.ones(1, 3, 2))
    with pytest.raises(TypeError, match="rows must be a torch.Tensor"):
        running.add([[1.0]])
    assert running.count == 4
    assert_same_bits(running.sum(), before)
    with pytest.raises(ValueError, match="mode='autograd' has no meaning"):
        detsum.RunningSum((2,), mode="autograd")
    with pytest.raises(ValueError, match="mode='fast' is not a detsum mode"):
        detsum.RunningSum((2,), mode="fast")
    with pytest.raises(TypeError, match="dtype=torch.int32; expected one of"):
        detsum.RunningSum((2,), dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"^detsum.RunningSum: detsum has no backend "
                                                  r"for meta tensors"):
        detsum.RunningSum((2,), device="meta")
