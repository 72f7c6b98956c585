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

from . import njit

__all__ = ["counting_sort", "check_sorted_offsets"]


# The arrays are allocated by the callers: NumPy's allocations compiled in the kernels were
# most of their compile time (their first call's).


@njit(cache=True)
def _counting_sort(index, counts, cursor, order):
    """order (int64 [N]) and offsets (counts, int64 [S + 1], zeros) of the index; cursor:
    int64 [S] scratch. Returns -1, or the first bad position, having built nothing."""
    n = index.shape[0]
    num_segments = cursor.shape[0]
    for i in range(n):
        v = index[i]
        if v < 0 or v >= num_segments:
            # Bad index: stop here, build nothing.
            return i
        counts[v + 1] += 1
    offsets = counts  # exclusive cumsum in place: offsets[s] = rows before segment s
    for s in range(num_segments):
        offsets[s + 1] += offsets[s]
        cursor[s] = offsets[s]
    # Stable scatter: positions visited in increasing order land in increasing slots.
    for i in range(n):
        v = index[i]
        order[cursor[v]] = i
        cursor[v] += 1
    return -1


@njit(cache=True)
def _check_sorted_offsets(index, counts):
    """counts (int64 [S + 1], zeros) made the offsets of an index promised nondecreasing:
    (first bad position, first unsorted position), -1 where none."""
    n = index.shape[0]
    num_segments = counts.shape[0] - 1
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
        return first_bad, first_unsorted
    for s in range(num_segments):
        counts[s + 1] += counts[s]
    return -1, -1


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
    index_np = _index_numpy(index)
    offsets = np.zeros(num_segments + 1, dtype=np.int64)
    order = np.empty(index_np.shape[0], dtype=np.int64)
    first_bad = _counting_sort(index_np, offsets, np.empty(num_segments, dtype=np.int64), order)
    if first_bad >= 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), first_bad
    return torch.from_numpy(order), torch.from_numpy(offsets), -1


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
    offsets = np.zeros(num_segments + 1, dtype=np.int64)
    first_bad, first_unsorted = _check_sorted_offsets(_index_numpy(index), offsets)
    if first_bad >= 0 or first_unsorted >= 0:
        return torch.empty(0, dtype=torch.int64), first_bad, first_unsorted
    return torch.from_numpy(offsets), -1, -1
