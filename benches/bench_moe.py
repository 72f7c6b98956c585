"""detsum.moe permute / unpermute against the naive torch composition, forward and backward.

T=16384 tokens, top-8 routing over 64 experts, bf16; H=4096 on CUDA (the MoE issue's shape),
H=1024 on the 2-core CPU. The naive composition is what a user writes without detsum:
``x[gather_indices // topk]`` with autograd's backward for permute, ``index_copy`` then
``(u.view(T, topk, H) * weights[..., None]).sum(1)`` for unpermute.

Phases: "permute_bwd" (the backward alone, on a kept graph) and "unpermute_fwd" (no grad) are
the two that the GPU targets name (>= 80% of copy bandwidth, >= 5x faster than the naive
composition); "permute" and "unpermute" time forward plus backward.
Ratios: against the naive composition's case of the same phase (``baseline_case``).
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, nbytes, run_case, sync
from detsum import moe

T, TOPK, N_EXPERTS = 16384, 8, 64
HIDDEN = {"cpu": 1024, "cuda": 4096}
DTYPE = torch.bfloat16
IMPLS = ["detsum-fp32", "detsum-kahan", "detsum-autograd", "torch-naive"]
PHASES = ["permute", "permute_bwd", "unpermute", "unpermute_fwd"]
ROUNDS = {"cpu": 5, "cuda": 50}
WARMUP = 1

_data: dict[str, dict] = {}


def moe_data(device: str) -> dict:
    if device not in _data:
        gen = torch.Generator().manual_seed(3)
        h = HIDDEN[device]
        selected = torch.randint(0, N_EXPERTS, (T, TOPK), generator=gen)
        gather_indices, _ = moe.route(selected, N_EXPERTS)
        to = lambda t: t.to(device)  # noqa: E731
        _data[device] = {
            # A copy, on every device: route's own tensor would pass as its Routing, unchecked,
            # and the timings are those of an index checked and inverted by each call.
            "gather_indices": to(gather_indices).clone(),
            "x": to(torch.randn(T, h, generator=gen).to(DTYPE)),
            "y": to(torch.randn(T * TOPK, h, generator=gen).to(DTYPE)),
            "weights": to(torch.softmax(torch.randn(T, TOPK, generator=gen), -1).to(DTYPE)),
            "grad_y": to(torch.randn(T * TOPK, h, generator=gen).to(DTYPE)),
            "grad_out": to(torch.randn(T, h, generator=gen).to(DTYPE)),
        }
    return _data[device]


def naive_unpermute(y, gather_indices, weights):
    u = torch.empty_like(y).index_copy(0, gather_indices, y)
    return (u.view(T, TOPK, -1) * weights[..., None]).sum(1)


def _fn(phase: str, impl: str, d: dict):
    g = d["gather_indices"]
    mode = impl.removeprefix("detsum-")
    naive = impl == "torch-naive"
    if phase.startswith("permute"):
        x = d["x"].clone().requires_grad_()

        def forward():
            if naive:
                return x[g // TOPK]
            return moe.permute(x, g, TOPK, mode=mode, check=False)

        if phase == "permute":
            return lambda: torch.autograd.grad(forward(), x, d["grad_y"])
        kept = forward()
        return lambda: torch.autograd.grad(kept, x, d["grad_y"], retain_graph=True)
    y = d["y"].clone().requires_grad_()
    w = d["weights"].clone().requires_grad_()

    def forward():
        if naive:
            return naive_unpermute(y, g, w)
        return moe.unpermute(y, g, TOPK, weights=w, mode=mode, check=False)

    if phase == "unpermute_fwd":
        def no_grad_forward():
            with torch.no_grad():
                return forward()
        return no_grad_forward
    return lambda: torch.autograd.grad(forward(), (y, w), d["grad_out"])


def _bytes(phase: str, d: dict) -> int:
    """Each tensor read once and each result written once, per phase."""
    x, y, grad_y, grad_out, w = d["x"], d["y"], d["grad_y"], d["grad_out"], d["weights"]
    index = nbytes(d["gather_indices"])
    if phase == "permute_bwd":
        return nbytes(grad_y, x) + index  # read grad_y, write grad_x
    if phase == "permute":
        return nbytes(x, y) + nbytes(grad_y, x) + 2 * index
    if phase == "unpermute_fwd":
        return nbytes(y, w, grad_out) + index  # read y and weights, write out
    # forward, then backward: read grad_out, y and weights, write grad_y and grad_weights
    return nbytes(y, w, grad_out) + nbytes(grad_out, y, w, grad_y, w) + 2 * index


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("device", DEVICES)
def test_moe(benchmark, device, phase, impl):
    benchmark.group = f"moe {phase} {device} bf16"
    d = moe_data(device)
    fn = _fn(phase, impl, d)
    fn()
    sync(device)
    info = {"primitive": f"moe {phase}", "case": f"moe T={T} topk={TOPK} H={HIDDEN[device]}",
            "device": device, "dtype": "bf16", "impl": impl, "bytes": _bytes(phase, d)}
    run_case(benchmark, fn, device, rounds=ROUNDS[device], warmup_rounds=WARMUP, info=info,
             baseline="naive torch composition",
             baseline_case=f"test_moe[{device}-{phase}-torch-naive]")
