"""kernels/numba/exact_state.py against detsum._limbs' torch operations, as detsum._kernel_ops
runs them: the same states after every addition, the same roundings of every state."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import assert_same_bits, dtype_id, make_data, terms_with_specials
from detsum import _kernel_ops, _limbs
from detsum.kernels import MAX_TERMS_PER_STATE
from detsum.kernels.numba import exact_state

ACC_DTYPES = (torch.float32, torch.float64)
ROUNDED = {torch.float32: (torch.float32, torch.bfloat16, torch.float16),
           torch.float64: (torch.float64,)}


def both_ways(function):
    """function() under the torch operations, then under the kernels."""
    with detsum.backend("reference"):
        expected = function()
    return function(), expected


@pytest.mark.parametrize("acc", ACC_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rows", [0, 1, 5, 300])
def test_additions_give_the_states_of_the_torch_operations(acc, rows):
    numel = 37
    start = _limbs.new_state(numel, acc, torch.device("cpu"))
    _kernel_ops.add_exact_terms(start, make_data((3, numel), acc, seed=rows, spread=True))

    def add():
        state = start.clone()
        _kernel_ops.add_exact_terms(state, terms_with_specials(rows, numel, acc, seed=rows + 1))
        # A slice of columns of a larger state, as GradAccumulator adds one parameter's.
        _kernel_ops.add_exact_terms(state[:, 5:20], make_data((rows, 15), acc, seed=rows + 2))
        return state

    got, expected = both_ways(add)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("acc", ACC_DTYPES, ids=dtype_id)
def test_normalising_gives_the_limbs_of_the_torch_operations(acc):
    """Limbs as a sum over ranks leaves them (each up to a few times 2**32, the last of
    either sign), and a slice of rows of a state, as the callers pass."""
    g = torch.Generator().manual_seed(9)
    n_limbs = _limbs.limb_count(acc)
    state = torch.randint(0, 2**34, (n_limbs + _limbs.COUNTERS, 300), generator=g)
    state[n_limbs - 1] = torch.randint(-2**33, 2**33, (300,), generator=g)
    state[:, :7] = torch.tensor([0, -1, 2**32 - 1, 2**32, -2**31, 2**62, -2**62])
    state[:n_limbs - 1, :7] = state[:n_limbs - 1, :7].abs() % 2**40

    def normalised():
        limbs = state.clone()
        _kernel_ops.normalise_limbs(limbs[:n_limbs])
        return limbs

    got, expected = both_ways(normalised)
    assert torch.equal(got, expected)
    assert not torch.equal(got, state)  # carries happened
    assert ((got[:n_limbs - 1] >= 0) & (got[:n_limbs - 1] < 2**32)).all()


@pytest.mark.parametrize("acc", ACC_DTYPES, ids=dtype_id)
def test_roundings_give_the_values_of_the_torch_operations(acc):
    """Sums of spread terms (most elements), special values, all -0.0, exact zeros,
    cancellations to a few units, and states that are not normalised (the sum of two
    states, as an all-reduce leaves it)."""
    numel = 400
    state = _limbs.new_state(numel, acc, torch.device("cpu"))
    with detsum.backend("reference"):
        _kernel_ops.add_exact_terms(state, terms_with_specials(40, numel, acc, seed=3))
        terms = make_data((2, numel), acc, seed=4, spread=True)
        cancel = torch.stack([terms[0], -terms[0] + torch.finfo(acc).smallest_normal * 3])
        cancelling = _limbs.new_state(numel, acc, torch.device("cpu"))
        _kernel_ops.add_exact_terms(cancelling, cancel)
        all_negative_zero = _limbs.new_state(numel, acc, torch.device("cpu"))
        _kernel_ops.add_exact_terms(all_negative_zero, torch.full((3, numel), -0.0, dtype=acc))
    merged = state + cancelling  # not normalised
    for candidate in (state, cancelling, all_negative_zero, merged,
                      _limbs.new_state(numel, acc, torch.device("cpu"))):
        for dtype in ROUNDED[acc]:
            for count in (None, 1, 3, 40, MAX_TERMS_PER_STATE):
                got, expected = both_ways(
                    lambda: _kernel_ops.round_exact_state(candidate, acc, dtype, count))
                assert_same_bits(got, expected)


@pytest.mark.parametrize("acc", ACC_DTYPES, ids=dtype_id)
def test_same_states_on_any_thread_count(acc, monkeypatch):
    monkeypatch.setattr(exact_state, "_MIN_PARALLEL_ELEMENTS", 1)
    numel = 2 * exact_state._BLOCK + 37  # three blocks of elements, the last partial
    terms = terms_with_specials(9, numel, acc, seed=8)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            state = _limbs.new_state(numel, acc, torch.device("cpu"))
            _kernel_ops.add_exact_terms(state, terms)
            results.append((state, _kernel_ops.round_exact_state(state, acc, acc, 9)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0])
    assert_same_bits(results[0][1], results[1][1])


def test_exact_gradients_keep_their_bits():
    """End to end: an exact batch gradient from the kernels equals the torch operations'."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                torch.nn.Linear(7, 3)).eval()
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))
    lossf = torch.nn.CrossEntropyLoss(reduction="none")
    got, expected = both_ways(lambda: detsum.loss.batch_grad(model, lossf, x, y, mode="exact"))
    for name in expected:
        assert_same_bits(got[name], expected[name])
