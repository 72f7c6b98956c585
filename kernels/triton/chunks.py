"""How a launch splits long segments into chunks, and folds them in the same launch.

The rules that split (WIDE and KAHAN in ``segment.py``; EXACT in ``exact.py``, where the order
does not matter) give a segment longer than a chunk of ``CHUNK`` positions to chunk programs,
one per ``CHUNK`` positions of the launch: program ``e`` owns the chunk starts of the long
segments that fall in positions ``[e * CHUNK, (e + 1) * CHUNK)``, at most two
(``_chunk_owned``; ``segment.py`` launches the two as two programs), found by binary searches
of the segments' bounds (or, where the launch has the keys the bounds come from, a sort's or a
plan's index, by a position's key, checked against its bounds: ``_segment_at``), and writes
each chunk's part to its workspace slot (``_chunk_slot``, found from the segment's start
alone). It then takes a ticket of its segment (``_last_chunk_done``); the program that takes
the segment's last ticket folds the parts and writes the segment's row. Nothing is counted
before the launch and the fold is part of it: one launch, no other device op, no host read.

Tickets: a chunk program's stores of its part, by all its threads, come before its ticket
(``tl.debug_barrier``, then the atomic with release semantics at GPU scope, ``acq_rel``), and
the folder's loads come after its own ticket (acquire) and must bypass L1 (``.cg``); the sm_90
PTX is checked for both (tests/ptx_check.py). The counters live in a workspace kept per device
and stream (``ticket_counters``), zeroed once when it is made; a launch leaves every counter it
used at 0, so no op resets them between launches. That holds when the bounds are consistent
(offsets that never decrease; sorted keys, whose searches never decrease).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from .launch import Kernel

__all__ = ["CHUNKS_FIRST", "GUIDED_CHUNKS", "sort_offsets", "ticket_counters"]

#: Whether a launch's chunk programs take its first slots, ahead of the whole segments'. A
#: GPU starts a launch's programs in about the order of their slots, and a chunk program is
#: among its longest: two binary searches of the bounds (a dependent load each step), then up
#: to CHUNK terms, where most whole segments of a skewed index hold a few. Last, the chunk
#: programs would run on alone after the rest (the launch's tail); first, the short programs
#: fill the GPU around them (a model of the Zipf benchmark's launch: benches/NOTES.md). The
#: order of the slots takes no part in any element's arithmetic: the same bits either way.
#: False: the chunk programs last, the order before, kept to compare the two on a GPU.
CHUNKS_FIRST = True

#: Whether a launch's chunk programs find their segments by the keys where the launch has
#: them (GUIDED, segment.py), rather than by searching the segments' bounds. The same bits
#: either way; False is kept to compare the two on a GPU.
GUIDED_CHUNKS = True

# What ``bounds_ptr`` holds (BOUNDS): offsets known to be valid; offsets of any values, each
# read clamped into [0, positions] (``kernels.UncheckedOffsets``); sorted keys
# (``kernels.SortedKeys``: a promised-sorted index, searched by torch.searchsorted's steps; a
# sort's values reach the launch as offsets, segment.py); the keys as they are, at most
# CHUNK_TERMS of them (``kernels.UnsortedKeys``: segment.py's programs each scan them all; no
# chunks); the inner offsets of any values (``UncheckedOffsets`` with ``padded``): the
# segments' bounds are a 0, then those values read as ANY_OFFSETS reads them, then
# ``positions``, so the caller makes no padded copy.
_OFFSETS = tl.constexpr(0)
_ANY_OFFSETS = tl.constexpr(1)
_KEYS = tl.constexpr(2)
_UNSORTED_KEYS = tl.constexpr(3)
_PADDED_OFFSETS = tl.constexpr(4)


# ---- the segments' bounds, the chunks --------------------------------------------------------

@triton.jit
def _segment_start(bounds_ptr, s, nseg, positions, BOUNDS: tl.constexpr):
    """Where segment ``s`` starts (``s`` in ``[0, nseg]``; the start of ``nseg`` is the last
    segment's end): ``offsets[s]`` (under ANY_OFFSETS clamped into ``[0, positions]``; under
    PADDED_OFFSETS 0 for ``s = 0``, ``positions`` for ``s = nseg``, else ``offsets[s - 1]``
    clamped so), or under KEYS the first of the ``positions`` sorted keys that is ``>= s``,
    found by the steps of ``torch.searchsorted`` (so the same answer, also for keys that are
    not sorted). ``s`` may be a tensor of segments (PADDED_OFFSETS)."""
    if BOUNDS == _PADDED_OFFSETS:
        inner = (s > 0) & (s < nseg)
        start = tl.load(bounds_ptr + tl.where(inner, s - 1, 0), mask=inner, other=0)
        start = tl.where(s >= nseg, positions, start.to(tl.int64))
        start = tl.minimum(tl.maximum(start, 0), positions)
    elif BOUNDS == _KEYS:
        lo = tl.zeros([], tl.int64)
        hi = lo + positions
        while lo < hi:
            mid = lo + (hi - lo) // 2
            if tl.load(bounds_ptr + mid) >= s:
                hi = mid
            else:
                lo = mid + 1
        start = lo
    else:
        start = tl.load(bounds_ptr + s).to(tl.int64)
        if BOUNDS == _ANY_OFFSETS:
            start = tl.minimum(tl.maximum(start, 0), positions)
    return start


# What ``keys_ptr`` holds for a launch's chunk programs (GUIDED), which name the segment of a
# position by its key: nothing (they search the bounds); the key of each position (a sort's
# values, whose offsets are the bounds); the key of each row (a plan's index: position p's is
# ``keys[order[p]]``).
_UNGUIDED = tl.constexpr(0)
_KEY_A_POSITION = tl.constexpr(1)
_KEY_A_ROW = tl.constexpr(2)


@triton.jit
def _segment_at(bounds_ptr, nseg, p, positions, BOUNDS: tl.constexpr, keys_ptr, order_ptr,
                GUIDED: tl.constexpr):
    """The segment holding position ``p < positions`` (its start ``<= p <`` its end), or -1
    when no segment does. GUIDED: the key of ``p`` (``keys_ptr``, as GUIDED says) names it."""
    found = tl.zeros([], tl.int64) - 2  # -2: not known yet
    if (BOUNDS == _KEYS) | (GUIDED != _UNGUIDED):
        # The key at p names it, checked against its bounds (keys that are not sorted, or do
        # not match the bounds, may fail the check, and take the search below). The keys the
        # bounds were made from always pass it: a load or two and the two bounds', where the
        # search takes a dependent load for each halving of the segments.
        at = bounds_ptr + p
        if GUIDED == _KEY_A_POSITION:
            at = keys_ptr + p
        if GUIDED == _KEY_A_ROW:
            at = keys_ptr + tl.load(order_ptr + p)
        guess = tl.minimum(tl.maximum(tl.load(at).to(tl.int64), -1), nseg)
        start = _segment_start(bounds_ptr, tl.maximum(guess, 0), nseg, positions, BOUNDS)
        end = _segment_start(bounds_ptr, tl.minimum(guess + 1, nseg), nseg, positions,
                             BOUNDS)
        holds = tl.where(guess < 0, p < start,
                         tl.where(guess >= nseg, p >= start, (start <= p) & (p < end)))
        found = tl.where(holds, tl.where(guess >= nseg, -1, guess), -2)
    if found == -2:
        # The first segment starting after p, by a binary search of the starts.
        lo = tl.zeros([], tl.int64)
        hi = lo + nseg + 1
        while lo < hi:
            mid = lo + (hi - lo) // 2
            if _segment_start(bounds_ptr, mid, nseg, positions, BOUNDS) > p:
                hi = mid
            else:
                lo = mid + 1
        # lo == nseg + 1: p is at or after the last segment's end; lo == 0: before the first.
        found = tl.where(lo > nseg, -1, lo - 1)
    return found


@triton.jit
def _chunk_owned(bounds_ptr, nseg, positions, e, side, CHUNK: tl.constexpr,
                 BOUNDS: tl.constexpr, keys_ptr, order_ptr, GUIDED: tl.constexpr):
    """(segment, chunk number, whether there is one) of chunk program ``e``'s ``side``.

    Chunk program ``e`` owns the chunk starts of the long segments (more than CHUNK terms)
    that lie in positions ``[e * CHUNK, (e + 1) * CHUNK)``. A long segment being longer than
    that range, it holds at most two: side 0, one of the segment holding position
    ``e * CHUNK`` (the first of its chunk starts at or after it); side 1, the first chunk of a
    long segment starting after ``e * CHUNK`` inside the range, which then holds the range's
    last position. The fold finds chunk ``k`` of a segment from its start alone
    (``_chunk_slot``), so no running count of chunks is needed."""
    low = e * CHUNK
    first_seg = _segment_at(bounds_ptr, nseg, low, positions, BOUNDS, keys_ptr, order_ptr,
                            GUIDED)
    seg = first_seg
    if side == 1:
        seg = _segment_at(bounds_ptr, nseg, tl.minimum(low + CHUNK, positions) - 1, positions,
                          BOUNDS, keys_ptr, order_ptr, GUIDED)
    real = seg >= 0
    seg_at = tl.maximum(seg, 0)
    p0 = _segment_start(bounds_ptr, seg_at, nseg, positions, BOUNDS)
    n = _segment_start(bounds_ptr, seg_at + 1, nseg, positions, BOUNDS) - p0
    j = tl.zeros([], tl.int64)
    if side == 0:
        j = (tl.maximum(low - p0, 0) + CHUNK - 1) // CHUNK
    else:
        real = real & (seg != first_seg)
    owned = real & (n > CHUNK) & (p0 + j * CHUNK < p0 + n)
    return seg_at, j, owned, p0, n


@triton.jit
def _chunk_slot(p0, k, CHUNK: tl.constexpr):
    """The workspace slot of chunk ``k`` of the long segment starting at ``p0``: chunk
    program ``e = (p0 + k * CHUNK) // CHUNK``'s side 0, or its side 1 for a first chunk that
    starts after ``e * CHUNK``."""
    q = p0 + k * CHUNK
    e = q // CHUNK
    side = tl.where((k == 0) & (q != e * CHUNK), 1, 0)
    return e * 2 + side


@triton.jit
def _last_chunk_done(counters_ptr, p0, n, CHUNK: tl.constexpr):
    """Take a ticket of the long segment of ``n`` terms starting at ``p0`` (and of this
    program's column block and outer index), once this program's stores of its chunk's part
    are done; whether it was the segment's last, whose taker folds the parts (and has set the
    counter back to 0 for the next launch, which starts after this one ends).

    The barrier orders every thread's stores before the ticket, and the release publishes
    them; the last taker's acquire makes the other parts visible to its loads. Which program
    folds varies from run to run; what it folds never does."""
    tl.debug_barrier()
    ticket_at = (counters_ptr + 1
                 + (_chunk_slot(p0, 0, CHUNK) * tl.num_programs(1) + tl.program_id(1))
                 * tl.num_programs(2) + tl.program_id(2))
    taken = tl.atomic_add(ticket_at, 1, sem="acq_rel")
    last = taken == (n + CHUNK - 1) // CHUNK - 1
    if last:
        tl.store(ticket_at, 0)
    return last


# ---- a sort's offsets ---------------------------------------------------------------------------

# Segments whose offsets one program searches for at once.
_OFFSETS_BLOCK = 1024


@triton.jit
def _sort_offsets_kernel(keys_ptr, offsets_ptr, positions, nseg, steps, BLOCK: tl.constexpr):
    """``offsets[s]`` for this program's BLOCK of ``s`` in ``[0, nseg]``: the first of the
    ``positions`` sorted keys that is ``>= s`` (``positions`` when none is), by ``steps``
    halvings of ``[0, positions]``, all of them at once. Keys in ``[0, nseg)`` give 0 first
    and ``positions`` last."""
    s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    lo = tl.zeros([BLOCK], tl.int64)
    hi = lo + positions
    for _ in range(steps):
        searching = lo < hi
        mid = lo + (hi - lo) // 2
        at_or_past = tl.load(keys_ptr + mid, mask=searching, other=0).to(tl.int64) >= s
        hi = tl.where(searching & at_or_past, mid, hi)
        lo = tl.where(searching & ~at_or_past, mid + 1, lo)
    tl.store(offsets_ptr + s, lo, mask=s <= nseg)


_launch_sort_offsets = Kernel(_sort_offsets_kernel)


def sort_offsets(keys: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The ``num_segments + 1`` int64 offsets that sorted 1-D ``keys`` stand for,
    ``torch.searchsorted(keys, torch.arange(num_segments + 1))``, in one launch (no
    ``arange``): from 0 to ``keys.numel()``, never decreasing."""
    positions = keys.shape[0]
    offsets = torch.empty(num_segments + 1, dtype=torch.int64, device=keys.device)
    # Each halving at least halves [lo, hi): positions.bit_length() of them empty it.
    _launch_sort_offsets(
        (-(-(num_segments + 1) // _OFFSETS_BLOCK),),
        (keys.contiguous(), offsets, positions, num_segments, positions.bit_length()),
        {"BLOCK": _OFFSETS_BLOCK}, num_warps=4)
    return offsets


# ---- tickets -----------------------------------------------------------------------------------

# A launch's tickets (the chunk programs', the checkers'): int64 counters, zero between
# launches, one set per device and stream (launches on one stream run one after the other;
# on two streams they may run at once; a CUDA graph replays its launches with the set of the
# stream it was captured on). Made zero when first needed, and again, larger, when a launch
# needs more: then the old set is kept, since a CUDA graph may have captured a launch that
# uses it.
_TICKET_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []
_MIN_COUNTERS = 4096


def are_ticket_counters(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of the tensors of ticket counters that ``ticket_counters`` hands
    out (or did, before a larger one replaced it)."""
    return any(t is counters for counters in (*_TICKET_COUNTERS.values(), *_RETIRED_COUNTERS))


def ticket_counters(device: torch.device, size: int) -> torch.Tensor:
    """At least ``size`` ticket counters for a launch on ``device``'s current stream, zero."""
    stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else None
    key = (device, stream)
    counters = _TICKET_COUNTERS.get(key)
    if counters is None or counters.numel() < size:
        held = 0
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
            held = counters.numel()
        counters = torch.zeros(max(size, 2 * held, _MIN_COUNTERS), dtype=torch.int64,
                               device=device)
        _TICKET_COUNTERS[key] = counters
    return counters

