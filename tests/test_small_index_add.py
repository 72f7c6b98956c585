"""kernels/numba/small.py: a small index_add, in one call without a plan, gives the bits of the
general path (the plan and the segment kernel) in every mode it takes, on every layout; so does
a small scatter_reduce sum from its input, which it computes too. And a 1-D index_add or
scatter_reduce of many terms in one pass without a plan (``_segments.streamed_scatter``: the
small calls' serial passes at any size, the one that keeps each row's chunk among them) gives
the plan's bits."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import (DTYPES, LAYOUTS, assert_same_bits, dtype_id, make_data, record_answers,
                      strided_copy, with_rows)
from detsum import _segments
from detsum.kernels import CHUNK_TERMS, EXACT, RULE_NAMES, SPLIT_RULES
from detsum.kernels.numba import small

MODES = ("fp32", "kahan", "autograd")


def general(monkeypatch, function):
    """function() with every launch on the general path."""
    with monkeypatch.context() as patch:
        patch.setattr(small, "MAX_ELEMENTS", -1)
        return function()


def problem(template, dim, rows, num_segments, dtype, seed):
    source = make_data(with_rows(template, rows), dtype, seed=seed, spread=True)
    input_shape = list(source.shape)
    input_shape[dim] = num_segments
    input = make_data(tuple(input_shape), dtype, seed=seed + 1, spread=True)
    index = torch.randint(0, num_segments, (rows,), generator=torch.Generator().manual_seed(seed))
    return input, index, source


@pytest.mark.parametrize(("template", "dim"), LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("alpha", [1, 0.37, -3])
def test_small_launches_give_the_bits_of_the_general_path(mode, dtype, template, dim, alpha,
                                                           monkeypatch):
    input, index, source = problem(template, dim, 23, 6, dtype, seed=len(mode) + 7)
    call = lambda: detsum.index_add(input, dim, index, source, alpha=alpha, mode=mode)  # noqa: E731
    assert_same_bits(call(), general(monkeypatch, call))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_in_place_strided_and_at_the_size_limits(mode, dtype, monkeypatch):
    """In place (out is the input itself), with an int32 index, at the most terms a segment
    may take (CHUNK_TERMS) and one more (the general path's split); strided tensors too (the
    general path takes them)."""
    for rows in (0, 1, CHUNK_TERMS, CHUNK_TERMS + 1):
        input, index, source = problem((None, 5), 0, rows, 4, dtype, seed=rows)
        index = index.int()
        index[:rows] = 2  # one segment takes every term
        for make in (lambda t: t.clone(), strided_copy):
            def call():
                target = make(input)
                detsum.index_add_(target, 0, index, make(source), alpha=0.5, mode=mode)
                return target
            assert_same_bits(call(), general(monkeypatch, call))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_a_strided_index_is_read_by_its_strides(index_dtype, monkeypatch):
    """The kernel reads the index from its address, one int64 after another: an index of
    every other element (or of another type) reaches it as a contiguous int64 copy."""
    calls, original = [], small.index_add_small
    monkeypatch.setattr(small, "index_add_small",
                        lambda *args: calls.append(args) or original(*args))
    input, _, source = problem((None, 5), 0, 23, 6, torch.float32, seed=3)
    every_other = torch.arange(46).remainder(6).flip(0).to(index_dtype)[::2]
    assert not every_other.is_contiguous()
    call = lambda: detsum.index_add(input, 0, every_other, source)  # noqa: E731
    assert_same_bits(call(), general(monkeypatch, call))
    assert_same_bits(call(), detsum.index_add(input, 0, every_other.clone(), source))
    assert calls  # the small path took it


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_special_values(mode, dtype, monkeypatch):
    big = torch.finfo(dtype).max
    source = torch.tensor([[-0.0, float("inf"), big], [float("nan"), -float("inf"), big],
                           [-0.0, 1.0, -big], [2.0, -0.0, big]], dtype=dtype)
    input = torch.tensor([[-0.0, 1.0, 0.0], [float("nan"), 0.0, -big], [0.0, -0.0, 1.0]],
                         dtype=dtype)
    index = torch.tensor([0, 1, 0, 2])
    call = lambda: detsum.index_add(input, 0, index, source, mode=mode)  # noqa: E731
    assert_same_bits(call(), general(monkeypatch, call))


def test_a_bad_index_is_named_and_nothing_is_written():
    input = torch.zeros(4, 3)
    source = torch.ones(5, 3)
    for bad, position in ((torch.tensor([0, 1, 4, 2, 0]), 2), (torch.tensor([0, -1, 0, 0, 1]), 1)):
        target = input.clone()
        with pytest.raises(IndexError, match=rf"index\[{position}\] = {int(bad[position])} is "
                                             rf"out of range"):
            detsum.index_add_(target, 0, bad, source)
        assert torch.equal(target, input)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_many_terms_in_rows_of_few_take_the_small_path(mode, dtype, monkeypatch):
    """Past CHUNK_TERMS terms in all the kernel counts each row's: with none past
    CHUNK_TERMS (one at exactly CHUNK_TERMS) it adds them, with the general path's bits; with
    one row past it (where the general path cuts chunks) it answers TOO_MANY_TERMS having
    written nothing, and the call takes the general path."""
    answers = record_answers(monkeypatch, small, "index_add_small")
    input, _, source = problem((None, 5), 0, 3 * CHUNK_TERMS, 16, dtype, seed=11)
    others = torch.tensor([row for row in range(16) if row != 3])
    index = torch.cat([torch.full((CHUNK_TERMS,), 3),
                       others[torch.arange(2 * CHUNK_TERMS) % len(others)]])
    index = index[torch.randperm(len(index), generator=torch.Generator().manual_seed(2))]
    # "autograd" (ROUND_EACH) adds every term in turn: it never splits, nor refuses.
    too_many = -1 if mode == "autograd" else small.TOO_MANY_TERMS
    for hot_row_terms, answer in ((CHUNK_TERMS, -1), (CHUNK_TERMS + 5, too_many)):
        if hot_row_terms > CHUNK_TERMS:  # a second chunk of 5 terms, added apart
            index[(index != 3).nonzero()[:5]] = 3
        assert int((index == 3).sum()) == hot_row_terms
        call = lambda: detsum.index_add(input, 0, index, source, alpha=0.5, mode=mode)  # noqa: E731
        answers.clear()
        got = call()
        assert answers == [answer]
        assert_same_bits(got, general(monkeypatch, call))
        for rule in (small.WIDE, small.KAHAN, small.ROUND_EACH):
            poisoned = torch.full_like(input, float("nan"))
            expected = -1 if rule == small.ROUND_EACH or hot_row_terms <= CHUNK_TERMS \
                else small.TOO_MANY_TERMS
            assert small.index_add_small(source.view(1, *source.shape), index,
                                         input.view(1, *input.shape),
                                         poisoned.view(1, *input.shape), 1.0, rule) == expected
            assert poisoned.isnan().all() == (expected == small.TOO_MANY_TERMS)


def test_large_launches_take_the_general_path(monkeypatch):
    """The small path is a shortcut, never the only way: a launch over its limits is planned."""
    calls, original = [], small.index_add_small
    monkeypatch.setattr(small, "index_add_small",
                        lambda *args: calls.append(args) or original(*args))
    rows = small.MAX_ELEMENTS // 8 + 1
    input, index, source = problem((None, 8), 0, rows, 4, torch.float32, seed=1)
    detsum.index_add(input, 0, index, source)
    assert not calls
    detsum.index_add(input, 0, index[:10], source[:10])
    assert len(calls) == 1
    detsum.index_add(input, 0, index[:10], strided_copy(source[:10]))
    detsum.index_add(input[:, ::2], 0, index[:10], source[:10, ::2])
    assert len(calls) == 1  # strided: the general kernel, not a compile of another layout


def scatter_problem(template, dim, dtype, seed):
    """``problem``'s tensors with special values (-0.0 terms and inits, infinities, NaN),
    and the index in its two forms: a row index, and torch's own of src's shape."""
    input, index, source = problem(template, dim, 23, 6, dtype, seed=seed)
    source.select(dim, 0).fill_(-0.0)
    source.select(dim, 1).fill_(float("inf"))
    input.select(dim, int(index[0])).fill_(-0.0)
    input.select(dim, int(index[2])).fill_(float("nan"))
    shape = [1] * source.dim()
    shape[dim] = -1
    return input, index, source, (index, index.view(shape).expand(source.shape))


@pytest.mark.parametrize(("template", "dim"), LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_small_scatter_sums_give_the_bits_of_the_general_path(mode, dtype, template, dim,
                                                              monkeypatch):
    """scatter_reduce's sum from its input (include_self), by a row index or torch's own index
    of src's shape, takes the small call; without include_self, or promised sorted, it does
    not. Special values included (-0.0 terms and inits, infinities, NaN)."""
    calls, original = [], small.index_add_small
    monkeypatch.setattr(small, "index_add_small",
                        lambda *args: calls.append(args) or original(*args))
    input, index, source, forms = scatter_problem(template, dim, dtype, seed=len(mode) + 11)
    for form in forms:
        for include_self in (True, False):
            call = lambda: detsum.scatter_reduce(input, dim, form, source, "sum",  # noqa: E731
                                                 include_self=include_self, mode=mode)
            before = len(calls)
            assert_same_bits(call(), general(monkeypatch, call))
            assert len(calls) == before + include_self
    sorted_index = index.sort().values
    detsum.scatter_reduce(input, dim, sorted_index, source, "sum", sorted=True, mode=mode)
    assert len(calls) == 2  # a sorted=True promise is checked on the general path


@pytest.mark.parametrize("reduce", ["mean", "amax", "amin"])
@pytest.mark.parametrize(("template", "dim"), LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", (*MODES, "exact"))
def test_small_scatter_means_and_extremes_give_the_bits_of_the_general_path(
        mode, dtype, template, dim, reduce, monkeypatch):
    """scatter_reduce's mean, amax and amin, with and without include_self, by a row index or
    torch's own index of src's shape, take one small call into a copy of the input (rows
    without terms keep the input's values); promised sorted, or a mean in "exact" mode, they
    do not. Special values included (-0.0 terms and inits, infinities, NaN)."""
    name = "mean_small_in_place" if reduce == "mean" else "extreme_small_in_place"
    answers = record_answers(monkeypatch, small, name)
    input, index, source, forms = scatter_problem(template, dim, dtype, seed=len(mode) + 13)
    takes_it = reduce != "mean" or mode != "exact"
    for form in forms:
        for include_self in (True, False):
            call = lambda: detsum.scatter_reduce(input, dim, form, source, reduce,  # noqa: E731
                                                 include_self=include_self, mode=mode)
            answers.clear()
            assert_same_bits(call(), general(monkeypatch, call))
            assert answers == ([-1] if takes_it else [])
    answers.clear()
    detsum.scatter_reduce(input, dim, index.sort().values, source, reduce, sorted=True,
                          mode=mode)
    assert answers == []  # a sorted=True promise is checked on the general path


@pytest.mark.parametrize("mode", MODES)
def test_a_small_scatter_mean_of_too_many_terms_takes_the_general_path(mode, monkeypatch):
    """A mean's row of more than CHUNK_TERMS terms: under the rules that split (fp32, kahan)
    the small call answers TOO_MANY_TERMS having written nothing, and the general path gives
    the call its bits; "autograd" (unsplit) takes it."""
    answers = record_answers(monkeypatch, small, "mean_small_in_place")
    index = torch.cat([torch.full((CHUNK_TERMS + 3,), 2), torch.tensor([0, 5, 2])])
    source = make_data((len(index), 3), torch.float32, seed=5, spread=True)
    input = make_data((6, 3), torch.float32, seed=6)
    call = lambda: detsum.scatter_reduce(input, 0, index, source, "mean", mode=mode)  # noqa: E731
    got = call()
    assert answers == [-1 if mode == "autograd" else small.TOO_MANY_TERMS]
    assert_same_bits(got, general(monkeypatch, call))


@pytest.mark.parametrize("reduce", ["mean", "amax", "amin"])
def test_a_small_scatter_means_or_extremes_bad_index_is_named_and_nothing_is_written(reduce):
    input = torch.zeros(4, 3)
    for bad, position in ((torch.tensor([0, 1, 4, 2]), 2), (torch.tensor([0, -1, 0, 0]), 1)):
        with pytest.raises(IndexError, match=rf"detsum.scatter_reduce: index\[{position}\] = "
                                             rf"{int(bad[position])} is out of range"):
            detsum.scatter_reduce(input, 0, bad, torch.ones(4, 3), reduce)
        assert torch.equal(input, torch.zeros(4, 3))


def test_a_small_scatter_sums_bad_index_is_named_and_nothing_is_written():
    input = torch.zeros(4, 3)
    with pytest.raises(IndexError, match=r"detsum.scatter_reduce: index\[2\] = 4 is out of "
                                         r"range"):
        detsum.scatter_reduce(input, 0, torch.tensor([0, 1, 4, 2]), torch.ones(4, 3), "sum")
    assert torch.equal(input, torch.zeros(4, 3))


@pytest.mark.parametrize("mode", ["fp32", "kahan"])
def test_a_bad_index_past_a_row_of_too_many_terms_is_named_by_the_general_path(mode):
    """The kernel's pass stops at a row's CHUNK_TERMS + 1st term (TOO_MANY_TERMS), before a
    bad value further on: the general path then names it, nothing written."""
    index = torch.cat([torch.full((CHUNK_TERMS + 1,), 3), torch.tensor([1, 16, 2])])
    source = torch.ones(len(index), 3)
    target = torch.zeros(16, 3)
    with pytest.raises(IndexError, match=rf"index\[{CHUNK_TERMS + 2}\] = 16 is out of range"):
        detsum.index_add_(target, 0, index, source, mode=mode)
    assert torch.equal(target, torch.zeros(16, 3))
    assert small.index_add_small(source.view(1, -1, 3), index, target.view(1, 16, 3),
                                 target.view(1, 16, 3), 1.0, small.WIDE) == small.TOO_MANY_TERMS


def segment_kernels_mean(target, index, source, include_base, rule):
    """The segment kernel's MEAN of ``source``'s rows ([outer, n, inner]) at ``index`` into a
    copy of ``target`` ([outer, S, inner]): its plan made here (a stable sort of the index)."""
    from detsum.kernels import MEAN
    from detsum.kernels.numba import segment

    order = torch.sort(index, stable=True).indices
    offsets = torch.zeros(target.shape[1] + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(index, minlength=target.shape[1]).cumsum(0)
    out = torch.full_like(target, float("nan"))
    segment.segment_reduce(source, order, offsets, target, out, reduce=MEAN, rule=rule, alpha=1.0,
                           include_base=include_base)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rule", small.RULES, ids=lambda rule: RULE_NAMES[rule])
def test_small_means_in_place_give_the_segment_kernels_bits(rule, dtype):
    """``mean_small_in_place`` against the segment kernel's MEAN under each rule it takes,
    with and without the target's values: data over many binades, infinities, NaNs and zeros
    of both signs, rows without terms (left untouched without the target's values), a row at
    exactly CHUNK_TERMS terms. One more term on it: the rules that split answer
    TOO_MANY_TERMS having written nothing; ROUND_EACH (torch's unsplit serial sum) takes it."""
    big = torch.finfo(dtype).max
    for terms_on_row_2 in (CHUNK_TERMS, CHUNK_TERMS + 1):
        n = terms_on_row_2 + 40
        index = torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(n))
        index[index == 2] = 0
        index[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:terms_on_row_2]] = 2
        source = make_data((2, n, 3), dtype, seed=n, spread=True)
        source[0, :4, 0] = torch.tensor([-0.0, float("inf"), float("nan"), big], dtype=dtype)
        target = make_data((2, 7, 3), dtype, seed=n + 1, spread=True)
        target[1, :3, 1] = torch.tensor([-0.0, float("nan"), -big], dtype=dtype)
        for include_base in (True, False):
            written = target.clone()
            answer = small.mean_small_in_place(source, index, written, 2, 3, include_base,
                                               rule)
            if rule in SPLIT_RULES and terms_on_row_2 > CHUNK_TERMS:
                assert answer == small.TOO_MANY_TERMS
                assert_same_bits(written, target)
                continue
            assert answer == -1
            # Rows 5 and 6 get no terms: the segment kernel writes them as they were.
            assert_same_bits(written, segment_kernels_mean(target, index, source, include_base,
                                                           rule))


def test_a_small_means_bad_index_writes_nothing():
    target = make_data((1, 4, 2), torch.float32, seed=3)
    for bad, position in ((torch.tensor([0, 1, 4, 2]), 2), (torch.tensor([0, -1, 0, 0]), 1)):
        written = target.clone()
        assert small.mean_small_in_place(torch.ones(1, 4, 2), bad, written, 1, 2, True,
                                         small.RULES[0]) == position
        assert_same_bits(written, target)


# ---- a 1-D index_add in one pass without a plan ------------------------------------------------

def _one_pass_from_2000_terms(monkeypatch) -> list:
    """The one-pass path with the small path off (which would take "autograd" first), its
    elementwise scatter from 2000 terms: what each later call of
    ``_segments.streamed_scatter`` answers, in turn (None where it did not take the call)."""
    monkeypatch.setattr(_segments, "_MIN_STREAMED_TERMS", 2000)
    monkeypatch.setattr(small, "MAX_ELEMENTS", -1)
    return record_answers(monkeypatch, _segments, "streamed_scatter")


def _taken(answers: list) -> list:
    """Whether each answer of ``_segments.streamed_scatter`` took its call."""
    return [answer is not None for answer in answers]


def _without_the_pass(monkeypatch, function):
    """function() with the one-pass path (``_segments.streamed_scatter``) declining."""
    with monkeypatch.context() as patch:
        patch.setattr(_segments, "streamed_scatter", lambda *args: None)
        return function()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", ("fp32", "kahan", "autograd", "exact"))
def test_a_1d_index_add_in_one_pass_gives_the_bits_of_the_plans_path(mode, dtype, monkeypatch):
    """A 1-D index_add (rows of one element) of many terms goes through one pass without a
    plan where that is the faster way: the plan's bits, out of place and in place, for rows
    of one term, of exactly CHUNK_TERMS and of several chunks and a shorter last one (cut as
    the plan's launch cuts them), rows with no terms, NaN, infinities and signed zeros, a
    strided source and an int32 index; along the last dim of a 2-D tensor of one row too.
    The pass is a serial sum (``small.index_add_one_column``, at any size), or for a strided
    source the elementwise scatter. "exact", alpha other than 1, a second row of the outer
    dim, a wider slice, a strided source of fewer terms than ``_MIN_STREAMED_TERMS``: the
    plan's path. Outputs are NaN before the kernel writes them."""
    taken = _one_pass_from_2000_terms(monkeypatch)
    g = torch.Generator().manual_seed(41)
    rows = 40
    counts = torch.tensor([1, CHUNK_TERMS, 3 * CHUNK_TERMS + 17, 2 * CHUNK_TERMS, 0] + [40] * 35)
    index = torch.repeat_interleave(torch.arange(rows), counts)
    index = index[torch.randperm(index.numel(), generator=g)]
    terms = index.numel()
    assert terms >= 2000
    source = make_data((terms,), dtype, seed=42, spread=True)
    source[torch.randint(0, terms, (8,), generator=g)] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 0.0, -0.0, 1.0]).to(dtype)
    base = make_data((rows,), dtype, seed=43, spread=True)
    calls = {
        "out of place": lambda s, i: detsum.index_add(base, 0, i, s, mode=mode),
        "in place": lambda s, i: detsum.index_add_(base.clone(), 0, i, s, mode=mode),
        "last dim of one row": lambda s, i: detsum.index_add(base.view(1, rows), 1, i,
                                                             s.view(1, -1), mode=mode),
    }
    # An int32 index; every row of many chunks (9 and more); rows of at most CHUNK_TERMS.
    long_rows = torch.arange(9 * CHUNK_TERMS * rows + 7) % rows
    long_source = make_data((long_rows.numel(),), dtype, seed=44, spread=True)
    short_rows = torch.repeat_interleave(torch.arange(rows), torch.tensor(
        [1, CHUNK_TERMS, 0] + [60] * (rows - 3)))
    short_rows = short_rows[torch.randperm(short_rows.numel(), generator=g)]
    passes = {name: record_answers(monkeypatch, small, name)
              for name in ("index_add_small", "index_add_one_column")}
    for name, call in calls.items():
        for s, i in ((source, index), (source, index.to(torch.int32)),
                     (strided_copy(source), index), (long_source, long_rows),
                     (source[:short_rows.numel()], short_rows)):
            taken.clear()
            for answers in passes.values():
                answers.clear()
            got = call(s, i)
            assert _taken(taken) == [mode != "exact"], name
            # A contiguous source's sum is the one-column serial pass; a strided one's the
            # scatter.
            serial = {} if mode == "exact" or not s.is_contiguous() else {
                "index_add_one_column": [-1]}
            assert {k: v for k, v in passes.items() if v} == serial, name
            assert_same_bits(got, _without_the_pass(monkeypatch, lambda: call(s, i)))
    declined = {
        "alpha": lambda: detsum.index_add(base, 0, index, source, alpha=0.5, mode=mode),
        "two outer rows": lambda: detsum.index_add(base.view(1, rows).expand(2, rows), 1, index,
                                                   source.view(1, -1).expand(2, -1), mode=mode),
        "slice of two": lambda: detsum.index_add(base.view(rows, 1).expand(rows, 2), 0, index,
                                                 source.view(-1, 1).expand(-1, 2), mode=mode),
        "a strided source of fewer terms": lambda: detsum.index_add(
            base, 0, index[:1999], strided_copy(source)[:1999], mode=mode),
    }
    for name, call in declined.items():
        taken.clear()
        call()
        assert True not in _taken(taken), name


def test_a_1d_index_add_in_one_pass_names_a_bad_index_and_writes_nothing(monkeypatch):
    """A value out of range in the one-pass path: the plan's error, in the caller's words,
    and the in-place target as it was."""
    monkeypatch.setattr(_segments, "_MIN_STREAMED_TERMS", 100)
    monkeypatch.setattr(small, "MAX_ELEMENTS", -1)
    index = torch.arange(300) % 7
    index[123] = 7
    source = torch.ones(300)
    target = torch.zeros(7)
    with pytest.raises(IndexError, match=r"^detsum.index_add_: index\[123\] = 7 is out of "
                                         r"range for input.size\(0\) = 7"):
        detsum.index_add_(target, 0, index, source)
    assert torch.equal(target, torch.zeros(7))
    with pytest.raises(IndexError, match=r"^detsum.index_add: index\[123\] = 7 is out of range"):
        detsum.index_add(target, 0, index, source)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", ("fp32", "kahan", "autograd", "exact"))
def test_a_1d_scatter_in_one_pass_gives_the_bits_of_the_plans_path(mode, dtype, monkeypatch):
    """A 1-D scatter_reduce of many terms by a 1-D index: one pass without a plan where that
    is the faster way, with the plan's bits, for every reduction, with and without the
    input's own values, rows of one term, of several chunks and of none (which keep the
    input); "exact" sums and means, and a ``sorted=True`` promise (which the plan checks),
    take the plan's path."""
    taken = _one_pass_from_2000_terms(monkeypatch)
    g = torch.Generator().manual_seed(47)
    rows = 30
    counts = torch.tensor([1, 3 * CHUNK_TERMS + 17, 0, CHUNK_TERMS] + [50] * 26)
    index = torch.repeat_interleave(torch.arange(rows), counts)
    index = index[torch.randperm(index.numel(), generator=g)]
    source = make_data((index.numel(),), dtype, seed=48, spread=True)
    source[::97] = torch.tensor(float("nan")).to(dtype)
    base = make_data((rows,), dtype, seed=49, spread=True)
    for reduce in ("sum", "mean", "prod", "amax", "amin"):
        if mode == "exact" and reduce == "prod":
            continue  # no exact product
        terms = (1 + source.double() / 1024).to(dtype) if reduce == "prod" else source
        for include_self in (True, False):
            call = lambda: detsum.scatter_reduce(  # noqa: E731
                base, 0, index, terms, reduce, include_self=include_self, mode=mode)
            taken.clear()
            got = call()
            assert (True in _taken(taken)) == (mode != "exact" or reduce not in ("sum", "mean"))
            assert_same_bits(got, _without_the_pass(monkeypatch, call))
            assert_same_bits(got[2], base[2])  # no terms: the input's value
    taken.clear()
    detsum.scatter_reduce(base, 0, index.sort().values, source, "sum", sorted=True, mode=mode)
    assert True not in _taken(taken)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", ("fp32", "kahan", "autograd"))
@pytest.mark.parametrize("alpha", [1, 0.37])
def test_the_one_column_serial_sum_gives_the_bits_of_the_general_path(mode, dtype, alpha,
                                                                       monkeypatch):
    """``small.index_add_one_column``, the serial sum of one column, under each rule, with
    alpha: the
    general path's bits for rows of one term, of no terms, of exactly one and two chunks, of
    several chunks with a shorter last one, and of enough chunks to take the count past its
    wrap (``2 * CHUNK_TERMS - 1``) many times, with NaN, infinities and signed zeros among
    the terms; in place and into a new output (NaN before it is written); a bad value (past
    the end, or negative) named by its position, nothing written."""
    counts = [1, 0, CHUNK_TERMS, 2 * CHUNK_TERMS, 5 * CHUNK_TERMS + 31, 2 * CHUNK_TERMS + 1, 9,
              CHUNK_TERMS - 1]
    g = torch.Generator().manual_seed(62)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    index = index[torch.randperm(index.numel(), generator=g)]
    source = make_data((index.numel(),), dtype, seed=61, spread=True)
    source[torch.randint(0, index.numel(), (6,), generator=g)] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -0.0]).to(dtype)
    base = make_data((len(counts),), dtype, seed=63, spread=True)
    base[1] = -0.0  # a row without terms keeps its own bits
    expected = general(monkeypatch, lambda: _without_the_pass(monkeypatch, lambda: (
        detsum.index_add(base, 0, index, source, alpha=alpha, mode=mode))))
    rule = {"fp32": small.WIDE, "kahan": small.KAHAN, "autograd": small.ROUND_EACH}[mode]
    out = torch.full_like(base, float("nan"))
    assert small.index_add_one_column(source, index, base, out, rule, alpha) == -1
    assert_same_bits(out, expected)
    target = base.clone()
    assert small.index_add_one_column(source, index.to(torch.int32), target, target, rule,
                                      alpha) == -1
    assert_same_bits(target, expected)
    for position, value in ((17, len(counts)), (index.numel() - 1, -1)):
        bad = index.clone()
        bad[position] = value
        untouched = base.clone()
        assert small.index_add_one_column(source, bad, untouched, untouched, rule,
                                          alpha) == position
        assert torch.equal(untouched, base)
    with pytest.raises(ValueError, match="rule exact is not a rule of the serial sums"):
        small.index_add_one_column(source, index, base, out, EXACT)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", ("fp32", "kahan", "autograd"))
@pytest.mark.parametrize("reduce", ("sum", "mean", "prod"))
def test_the_one_column_serial_reduction_gives_the_bits_of_the_general_path(reduce, mode, dtype,
                                                                            monkeypatch):
    """``small.reduce_one_column``, the elementwise scatter's sum, mean and product of one
    column: the general path's bits (``detsum.scatter_reduce``'s plan) with and without each
    row's own value, for rows of one term, of none (which keep their bits without it), of
    exactly one and two chunks, of several chunks with a shorter last one and of one past a
    chunk; terms near 1 (a product of many stays finite), NaN and both zeros on rows of their
    own; in place and into a new output; a bad value named, nothing written."""
    counts = [1, 0, CHUNK_TERMS, 2 * CHUNK_TERMS, 5 * CHUNK_TERMS + 31, CHUNK_TERMS + 1, 9, 3]
    g = torch.Generator().manual_seed(67)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    index = index[torch.randperm(index.numel(), generator=g)]
    spread = make_data((index.numel(),), torch.float64, seed=68, spread=True)
    source = (1 + spread / spread.abs().max() / 64).to(dtype)
    source[(index == 6).nonzero().flatten()[2]] = float("nan")
    source[(index == 7).nonzero().flatten()] = torch.tensor([-0.0, 0.0, -0.0]).to(dtype)
    base = make_data((len(counts),), dtype, seed=69, spread=True)
    base[1] = -0.0
    rule = {"fp32": small.WIDE, "kahan": small.KAHAN, "autograd": small.ROUND_EACH}[mode]
    for include_base in (True, False):
        expected = general(monkeypatch, lambda: _without_the_pass(monkeypatch, lambda: (
            detsum.scatter_reduce(base, 0, index, source, reduce, include_self=include_base,
                                  mode=mode))))
        code = small.REDUCE_CODES[reduce]
        out = torch.full_like(base, float("nan"))
        assert small.reduce_one_column(source, index, base, out, code, rule,
                                       include_base) == -1
        assert_same_bits(out, expected)
        # Row 1 has no terms: -0.0, bit for bit (its own, or its mean or product of one).
        assert torch.equal(out[1:2].view(torch.uint8), base[1:2].view(torch.uint8))
        target = base.clone()
        assert small.reduce_one_column(source, index.to(torch.int32), target, target, code,
                                       rule, include_base) == -1
        assert_same_bits(target, expected)
        bad = index.clone()
        bad[17] = len(counts)
        untouched = base.clone()
        assert small.reduce_one_column(source, bad, untouched, untouched, code, rule,
                                       include_base) == 17
        assert_same_bits(untouched, base)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce", ("amax", "amin"))
def test_the_one_column_serial_extreme_gives_the_bits_of_the_general_path(reduce, dtype,
                                                                          monkeypatch):
    """``small.extreme_one_column``, a max or min of one column: the general path's bits with
    and without each row's own value, for rows of one term, of none (which keep their own
    value), of many, with NaN, infinities and both zeros among the terms and the rows; in
    place and into a new output (NaN before it is written); a bad value (past the end, or
    negative) named by its position, nothing written."""
    counts = [1, 0, 700, 3, 0, 40, 2, 90]
    g = torch.Generator().manual_seed(64)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    index = index[torch.randperm(index.numel(), generator=g)]
    source = make_data((index.numel(),), dtype, seed=65, spread=True)
    # Row 3: a NaN among its terms; row 6: -0.0 then +0.0 (the earlier stays); row 0 has one.
    rows_at = {r: (index == r).nonzero().flatten() for r in (3, 6)}
    source[rows_at[3][1]] = float("nan")
    source[rows_at[6]] = torch.tensor([-0.0, 0.0]).to(dtype)
    source[(index == 7).nonzero().flatten()[::7]] = torch.tensor(float("inf")).to(dtype)
    base = make_data((len(counts),), dtype, seed=66, spread=True)
    base[1], base[4], base[5] = float("nan"), -0.0, -float("inf")
    for include_base in (True, False):
        expected = general(monkeypatch, lambda: _without_the_pass(monkeypatch, lambda: (
            detsum.scatter_reduce(base, 0, index, source, reduce, include_self=include_base))))
        maximum = reduce == "amax"
        out = torch.full_like(base, float("nan"))
        assert small.extreme_one_column(source, index, base, out, maximum, include_base) == -1
        assert_same_bits(out, expected)
        target = base.clone()
        assert small.extreme_one_column(source, index.to(torch.int32), target, target, maximum,
                                        include_base) == -1
        assert_same_bits(target, expected)
        for position, value in ((17, len(counts)), (index.numel() - 1, -1)):
            bad = index.clone()
            bad[position] = value
            untouched = base.clone()
            assert small.extreme_one_column(source, bad, untouched, untouched, maximum,
                                            include_base) == position
            assert_same_bits(untouched, base)
