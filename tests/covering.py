"""Sweeps that meet what matters instead of every combination of their parameters.

Triton's interpreter runs a kernel program in Python, so a full cartesian sweep of modes,
dtypes, reductions, layouts and cases costs minutes. Bugs live where two parameters meet (the
alpha bug: chunking and alpha != 1), so a sweep that meets every value of every axis and every
pair of values of the axes that can interact finds them at a fraction of the cost.

An axis is a list of values; a value is one test argument, or a ``pytest.param`` of several
(a joint axis, whose combinations are then all met: ``(mode, reduce)``, ``(layout, case)``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import dtype_id


def _parts(value):
    """(the test arguments, the id) of one axis value."""
    if isinstance(value, type(pytest.param())):
        return tuple(value.values), value.id
    if isinstance(value, torch.dtype):
        return (value,), dtype_id(value)
    return (value,), str(value)


def _param(combination):
    values, ids = (), []
    for value in combination:
        v, i = _parts(value)
        values += v
        ids.append(i)
    return pytest.param(*values, id="-".join(ids))


def covering(full: list[list], cycled: list) -> list:
    """pytest params: every combination of the ``full`` axes, each with the next value of
    ``cycled`` in turn: each value of ``cycled`` meets every value of every full axis (checked
    here), at the cost of the full axes alone."""
    combinations = list(itertools.product(*[range(len(axis)) for axis in full]))
    for a, axis in enumerate(full):
        met = {(c[a], k % len(cycled)) for k, c in enumerate(combinations)}
        assert len(met) == len(axis) * len(cycled), f"full axis {a} misses cycled values"
    return [_param((*[axis[v] for axis, v in zip(full, c)], cycled[k % len(cycled)]))
            for k, c in enumerate(combinations)]


def pairwise(axes: list[list], *, pairs=None, allowed=None, cost=None,
             everything: bool = False) -> list:
    """pytest params over ``axes`` that meet every value of every axis and every pair of values
    of the axes in ``pairs`` (pairs of axis positions; every pair of axes when None).

    ``allowed(*arguments)`` says whether a combination may run (the test's arguments, in
    order): a pair that no allowed combination holds is not asked for. ``cost(*arguments)``
    is a combination's relative cost (1 when None). The combinations are drawn greedily from
    the full product, each the one that meets most of what is still unmet for its cost (ties:
    the one whose values ran least, then the first), so the draw is fixed and close to the
    cheapest. With ``everything``, every allowed combination (on a GPU, where a case costs
    milliseconds)."""
    if pairs is None:
        pairs = list(itertools.combinations(range(len(axes)), 2))
    combinations, costs = [], []
    for c in itertools.product(*[range(len(axis)) for axis in axes]):
        param = _param([axis[v] for axis, v in zip(axes, c)])
        if allowed is None or allowed(*param.values):
            combinations.append((c, param))
            costs.append(1.0 if cost is None else float(cost(*param.values)))
    if everything:
        return [param for _, param in combinations]
    # Number each single (axis, value) and each asked pair of values; each combination meets
    # one single per axis and one pair per asked pair of axes.
    single_at = [sum(len(axis) for axis in axes[:a]) for a in range(len(axes))]
    pair_at, offset = [], sum(len(axis) for axis in axes)
    for a, b in pairs:
        pair_at.append(offset)
        offset += len(axes[a]) * len(axes[b])
    met = torch.tensor(
        [[single_at[a] + c[a] for a in range(len(axes))]
         + [at + c[a] * len(axes[b]) + c[b] for at, (a, b) in zip(pair_at, pairs)]
         for c, _ in combinations], dtype=torch.long).view(len(combinations), -1)
    costs = torch.tensor(costs, dtype=torch.float64)
    unmet = torch.zeros(offset, dtype=torch.bool)
    unmet[met.view(-1)] = True  # only what some allowed combination meets is asked for
    runs = torch.zeros(offset, dtype=torch.long)
    chosen = []
    while unmet.any():
        value = unmet[met].sum(1) / costs
        # The most unmet things for the cost first; among those, the values that ran least.
        best = value == value.max()
        ran = runs[met[:, :len(axes)]].sum(1)
        k = int(torch.argmax(torch.where(best, -ran, -ran.max() - 1)))  # the first of the best
        chosen.append(k)
        unmet[met[k]] = False
        runs[met[k, :len(axes)]] += 1
    return [combinations[k][1] for k in sorted(chosen)]
