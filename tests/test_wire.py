"""The wire format of detsum.distributed, in one process: each rank's header and payload built
by hand, the payloads summed as the all-reduce sums them, and the sum decoded. The decoded
states must be the states merged in one process (the limbs added and normalised, the
counters added), whatever the window, the counters' packing and the number of ranks."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import dtype_id, make_data
from detsum import _limbs, distributed

CPU = torch.device("cpu")
ACC_DTYPES = (torch.float32, torch.float64)


def exact_state(terms: torch.Tensor) -> torch.Tensor:
    """The exact state of ``terms`` ``[k, numel]`` (fp32 or fp64), from the torch operations."""
    state = _limbs.new_state(terms.shape[1], terms.dtype, CPU)
    with detsum.backend("reference"):
        _limbs.add_terms(state, terms)
    return state


def merged(states: list[torch.Tensor]) -> torch.Tensor:
    """The states of several sums merged in one process: added, limbs normalised."""
    total = torch.stack(states).sum(0)
    _limbs.normalise(total[:total.shape[0] - _limbs.COUNTERS])
    return total


def over_ranks(ranks: list[list[tuple[torch.Tensor, int]]], out=None):
    """sum_over_ranks for every rank of ``ranks`` (each a list of ``(state, count)``), in one
    process: the header's maxima, each rank's payload, their sum decoded into ``out`` (new
    tensors when None). Returns (the wire, the payloads, the decoded ``(state, count)``)."""
    outgoing = [[distributed._Outgoing(state, count) for state, count in states]
                for states in ranks]
    headers = torch.stack([distributed._local_header(o) for o in outgoing])
    wire = distributed._Wire(headers.amax(0).tolist(), len(ranks))
    payloads = [wire.encode(o) for o in outgoing]
    return wire, payloads, wire.decode(torch.stack(payloads).sum(0), outgoing[0], out)


def poisoned(states: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(state, distributed._POISON) for state in states]


@pytest.mark.parametrize("acc", ACC_DTYPES, ids=dtype_id)
def test_payloads_summed_decode_to_the_merged_state(acc):
    numel = 300
    shards = [make_data((k, numel), acc, seed=k, spread=True) for k in (5, 1, 0, 9)]
    shards[1][0, :7] = -0.0  # a counter on the wire
    states = [exact_state(shard) for shard in shards]
    with detsum.backend("reference"):
        _, _, [(summed, total)] = over_ranks([[(s, len(t))] for s, t in zip(states, shards)],
                                             out=poisoned(states[:1]))
    assert torch.equal(summed, merged(states))
    assert total == sum(len(t) for t in shards)


def test_zero_states_of_both_widths_decode_to_zero_everywhere():
    """No rank has a digit: the window is empty, and every limb of every state is written
    (zero), the fp64 state's above the fp32 state's limb count too."""
    states = [_limbs.new_state(3, torch.float32, CPU), _limbs.new_state(2, torch.float64, CPU)]
    with detsum.backend("reference"):
        _, _, results = over_ranks([[(s, 0) for s in states]] * 2, out=poisoned(states))
    for (summed, total), state in zip(results, states):
        assert torch.equal(summed, state) and total == 0
