"""Sums over the ranks of a torch.distributed group, exact: the same bits for any number of ranks.

An ``"exact"`` running sum keeps its state as integers (``detsum._limbs``), so the sum of the
states of every rank is an integer all-reduce: exact in whatever order or tree the backend
(gloo, NCCL) adds them, and so the same for one rank holding every row as for any number of
ranks holding any shards of them. A floating-point all-reduce promises nothing of the kind:
its order, and so its bits, follow the number of ranks and the algorithm the backend picks.

One sum over ranks is two collectives (docs/distributed.md):

1. a header, all-reduced with MAX: a fingerprint of what the ranks must agree on (shapes,
   dtypes, mode and the like) and its negation, whose two maxima are equal only when every
   rank sent the same fingerprint; then, for each state, the highest limb that any rank's
   state uses in balanced form, minus the lowest, and whether any rank holds NaN, +inf, -inf
   or -0.0 terms;
2. the payload, all-reduced with SUM: the row count, the limbs inside that window, and only
   the counters that some rank needs.

Ranks that disagree get the same error on every rank, naming what differs and where, before
any state is touched. The loss functions (``detsum.loss``) take part through the helpers here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from detsum import _limbs
from detsum.modes import Mode
from detsum.ops.running_sum import RunningSum

__all__ = ["all_reduce_"]

#: Header entries per state: top limb, minus the bottom limb, one flag per counter.
_HEADER_PER_STATE = 2 + _limbs.COUNTERS
EXACT_ONLY = ("only mode='exact' sums add up to the same bits for every number of ranks (the "
               "other modes depend on the order of their rows, and rows on different ranks "
               "have no order)")


def check_group(caller: str, group: object, *, none_means: str) -> None:
    """torch.distributed is initialised and ``group`` is a process group this rank is in
    (or None, which the caller reads as ``none_means``)."""
    if not dist.is_available():
        raise RuntimeError(f"{caller}: this torch build has no torch.distributed; expected a "
                           f"build with distributed support for a sum over ranks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{caller}: torch.distributed is not initialised; expected "
            f"torch.distributed.init_process_group(...) on every rank before a sum over ranks")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{caller}: this rank is not a member of group; expected a group "
                         f"that includes the calling rank")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{caller}: group must be a torch.distributed.ProcessGroup or None "
                        f"({none_means}), got {type(group).__name__}")


def _header_device(group) -> torch.device:
    # NCCL moves CUDA tensors only; every other backend takes CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fingerprint(fields: dict) -> int:
    """63 bits of a hash of ``fields`` that every process computes alike (Python's own
    ``hash`` of a string changes from process to process)."""
    digest = hashlib.blake2b(repr(list(fields.items())).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _shown(value: object) -> str:
    # Quoted, but not escaped: an error's own words read as they were written.
    return f"'{value}'" if isinstance(value, str) else repr(value)


def describe_error(error: Exception) -> str:
    """An error as a field that ranks compare: its type and its words."""
    return f"{type(error).__name__}: {error}"


def _raise_disagreement(caller: str, group, fields: dict) -> None:
    """Every rank gets here together (they all saw two fingerprints): gather the fields and
    name the first one that differs, with the ranks holding each value."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, fields, group=group)
    global_ranks = [dist.get_global_rank(group, r) if group is not None else r
                    for r in range(len(gathered))]
    keys = list(dict.fromkeys(key for theirs in gathered for key in theirs))
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, theirs in zip(global_ranks, gathered):
            by_value.setdefault(_shown(theirs[key]) if key in theirs else "nothing",
                                []).append(rank)
        if len(by_value) > 1:
            listed = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in by_value.items())
            raise ValueError(f"{caller}: the ranks of the group disagree on {key}: {listed}; "
                             f"expected the same {key} on every rank")
    raise ValueError(f"{caller}: the ranks of the group described their arguments alike but "
                     f"their fingerprints differ ({fields}); expected every rank to run the "
                     f"same detsum and Python versions")


def _exchange(caller: str, group, fields: dict, values: torch.Tensor | None) -> list[int]:
    """All-reduce with MAX the fingerprint of ``fields``, its negation, then ``values``
    (int64); return the maxima of ``values``. Raises the same error on every rank when the
    ranks' fields differ."""
    fingerprint = _fingerprint(fields)
    device = _header_device(group)
    header = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    if values is not None:
        header = torch.cat([header, values.to(device)])
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group)
    received = header.tolist()
    if received[0] != -received[1]:  # max(f) != min(f): two ranks sent two fingerprints
        _raise_disagreement(caller, group, fields)
    return received[2:]


def agree(caller: str, group, fields: dict) -> None:
    """One small collective: every rank of ``group`` passes ``fields`` (names to picklable
    values with a stable ``repr``), and all of them raise, naming the first field that differs
    and on which ranks, unless every rank passed the same."""
    _exchange(caller, group, fields, None)


def fail_together(caller: str, group, fields: dict, error: Exception) -> NoReturn:
    """Raise ``error`` (an argument error found on this rank) where :func:`sum_over_ranks` of
    one state would run: the header goes out first, so that every rank raises, this error
    where all ranks found it, the disagreement (naming this rank) where only some did."""
    empty = _limbs.new_state(0, torch.float32, torch.device("cpu"))
    sum_over_ranks(caller, group, [(empty, 0)], fields, local_error=error)
    raise AssertionError("unreachable: sum_over_ranks raised")


class _Outgoing:
    """What one rank sends of one exact state: its limbs in balanced form, limb-major
    (``[L, numel]``, so that a window of limbs is one contiguous block), and its header."""

    def __init__(self, state: torch.Tensor, count: int):
        self.state, self.count = state, count
        n_limbs = state.shape[1] - _limbs.COUNTERS
        self.n_limbs = n_limbs
        self.digits = state[:, :n_limbs].t().contiguous()
        _limbs.balance(self.digits.t())
        used = (self.digits != 0).any(1)
        positions = torch.arange(n_limbs, device=state.device)
        top = torch.where(used, positions, -1).amax()
        bottom = torch.where(used, positions, n_limbs).amin()
        counters = state[:, n_limbs:]
        flags = [(counters[:, k] != 0).any() for k in (_limbs.NAN, _limbs.POS_INF,
                                                        _limbs.NEG_INF)]
        flags.append((counters[:, _limbs.NOT_NEG_ZERO] != count).any())
        self.header = torch.stack([top, -bottom, *(f.long() for f in flags)])

    def counter(self, k: int) -> torch.Tensor:
        column = self.state[:, self.n_limbs + k]
        # -0.0 terms are rare, so the count of terms other than -0.0 goes as its complement,
        # which is zero everywhere when no rank has any: then it stays off the wire.
        return self.count - column if k == _limbs.NOT_NEG_ZERO else column


def sum_over_ranks(caller: str, group, states: Sequence[tuple[torch.Tensor, int]],
                   fields: dict, *, local_error: Exception | None = None
                   ) -> list[tuple[torch.Tensor, int]]:
    """The sum over the ranks of ``group`` of each exact ``(state, count)`` (``state``
    ``[numel, L + COUNTERS]`` int64, normalised; ``count`` its rows): new normalised states
    and the total counts, the same on every rank. The arguments are not changed.

    Two collectives: the header (``fields`` agreed, the limb window and counter flags of
    every state) and the payload. Every rank must pass the same number of states (callers
    settle that first, or pass one). A rank with ``local_error`` takes part in the header
    with empty states and raises it once every rank agrees (or the disagreement otherwise),
    so that no rank is left waiting for another."""
    outgoing = [_Outgoing(state, count) for state, count in states]
    maxima = _exchange(caller, group, fields, torch.cat([o.header for o in outgoing]))
    if local_error is not None:
        raise local_error
    parts, layout = [], []
    for i, o in enumerate(outgoing):
        top, minus_bottom, *flags = maxima[i * _HEADER_PER_STATE:(i + 1) * _HEADER_PER_STATE]
        bottom = -minus_bottom
        counters = [k for k, flag in enumerate(flags) if flag]
        parts.append(torch.tensor([o.count], dtype=torch.int64, device=o.state.device))
        if top >= bottom:
            parts.append(o.digits[bottom:top + 1].reshape(-1))
        parts.extend(o.counter(k) for k in counters)
        layout.append((bottom, top, counters))
    payload = torch.cat(parts)
    # Integer addition: exact, so the same sums in any order the backend chooses.
    dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group)

    results, offset, count_positions = [], 0, []
    for o, (bottom, top, counters) in zip(outgoing, layout):
        numel = o.state.shape[0]
        count_positions.append(offset)
        offset += 1
        limbs = torch.zeros((o.n_limbs, numel), dtype=torch.int64, device=o.state.device)
        if top >= bottom:
            width = top - bottom + 1
            limbs[bottom:top + 1] = payload[offset:offset + width * numel].view(width, numel)
            offset += width * numel
            # Limbs below the window are zero on every rank: nothing to carry from there.
            _limbs.normalise(limbs[bottom:].t())
        summed = torch.empty_like(o.state)
        summed[:, :o.n_limbs] = limbs.t()
        summed[:, o.n_limbs:] = 0
        for k in counters:
            summed[:, o.n_limbs + k] = payload[offset:offset + numel]
            offset += numel
        results.append(summed)
    totals = payload[count_positions].tolist()
    for summed, total, o in zip(results, totals, outgoing):
        not_neg_zero = summed[:, o.n_limbs + _limbs.NOT_NEG_ZERO]
        # What went on the wire was the complement (or nothing, when it was zero everywhere).
        not_neg_zero.copy_(total - not_neg_zero)
    return list(zip(results, totals))


def all_reduce_(running_sum: RunningSum, group=None) -> None:
    """Sum an ``"exact"`` :class:`detsum.RunningSum` over the ranks of ``group``, in place.

    Afterwards every rank holds the state of one running sum over the rows that every rank
    had added, with their count: the state that merging all the ranks' sums in one process
    (:meth:`detsum.RunningSum.merge`) gives, the same integers on every rank. Its ``sum()`` and
    ``mean()`` are therefore the exact sum (mean) of all those rows rounded once, the same
    bits for every number of ranks and every way the rows were spread over them.

    Args:
        running_sum: an ``"exact"`` running sum of the same shape and dtype on every rank.
        group: the ranks to sum over (a ``torch.distributed.ProcessGroup``); None: the
            default group, as in ``torch.distributed``. A collective: every rank of the group
            calls it.

    Exactness: the state is integers (limbs of 32 bits and four counters per element, see
    :class:`detsum.RunningSum`); the ranks add them with an integer ``all_reduce``, exact in
    any order and for any backend. Only the limbs that some rank uses go on the wire, in a
    form whose sum over fewer than ``2**31`` ranks stays within int64 (docs/distributed.md):
    about 8 bytes per limb in use and element, where the whole state takes 112 (fp32).

    Raises (before any state changes, and on every rank alike where the cause is on one):
        RuntimeError: torch.distributed is not initialised.
        ValueError: the sum's mode is not ``"exact"``; or the ranks disagree on the mode,
            dtype or shape (the message names the value on each rank).

    Example (one process per rank, after ``torch.distributed.init_process_group``)::

        running = detsum.RunningSum(grad.shape, mode="exact")
        running.add(my_rows)
        detsum.distributed.all_reduce_(running)
        total = running.sum()  # the same bits on every rank, for any number of ranks
    """
    caller = "detsum.distributed.all_reduce_"
    check_group(caller, group, none_means="the default group")
    if not isinstance(running_sum, RunningSum):
        raise TypeError(f"{caller}: running_sum must be a detsum.RunningSum, got "
                        f"{type(running_sum).__name__}")
    fields = {"mode": running_sum.mode.value, "dtype": running_sum.dtype,
              "shape": tuple(running_sum.shape)}
    if running_sum.mode is Mode.EXACT:
        state, error = running_sum._state, None
    else:
        # The header still goes out, so that a rank of another mode is told of it too.
        state = _limbs.new_state(0, torch.float32, running_sum.device)
        error = ValueError(f"{caller}: running_sum has mode={running_sum.mode.value!r}; "
                           f"expected mode='exact': {EXACT_ONLY}")
    [(summed, total)] = sum_over_ranks(caller, group, [(state, running_sum.count)], fields,
                                       local_error=error)
    running_sum._state.copy_(summed)
    running_sum.count = total
