"""The spread of the distributed cases' times, interleaved: rank 0 times every call.

On a small shared CPU a step's time is bimodal (the ranks meet within a few tenths of a
millisecond, or one waits a scheduler time slice), so a median of a few rounds moves by a
millisecond between runs. This runs the cases of ``bench_distributed.py`` in alternating
blocks, with the same processes, and prints each case's 10th percentile, median, 90th
percentile and mean. Compare two versions by running it in a checkout of each, alternately.

    python benches/distributed_spread.py [--ranks 2] [--blocks 12] [--calls 25]
        [--cases ddp-step,exact-step,fp32-all_reduce/example,exact-all_reduce/example]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_distributed  # noqa: E402

WARMUP_CALLS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--calls", type=int, default=25, help="calls per block, the first "
                        f"{WARMUP_CALLS} untimed")
    parser.add_argument("--cases", default="ddp-step,exact-step,fp32-all_reduce/example,"
                                            "exact-all_reduce/example")
    args = parser.parse_args()
    cases = args.cases.split(",")
    torch.set_num_threads(1)
    group = bench_distributed._Group(args.ranks)
    times: dict[str, list[float]] = {case: [] for case in cases}
    try:
        for _ in range(args.blocks):
            for case in cases:
                fn, _ = group.case(case, args.calls)
                for call in range(args.calls):
                    start = time.perf_counter()
                    fn()
                    if call >= WARMUP_CALLS:
                        times[case].append((time.perf_counter() - start) * 1e3)
    finally:
        group.close()
    print(f"{args.ranks} ranks, rank 0's times in ms")
    for case, spent in times.items():
        deciles = statistics.quantiles(spent, n=10)
        print(f"{case:28s} n={len(spent)}  p10 {deciles[0]:.2f}  median "
              f"{statistics.median(spent):.2f}  p90 {deciles[-1]:.2f}  mean "
              f"{statistics.mean(spent):.2f}")


if __name__ == "__main__":
    main()
