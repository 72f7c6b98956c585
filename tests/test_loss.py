"""detsum.loss.reduce and detsum.explain (the first part of the batch-loss consumer)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import detsum
from conftest import assert_same_bits, dtype_id, make_data
from detsum import loss, reference


def exact_fp32_sum(values: torch.Tensor) -> Fraction:
    """The exact sum of fp32 values, with integers: every value is an integer times 2**-149."""
    scaled = [int(Fraction(v) * 2**149) for v in values.double().tolist()]
    return Fraction(sum(scaled), 2**149)


def test_kahan_reduce_within_one_ulp_of_exact():
    """10**6 positive fp32 losses spanning 8 orders of magnitude: "kahan" is within 1 ulp of
    the exact sum. Measured here: kahan 0 ulps, torch.sum (pairwise blocks) 1, the serial
    "fp32" order 11."""
    g = torch.Generator().manual_seed(0)
    losses = torch.pow(10.0, torch.rand(10**6, generator=g, dtype=torch.float64) * 8 - 4).float()
    exact = reference.round_exact(exact_fp32_sum(losses), torch.float32)
    kahan = loss.reduce(losses, "sum", mode="kahan")
    fp32 = loss.reduce(losses, "sum", mode="fp32")
    torch_sum = losses.sum()
    ulps = {name: reference.ulp_distance(v, exact).item()
            for name, v in (("kahan", kahan), ("fp32", fp32), ("torch.sum", torch_sum))}
    assert ulps["kahan"] <= 1
    assert ulps["kahan"] < ulps["torch.sum"] < ulps["fp32"]
    mean_exact = reference.round_exact(exact_fp32_sum(losses) / 10**6, torch.float32)
    assert reference.ulp_distance(loss.reduce(losses, mode="kahan"), mean_exact).item() <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=dtype_id)
@pytest.mark.parametrize("mode", ["fp32", "kahan"])
def test_reduce_is_one_ordered_sum_rounded_once(mode, dtype):
    losses = make_data((7, 9), dtype, seed=3, spread=True).abs()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    with detsum.backend("reference"):
        total = detsum.segment_sum(losses.reshape(-1, 1).to(acc), torch.tensor([0, 63]),
                                   mode=mode).view(())
    assert_same_bits(loss.reduce(losses, "sum", mode=mode), total.to(dtype))
    assert_same_bits(loss.reduce(losses, "mean", mode=mode), (total / 63).to(dtype))
    weight = make_data((7, 9), dtype, seed=4).abs()
    with detsum.backend("reference"):
        products = (losses.to(acc) * weight.to(acc)).reshape(-1, 1)
        weighted = detsum.segment_sum(products, torch.tensor([0, 63]), mode=mode).view(())
        weights = detsum.segment_sum(weight.reshape(-1, 1).to(acc), torch.tensor([0, 63]),
                                     mode=mode).view(())
    assert_same_bits(loss.reduce(losses, "mean", weight=weight, mode=mode),
                     (weighted / weights).to(dtype))


def test_reduce_gradient_is_exact():
    losses = torch.rand(6, requires_grad=True)
    loss.reduce(losses).backward()
    assert_same_bits(losses.grad, torch.full((6,), 1 / 6))
    weight = torch.tensor([1.0, 2.0, 0.0, 1.0, 3.0, 1.0])
    losses.grad = None
    loss.reduce(losses, weight=weight).backward()
    assert torch.allclose(losses.grad, weight / weight.sum(), rtol=0, atol=1e-7)


def test_reduce_rejects_bad_input():
    with pytest.raises(ValueError, match="mode='autograd' has no meaning.*mode='fp32' or "
                                         "mode='kahan'"):
        loss.reduce(torch.ones(3), mode="autograd")
    with pytest.raises(ValueError, match="losses is empty"):
        loss.reduce(torch.ones(0))
    with pytest.raises(TypeError, match="losses has dtype torch.int64"):
        loss.reduce(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction='max'"):
        loss.reduce(torch.ones(3), "max")
    with pytest.raises(ValueError, match=r"weight has shape \(2,\)"):
        loss.reduce(torch.ones(3), weight=torch.ones(2))


# ---- explain ----------------------------------------------------------------------------------

def per_sample_grads(seed=0, batch=16, features=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, features, generator=g)


def test_explain_tells_rounding_from_a_bug():
    grads = per_sample_grads()
    serial = torch.zeros(8)
    for row in grads:  # one order ...
        serial = serial + row
    tree = grads.sum(0)  # ... and torch's
    magnitude = grads.abs().sum(0)
    verdict = detsum.explain(serial / 16, tree / 16, terms=16, magnitude=magnitude / 16)
    assert verdict.verdict in ("identical", "rounding")
    # The aliasing trap: the first sample's gradient replaced by the second's.
    aliased = grads.clone()
    aliased[0] = aliased[1]
    report = detsum.explain(grads.mean(0), aliased.mean(0), terms=16,
                            magnitude=magnitude / 16)
    assert report.verdict == "not rounding"
    assert "view across zero_grad()" in str(report)
    assert detsum.explain(grads, grads.clone()).verdict == "identical"


def test_explain_names_a_scale_mismatch():
    grads = per_sample_grads()
    report = detsum.explain(grads.sum(0), grads.mean(0))
    assert report.verdict == "not rounding" and report.constant_ratio == 16
    assert "scale mismatch" in str(report)


def test_explain_bound_is_the_documented_formula():
    a = torch.tensor([1.0])
    b = torch.nextafter(a, torch.tensor([2.0]))
    report = detsum.explain(a, b, terms=4, magnitude=3.0)
    u = 2.0**-24
    gamma = 4 * u / (1 - 4 * u)
    assert report.bound == pytest.approx(2 * gamma * 3.0 + u * (1 + b.item()), rel=1e-12)
    assert report.verdict == "rounding" and report.max_ulps == 1
    with pytest.raises(ValueError, match="expected the same shape and dtype"):
        detsum.explain(a, a.double())
