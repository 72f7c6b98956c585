"""A model, not a measurement: how long one ``_segment_kernel`` launch on the Zipf benchmark's
index takes with its chunk programs first or last (``detsum.kernels.triton.chunks.CHUNKS_FIRST``),
if every program's time were its dependent memory round trips.

Why a model: no GPU was at hand when the order changed; ``gpu_moe_profile.py --shape zipf``
measures both orders on one (rows "chunks last"). The model stands in until then and says
how large a difference to look for.

Assumptions (each one a simplification, stated so that a GPU run can correct it):

- The GPU starts a launch's programs in the order of their linear index (slot fastest, then
  column block: every slot of column block 0 before any of column block 1), each into the
  first of ``SMS * RESIDENT`` places to come free. 132 SMs (an H100 or H200); 16 programs an
  SM (four warps a program, 40 registers a thread: 12 by registers, 16 by the 64 warps).
- A program's time is ``L`` per dependent round trip to memory, and bandwidth is never the
  limit (a bandwidth-bound launch hides the order: then both orders take the same time).
  A whole segment of ``n <= CHUNK`` terms: its bounds, ``ceil(n / K)`` steps of the term
  loop (K rows in flight), its base row and its store: ``3 + ceil(n / K)`` trips; one whose
  chunk programs own it: 2. A chunk program: two binary searches of the segments' starts
  (``SEARCH_STEPS`` trips each; guided by the keys, a load of the key and one of its bounds
  instead, a second for a plan's index), its bounds, up to CHUNK terms, and 8 trips for the
  ticket and the fold when it owns a chunk.

    python benches/launch_order_model.py [--latency-us 1.0]

Prints, for bf16 (one column block of 1024 features) and fp32 (two), the modelled time of the
launch with the chunk programs last (the order before), first, and first with their segments
found from the keys (``GUIDED``).
"""

from __future__ import annotations

import argparse
import heapq

import torch

from bench_skew import ROWS, TABLE, ZIPF_EXPONENT, zipf_index

SMS, RESIDENT = 132, 16
K = 4  # rows in flight in the term loop (segment._TERM_STAGES - 1)
CHUNK = 256  # detsum.kernels.CHUNK_TERMS
SEARCH_STEPS = 16  # a binary search of 32768 + 1 segment starts
GUIDED_STEPS = 1  # the key of the position, then its two bounds at once


def makespan(durations: list[float]) -> float:
    """When the last program ends, programs started in list order into free places."""
    free = [0.0] * (SMS * RESIDENT)
    end = 0.0
    for duration in durations:
        start = heapq.heappop(free)
        heapq.heappush(free, start + duration)
        end = max(end, start + duration)
    return end


def programs(counts: list[int], positions: int, latency: float, search_steps: int
             ) -> tuple[list[float], list[float]]:
    """(the whole segments' programs' times, the chunk programs' times) of one column block,
    ``search_steps`` dependent loads to find a chunk's segment."""
    whole = [2 * latency if n > CHUNK else (3 + -(-n // K)) * latency for n in counts]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    long_segments = [(start, n) for start, n in zip(starts, counts) if n > CHUNK]
    chunk = []
    for e in range(-(-positions // CHUNK)):
        low = e * CHUNK
        for side in (0, 1):
            terms = 0
            for start, n in long_segments:
                if side == 0 and start <= low < start + n:
                    terms = min(CHUNK, start + n - low)
                if side == 1 and low < start < low + CHUNK:
                    terms = min(CHUNK, n)
            chunk.append((2 * search_steps + 2 + -(-terms // K) + (8 if terms else 0))
                         * latency)
    return whole, chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-us", type=float, default=1.0,
                        help="L, one dependent round trip to memory under load")
    args = parser.parse_args()
    index = zipf_index(ROWS, TABLE, ZIPF_EXPONENT, torch.Generator().manual_seed(0))
    counts = torch.bincount(index, minlength=TABLE).tolist()
    whole, chunk = programs(counts, ROWS, args.latency_us, SEARCH_STEPS)
    _, guided = programs(counts, ROWS, args.latency_us, GUIDED_STEPS)
    print(f"Zipf index: {ROWS} rows into {TABLE}, {sum(n > CHUNK for n in counts)} segments "
          f"longer than a chunk; per column block {len(whole)} whole-segment and "
          f"{len(chunk)} chunk programs, the longest {max(chunk):.0f} us, guided "
          f"{max(guided):.0f} us (L = {args.latency_us} us)")
    for name, blocks in (("bf16, 1 column block", 1), ("fp32, 2 column blocks", 2)):
        last = makespan((whole + chunk) * blocks)
        first = makespan((chunk + whole) * blocks)
        first_guided = makespan((guided + whole) * blocks)
        print(f"{name}: chunk programs last {last:.0f} us, first {first:.0f} us "
              f"({first / last:.2f}), first and guided {first_guided:.0f} us "
              f"({first_guided / last:.2f})")


if __name__ == "__main__":
    main()
