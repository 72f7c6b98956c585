"""Per-call overhead: each primitive on a tiny input, where nearly all time is dispatch.

What a call costs before any data moves: argument checks, the torch.library custom op, the
segment plan and the kernel launch. Compared with the matching torch op on the same input.
"""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DEVICES, run_case, skip_unsupported

N_SRC, N_OUT, H = 16, 4, 8
ROUNDS = 200
ITERATIONS = 10  # calls per round: a round of one call would be timer resolution


def _ops(device: str) -> dict:
    gen = torch.Generator().manual_seed(3)
    index = torch.randint(0, N_OUT, (N_SRC,), generator=gen).to(device)
    src = torch.randn(N_SRC, H, generator=gen).to(device)
    init = torch.randn(N_OUT, H, generator=gen).to(device)
    offsets = torch.tensor([0, 4, 8, 12, 16], device=device)
    index2 = index.view(-1, 1).expand(-1, H)
    return {
        "detsum.index_add": lambda: detsum.index_add(init, 0, index, src),
        "torch.index_add": lambda: torch.index_add(init, 0, index, src),
        "detsum.scatter_reduce": lambda: detsum.scatter_reduce(init, 0, index, src, "sum"),
        "torch.scatter_reduce": lambda: torch.scatter_reduce(init, 0, index2, src, "sum"),
        "detsum.segment_sum": lambda: detsum.segment_sum(src, offsets),
        "torch.segment_reduce": lambda: torch.segment_reduce(src, "sum", offsets=offsets),
    }


OPS = list(_ops("cpu"))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", DEVICES)
def test_dispatch(benchmark, device, op):
    benchmark.group = f"dispatch {device}"
    fn = _ops(device)[op]
    skip_unsupported(fn)
    info = {"primitive": "dispatch", "case": f"{N_SRC}x{H} -> {N_OUT}x{H} fp32",
            "device": device, "dtype": "fp32", "impl": op, "max_ulps": None}
    run_case(benchmark, fn, device, rounds=ROUNDS, warmup_rounds=5, info=info,
             iterations=ITERATIONS)
