"""index_add_ with a Zipf-skewed index: an embedding-table gradient, where a few rows are hot.

50k source rows (tokens) of H=1024 features add into a 32k-row table; token ids follow a
Zipf law (exponent 1.1), so the hottest row receives about a tenth of all rows. One program
per output row would serialise on that row: the "fp32" and "kahan" modes split it into
chunks of ``detsum.kernels.CHUNK_TERMS`` terms (part of their canonical order), "autograd"
keeps torch's serial order as torch does. Baseline: torch.index_add_.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    DEVICES, DTYPE_IDS, index_add_impl, nbytes, run_case, skip_unsupported, sync)
from detsum import measure

ROWS, TABLE, H = 50_000, 32_768, 1024
ZIPF_EXPONENT = 1.1
SAMPLE_ROWS = 16
DTYPES = [torch.bfloat16, torch.float32]
IMPLS = ["detsum-fp32", "detsum-kahan", "detsum-autograd", "torch-index_add_",
         "torch-index_put_"]
ROUNDS = {"cpu": 11, "cuda": 100}
WARMUP = 2

_data: dict[tuple[str, torch.dtype], dict] = {}


def zipf_index(n: int, table: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """n draws of row r with probability proportional to 1 / (r + 1)**exponent."""
    weights = 1.0 / torch.arange(1, table + 1, dtype=torch.float64) ** exponent
    return torch.multinomial(weights, n, replacement=True, generator=gen)


def skew_data(device: str, dtype: torch.dtype) -> dict:
    key = (device, dtype)
    if key not in _data:
        gen = torch.Generator().manual_seed(2)
        index = zipf_index(ROWS, TABLE, ZIPF_EXPONENT, gen)
        source = torch.randn(ROWS, H, generator=gen).to(dtype)
        init = torch.randn(TABLE, H, generator=gen).to(dtype)
        # The hottest rows and some cold ones.
        rows = torch.cat([torch.arange(SAMPLE_ROWS // 2),
                          torch.unique(index)[-SAMPLE_ROWS // 2:]]).sort().values
        exact = measure.exact_rows(source, index, rows, init)
        _data[key] = {"index": index.to(device), "source": source.to(device),
                      "init": init.to(device), "rows": rows, "exact": exact,
                      "hottest_share": float(torch.bincount(index).max()) / ROWS}
    return _data[key]


def _op(impl: str, work: torch.Tensor, d: dict):
    return index_add_impl(impl, work, d["index"], d["source"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("device", DEVICES)
def test_index_add_zipf(benchmark, baselines, device, dtype, impl):
    benchmark.group = f"index_add zipf {device} {DTYPE_IDS[dtype]}"
    d = skew_data(device, dtype)
    out = d["init"].clone()
    skip_unsupported(_op(impl, out, d))
    sync(device)
    info = {"primitive": "index_add", "case": f"zipf rows={ROWS} table={TABLE} H={H}",
            "device": device, "dtype": DTYPE_IDS[dtype], "impl": impl,
            "hottest_row_share": d["hottest_share"],
            "bytes": nbytes(d["source"], d["init"], d["init"], d["index"]),
            "max_ulps": measure.max_ulps(out, d["rows"], d["exact"]), "ulp_rows": SAMPLE_ROWS}
    del out
    case = f"test_index_add_zipf[{device}-{DTYPE_IDS[dtype]}-torch-index_add_]"
    work = d["init"].clone()
    base_s = baselines.median(case, ("zipf", device, dtype), _op("torch-index_add_", work, d),
                              device, reps=ROUNDS[device])
    run_case(benchmark, _op(impl, d["init"].clone(), d), device, rounds=ROUNDS[device],
             warmup_rounds=WARMUP, info=info, baseline="torch.Tensor.index_add_",
             baseline_case=case, baseline_s=base_s)
