"""A stable sort of segment keys by counting, in two launches and two torch ops, for a GPU,
and the offsets of the sorted keys with it.

``kernels.sort_by_segment`` sorts an index by the segment each key names, keys clamped into
``[-1, num_segments]``: there are at most ``num_segments + 2`` distinct values, so the sort is
a counting sort. Positions go in blocks of ``BLOCK``. For each block and each value, the
number of the block's keys with that value lands in a table, value-major (cell
``value * blocks + block``); a running sum of the table (``torch.cumsum``) then holds, at each
cell, how many keys sort before that block's keys of that value plus how many there are; and
each key's place is that cell's start plus its rank among the block's equal keys before it.
Equal keys so keep the order of their positions: the order and values are those of
``torch.sort(clamped_keys, stable=True)``, bit for bit (the stable order is unique), by
integer counts alone.

The placing launch also writes the offsets of the sorted keys (``offsets[s]``, the keys
below ``s``: the running sum's end of value ``s``'s last block), which the reduction then
takes rather than search the values for them. On a GPU that is the table's fill, the ranking
launch, the running sum (one or two CUB launches) and the placing launch, where torch's
radix sort of the same keys (CUB's onesweep sort) makes 8 launches for int16 keys and 12 for
int32, after the clamp and the cast to them that this sort does not need, and a search
launch after it. A block's ranks come from comparing each key with the block's
keys, ``CHUNK`` of them at a time (``BLOCK * BLOCK`` comparisons a block, no sort inside the
block, no atomics): the table has ``(num_segments + 2) * ceil(n / BLOCK)`` cells, so larger
blocks mean a smaller table and more comparisons. ``takes`` says where the table stays
within ``MAX_TABLE_CELLS``; elsewhere (a GNN's 100k-row table of a million edges, say) the
caller sorts with torch.
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
#: The most cells of the table (int32: 32 MiB): its fill and running sum move it twice.
MAX_TABLE_CELLS = 1 << 23
#: Warps a program of either launch runs on (4: each thread ranks 4 of a block's keys).
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
def _rank_kernel(keys_ptr, ranks_ptr, table_ptr, positions, num_segments, blocks,
                 BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Block ``b``: each key's rank among the block's equal keys before it (``ranks``), and at
    the first of each value the block's count of it (``table[value * blocks + b]``)."""
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    at = b.to(tl.int64) * BLOCK + j
    valid = at < positions
    value = _value(keys_ptr, at, valid, num_segments, -1)
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
    tl.store(ranks_ptr + at, rank, mask=valid)
    tl.store(table_ptr + value.to(tl.int64) * blocks + b, count, mask=valid & (rank == 0))


@triton.jit
def _place_kernel(keys_ptr, ranks_ptr, table_ptr, ends_ptr, values_ptr, order_ptr, offsets_ptr,
                  positions, num_segments, blocks, BLOCK: tl.constexpr):
    """Block ``b``: each key's place, its cell's start (the running sum's ``ends`` less the
    cell's count) plus its rank; there the key's position (``order``) and its clamped value
    (``values``). And, the programs taking turns, the offsets those values stand for:
    ``offsets[s]``, the number of keys below ``s``, is the running sum's end of the last
    block's cell of value ``s`` (that of the key ``s - 1``)."""
    b = tl.program_id(0)
    at = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = at < positions
    value = _value(keys_ptr, at, valid, num_segments, 0)
    cell = value.to(tl.int64) * blocks + b
    start = (tl.load(ends_ptr + cell, mask=valid, other=0)
             - tl.load(table_ptr + cell, mask=valid, other=0))
    place = start + tl.load(ranks_ptr + at, mask=valid, other=0)
    tl.store(order_ptr + place, at, mask=valid)
    tl.store(values_ptr + place, (value - 1).to(values_ptr.dtype.element_ty), mask=valid)
    for first in range(b.to(tl.int64) * BLOCK, num_segments + 1, blocks * BLOCK):
        s = first + tl.arange(0, BLOCK)
        ends = tl.load(ends_ptr + (s + 1) * blocks - 1, mask=s <= num_segments, other=0)
        tl.store(offsets_ptr + s, ends.to(tl.int64), mask=s <= num_segments)


_launch_rank = Kernel(_rank_kernel)
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
    blocks = -(-positions // BLOCK)
    table = torch.zeros((num_segments + 2) * blocks, dtype=torch.int32, device=keys.device)
    ranks = torch.empty(positions, dtype=torch.int32, device=keys.device)
    _launch_rank((blocks,), (keys, ranks, table, positions, num_segments, blocks),
                 {"BLOCK": BLOCK, "CHUNK": CHUNK}, num_warps=NUM_WARPS)
    ends = torch.cumsum(table, 0, dtype=torch.int32)
    values = torch.empty(positions, dtype=values_dtype, device=keys.device)
    order = torch.empty(positions, dtype=torch.int64, device=keys.device)
    offsets = torch.empty(num_segments + 1, dtype=torch.int64, device=keys.device)
    _launch_place((blocks,), (keys, ranks, table, ends, values, order, offsets, positions,
                              num_segments, blocks), {"BLOCK": BLOCK}, num_warps=NUM_WARPS)
    return values, order, offsets
