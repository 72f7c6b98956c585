"""tests/covering.py: the sweeps' coverings meet what they say they meet."""

from __future__ import annotations

import itertools

import pytest
import torch

from covering import covering, pairwise

AXES = [["autograd", "fp32", "kahan", "exact"],
        [torch.float32, torch.float16, torch.bfloat16, torch.float64],
        [pytest.param((5,), 0, id="N"), pytest.param((5, 3), 0, id="Nx3"),
         pytest.param((2, 5), 1, id="2xN")],
        ["uniform", "zero_columns", "alpha", "noncontiguous", "empty"]]


def _allowed(mode, dtype, shape, dim, case):
    return not (mode == "exact" and dtype == torch.float16) and not (
        case == "zero_columns" and len(shape) == 1)


def _rows(params, axes):
    """Each param's value index on each axis (a joint value: the index of its arguments)."""
    rows = []
    for param in params:
        values, at, row = param.values, 0, []
        for axis in axes:
            for k, value in enumerate(axis):
                given = tuple(value.values) if isinstance(value, type(param)) else (value,)
                if values[at:at + len(given)] == given:
                    row.append(k)
                    at += len(given)
                    break
        rows.append(tuple(row))
    return rows


def _allowed_rows(axes, allowed):
    def arguments(row):
        out = ()
        for axis, k in zip(axes, row):
            value = axis[k]
            out += tuple(value.values) if hasattr(value, "values") else (value,)
        return out

    return [row for row in itertools.product(*[range(len(a)) for a in axes])
            if allowed is None or allowed(*arguments(row))]


@pytest.mark.parametrize("pairs", [None, [(0, 1), (2, 3)], []], ids=["all", "two", "none"])
@pytest.mark.parametrize("allowed", [None, _allowed], ids=["any", "allowed"])
@pytest.mark.parametrize("cost", [None, lambda mode, *_: 5 if mode == "exact" else 1],
                         ids=["even", "costly_exact"])
def test_pairwise_meets_every_value_and_every_asked_pair_it_can(pairs, allowed, cost):
    params = pairwise(AXES, pairs=pairs, allowed=allowed, cost=cost)
    rows = _rows(params, AXES)
    possible = _allowed_rows(AXES, allowed)
    assert set(rows) <= set(possible)  # only allowed combinations, each once
    assert len(set(rows)) == len(rows)
    asked = list(itertools.combinations(range(len(AXES)), 2)) if pairs is None else pairs
    for a in range(len(AXES)):
        assert {r[a] for r in rows} == {r[a] for r in possible}, a
    for a, b in asked:
        assert {(r[a], r[b]) for r in rows} == {(r[a], r[b]) for r in possible}, (a, b)
    if pairs is None and allowed is None:
        assert len(rows) <= 25  # 5 x 4 pairs at least; far from the 240 combinations


def test_pairwise_with_everything_gives_every_allowed_combination():
    params = pairwise(AXES, allowed=_allowed, everything=True)
    assert _rows(params, AXES) == _allowed_rows(AXES, _allowed)
    assert params[0].id == "autograd-float32-N-uniform"


def test_pairwise_spends_on_costly_values_only_what_their_pairs_need():
    """"exact" meets each of the 5 cases (its pairs): 5 costly cases, not more."""
    params = pairwise(AXES, allowed=_allowed, cost=lambda mode, *_: 10 if mode == "exact" else 1)
    assert sum(p.values[0] == "exact" for p in params) == 5


def test_covering_meets_every_cycled_value_with_every_full_value():
    full = [["sum", "mean", "prod"], [1, 2, 3, 4, 5, 6, 7]]
    params = covering(full, ["a", "b"])
    assert [p.values[:2] for p in params] == list(itertools.product(*full))
    for axis in (0, 1):
        assert {(p.values[axis], p.values[2]) for p in params} == set(
            itertools.product(full[axis], ["a", "b"]))
    # Each 1..7 would come 2 times, with 2 of the 3 cycled values only.
    with pytest.raises(AssertionError, match="full axis 1 misses cycled values"):
        covering([["sum", "mean"], [1, 2, 3, 4, 5, 6, 7]], ["a", "b", "c"])
