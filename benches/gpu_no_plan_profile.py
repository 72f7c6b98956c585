"""Where a call without a plan spends its host time on a GPU, op by op.

On an H200 (2026-11-27) ``gpu_call_cost.py`` timed ``index_add`` of 16384 rows x 64 into
2048 without a plan at check="off" (6 device ops, 53 us of them on the device) at 350-400 us
of host time to issue, against 50 with a plan; the same call with the device work stubbed
out takes about 55 us on a 2-core CPU. This script says where the difference goes. It first
times each case in turn, round by round (the cases in a shuffled order each round: that
host's times moved by 2x between runs), then prints for each case the functions taking the
most of its own host time (cProfile, by time spent in each) and torch's profiler's table of
the ops it ran (self CPU time, the CUDA kernels beside them; its row "Activity Buffer
Request" is the profiler's own start, counted in the first op's CPU total too). Cases: that
call at "off" and at "device", ``segment_sum`` of those rows over offsets at "device", and
the switch's Zipf-skewed ``index_add_`` (50000 rows x 256 into 32768, as
``bench_enable.test_enable_cuda`` times it: the switch on around the call); each made again
from its record (``detsum._replay``, from a signature's third call) and on its whole path.

    python benches/gpu_no_plan_profile.py [--device cuda] [--calls 50] [--rounds 15]

``--device cpu`` runs it on CPU tensors (Numba's path: a dry run of the script itself).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import time

import torch

import detsum
from bench_skew import ZIPF_EXPONENT, zipf_index


def _cases(device: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    t = {"mid_index": torch.randint(0, 2048, (16384,), generator=gen),
         "mid_src": torch.randn(16384, 64, generator=gen),
         "mid_init": torch.randn(2048, 64, generator=gen),
         "zipf": zipf_index(50_000, 32_768, ZIPF_EXPONENT, gen),
         "zipf_src": torch.randn(50_000, 256, generator=gen),
         "zipf_work": torch.zeros(32_768, 256),
         # 2048 segments of 8 rows each.
         "mid_offsets": torch.arange(0, 16385, 8)}
    t = {name: tensor.to(device) for name, tensor in t.items()}
    cases = {
        "index_add 16384x64 -> 2048, off": lambda: detsum.index_add(
            t["mid_init"], 0, t["mid_index"], t["mid_src"], check="off"),
        "index_add 16384x64 -> 2048, device": lambda: detsum.index_add(
            t["mid_init"], 0, t["mid_index"], t["mid_src"], check="device"),
        "segment_sum 16384x64 -> 2048 over offsets, device": lambda: detsum.segment_sum(
            t["mid_src"], t["mid_offsets"], check="device"),
        "switch: index_add_ zipf 50000x256 -> 32768": lambda: _switched(
            lambda: t["zipf_work"].index_add_(0, t["zipf"], t["zipf_src"])),
    }
    # Each on its whole path too: from a signature's third call, a call without a plan is
    # made again from its record (detsum._replay).
    for name, call in list(cases.items()):
        cases[f"{name}, whole path"] = lambda call=call: _whole_path(call)
    return cases


def _whole_path(call):
    replay = detsum._replay.REPLAY
    detsum._replay.REPLAY = False
    try:
        return call()
    finally:
        detsum._replay.REPLAY = replay


def _switched(call):
    with detsum.deterministic("fp32"):
        return call()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_rounds(cases: dict, device: str, calls: int, rounds: int) -> dict:
    """Per case, the medians over ``rounds`` of the host time to issue ``calls`` calls and to
    see them finish, in us a call; the cases take turns within each round, in a shuffled
    order, so that a change in the machine's load falls on all of them alike."""
    issue = {name: [] for name in cases}
    finish = {name: [] for name in cases}
    order = list(cases)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                cases[name]()
            issued = time.perf_counter()
            _sync(device)
            done = time.perf_counter()
            issue[name].append((issued - start) / calls * 1e6)
            finish[name].append((done - start) / calls * 1e6)
    return {name: (statistics.median(issue[name]), statistics.median(finish[name]))
            for name in cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}")
    cases = _cases(args.device)
    for call in cases.values():
        for _ in range(5):
            call()
    for name, (issued, finished) in _timed_rounds(cases, args.device, args.calls,
                                                  args.rounds).items():
        print(f"{name}: {issued:.1f} us a call to issue, {finished:.1f} to finish "
              f"(medians of {args.rounds} rounds of {args.calls} calls, the cases in turn)")
    for name, call in cases.items():
        print(f"\n=== {name}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            call()
        profile.disable()
        _sync(args.device)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(20):
                call()
            _sync(args.device)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                        max_name_column_width=48))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
