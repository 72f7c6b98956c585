"""Where the MoE backward's time goes on a GPU: ``index_add_`` of 131072 rows of 4096 into 16384
(each token receives 8 rows), bf16 and fp32, "fp32" mode, by the parts of the call.

Rows (median of CUDA-event times over ``--reps`` calls after a warm-up, each into the same
output): the copy of the source (the bandwidth yardstick: bytes read plus written), torch's
``index_add_`` (atomics), detsum's call without a plan at "host" and "off", the sort of the
index alone, and the call with a plan (one launch, the kernel alone); every detsum row's
result equal to the others' (``torch.equal``), so the parts are the same computation. GB/s
counts what the call must move: the source once, the output read and written, the index.

With ``--only plan`` (or ``off``) the script runs that row alone, a few times: the form
``ncu`` profiles (``bash benches/gpu_run.sh profile``). ``--shape zipf`` takes the same rows
on ``bench_skew.py``'s index instead (50k rows of 1024 into 32k, Zipf-skewed: a tenth of the
rows on the hottest one), the shape where the call without a plan is furthest from torch's
atomics. The rows "chunks last" launch the chunk programs of long segments after the whole
segments' (``chunks.CHUNKS_FIRST`` off, the order before): on the Zipf index, what starting
them first gains; the rows "unguided" have the chunk programs search the segments' bounds
rather than read their keys (``chunks.GUIDED_CHUNKS`` off). The row "sort by segment" is
the sort the call without a plan makes (``kernels.sort_by_segment``: by counting,
``triton.counting_sort``), "sort by segment, torch's" the sort before it (the index clamped
and cast to int16 here, int32 for the Zipf table, then sorted by torch), and the rows
"detsum off, torch's sort" and "detsum off, torch's keys" the call with the index sorted
those ways and as it is (int64): what the counting and the narrow keys gain. ``--shape wide``
takes 4608 rows of 256 into 900,000 (an embedding's gradient of a few tokens into a large
vocabulary: a table of 9 blocks by 900,002 values), where the row "sort by segment, a
program a row" ranks each block's row in one program (``counting_sort.ROW_VALUES`` past the
row's width, the layout before the row was split among programs: 3.6 MB of zeros each).

    python3 benches/gpu_moe_profile.py [--json PATH] [--reps 30] [--only plan|off]
                                       [--shape moe|zipf|wide]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import detsum
from detsum import kernels
from detsum.kernels.triton import chunks

TOKENS, TOPK, HIDDEN = 16384, 8, 4096
WIDE_ROWS, WIDE_TABLE, WIDE_HIDDEN = 4608, 900_000, 256


def _data(dtype: torch.dtype, shape: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    if shape == "zipf":
        from bench_skew import H, ROWS, TABLE, ZIPF_EXPONENT, zipf_index
        index, rows, table, hidden = zipf_index(ROWS, TABLE, ZIPF_EXPONENT, gen), ROWS, TABLE, H
    elif shape == "wide":
        rows, table, hidden = WIDE_ROWS, WIDE_TABLE, WIDE_HIDDEN
        index = torch.randint(0, table, (rows,), generator=gen)
    else:
        gather_indices = torch.randint(0, 64, (TOKENS, TOPK), generator=gen).view(-1).argsort(
            stable=True)
        index, rows, table, hidden = gather_indices // TOPK, TOKENS * TOPK, TOKENS, HIDDEN
    index = index.cuda()
    return {"index": index, "source": torch.randn(rows, hidden, generator=gen)
            .to("cuda", dtype), "init": torch.randn(table, hidden, generator=gen)
            .to("cuda", dtype), "plan": detsum.plan(index, table)}


def _with_setting(module, name: str, value, call):
    """``call`` with ``module.name`` set to ``value`` while it runs, then set back."""
    def called():
        before = getattr(module, name)
        setattr(module, name, value)
        try:
            return call()
        finally:
            setattr(module, name, before)
    return called


def _chunks_last(call):
    """``call`` with the launch's chunk programs after the whole segments' (the order before
    ``chunks.CHUNKS_FIRST``): the same bits, another order of the programs."""
    return _with_setting(chunks, "CHUNKS_FIRST", False, call)


def _unguided(call):
    """``call`` with the chunk programs searching the segments' bounds rather than reading
    their keys (``chunks.GUIDED_CHUNKS`` off): the same bits, other loads."""
    return _with_setting(chunks, "GUIDED_CHUNKS", False, call)


def narrowed_torch_sort(call):
    """``call`` with its index sorted by torch's sort of the narrowed keys, not by counting
    (``triton.counting_sort.MAX_TABLE_CELLS`` 0: no table is small enough): the same bits."""
    from detsum.kernels.triton import counting_sort

    return _with_setting(counting_sort, "MAX_TABLE_CELLS", 0, call)


def _a_program_a_row(call):
    """``call`` with each block's row of the counting sort's table ranked by one program
    (``triton.counting_sort.ROW_VALUES`` past any row): the same bits."""
    from detsum.kernels.triton import counting_sort

    return _with_setting(counting_sort, "ROW_VALUES", 2**30, call)


def torch_keys(call):
    """``call`` with its index sorted as it is, not narrowed (``kernels.NARROW_SORT_ABOVE``
    past any index): the same bits, a sort of wider keys."""
    return _with_setting(kernels, "NARROW_SORT_ABOVE", 2**62, call)


def whole_path(call):
    """``call`` with ``detsum.plans.LAUNCH_AGAIN`` off: a call with a plan takes its whole
    path rather than make its last launch again (the same bits, more host time)."""
    return _with_setting(detsum.plans, "LAUNCH_AGAIN", False, call)


def _calls(d: dict, out: torch.Tensor) -> dict:
    index, source, plan = d["index"], d["source"], d["plan"]
    copy_target = torch.empty_like(source)
    # Would a sort of narrower keys (half or a quarter of the radix passes) pay?
    index32, index16 = index.to(torch.int32), index.to(torch.int16)
    calls = {
        "copy": lambda: copy_target.copy_(source),
        "torch index_add_": lambda: out.index_add_(0, index, source),
        "sort of the index": lambda: torch.sort(index, stable=True),
        "sort, int32 keys": lambda: torch.sort(index32, stable=True),
        "sort, int16 keys": lambda: torch.sort(index16, stable=True),
        "sort by segment": lambda: kernels.sort_by_segment(index, out.shape[0]),
        "sort by segment, torch's": narrowed_torch_sort(
            lambda: kernels.sort_by_segment(index, out.shape[0])),
        "sort by segment, a program a row": _a_program_a_row(
            lambda: kernels.sort_by_segment(index, out.shape[0])),
        "detsum host": lambda: detsum.index_add_(out, 0, index, source),
        "detsum off": lambda: detsum.index_add_(out, 0, index, source, check="off"),
        "detsum plan": lambda: detsum.index_add_(out, 0, index, source, plan=plan),
    }
    calls["detsum off, chunks last"] = _chunks_last(calls["detsum off"])
    calls["detsum plan, chunks last"] = _chunks_last(calls["detsum plan"])
    calls["detsum off, unguided"] = _unguided(calls["detsum off"])
    calls["detsum plan, unguided"] = _unguided(calls["detsum plan"])
    calls["detsum off, torch's sort"] = narrowed_torch_sort(calls["detsum off"])
    calls["detsum off, torch's keys"] = torch_keys(calls["detsum off"])
    return calls


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--only", choices=["plan", "off"])
    parser.add_argument("--shape", choices=["moe", "zipf", "wide"], default="moe")
    args = parser.parse_args(argv)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        d = _data(dtype, args.shape)
        if args.only:
            out = d["init"].clone()
            call = _calls(d, out)[f"detsum {args.only}"]
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            continue
        results = {}
        for name, fn in _calls(d, d["init"].clone()).items():
            if name.startswith("detsum"):
                out = d["init"].clone()  # one call's result, for the bits
                _calls(d, out)[name]()
                results[name] = out
            moved = (2 * d["source"].nbytes if name == "copy" else
                     d["index"].nbytes if name.startswith("sort") else
                     d["source"].nbytes + 2 * d["init"].nbytes + d["index"].nbytes)
            ms = _median_ms(fn, args.reps)
            rows.append({"dtype": str(dtype), "call": name, "ms": ms, "gb_per_s": moved / ms / 1e6})
        first, *others = results.values()
        same = all(torch.equal(first, other) for other in others)
        copy = next(r for r in rows if r["call"] == "copy" and r["dtype"] == str(dtype))
        for r in rows:
            if r["dtype"] == str(dtype):
                r["of_copy"] = r["gb_per_s"] / copy["gb_per_s"]
                r["same_bits"] = same
    if args.only:
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape}; "
          f"median of {args.reps}")
    print(f"{'dtype':15} {'call':32} {'ms':>8} {'GB/s':>8} {'of copy':>8} same bits")
    for r in rows:
        print(f"{r['dtype']:15} {r['call']:32} {r['ms']:8.3f} {r['gb_per_s']:8.0f} "
              f"{r['of_copy']:8.2f} {r['same_bits']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "shape": args.shape, "reps": args.reps, "rows": rows}, f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
