"""segment_sum over CSR segments, plain and with a fused gather (perm), against torch.

200k rows of H=64 into 20k segments of random lengths. With ``perm`` detsum reads the rows in
permuted order without copying them; torch needs ``src[perm]`` first, which is timed with it.
"""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DEVICES, DTYPE_IDS, nbytes, run_case, skip_unsupported, sync
from detsum import measure

ROWS, SEGMENTS, H = 200_000, 20_000, 64
SAMPLE_ROWS = 32
DTYPES = [torch.bfloat16, torch.float32]
IMPLS = ["detsum-fp32", "detsum-kahan", "detsum-autograd", "torch-segment_reduce"]
ROUNDS = {"cpu": 11, "cuda": 200}
WARMUP = 2

_data: dict[tuple[str, torch.dtype], dict] = {}


def segment_data(device: str, dtype: torch.dtype) -> dict:
    key = (device, dtype)
    if key not in _data:
        gen = torch.Generator().manual_seed(2)
        seg_of_position = torch.randint(0, SEGMENTS, (ROWS,), generator=gen).sort().values
        counts = torch.bincount(seg_of_position, minlength=SEGMENTS)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        src = torch.randn(ROWS, H, generator=gen).to(dtype)
        perm = torch.randperm(ROWS, generator=gen)
        rows = torch.randperm(SEGMENTS, generator=gen)[:SAMPLE_ROWS].sort().values
        # Position p of segment s reads row p (plain) or perm[p] (gathered): as index_add terms,
        # source row r goes to seg_of_position[p] where p is r's position.
        seg_of_row = torch.empty_like(seg_of_position)
        seg_of_row[perm] = seg_of_position
        exact = {False: measure.exact_rows(src, seg_of_position, rows),
                 True: measure.exact_rows(src, seg_of_row, rows)}
        _data[key] = {"src": src.to(device), "offsets": offsets.to(device),
                      "perm": perm.to(device), "rows": rows, "exact": exact}
    return _data[key]


def _op(impl: str, d: dict, gathered: bool):
    src, offsets = d["src"], d["offsets"]
    perm = d["perm"] if gathered else None
    if impl == "torch-segment_reduce":
        if gathered:
            return lambda: torch.segment_reduce(src[perm], "sum", offsets=offsets)
        return lambda: torch.segment_reduce(src, "sum", offsets=offsets)
    mode = impl.removeprefix("detsum-")
    return lambda: detsum.segment_sum(src, offsets, perm=perm, mode=mode)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gathered", [False, True], ids=["plain", "perm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("device", DEVICES)
def test_segment_sum(benchmark, baselines, device, dtype, gathered, impl):
    kind = "perm" if gathered else "plain"
    benchmark.group = f"segment_sum {kind} {device} {DTYPE_IDS[dtype]}"
    d = segment_data(device, dtype)
    fn = _op(impl, d, gathered)
    out = skip_unsupported(fn)
    sync(device)
    moved = [d["src"], d["offsets"]] + ([d["perm"]] if gathered else [])
    info = {"primitive": f"segment_sum {kind}", "case": f"rows={ROWS} segments={SEGMENTS} H={H}",
            "device": device, "dtype": DTYPE_IDS[dtype], "impl": impl,
            # src read, output written, offsets (and perm) read
            "bytes": nbytes(*moved) + SEGMENTS * H * d["src"].element_size(),
            "max_ulps": measure.max_ulps(out, d["rows"], d["exact"][gathered]),
            "ulp_rows": SAMPLE_ROWS}
    del out
    case = f"test_segment_sum[{device}-{DTYPE_IDS[dtype]}-{kind}-torch-segment_reduce]"
    base_s = baselines.median(case, ("segment_reduce", kind, device, dtype),
                              _op("torch-segment_reduce", d, gathered), device,
                              reps=ROUNDS[device])
    run_case(benchmark, fn, device, rounds=ROUNDS[device], warmup_rounds=WARMUP, info=info,
             baseline="torch.segment_reduce" + ("(src[perm])" if gathered else ""),
             baseline_case=case, baseline_s=base_s)
