"""kernels/numba/small.py's ``segment_sum_small``: a small ``segment_sum`` in one call, its
offsets checked there, gives the bits of the general path (the segment kernel) in every mode it
takes, on every layout; bad offsets and long segments leave it to the general path, nothing
written."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import (DTYPES, LAYOUTS, assert_same_bits, dtype_id, make_data, record_answers,
                      strided_copy, with_rows)
from detsum import kernels
from detsum.kernels import CHUNK_TERMS, RULE_NAMES, SPLIT_RULES
from detsum.kernels.numba import segment, small

MODES = ("fp32", "kahan", "autograd")


def general(monkeypatch, function):
    """function() with every launch on the general path."""
    with monkeypatch.context() as patch:
        patch.setattr(small, "MAX_ELEMENTS", -1)
        return function()


def offsets_of(lengths) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])


@pytest.mark.parametrize(("template", "dim"), LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_small_segment_sums_give_the_bits_of_the_general_path(mode, dtype, template, dim,
                                                               monkeypatch):
    """Segments of every length from 0 (empty ones write 0) to several rows, the offsets
    int64 and int32 and every other element of a longer tensor (read by their strides);
    the source spread over many binades, with -0.0, infinities and NaN."""
    answers = record_answers(monkeypatch, small, "segment_sum_small")
    rows = 23
    source = make_data(with_rows(template, rows), dtype, seed=len(mode), spread=True)
    flat = source.view(-1)
    flat[:4] = torch.tensor([-0.0, float("inf"), float("nan"), -0.0], dtype=dtype)
    lengths = [0, 3, 1, 0, 5, 2]
    lengths.append(rows - sum(lengths))
    offsets = offsets_of(lengths)
    strided = torch.stack([offsets, torch.full_like(offsets, -7)], 1).view(-1)[::2]
    for bounds in (offsets, offsets.int(), strided):
        call = lambda: detsum.segment_sum(source, bounds, dim=dim, mode=mode)  # noqa: E731
        answers.clear()
        got = call()
        assert answers == [-1]
        assert_same_bits(got, general(monkeypatch, call))
    # A segment of -0.0 alone sums to +0.0 (from +0.0, as the segment kernel does).
    zeros = torch.full(with_rows(template, 2), -0.0, dtype=dtype)
    got = detsum.segment_sum(zeros, offsets_of([2]), dim=dim, mode=mode)
    assert_same_bits(got, general(monkeypatch, lambda: detsum.segment_sum(
        zeros, offsets_of([2]), dim=dim, mode=mode)))
    assert not torch.signbit(got).any()


def segment_kernels_sum(source3, offsets, rule):
    """The segment kernel's SUM of ``source3``'s segments, no order, no base."""
    out = torch.full((source3.shape[0], offsets.shape[0] - 1, source3.shape[2]), float("nan"),
                     dtype=source3.dtype)
    segment.segment_reduce(source3, None, offsets, None, out, reduce=kernels.SUM, rule=rule,
                           alpha=1.0, include_base=False)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rule", small.RULES, ids=lambda rule: RULE_NAMES[rule])
def test_the_kernel_gives_the_segment_kernels_bits_up_to_a_chunk(rule, dtype):
    """Against the segment kernel under each rule the kernel takes: a segment of exactly
    CHUNK_TERMS rows is summed; one more row in it and the rules that split (WIDE, KAHAN)
    answer TOO_MANY_TERMS having written nothing, while ROUND_EACH (torch's unsplit serial
    sum) takes it. Extreme values: the largest finite ones (their sums overflow), infinities
    of both signs, NaN, zeros of both signs."""
    big = torch.finfo(dtype).max
    for hot in (CHUNK_TERMS, CHUNK_TERMS + 1):
        offsets = offsets_of([3, hot, 0, 7])
        source = make_data((2, int(offsets[-1]), 3), dtype, seed=hot, spread=True)
        source[0, :6, 0] = torch.tensor([-0.0, -0.0, -0.0, big, big, -big], dtype=dtype)
        source[1, 3:6, 1] = torch.tensor([float("inf"), -float("inf"), float("nan")],
                                         dtype=dtype)
        out = torch.full((2, 4, 3), float("nan"), dtype=dtype)
        answer = small.segment_sum_small(source, offsets, out, rule)
        if rule in SPLIT_RULES and hot > CHUNK_TERMS:
            assert answer == small.TOO_MANY_TERMS
            assert out.isnan().all()
            continue
        assert answer == -1
        assert_same_bits(out, segment_kernels_sum(source, offsets, rule))


@pytest.mark.parametrize("offsets,message", [
    ([1, 2, 5], r"offsets\[0\] = 1; expected 0"),
    ([0, 2, 4], r"offsets\[-1\] = 4; expected src.size\(dim\) = 5"),
    ([0, 3, 2, 5], r"offsets decrease at position 2 \(3 then 2\)"),
])
def test_bad_offsets_write_nothing_and_are_named_by_the_general_path(offsets, message):
    source = make_data((5, 4), torch.float32, seed=1)
    bounds = torch.tensor(offsets)
    out = torch.full((1, len(offsets) - 1, 4), float("nan"))
    for rule in small.RULES:
        assert small.segment_sum_small(source.view(1, 5, 4), bounds, out, rule) == \
            small.BAD_OFFSETS
        assert out.isnan().all()
    with pytest.raises(ValueError, match=rf"detsum.segment_sum: {message}"):
        detsum.segment_sum(source, bounds)


def test_other_calls_take_the_general_path(monkeypatch):
    """The small path is a shortcut, never the only way: a launch over its size limit, a
    strided source (another compiled layout), a ``perm``, "exact" mode, a plan and no
    segments at all are the general path's."""
    answers = record_answers(monkeypatch, small, "segment_sum_small")
    source = make_data((12, 4), torch.float32, seed=2)
    offsets = offsets_of([5, 0, 7])
    detsum.segment_sum(source, offsets)
    assert answers == [-1]
    answers.clear()
    large = make_data((small.MAX_ELEMENTS // 4 + 1, 4), torch.float32, seed=3)
    detsum.segment_sum(large, offsets_of([large.shape[0]]))
    detsum.segment_sum(strided_copy(source), offsets)
    detsum.segment_sum(source, offsets, perm=torch.arange(12).flip(0))
    detsum.segment_sum(source, offsets, mode="exact")
    detsum.segment_sum(source, plan=detsum.plan(torch.tensor([0] * 5 + [2] * 7), 3))
    detsum.segment_sum(source[:0], torch.zeros(1, dtype=torch.int64))  # no segment, no row
    assert answers == []
