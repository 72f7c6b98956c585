"""A stable sort of segment keys by counting, in four launches and no other torch op than its
allocations, for a GPU, and the offsets of the sorted keys with it.

``kernels.sort_by_segment`` sorts an index by the segment each key names, keys clamped into
``[-1, num_segments]``: there are at most ``num_segments + 2`` distinct values, so the sort is
a counting sort. Positions go in blocks of ``BLOCK``, and a table has a row for each block and
a column for each value (cell ``block * num_values + value``):

1. ``_rank_kernel``, a program for each block and each ``ROW_VALUES`` values of its row:
   the rank of each key of those values among the block's equal keys before it, and the
   block's count of each of those values in its row (zeros first, where no key has it; the
   program's threads meet at a barrier before the counts land on them). The ranks come from
   comparing each key with the block's keys, ``CHUNK`` of them at a time (``BLOCK * BLOCK``
   comparisons a block, no sort inside the block, no atomics). A wide row is so zeroed by
   many programs, not one (4608 keys into 900,000 segments: 9 blocks, 3.6 MB of zeros each);
   a program whose values no key of its block has only zeroes.
2. ``_totals_kernel``, a program for ``VALUES`` columns of ``ROWS_PER_PROGRAM`` rows: each
   value's count over those blocks, and the program's sum of them.
3. ``_starts_kernel``, the same programs: each cell becomes its start, the number of keys that
   sort before the block's keys of that value (those of smaller values, then those of the
   value in earlier blocks: a running sum of the table taken column by column, each
   program's start the sums of the programs before it); and the offsets of the sorted keys,
   ``offsets[s]`` the keys below ``s``, each value's start.
4. ``_place_kernel``, a program a block: each key's place, its cell's start plus its rank;
   there its position (``order``) and clamped value (``values``).

Equal keys so keep the order of their positions: the order and values are those of
``torch.sort(clamped_keys, stable=True)``, bit for bit (the stable order is unique), by
integer counts alone. Every cell and output is written by a launch, so nothing is filled
before them: on a GPU the sort is four Triton launches, where torch's radix sort of the same
keys (CUB's onesweep sort) makes 8 launches for int16 keys and 12 for int32, after the clamp
and the cast to them that this sort does not need, and a search launch after it. The table
has ``(num_segments + 2) * ceil(n / BLOCK)`` cells, so larger blocks mean a smaller table and
more comparisons. ``takes`` says where the table stays within ``MAX_TABLE_CELLS``; elsewhere
(a GNN's 100k-row table of a million edges, say) the caller sorts with torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Kernel

__all__ = ["BLOCK", "MAX_TABLE_CELLS", "sort_by_segment", "takes"]

#: Positions a program ranks: each is compared with the block's every key.
BLOCK = 512
#: Keys a program compares its block with at once (a [CHUNK, BLOCK] comparison).
CHUNK = 16
#: Values (table columns) a program of the totals and starts launches takes.
VALUES = 256
#: Blocks (table rows) those programs take: the table is split into programs both ways, so
#: that a few values of many blocks (a long index into few segments) still make many.
ROWS_PER_PROGRAM = 64
#: Rows they read at once: a [ROWS, VALUES] tile, so that each program keeps several loads
#: in flight rather than waiting on one row after another.
ROWS = 16
#: Programs' sums a program of the starts launch adds at once.
SUMS = 1024
#: The most cells of the table (int32: 32 MiB): the launches move it four times.
MAX_TABLE_CELLS = 1 << 23
#: Values of a block's row a ranking program takes (int32: 256 KiB of zeros at most).
ROW_VALUES = 1 << 16
#: Warps a program of each launch runs on (4: each thread of the rank and place launches
#: takes 4 of a block's keys).
NUM_WARPS = 4


def takes(positions: int, num_segments: int) -> bool:
    """Whether ``sort_by_segment`` sorts ``positions`` keys into ``num_segments`` segments:
    its table within ``MAX_TABLE_CELLS``, every count and place within int32."""
    # -(-a // b): the ceiling of a / b (triton.cdiv, a constexpr function, costs the host
    # a few microseconds a call).
    cells = (num_segments + 2) * -(-positions // BLOCK)
    return 0 < positions < 2**31 - 1 and cells <= MAX_TABLE_CELLS


@triton.jit
def _value(keys_ptr, at, valid, num_segments, absent):
    """The table's value of the keys at ``at``: the key clamped into ``[-1, num_segments]``,
    plus 1; ``absent`` where not ``valid``."""
    key = tl.load(keys_ptr + at, mask=valid, other=0)
    key = tl.minimum(tl.maximum(key, -1), num_segments).to(tl.int32)
    return tl.where(valid, key + 1, absent)


@triton.jit
def _rank_kernel(keys_ptr, ranks_ptr, table_ptr, positions, num_segments, num_values,
                 BLOCK: tl.constexpr, CHUNK: tl.constexpr, ROW_VALUES: tl.constexpr):
    """Block ``b``, values ``[p * ROW_VALUES, (p + 1) * ROW_VALUES)``: the rank of each key of
    those values among the block's equal keys before it (``ranks``), and those cells of the
    table's row ``b``: the block's count of each value (0 for those it lacks)."""
    b = tl.program_id(0)
    p = tl.program_id(1)
    row = table_ptr + b.to(tl.int64) * num_values
    lowest = p * ROW_VALUES
    above = tl.minimum(lowest + ROW_VALUES, num_values)
    for first in range(lowest, above, BLOCK):
        value_at = first + tl.arange(0, BLOCK)
        tl.store(row + value_at, tl.zeros([BLOCK], tl.int32), mask=value_at < above)
    # The zeros, stored by all of the program's threads, land before its counts.
    tl.debug_barrier()
    j = tl.arange(0, BLOCK)
    at = b.to(tl.int64) * BLOCK + j
    valid = at < positions
    value = _value(keys_ptr, at, valid, num_segments, -1)
    # Each key's value is in one program's values: that program ranks it and counts it.
    mine = valid & (value >= lowest) & (value < above)
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        rank = tl.zeros([BLOCK], tl.int32)
        count = tl.zeros([BLOCK], tl.int32)
        for start in range(0, BLOCK, CHUNK):
            i = start + tl.arange(0, CHUNK)
            other_at = b.to(tl.int64) * BLOCK + i
            # -2: no key's value, nor a missing key's (-1), so a missing key counts nowhere.
            other = _value(keys_ptr, other_at, other_at < positions, num_segments, -2)
            same = other[:, None] == value[None, :]
            rank += tl.sum(tl.where(same & (i[:, None] < j[None, :]), 1, 0), axis=0)
            count += tl.sum(tl.where(same, 1, 0), axis=0)
        tl.store(ranks_ptr + at, rank, mask=mine)
        tl.store(row + value, count, mask=mine & (rank == 0))


@triton.jit
def _rows_of_columns(table_ptr, first, value, in_table, num_values, blocks,
                     ROWS: tl.constexpr):
    """The cells of rows ``[first, first + ROWS)`` of the table at the columns ``value``: their
    addresses, and which of them are in the table."""
    b = first + tl.arange(0, ROWS)
    return (table_ptr + b[:, None].to(tl.int64) * num_values + value[None, :],
            (b[:, None] < blocks) & in_table[None, :])


@triton.jit
def _totals_kernel(table_ptr, partials_ptr, tile_sums_ptr, num_values, blocks, row_programs,
                   VALUES: tl.constexpr, ROWS: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    """Columns ``[t * VALUES, (t + 1) * VALUES)`` of rows ``[r * ROWS_PER_PROGRAM, (r + 1) *
    ROWS_PER_PROGRAM)``: each value's count over those blocks (``partials[r, value]``), and
    their sum (``tile_sums[t, r]``)."""
    # A program's rows are whole tiles: none reaches into the next program's rows.
    tl.static_assert(ROWS_PER_PROGRAM % ROWS == 0)
    t = tl.program_id(0)
    r = tl.program_id(1)
    value = t * VALUES + tl.arange(0, VALUES)
    in_table = value < num_values
    total = tl.zeros([VALUES], tl.int32)
    rows_start = r * ROWS_PER_PROGRAM
    for first in range(rows_start, tl.minimum(rows_start + ROWS_PER_PROGRAM, blocks), ROWS):
        cell, in_tile = _rows_of_columns(table_ptr, first, value, in_table, num_values, blocks,
                                         ROWS)
        total += tl.sum(tl.load(cell, mask=in_tile, other=0), axis=0)
    tl.store(partials_ptr + r.to(tl.int64) * num_values + value, total, mask=in_table)
    tl.store(tile_sums_ptr + t * row_programs + r, tl.sum(total, axis=0))


@triton.jit
def _starts_kernel(table_ptr, partials_ptr, tile_sums_ptr, offsets_ptr, num_values, blocks,
                   row_programs, VALUES: tl.constexpr, ROWS: tl.constexpr,
                   ROWS_PER_PROGRAM: tl.constexpr, SUMS: tl.constexpr):
    """Columns ``[t * VALUES, (t + 1) * VALUES)`` of rows ``[r * ROWS_PER_PROGRAM, (r + 1) *
    ROWS_PER_PROGRAM)``: each cell's count replaced by its start, the keys that sort before
    its own: those of smaller values (the sums of earlier columns' programs, then the
    totals of the column's smaller values), then those of its value in earlier blocks (the
    partials of earlier rows' programs, then the rows above it in its own); and, from the
    programs of the first rows, ``offsets[value - 1]`` (the keys below segment
    ``value - 1``), each value's start."""
    tl.static_assert(ROWS_PER_PROGRAM % ROWS == 0)
    t = tl.program_id(0)
    r = tl.program_id(1)
    earlier = tl.zeros([SUMS], tl.int32)
    for first in range(0, t * row_programs, SUMS):
        program = first + tl.arange(0, SUMS)
        earlier += tl.load(tile_sums_ptr + program, mask=program < t * row_programs, other=0)
    value = t * VALUES + tl.arange(0, VALUES)
    in_table = value < num_values
    total = tl.zeros([VALUES], tl.int32)
    above = tl.zeros([VALUES], tl.int32)
    for first in range(0, row_programs, ROWS):
        # The partials are a table too, a row for each program's rows.
        cell, in_tile = _rows_of_columns(partials_ptr, first, value, in_table, num_values,
                                         row_programs, ROWS)
        partial = tl.load(cell, mask=in_tile, other=0)
        total += tl.sum(partial, axis=0)
        rows = first + tl.arange(0, ROWS)
        above += tl.sum(tl.where(rows[:, None] < r, partial, 0), axis=0)
    value_start = tl.sum(earlier, axis=0) + tl.cumsum(total, axis=0) - total
    if r == 0:
        tl.store(offsets_ptr + value - 1, value_start.to(tl.int64), mask=in_table & (value > 0))
    start = value_start + above
    rows_start = r * ROWS_PER_PROGRAM
    for first in range(rows_start, tl.minimum(rows_start + ROWS_PER_PROGRAM, blocks), ROWS):
        cell, in_tile = _rows_of_columns(table_ptr, first, value, in_table, num_values, blocks,
                                         ROWS)
        count = tl.load(cell, mask=in_tile, other=0)
        tl.store(cell, start[None, :] + tl.cumsum(count, axis=0) - count, mask=in_tile)
        start += tl.sum(count, axis=0)


@triton.jit
def _place_kernel(keys_ptr, ranks_ptr, table_ptr, values_ptr, order_ptr, positions,
                  num_segments, num_values, BLOCK: tl.constexpr):
    """Block ``b``: each key's place, its cell's start plus its rank; there the key's
    position (``order``) and its clamped value (``values``)."""
    b = tl.program_id(0)
    at = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = at < positions
    value = _value(keys_ptr, at, valid, num_segments, 0)
    place = (tl.load(table_ptr + b.to(tl.int64) * num_values + value, mask=valid, other=0)
             + tl.load(ranks_ptr + at, mask=valid, other=0))
    tl.store(order_ptr + place, at, mask=valid)
    tl.store(values_ptr + place, (value - 1).to(values_ptr.dtype.element_ty), mask=valid)


_launch_rank = Kernel(_rank_kernel)
_launch_totals = Kernel(_totals_kernel)
_launch_starts = Kernel(_starts_kernel)
_launch_place = Kernel(_place_kernel)


def sort_by_segment(keys: torch.Tensor, num_segments: int, values_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, order) of ``torch.sort(keys.clamp(-1, num_segments).to(values_dtype),
    stable=True)`` for 1-D integer ``keys`` where ``takes(len(keys), num_segments)``: the
    same bits, by counting (see above); and the int64 offsets of the values,
    ``torch.searchsorted(values, torch.arange(num_segments + 1))``, made along with them.
    ``values_dtype`` must hold ``[-1, num_segments]``."""
    positions = keys.shape[0]
    keys = keys.contiguous()
    device = keys.device
    blocks = -(-positions // BLOCK)
    num_values = num_segments + 2
    column_programs = -(-num_values // VALUES)
    # At most 43691 (a table of 3 values by 2**23 / 3 blocks): within a grid's second
    # dimension (65535).
    row_programs = -(-blocks // ROWS_PER_PROGRAM)
    ranks = torch.empty(positions, dtype=torch.int32, device=device)
    cells = blocks * num_values
    partial_cells = row_programs * num_values
    # The table, the partials and the tile sums: one allocation.
    table = torch.empty(cells + partial_cells + column_programs * row_programs,
                        dtype=torch.int32, device=device)
    partials, tile_sums = table[cells:], table[cells + partial_cells:]
    values = torch.empty(positions, dtype=values_dtype, device=device)
    order = torch.empty(positions, dtype=torch.int64, device=device)
    offsets = torch.empty(num_segments + 1, dtype=torch.int64, device=device)
    # At most 128 programs a row (a table of one block): within a grid's second dimension.
    _launch_rank((blocks, -(-num_values // ROW_VALUES)),
                 (keys, ranks, table, positions, num_segments, num_values),
                 {"BLOCK": BLOCK, "CHUNK": CHUNK, "ROW_VALUES": ROW_VALUES},
                 num_warps=NUM_WARPS)
    tiles = {"VALUES": VALUES, "ROWS": ROWS, "ROWS_PER_PROGRAM": ROWS_PER_PROGRAM}
    _launch_totals((column_programs, row_programs),
                   (table, partials, tile_sums, num_values, blocks, row_programs), tiles,
                   num_warps=NUM_WARPS)
    _launch_starts((column_programs, row_programs),
                   (table, partials, tile_sums, offsets, num_values, blocks, row_programs),
                   {**tiles, "SUMS": SUMS}, num_warps=NUM_WARPS)
    _launch_place((blocks,), (keys, ranks, table, values, order, positions, num_segments,
                              num_values), {"BLOCK": BLOCK}, num_warps=NUM_WARPS)
    return values, order, offsets
