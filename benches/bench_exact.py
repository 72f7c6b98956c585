"""mode="exact" beside "fp32" (and torch's index_add_) on the MoE and GNN shapes, in one run.

- MoE permute backward: [T * topk, H] rows into [T, H], T=16384, topk=8, H=1024 (every token
  receives 8 rows from anywhere in the source).
- GNN aggregation: 1M edge rows into 100k node rows, H=64, uniformly random destinations
  (about 10 rows per node).

Both as ``index_add_`` into the previous result, as in backward. Targets (reported by
``summarize.py``, never asserted): on CPU "exact" within 1.5x of "fp32" for bf16 and fp16 data
and within 2x for fp32 and fp64 data; on a GPU within 1.3x of torch's atomic ``index_add_``.
``max_ulps`` is the largest distance from the correctly rounded sum on 32 sampled rows: 0 for
"exact" by construction, and the test suite checks it everywhere.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, DTYPE_IDS, index_add_impl, nbytes, run_case, skip_unsupported, sync
from detsum import measure

SHAPES = {
    # name: (output rows, rows per output row, hidden size)
    "moe": (16384, 8, 1024),
    "gnn": (100_000, 10, 64),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
IMPLS = ["detsum-fp32", "detsum-exact", "torch-index_add_"]
SAMPLE_ROWS = 32
ROUNDS = {"cpu": 10, "cuda": 100}
WARMUP = 2

_data: dict[tuple, dict] = {}


def shape_data(shape: str, device: str, dtype: torch.dtype) -> dict:
    key = (shape, device, dtype)
    if key not in _data:
        rows, per_row, hidden = SHAPES[shape]
        gen = torch.Generator().manual_seed(1)
        if shape == "moe":
            # Rows sorted by expert, as a MoE layer's permute leaves them.
            index = torch.randint(0, 64, (rows, per_row), generator=gen).view(-1).argsort(
                stable=True) // per_row
        else:
            index = torch.randint(0, rows, (rows * per_row,), generator=gen)
        source = torch.randn(rows * per_row, hidden, generator=gen).to(dtype)
        init = torch.randn(rows, hidden, generator=gen).to(dtype)
        sampled = torch.randperm(rows, generator=gen)[:SAMPLE_ROWS].sort().values
        _data[key] = {"index": index.to(device), "source": source.to(device),
                      "init": init.to(device), "rows": sampled,
                      "exact": measure.exact_rows(source, index, sampled, init)}
    return _data[key]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("device", DEVICES)
def test_exact_index_add(benchmark, device, shape, dtype, impl):
    benchmark.group = f"exact {shape} {device} {DTYPE_IDS[dtype]}"
    d = shape_data(shape, device, dtype)
    out = d["init"].clone()
    skip_unsupported(index_add_impl(impl, out, d["index"], d["source"]))
    sync(device)
    rows, per_row, hidden = SHAPES[shape]
    info = {"primitive": "index_add", "case": f"exact-{shape} rows={rows} x{per_row} H={hidden}",
            "device": device, "dtype": DTYPE_IDS[dtype], "impl": impl,
            "bytes": nbytes(d["source"], d["init"], d["init"], d["index"]),
            "max_ulps": measure.max_ulps(out, d["rows"], d["exact"]), "ulp_rows": SAMPLE_ROWS}
    del out
    work = d["init"].clone()
    run_case(benchmark, index_add_impl(impl, work, d["index"], d["source"]), device,
             rounds=ROUNDS[device], warmup_rounds=WARMUP, info=info)
