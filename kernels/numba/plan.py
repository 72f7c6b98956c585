"""Segment plans for the CPU path: which source rows feed which output row, in what order.

``segment_reduce`` (``detsum.kernels.numba.segment``) reads a segment's rows as
``order[offsets[s]] .. order[offsets[s+1]-1]``. The order inside a segment is the canonical
order of the contract (docs/determinism.md): rows in order of appearance along ``dim``. ``counting_sort`` builds exactly
that (a stable counting sort of the index); ``check_sorted_offsets`` serves an index already
promised nondecreasing, where no ``order`` is needed at all.

Both are single serial passes over the index (plus one over the segments): they are O(N + S),
deterministic by construction, and cheap next to the reduction itself.
"""

import numpy as np
import torch
from numba import njit

__all__ = ["counting_sort", "check_sorted_offsets"]


@njit(cache=True)
def _counting_sort(index, num_segments):
    n = index.shape[0]
    counts = np.zeros(num_segments + 1, dtype=np.int64)
    for i in range(n):
        v = index[i]
        if v < 0 or v >= num_segments:
            # Bad index: stop here, build nothing.
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), i
        counts[v + 1] += 1
    offsets = counts  # exclusive cumsum in place: offsets[s] = rows before segment s
    for s in range(num_segments):
        offsets[s + 1] += offsets[s]
    # Stable scatter: positions visited in increasing order land in increasing slots.
    cursor = offsets[:-1].copy()
    order = np.empty(n, dtype=np.int64)
    for i in range(n):
        v = index[i]
        order[cursor[v]] = i
        cursor[v] += 1
    return order, offsets, -1


@njit(cache=True)
def _check_sorted_offsets(index, num_segments):
    n = index.shape[0]
    counts = np.zeros(num_segments + 1, dtype=np.int64)
    first_bad = -1
    first_unsorted = -1
    prev = 0
    for i in range(n):
        v = index[i]
        if v < 0 or v >= num_segments:
            first_bad = i
            break
        if first_unsorted < 0:
            if i > 0 and v < prev:
                first_unsorted = i
            else:
                counts[v + 1] += 1
        prev = v
    if first_bad >= 0 or first_unsorted >= 0:
        return np.empty(0, dtype=np.int64), first_bad, first_unsorted
    for s in range(num_segments):
        counts[s + 1] += counts[s]
    return counts, -1, -1


def _index_numpy(index):
    if index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
        raise TypeError(
            f"index must be a 1-D int32 or int64 tensor, got {index.dtype} with shape "
            f"{tuple(index.shape)}"
        )
    if index.device.type != "cpu":
        raise ValueError(f"index must be on the CPU, got {index.device}")
    # A strided view, no copy: numba reads non-contiguous arrays as they are.
    return index.detach().numpy()


def counting_sort(index, num_segments):
    """Group the positions of a 1-D index by value, stably.

    Args:
        index: int32 or int64 CPU tensor ``[N]`` (any strides).
        num_segments: the number of segments ``S``; valid values are ``0 <= index[i] < S``.

    Returns:
        ``(order, offsets, first_bad)``. With every value valid, ``first_bad == -1``,
        ``order`` is an int64 tensor ``[N]`` holding the positions grouped by value, in
        increasing position within a value (a stable sort), and ``offsets`` an int64 tensor
        ``[S + 1]``, the exclusive cumulative sum of the counts, so segment ``s`` is
        ``order[offsets[s]:offsets[s + 1]]``. Otherwise ``first_bad`` is the first position
        whose value lies outside ``[0, S)`` and ``order`` / ``offsets`` are empty tensors
        (the pass stops there and builds nothing).

    One serial pass counts and validates, one scatters: the result never depends on threads.
    """
    num_segments = int(num_segments)
    if num_segments < 0:
        raise ValueError(f"num_segments must be >= 0, got {num_segments}")
    order, offsets, first_bad = _counting_sort(_index_numpy(index), num_segments)
    return torch.from_numpy(order), torch.from_numpy(offsets), int(first_bad)


def check_sorted_offsets(index, num_segments):
    """Offsets of an index promised nondecreasing, checked in one pass.

    Args:
        index: int32 or int64 CPU tensor ``[N]`` (any strides), expected nondecreasing.
        num_segments: the number of segments ``S``.

    Returns:
        ``(offsets, first_bad_range, first_unsorted)``. ``first_bad_range`` is the first
        position whose value lies outside ``[0, S)`` (-1 if none); ``first_unsorted`` the
        first position ``i`` with ``index[i] < index[i - 1]`` among the positions before
        ``first_bad_range`` (-1 if none). When both are -1, ``offsets`` is the int64 tensor
        ``[S + 1]`` with segment ``s`` = rows ``offsets[s] .. offsets[s + 1] - 1`` (use
        ``order=None`` with ``segment_reduce``); otherwise it is an empty tensor.

    The scan goes on past an unsorted position (counting stops there) so that an
    out-of-range value is always reported, and it stops at the first out-of-range value.
    """
    num_segments = int(num_segments)
    if num_segments < 0:
        raise ValueError(f"num_segments must be >= 0, got {num_segments}")
    offsets, first_bad, first_unsorted = _check_sorted_offsets(
        _index_numpy(index), num_segments
    )
    return torch.from_numpy(offsets), int(first_bad), int(first_unsorted)
