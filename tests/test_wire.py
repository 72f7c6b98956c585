"""The wire format of detsum.distributed in one process, and kernels/numba/wire.py against the
torch operations: each rank's header and payload built by hand, the payloads summed as the
all-reduce sums them, and the sum decoded.

The kernels must give the torch operations' header values, payload bytes and decoded states
(``torch.equal``), so that ranks on either path interoperate; and the decoded states must be
the states merged in one process (limbs added and normalised, counters added), whatever the
window, the counters' packing, the number of ranks and the path each rank took. Payloads and
decoded states are poisoned before anything writes them (conftest's ``poison_outputs``, and
``out`` here), so an element that a kernel leaves unwritten fails."""

from __future__ import annotations

import contextlib

import pytest
import torch

import detsum
from conftest import dtype_id, make_data, terms_with_specials
from detsum import _kernel_ops, _limbs, _wire, distributed
from detsum.kernels import EXACT_LIMBS
from detsum.kernels import numba as numba_kernels
from detsum.kernels.numba import wire

CPU = torch.device("cpu")
ACC_DTYPES = (torch.float32, torch.float64)
UNIT_EXPONENT = {torch.float32: -149, torch.float64: -1074}
# Element counts: none, one, a few (one partial block), and several blocks, the last partial.
NUMELS = (0, 1, 7, 3 * wire._BLOCK + 5)


def exact_state(terms: torch.Tensor) -> torch.Tensor:
    """The exact state of ``terms`` ``[k, numel]`` (fp32 or fp64), from the torch operations."""
    state = _limbs.new_state(terms.shape[1], terms.dtype, CPU)
    _limbs.add_terms(state, terms)
    return state


def powers_of_the_limb_base(numel: int, acc: torch.dtype, seed: int) -> torch.Tensor:
    """One term per element, -2**(32 k) units: the values whose magnitude's one digit lies
    where their two's complement holds the sign's fill alone, above zeros (the top of the
    window, where no limb differs from that fill); k = 0 is -1 unit, all ones."""
    g = torch.Generator().manual_seed(seed)
    top = 8 if acc == torch.float32 else 64  # 2**(32 k) units stays a finite term
    k = torch.randint(0, top + 1, (numel,), generator=g).double()
    return (-torch.exp2(32 * k + UNIT_EXPONENT[acc])).to(acc).unsqueeze(0)


def full_top_limbs(numel: int, acc: torch.dtype) -> torch.Tensor:
    """One term per element, +-(2**24 - 1) * 2**(32 k + 8) units, the same on every rank: its
    magnitude's top limb is nearly full, so the digit sums of a few ranks carry out of the
    window's top row."""
    element = torch.arange(numel)
    k = (element % (7 if acc == torch.float32 else 60)).double()
    sign = torch.where(element % 3 == 0, -1.0, 1.0).double()
    return (sign * (2**24 - 1) * torch.exp2(32 * k + 8 + UNIT_EXPONENT[acc])).to(acc).unsqueeze(0)


def loaded_by_hand(numel: int, acc: torch.dtype, seed: int) -> tuple[torch.Tensor, int]:
    """A normalised state that no sum of rows reaches (``RunningSum.load_state`` takes it):
    every limb in use, last limbs of either sign beyond ``2**32`` (the magnitude's last limb
    holds the rest, as the state's own does), the first element -2**(32 (L - 1)) units, and
    counts of terms other than -0.0 above the row count (their complement, what goes on the
    wire, is negative)."""
    g = torch.Generator().manual_seed(seed)
    n_limbs = _limbs.limb_count(acc)
    state = torch.randint(0, 2**32, (n_limbs + _limbs.COUNTERS, numel), generator=g)
    state[n_limbs - 1] = torch.randint(-2**40, 2**40, (numel,), generator=g)
    # -2**(32 (L - 1)) units: the one digit in the last limb, below it only zeros.
    state[:n_limbs, :1] = 0
    state[n_limbs - 1, :1] = -1
    state[n_limbs:] = torch.randint(0, 9, (_limbs.COUNTERS, numel), generator=g)
    return state, 5


def states_of(case: str, acc: torch.dtype, numel: int, seed: int) -> tuple[torch.Tensor, int]:
    """``(state, count)`` of one kind of exact state."""
    if case == "loaded by hand":
        return loaded_by_hand(numel, acc, seed)
    if case == "zero":
        return _limbs.new_state(numel, acc, CPU), 0
    if case == "negative zeros":  # zero limbs, and the complement counter on the wire
        terms = torch.full((3, numel), -0.0, dtype=acc)
    elif case == "-2**(32 k)":
        terms = powers_of_the_limb_base(numel, acc, seed)
    elif case == "full top limbs":
        terms = full_top_limbs(numel, acc)
    elif case == "narrow":  # a gradient's: a window of two or three limbs
        terms = make_data((4, numel), acc, seed=seed) * 2.0**-10
    else:
        terms = terms_with_specials(6, numel, acc, seed)
        if case == "all negative":
            terms = -terms.abs()
        elif case == "single nonzero":
            terms[:, :-1] = 0.0
    return exact_state(terms), terms.shape[0]


CASES = ("spread", "narrow", "all negative", "single nonzero", "-2**(32 k)", "full top limbs",
         "zero", "negative zeros", "loaded by hand")


def merged(states: list[torch.Tensor]) -> torch.Tensor:
    """The states of several sums merged in one process: added, limbs normalised."""
    total = torch.stack(states).sum(0)
    _limbs.normalise(total[:total.shape[0] - _limbs.COUNTERS])
    return total


def poisoned(states: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(state, distributed._POISON) for state in states]


def on_the_kernels(kernels: bool):
    """CPU states on the kernels (the numba backend, their default) or, where not
    ``kernels``, on the torch operations."""
    return contextlib.nullcontext() if kernels else detsum.backend("reference")


def sent(states: list[tuple[torch.Tensor, int]], kernels: bool) -> list:
    """``states`` as a rank sends them, on the kernels where ``kernels``."""
    with on_the_kernels(kernels):
        outgoing = _kernel_ops.outgoing_states(states)
    assert all(o.kernels == kernels for o in outgoing)
    return outgoing


def over_ranks(ranks: list[list[tuple[torch.Tensor, int]]], kernels: list[bool],
               decode_with_kernels: bool, *, widen: list[int] | None = None):
    """sum_over_ranks for every rank of ``ranks`` (each a list of ``(state, count)``), in one
    process, rank ``r`` on the kernels where ``kernels[r]``: the header's sums (with
    ``widen``'s, as from another rank, where given), each rank's payload, and their sum
    decoded into poisoned tensors. Returns (the payloads, the decoded ``(state, count)``)."""
    outgoing = [sent(states, k) for states, k in zip(ranks, kernels)]
    headers = [distributed._local_header(o).tolist() for o in outgoing] + (
        [widen] if widen is not None else [])
    layout = distributed._Wire([sum(values) for values in
                                zip(*map(distributed._summable, headers))])
    payloads = [layout.encode(o) for o in outgoing]
    receiver = sent(ranks[0], decode_with_kernels)
    out = poisoned([state for state, _ in ranks[0]])
    with on_the_kernels(decode_with_kernels):
        return payloads, layout.decode(torch.stack(payloads).sum(0), receiver, out)


def test_the_kernels_run_on_cpu_under_numba_only():
    state = _limbs.new_state(3, torch.float32, CPU)
    assert [o.kernels for o in _kernel_ops.outgoing_states([(state, 0)] * 2)] == [True, True]
    with detsum.backend("reference"):
        assert [o.kernels for o in _kernel_ops.outgoing_states([(state, 0)])] == [False]


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("acc", ACC_DTYPES, ids=dtype_id)
def test_header_values_are_the_torch_operations(acc, case, numel):
    state, rows = states_of(case, acc, numel, seed=numel)
    for count in (rows, rows + 3, 0):  # complements of every sign
        expected = _wire.Outgoing(state, count).header()
        assert wire.scan(state, count) == expected, (case, count)


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("acc", ACC_DTYPES, ids=dtype_id)
def test_payloads_and_sums_are_the_torch_operations(acc, case, numel):
    """Three ranks (one of them on the torch operations) of one kind of state: the same
    payload bytes from either path, and the sum decoded by either path is the merged
    state."""
    ranks = [[states_of(case, acc, numel, seed=numel + 10 * r)] for r in range(3)]
    payloads, [(summed, total)] = over_ranks(ranks, [True, False, True], True)
    expected_payloads, [(expected, expected_total)] = over_ranks(ranks, [False] * 3, False)
    for got, wanted in zip(payloads, expected_payloads):
        assert torch.equal(got, wanted)
    assert torch.equal(summed, expected) and total == expected_total
    assert torch.equal(summed, merged([states[0][0] for states in ranks]))
    assert total == sum(states[0][1] for states in ranks)


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("numel", [1, 2 * wire._BLOCK + 3])
def test_windows_wider_than_a_states_own_limbs(numel, widen):
    """fp32 and fp64 states in one call share one window, beyond the fp32 state's limb count
    and wider than either state's digits (with ``widen``, a rank's header asks for every
    limb: the fp32 state sends all of its own, the fp64 state all 67)."""
    cases = ("spread", "narrow", "all negative", "-2**(32 k)", "full top limbs", "zero",
             "loaded by hand")
    for index, case in enumerate(cases):
        ranks = [[states_of(case, torch.float32, numel, seed=index + r),
                  states_of(cases[-1 - index], torch.float64, numel + 2, seed=100 + index + 7 * r)]
                 for r in range(2)]
        wide = ([EXACT_LIMBS["fp64"] - 1, 0] + [0] * 2 * _limbs.COUNTERS) if widen else None
        payloads, results = over_ranks(ranks, [True, True], True, widen=wide)
        expected_payloads, expected = over_ranks(ranks, [False, False], False, widen=wide)
        for got, wanted in zip(payloads, expected_payloads):
            assert torch.equal(got, wanted), case
        for j, ((summed, total), (wanted, wanted_total)) in enumerate(zip(results, expected)):
            assert torch.equal(summed, wanted) and total == wanted_total, case
            assert torch.equal(summed, merged([states[j][0] for states in ranks])), case


@pytest.mark.parametrize("ranks", [1, 5, 2**20, 2**31 - 1])
def test_counters_packed_for_any_number_of_ranks(ranks):
    """The counters' packing follows the number of ranks (``bits`` grows with it, ``fields``
    shrinks to one): the same lanes from either path, unpacked alike. The sum is that of one
    payload, so it is the state itself."""
    numel = wire._BLOCK + 77
    for case in ("spread", "negative zeros", "loaded by hand"):
        state, count = states_of(case, torch.float32, numel, seed=ranks % 97)
        results = {}
        for kernels in (True, False):
            o = sent([(state, count)], kernels)
            # As if every rank had sent this state's header.
            layout = distributed._Wire([ranks * value for value in distributed._summable(
                distributed._local_header(o).tolist())])
            payload = layout.encode(o)
            with on_the_kernels(kernels):
                [(summed, total)] = layout.decode(payload, o, poisoned([state]))
            results[kernels] = payload, summed, total, (layout.fields, layout.bits)
        assert torch.equal(results[True][0], results[False][0]), case
        assert torch.equal(results[True][1], results[False][1]), case
        assert torch.equal(results[True][1], state) and results[True][2] == count, case
    assert results[True][3] == (1, 64)  # negative counters (loaded by hand): one to an int64


@pytest.mark.parametrize("acc", ACC_DTYPES, ids=dtype_id)
def test_the_same_on_any_thread_count(acc, monkeypatch):
    """Every block on its own thread (the parallel path of each kernel) gives what one
    thread and the torch operations give."""
    monkeypatch.setattr(wire, "_MIN_PARALLEL_ELEMENTS", 1)
    numel = 5 * wire._BLOCK + 11
    ranks = [[states_of(case, acc, numel, seed=r)] for r, case in
             enumerate(("spread", "negative zeros", "-2**(32 k)", "full top limbs"))]
    expected_payloads, expected = over_ranks(ranks, [False] * 3, False)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            payloads, results = over_ranks(ranks, [True] * 3, True)
            for got, wanted in zip(payloads, expected_payloads):
                assert torch.equal(got, wanted), count
            assert torch.equal(results[0][0], expected[0][0]), count
    finally:
        torch.set_num_threads(threads)


def test_the_same_in_a_forked_process(monkeypatch):
    """Through the kernels' serial twins, as in a process forked from one that had run them
    (tests/test_threads.py): what the torch operations give."""
    monkeypatch.setattr(wire, "_MIN_PARALLEL_ELEMENTS", 1)
    numel = 5 * wire._BLOCK + 11
    ranks = [[states_of(case, torch.float32, numel, seed=r)] for r, case in
             enumerate(("spread", "negative zeros", "-2**(32 k)", "full top limbs"))]
    expected_payloads, expected = over_ranks(ranks, [False] * 3, False)
    monkeypatch.setattr(numba_kernels, "_forked", True)
    payloads, results = over_ranks(ranks, [True] * 3, True)
    for got, wanted in zip(payloads, expected_payloads):
        assert torch.equal(got, wanted)
    assert torch.equal(results[0][0], expected[0][0])
    assert all(kernel.serial().signatures for kernel in (wire._scan, wire._encode, wire._decode))


def test_zero_states_of_both_widths_decode_to_zero_everywhere():
    """No rank has a digit: the window is empty, and every limb of every state is written
    (zero), the fp64 state's above the fp32 state's limb count too."""
    states = [_limbs.new_state(3, torch.float32, CPU), _limbs.new_state(2, torch.float64, CPU)]
    for kernels in (True, False):
        _, results = over_ranks([[(s, 0) for s in states]] * 2, [kernels] * 2, kernels)
        for (summed, total), state in zip(results, states):
            assert torch.equal(summed, state) and total == 0
