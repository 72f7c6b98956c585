"""kernels/numba/small.py's ``segment_reduce_small``: a small segmented sum, mean, max or min
in one call, its bounds checked there, gives the bits of the segment kernel under every rule it
takes (and ``segment_sum``'s small calls those of its general path, on every layout); bad
bounds and long segments leave it to the general path, nothing written."""

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
REDUCTIONS = {"sum": kernels.SUM, "mean": kernels.MEAN, "amax": kernels.AMAX,
              "amin": kernels.AMIN}


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
    """``segment_sum``: segments of every length from 0 (empty ones write 0) to several rows,
    the offsets int64 and int32 and every other element of a longer tensor (read by their
    strides); the source spread over many binades, with -0.0, infinities and NaN."""
    answers = record_answers(monkeypatch, small, "segment_reduce_small")
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


def segment_kernels(source3, offsets, reduce, rule):
    """The segment kernel's reduction of ``source3``'s segments, no order, no base; for a
    mean under ROUND_EACH (torch's ``segment_reduce`` mean, not ``scatter_reduce``'s) its
    sum, divided in the dtype by the lengths rounded to it."""
    out = torch.full((source3.shape[0], offsets.shape[0] - 1, source3.shape[2]), float("nan"),
                     dtype=source3.dtype)
    torchs_mean = reduce == kernels.MEAN and rule == kernels.ROUND_EACH
    segment.segment_reduce(source3, None, offsets, None, out,
                           reduce=kernels.SUM if torchs_mean else reduce, rule=rule, alpha=1.0,
                           include_base=False)
    if torchs_mean:
        lengths = offsets.diff().to(source3.dtype).view(1, -1, 1)
        out = torch.where(lengths != 0, out / lengths, out)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rule", small.RULES, ids=lambda rule: RULE_NAMES[rule])
@pytest.mark.parametrize("reduce", list(REDUCTIONS))
def test_the_kernel_gives_the_segment_kernels_bits_up_to_a_chunk(reduce, rule, dtype):
    """Against the segment kernel under each rule the kernel takes, the bounds as offsets
    and as lengths: a segment of exactly CHUNK_TERMS rows is reduced; one more row in it and
    a sum or mean under the rules that split (WIDE, KAHAN) answers TOO_MANY_TERMS having
    written nothing, while ROUND_EACH (torch's unsplit serial sum), a max and a min take it.
    Extreme values: the largest finite ones (their sums overflow), infinities of both signs,
    NaN, zeros of both signs in both orders. An empty segment: the sum and mean 0 (the
    segment kernel's; the mean NaN where asked), the max -inf, the min +inf (the segment
    kernel's 0 there)."""
    big = torch.finfo(dtype).max
    code = REDUCTIONS[reduce]
    for hot in (CHUNK_TERMS, CHUNK_TERMS + 1):
        offsets = offsets_of([3, hot, 0, 7, 2])
        source = make_data((2, int(offsets[-1]), 3), dtype, seed=hot, spread=True)
        source[0, :6, 0] = torch.tensor([-0.0, -0.0, -0.0, big, big, -big], dtype=dtype)
        source[1, 3:6, 1] = torch.tensor([float("inf"), -float("inf"), float("nan")],
                                         dtype=dtype)
        source[:, -2:, 2] = torch.tensor([[-0.0, 0.0], [0.0, -0.0]], dtype=dtype)
        expected = segment_kernels(source, offsets, code, rule)
        # The segment kernel without a base writes 0 for every empty segment; the small one
        # a max's -inf and a min's +inf (torch's segment_reduce's).
        assert_same_bits(expected[:, 2], torch.zeros(2, 3, dtype=dtype))
        expected[:, 2] = {"amax": -float("inf"), "amin": float("inf")}.get(reduce, 0.0)
        for bounds, lengths in ((offsets, False), (offsets.diff(), True)):
            for empty_nan in (False, True):
                out = torch.full((2, 5, 3), float("nan"), dtype=dtype)
                answer = small.segment_reduce_small(source, bounds, out, code, rule, lengths,
                                                    empty_nan)
                if rule in SPLIT_RULES and hot > CHUNK_TERMS and reduce in ("sum", "mean"):
                    assert answer == small.TOO_MANY_TERMS
                    assert out.isnan().all()
                    continue
                assert answer == -1
                if empty_nan and reduce == "mean":
                    assert out[:, 2].isnan().all()
                    out[:, 2] = 0.0
                assert_same_bits(out, expected)


@pytest.mark.parametrize("offsets,message", [
    ([1, 2, 5], r"offsets\[0\] = 1; expected 0"),
    ([0, 2, 4], r"offsets\[-1\] = 4; expected src.size\(dim\) = 5"),
    ([0, 3, 2, 5], r"offsets decrease at position 2 \(3 then 2\)"),
])
def test_bad_offsets_write_nothing_and_are_named_by_the_general_path(offsets, message):
    source = make_data((5, 4), torch.float32, seed=1)
    bounds = torch.tensor(offsets)
    out = torch.full((1, len(offsets) - 1, 4), float("nan"))
    for code in REDUCTIONS.values():
        for rule in small.RULES:
            assert small.segment_reduce_small(source.view(1, 5, 4), bounds, out, code,
                                              rule) == small.BAD_OFFSETS
            assert out.isnan().all()
    with pytest.raises(ValueError, match=rf"detsum.segment_sum: {message}"):
        detsum.segment_sum(source, bounds)


def test_bad_lengths_write_nothing():
    """Lengths with a negative one, or that do not sum to the rows' count."""
    source = make_data((1, 5, 4), torch.float32, seed=1)
    for lengths in ([2, -1, 4], [2, 2], [2, 2, 2]):
        out = torch.full((1, len(lengths), 4), float("nan"))
        for code in REDUCTIONS.values():
            assert small.segment_reduce_small(source, torch.tensor(lengths), out, code,
                                              small.WIDE, True) == small.BAD_OFFSETS
            assert out.isnan().all()


def test_other_calls_take_the_general_path(monkeypatch):
    """The small path is a shortcut, never the only way: a launch over its size limit, a
    strided source (another compiled layout), a ``perm``, "exact" mode, a plan and no
    segments at all are the general path's."""
    answers = record_answers(monkeypatch, small, "segment_reduce_small")
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
