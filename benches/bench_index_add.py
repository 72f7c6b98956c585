"""index_add_ on the MoE permute-backward shape, against torch's index_add_ and index_put_.

A mixture-of-experts layer with T tokens and top-k routing gathers ``x[gather_indices // k]``
(rows sorted by expert) in forward; backward adds the [T * k, H] gradient rows back into the
[T, H] token rows: every token receives exactly k rows, scattered over the whole source.
``torch.Tensor.index_put_((index,), source, accumulate=True)`` is what autograd runs there;
``torch.Tensor.index_add_`` is the fast, order-dependent alternative.

Targets (reported, not asserted; ``summarize.py`` checks them): on CPU "fp32" and "autograd" no
slower than torch.index_add_, "autograd" at least 5x faster than index_put_(accumulate=True),
"kahan" within 1.5x of "fp32"; on a GPU (H=4096) "fp32" and "autograd" within 1.1x of
index_add_ and at 80% of the copy bandwidth or more, "kahan" within 1.2x of "fp32".
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    DEVICES, DTYPE_IDS, index_add_impl, nbytes, run_case, skip_unsupported, sync)
from detsum import measure

T, TOPK = 16384, 8
# Hidden size: the GPU issue's shape on CUDA; a quarter of it on the 2-core CPU.
HIDDEN = {"cpu": 1024, "cuda": 4096}
N_EXPERTS = 64
SAMPLE_ROWS = 32
DTYPES = [torch.bfloat16, torch.float32]
# "detsum-fp32-plan": the same call given a plan of the index (no sort, no check in the
# call), as detsum.moe's backward runs.
IMPLS = ["detsum-fp32", "detsum-fp32-plan", "detsum-kahan", "detsum-autograd",
         "torch-index_add_", "torch-index_put_"]

# Rounds per case: each call moves ~0.4-0.8 GB, 50-150 ms on a 2-core CPU; torch's CPU
# index_put_(accumulate=True) takes 0.3 s (bf16, serial) to 1.2 s (fp32, atomics).
ROUNDS = {"cpu": 15, "cuda": 100}
SLOW_ROUNDS = {"cpu": 5, "cuda": 50}
WARMUP = 2

_data: dict[tuple[str, torch.dtype], dict] = {}


def moe_data(device: str, dtype: torch.dtype) -> dict:
    """Index, source, input and the exact sums of SAMPLE_ROWS output rows (computed once)."""
    key = (device, dtype)
    if key not in _data:
        gen = torch.Generator().manual_seed(0)
        # Stable: the same permutation on every device and thread count.
        gather_indices = torch.randint(0, N_EXPERTS, (T, TOPK), generator=gen).view(-1).argsort(
            stable=True)
        index = gather_indices // TOPK
        source = torch.randn(T * TOPK, HIDDEN[device], generator=gen).to(dtype)
        init = torch.randn(T, HIDDEN[device], generator=gen).to(dtype)
        rows = torch.randperm(T, generator=gen)[:SAMPLE_ROWS].sort().values
        exact = measure.exact_rows(source, index, rows, init)
        _data[key] = {"index": index.to(device), "source": source.to(device),
                      "init": init.to(device), "rows": rows, "exact": exact}
    return _data[key]


def _op(impl: str, work: torch.Tensor, d: dict):
    return index_add_impl(impl, work, d["index"], d["source"])


def _info(device: str, dtype: torch.dtype, d: dict) -> dict:
    return {"primitive": "index_add", "case": f"moe T={T} topk={TOPK} H={HIDDEN[device]}",
            "device": device, "dtype": DTYPE_IDS[dtype],
            # source read + input read + output written + index read
            "bytes": nbytes(d["source"], d["init"], d["init"], d["index"])}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("device", DEVICES)
def test_index_add_moe(benchmark, baselines, device, dtype, impl):
    benchmark.group = f"index_add moe {device} {DTYPE_IDS[dtype]}"
    d = moe_data(device, dtype)
    # Error on a fresh copy of input; this first call also compiles (Numba) or warms up.
    out = d["init"].clone()
    skip_unsupported(_op(impl, out, d))
    sync(device)
    info = _info(device, dtype, d)
    info.update(impl=impl, max_ulps=measure.max_ulps(out, d["rows"], d["exact"]),
                ulp_rows=SAMPLE_ROWS)
    del out
    # In place, as in backward: each round adds into the result of the previous one (values
    # grow like sqrt(rounds), far from overflow; speed does not depend on them).
    work = d["init"].clone()
    rounds = SLOW_ROUNDS[device] if impl == "torch-index_put_" else ROUNDS[device]
    run_case(benchmark, _op(impl, work, d), device, rounds=rounds, warmup_rounds=WARMUP,
             info=info, **_baseline(baselines, device, dtype, d))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("device", DEVICES)
def test_copy_yardstick(benchmark, baselines, device, dtype):
    """``dst.copy_(source)``: what reading and writing the source once costs on this device."""
    benchmark.group = f"index_add moe {device} {DTYPE_IDS[dtype]}"
    d = moe_data(device, dtype)
    src = d["source"]
    dst = torch.empty_like(src)
    info = {"primitive": "copy", "case": f"copy [{T * TOPK}, {HIDDEN[device]}]", "device": device,
            "dtype": DTYPE_IDS[dtype], "impl": "torch-copy_", "bytes": 2 * nbytes(src),
            "max_ulps": None}
    run_case(benchmark, lambda: dst.copy_(src), device, rounds=ROUNDS[device],
             warmup_rounds=WARMUP, info=info, **_baseline(baselines, device, dtype, d))


def _baseline(baselines, device: str, dtype: torch.dtype, d: dict) -> dict:
    """torch.index_add_ as the baseline: its case in this run, or else timed once here."""
    case = f"test_index_add_moe[{device}-{DTYPE_IDS[dtype]}-torch-index_add_]"
    work = d["init"].clone()
    seconds = baselines.median(case, ("index_add_", device, dtype),
                               _op("torch-index_add_", work, d), device, reps=ROUNDS[device])
    return {"baseline": "torch.Tensor.index_add_", "baseline_case": case, "baseline_s": seconds}
