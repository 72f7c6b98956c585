"""Sums over the ranks of a torch.distributed group, exact: the same bits for any number of ranks.

An ``"exact"`` running sum keeps its state as integers (``detsum._limbs``), so the sum of the
states of every rank is an integer all-reduce: exact in whatever order or tree the backend
(gloo, NCCL) adds them, and so the same for one rank holding every row as for any number of
ranks holding any shards of them. A floating-point all-reduce promises nothing of the kind:
its order, and so its bits, follow the number of ranks and the algorithm the backend picks.

One sum over ranks is one collective for small states, two for the others (docs/distributed.md
has the proof of exactness). Both are all-reduced with SUM, integers:

1. the header, ``HEADER_INT64S`` int64 on every call whatever the states, so that ranks in
   different calls still pair up, and find out: the bytes of a fingerprint of what the ranks
   must agree on (shapes, dtypes, mode and the like) and their squares, whose sums show
   whether every rank sent the same bytes; for each limb row, how many ranks' states use it
   in sign-magnitude form; each counter's largest value and largest negated value, summed
   over the ranks. Its room after these holds the states' counts and the states themselves,
   whole, where they fit (``_ROOM``): the sum is then complete after this one collective,
   and one read back of the header's values and the counts;
2. otherwise the payload: each state's row count, its limbs inside the window of rows that
   any rank uses, as sign-magnitude digits, and only the counters that some rank needs,
   packed several to an int64 where their sum over the ranks is known to fit.

Ranks that disagree get the same error on every rank, naming what differs and where, before
any state is touched. The loss functions (``detsum.loss``) take part through the helpers here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from detsum import _kernel_ops, _limbs, _segments, _wire
from detsum.modes import EXACT_LIMBS, Mode
from detsum.ops.running_sum import RunningSum

__all__ = ["all_reduce_"]

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


#: A rank's own header values (the maxima over its states of ``_wire.Outgoing.header``): the
#: window of limbs in use (its top, minus its bottom), then for each counter its largest value
#: and its largest negated value.
_LOCAL_VALUES = 2 + 2 * _limbs.COUNTERS

_FINGERPRINT_BYTES = 8
#: The most limb rows a state has (an fp64 one).
_MAX_ROWS = max(EXACT_LIMBS.values())
#: The header's values (its start): the fingerprint's bytes, their squares, a count of ranks
#: per limb row, two sums per counter (``_summable``).
_HEADER_VALUES = 2 * _FINGERPRINT_BYTES + _MAX_ROWS + 2 * _limbs.COUNTERS
#: The header's size on every call: 64 KiB. Its room after the values holds small states
#: whole (the distributed example's 484 fp32 parameters take 6777 int64 of it).
HEADER_INT64S = 8192
_ROOM = HEADER_INT64S - _HEADER_VALUES


def _new_header(fields: dict, device: torch.device,
                layout_values: Sequence[int] | None = None) -> torch.Tensor:
    """A header of ``fields``' fingerprint and this rank's ``layout_values``
    (:func:`_summable`; zeros where None), its room zero."""
    fingerprint = _fingerprint(fields)
    digits = [(fingerprint >> (8 * i)) & 0xFF for i in range(_FINGERPRINT_BYTES)]
    values = (digits + [d * d for d in digits]
              + list(layout_values or [0] * (_HEADER_VALUES - 2 * _FINGERPRINT_BYTES)))
    header = torch.zeros(HEADER_INT64S, dtype=torch.int64, device=device)
    header[:_HEADER_VALUES] = torch.tensor(values, dtype=torch.int64)
    return header


def _exchange(caller: str, group, fields: dict, header: torch.Tensor,
              room_values: int = 0) -> tuple[list[int], list[int]]:
    """All-reduce ``header`` (:func:`_new_header` of ``fields``) with SUM, in place; return
    the sums of its layout values and of the first ``room_values`` int64 of its room, read
    back together (one host read on a GPU). Raises the same error on every rank when the
    ranks' fields differ. Every call sends a header of one size, so that ranks in different
    calls still pair up, and find out."""
    dist.all_reduce(header, op=dist.ReduceOp.SUM, group=group)
    received = header[:_HEADER_VALUES + room_values].tolist()
    ranks = dist.get_world_size(group)
    for i in range(_FINGERPRINT_BYTES):
        # The sums of n bytes b_r and of their squares: (sum b_r)**2 <= n * sum b_r**2, equal
        # only when every b_r is the same (Cauchy-Schwarz), in exact integers.
        total, squares = received[i], received[_FINGERPRINT_BYTES + i]
        if total * total != ranks * squares:
            _raise_disagreement(caller, group, fields)
    return received[2 * _FINGERPRINT_BYTES:_HEADER_VALUES], received[_HEADER_VALUES:]


def agree(caller: str, group, fields: dict) -> None:
    """One small collective: every rank of ``group`` passes ``fields`` (names to picklable
    values with a stable ``repr``), and all of them raise, naming the first field that differs
    and on which ranks, unless every rank passed the same."""
    _exchange(caller, group, fields, _new_header(fields, _header_device(group)))


def fail_together(caller: str, group, fields: dict, error: Exception) -> NoReturn:
    """Raise ``error`` (an argument error found on this rank) where another rank may be in
    :func:`sum_over_ranks`: the header goes out first, so that every rank raises, this error
    where all ranks found it, the disagreement (naming this rank) where only some did."""
    agree(caller, group, fields)
    raise error


def _local_header(outgoing: Sequence[_wire.Outgoing]) -> torch.Tensor:
    """This rank's header values (``_LOCAL_VALUES``): the maxima over its states."""
    values = ([max(column) for column in zip(*(o.header() for o in outgoing))] if outgoing
              else [-1, 0] + [0] * (_LOCAL_VALUES - 2))  # no states: an empty window
    return torch.tensor(values, dtype=torch.int64)


def _summable(local: Sequence[int]) -> list[int]:
    """This rank's layout values in the header, from its maxima (:func:`_local_header`), as
    numbers whose sums over the ranks fix the layout (:class:`_Wire`): 1 for each limb row
    in its window, 0 for the others; each counter's extremes, at least 0. The sum of a
    counter's largest values is at least the largest, and bounds the counter's sum."""
    top, bottom = local[0], -local[1]
    return ([int(bottom <= row <= top) for row in range(_MAX_ROWS)]
            + [max(value, 0) for value in local[2:]])


#: What an int64 that nothing wrote holds under test (``_segments.POISON_OUTPUTS``).
_POISON = 0x5EED_5EED_5EED_5EED


def _poisoned_under_test(tensor: torch.Tensor) -> torch.Tensor:
    """A new ``tensor``, poisoned under test: an element that nothing writes fails there."""
    if _segments.POISON_OUTPUTS:
        tensor.fill_(_POISON)
    return tensor


class _Wire:
    """The payload's layout, which the header's sums fix alike on every rank: the window of
    limb rows ``[bottom, top]`` that every state's digits go in, the counters that go
    (``kinds``: those that some rank needs), and their packing (``fields`` to an int64, of
    ``bits`` bits each). A state's part of the payload is its row count, its digits in the
    window row by row, then each counter of ``kinds`` in lanes (``detsum._wire``)."""

    def __init__(self, sums: Sequence[int]):
        """``sums``: the sums over the ranks of their :func:`_summable` values."""
        used = [row for row in range(_MAX_ROWS) if sums[row]]
        # The union of the ranks' windows; an empty one where no rank has a digit.
        self.top, self.bottom = (used[-1], used[0]) if used else (-1, 0)
        bounds = sums[_MAX_ROWS:]
        self.kinds = [k for k in range(_limbs.COUNTERS)
                      if bounds[2 * k] > 0 or bounds[2 * k + 1] > 0]
        if any(bounds[2 * k + 1] > 0 for k in self.kinds):
            # A negative counter (a state loaded by hand): one per int64.
            self.fields, self.bits = 1, 64
        else:
            # Each counter's sum over the ranks is at most the sum of the ranks' largest.
            bits = (max(bounds[2 * k].bit_length() for k in self.kinds)
                    if self.kinds else 1)
            self.fields, self.bits = max(1, 63 // bits), bits

    def window_rows(self, n_limbs: int) -> int:
        """Rows of the window within a state of ``n_limbs`` limbs (fp32 and fp64 states
        summed in one call share one window)."""
        return max(0, min(self.top, n_limbs - 1) - self.bottom + 1)

    def lanes(self, numel: int) -> int:
        return -(-numel // self.fields)

    def size(self, n_limbs: int, numel: int) -> int:
        return 1 + self.window_rows(n_limbs) * numel + len(self.kinds) * self.lanes(numel)

    def encode(self, outgoing: Sequence[_wire.Outgoing]) -> torch.Tensor:
        """The payload of ``outgoing``, this rank's states."""
        sizes = [self.size(o.n_limbs, o.state.shape[1]) for o in outgoing]
        device = outgoing[0].state.device if outgoing else torch.device("cpu")
        payload = _poisoned_under_test(torch.empty(sum(sizes), dtype=torch.int64, device=device))
        offset = 0
        for o, size in zip(outgoing, sizes):
            o.write(payload[offset:offset + size], self.bottom, self.window_rows(o.n_limbs),
                    self.kinds, self.fields, self.bits)
            offset += size
        return payload

    def decode(self, payload: torch.Tensor, outgoing: Sequence[_wire.Outgoing],
               out: Sequence[torch.Tensor] | None) -> list[tuple[torch.Tensor, int]]:
        """The states and total counts that ``payload``, a sum of every rank's, holds: into
        ``out`` or new tensors. ``outgoing``: this rank's states (their shapes)."""
        offsets, offset = [], 0
        for o in outgoing:
            offsets.append(offset)
            offset += self.size(o.n_limbs, o.state.shape[1])
        totals = payload[offsets].tolist()
        results = []
        for i, (o, offset, total) in enumerate(zip(outgoing, offsets, totals)):
            numel, n_limbs = o.state.shape[1], o.n_limbs
            summed = _poisoned_under_test(torch.empty_like(o.state)) if out is None else out[i]
            part = payload[offset:offset + self.size(n_limbs, numel)]
            _kernel_ops.decode_state(part, self.bottom, self.window_rows(n_limbs), self.kinds,
                                     self.fields, self.bits, total, summed)
            results.append((summed, total))
        return results


def sum_over_ranks(caller: str, group, states: Sequence[tuple[torch.Tensor, int]],
                   fields: dict, *, out: Sequence[torch.Tensor] | None = None,
                   local_error: Exception | None = None, sent: dict | None = None
                   ) -> list[tuple[torch.Tensor, int]]:
    """The sum over the ranks of ``group`` of each exact ``(state, count)`` (``state``
    ``[L + COUNTERS, numel]`` int64, normalised, as ``detsum._limbs`` keeps it; ``count`` its
    rows): normalised states and the total counts, the same on every rank. The results go
    into ``out`` (which may be the states themselves) or new tensors.

    One collective where the states and their counts fit in the header's room (``_ROOM``
    int64): the header (``fields`` agreed) carries them whole. Two otherwise: the header
    (``fields`` agreed; the window of limbs that any rank uses, over all the states; the
    counters' extremes) and the payload: each state's count, its digits in that window, and
    the counters that some rank needs, packed several to an int64 where their sum over the
    ranks is known to fit. Every rank must pass the same number of states with the same
    shapes (``fields`` should say so): ranks whose fields differ raise before either path
    reads what it received. ``local_error``: this rank found an error in its arguments; it
    sends the header and raises that error where every rank did the same, the disagreement
    otherwise. ``sent``, where given, receives the bytes each rank hands to the all-reduces
    (``"header_bytes"``, ``"payload_bytes"``)."""
    if local_error is not None:
        fail_together(caller, group, fields, local_error)
    device = _header_device(group)
    if sum(1 + state.numel() for state, _ in states) <= _ROOM:
        header = _new_header(fields, device)
        room = header[_HEADER_VALUES:]
        _write_whole(states, room)
        if sent is not None:
            sent["header_bytes"], sent["payload_bytes"] = 8 * HEADER_INT64S, 0
        # Integer addition, as for the payload below.
        _, totals = _exchange(caller, group, fields, header, room_values=len(states))
        return _read_whole(room, states, totals, out)
    outgoing = _kernel_ops.outgoing_states(states)
    header = _new_header(fields, device, _summable(_local_header(outgoing).tolist()))
    layout = _Wire(_exchange(caller, group, fields, header)[0])
    payload = layout.encode(outgoing)
    if sent is not None:
        sent["header_bytes"] = 8 * HEADER_INT64S
        sent["payload_bytes"] = payload.numel() * payload.element_size()
    # Integer addition: exact, so the same sums in any order the backend chooses.
    dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group)
    return layout.decode(payload, outgoing, out)


def _write_whole(states: Sequence[tuple[torch.Tensor, int]], room: torch.Tensor) -> None:
    """The states' counts, then the states themselves one after the other, into ``room``."""
    offset = len(states)
    for i, (state, count) in enumerate(states):
        room[i] = count
        room[offset:offset + state.numel()].view(state.shape).copy_(state)
        offset += state.numel()


def _read_whole(room: torch.Tensor, states: Sequence[tuple[torch.Tensor, int]],
                totals: Sequence[int], out: Sequence[torch.Tensor] | None
                ) -> list[tuple[torch.Tensor, int]]:
    """The states that ``room``, the sum of every rank's :func:`_write_whole`, holds,
    normalised, with their ``totals`` (its first values, read back with the header's): into
    ``out`` or new tensors.

    Every limb but a state's last is in ``[0, 2**32)`` on each rank and its last below
    ``2**31`` in magnitude, so fewer than ``2**31`` ranks sum every limb exactly in int64;
    normalising the sum gives the one normalised form of the summed integers. The counters
    are sums of counts."""
    results, offset = [], len(states)
    for i, ((state, _), total) in enumerate(zip(states, totals)):
        summed = _poisoned_under_test(torch.empty_like(state)) if out is None else out[i]
        summed.copy_(room[offset:offset + state.numel()].view(state.shape))
        _kernel_ops.normalise_limbs(summed[:state.shape[0] - _limbs.COUNTERS])
        results.append((summed, total))
        offset += state.numel()
    return results


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
    any order and for any backend. Only the limbs inside the window that some rank uses go on
    the wire, as sign-magnitude digits whose sum over fewer than ``2**31`` ranks stays within
    int64, and only the counters that some rank needs (:doc:`distributed`): 8 bytes per limb
    in that window and element (16 to 24 for fp32 gradients), where the whole state takes 112.

    Every error is raised before any state changes, on every rank alike where its cause is on
    one rank (the ranks exchange a fingerprint of the mode, dtype and shape first).

    Raises:
        RuntimeError: torch.distributed is not initialised; or the sum was made under
            ``torch.inference_mode()`` and this call is outside it.
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
    if running_sum.mode is not Mode.EXACT:
        # The header still goes out, so that a rank of another mode is told of it too.
        fail_together(caller, group, fields, ValueError(
            f"{caller}: running_sum has mode={running_sum.mode.value!r}; expected "
            f"mode='exact': {EXACT_ONLY}"))
    try:
        running_sum._check_changeable(caller)
    except RuntimeError as error:
        fail_together(caller, group, {**fields, "running_sum": describe_error(error)}, error)
    fields["running_sum"] = "changeable"
    [(_, total)] = sum_over_ranks(caller, group, [(running_sum._state, running_sum.count)],
                                  fields, out=[running_sum._state])
    running_sum.count = total
