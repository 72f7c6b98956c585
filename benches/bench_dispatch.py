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


#: The speed issue's small call: 256 rows of 64 added in place into 64 rows (target: detsum's
#: ``index_add_`` within 2x of torch's).
SMALL_SRC, SMALL_OUT, SMALL_H = 256, 64, 64


@pytest.mark.parametrize("impl", ["detsum.index_add_", "torch.index_add_"])
@pytest.mark.parametrize("device", DEVICES)
def test_small_index_add_(benchmark, device, impl):
    gen = torch.Generator().manual_seed(4)
    index = torch.randint(0, SMALL_OUT, (SMALL_SRC,), generator=gen).to(device)
    src = torch.randn(SMALL_SRC, SMALL_H, generator=gen).to(device)
    # Added into over and over: the values grow, the cost does not.
    work = torch.randn(SMALL_OUT, SMALL_H, generator=gen).to(device)
    if impl == "detsum.index_add_":
        def fn():
            return detsum.index_add_(work, 0, index, src)
    else:
        def fn():
            return work.index_add_(0, index, src)
    benchmark.group = f"small index_add_ {device}"
    info = {"primitive": "small index_add_",
            "case": f"{SMALL_SRC}x{SMALL_H} -> {SMALL_OUT}x{SMALL_H} fp32", "device": device,
            "dtype": "fp32", "impl": impl, "max_ulps": None}
    run_case(benchmark, fn, device, rounds=ROUNDS, warmup_rounds=5, info=info,
             iterations=ITERATIONS, baseline="torch.index_add_",
             baseline_case=f"test_small_index_add_[{device}-torch.index_add_]")


#: A training step's call: forward and backward, the source requiring grad (autograd records
#: the call), with and without a plan, against torch's own ``index_add`` the same way.
TRAINING_IMPLS = ["detsum.index_add", "detsum.index_add plan", "torch.index_add"]


@pytest.mark.parametrize("impl", TRAINING_IMPLS)
@pytest.mark.parametrize("device", DEVICES)
def test_training_call(benchmark, device, impl):
    gen = torch.Generator().manual_seed(5)
    index = torch.randint(0, SMALL_OUT, (SMALL_SRC,), generator=gen).to(device)
    src = torch.randn(SMALL_SRC, SMALL_H, generator=gen).to(device).requires_grad_()
    init = torch.randn(SMALL_OUT, SMALL_H, generator=gen).to(device)
    grad = torch.randn(SMALL_OUT, SMALL_H, generator=gen).to(device)
    plan = detsum.plan(index, SMALL_OUT) if impl.endswith("plan") else None
    if impl.startswith("detsum"):
        def fn():
            detsum.index_add(init, 0, index, src, plan=plan).backward(grad)
    else:
        def fn():
            torch.index_add(init, 0, index, src).backward(grad)
    benchmark.group = f"training call {device}"
    info = {"primitive": "training call",
            "case": f"{SMALL_SRC}x{SMALL_H} -> {SMALL_OUT}x{SMALL_H} fp32, forward and backward",
            "device": device, "dtype": "fp32", "impl": impl, "max_ulps": None}
    run_case(benchmark, fn, device, rounds=ROUNDS, warmup_rounds=5, info=info,
             iterations=ITERATIONS, baseline="torch.index_add",
             baseline_case=f"test_training_call[{device}-torch.index_add]")
