"""detsum.loss (reduce, per-sample gradients, GradAccumulator, batch_grad) and detsum.explain."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

import detsum
from conftest import assert_same_bits, dtype_id, make_data, run_docs_example
from detsum import loss, reference


def exact_fp32_sum(values: torch.Tensor) -> Fraction:
    """The exact sum of fp32 values, with integers: every value is an integer times 2**-149."""
    scaled = [int(Fraction(v) * 2**149) for v in values.double().tolist()]
    return Fraction(sum(scaled), 2**149)


def test_kahan_reduce_within_one_ulp_of_exact():
    """10**6 positive fp32 losses spanning 8 orders of magnitude: "kahan" is within 1 ulp of
    the exact sum, and closer than the serial "fp32" order (measured: kahan 0 ulps, "fp32" 11).
    torch.sum is not ranked: its blocks follow the thread count (1 ulp on 2 threads, 0 on 16)."""
    g = torch.Generator().manual_seed(0)
    losses = torch.pow(10.0, torch.rand(10**6, generator=g, dtype=torch.float64) * 8 - 4).float()
    exact = reference.round_exact(exact_fp32_sum(losses), torch.float32)
    kahan = loss.reduce(losses, "sum", mode="kahan")
    fp32 = loss.reduce(losses, "sum", mode="fp32")
    kahan_ulps = reference.ulp_distance(kahan, exact).item()
    assert kahan_ulps <= 1
    assert kahan_ulps < reference.ulp_distance(fp32, exact).item()
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


def _rounded_exactly(total: Fraction, dtype: torch.dtype) -> torch.Tensor:
    return reference.round_exact(total, dtype).view(())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=dtype_id)
def test_exact_reduce_rounds_the_exact_sum_once(dtype):
    """mode="exact": the sum and the mean are the exact ones rounded once to the dtype, in any
    order of the losses; a weighted mean is the quotient of the two correctly rounded sums."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    losses = make_data((7, 9), dtype, seed=3, spread=True)
    weight = make_data((7, 9), dtype, seed=4).abs()
    terms = [Fraction(v) for v in losses.double().reshape(-1).tolist()]
    products = (losses.to(acc) * weight.to(acc)).reshape(-1)
    weighted = sum(Fraction(v) for v in products.double().tolist())
    weights = sum(Fraction(v) for v in weight.to(acc).double().reshape(-1).tolist())
    shuffled = torch.randperm(63, generator=torch.Generator().manual_seed(5))
    for data, w in ((losses, weight), (losses.reshape(-1)[shuffled], weight.reshape(-1)[shuffled])):
        assert_same_bits(loss.reduce(data, "sum", mode="exact"),
                         _rounded_exactly(sum(terms), dtype))
        assert_same_bits(loss.reduce(data, "mean", mode="exact"),
                         _rounded_exactly(sum(terms) / 63, dtype))
        assert_same_bits(loss.reduce(data, "sum", weight=w, mode="exact"),
                         _rounded_exactly(weighted, dtype))
        quotient = _rounded_exactly(weighted, acc) / _rounded_exactly(weights, acc)
        assert_same_bits(loss.reduce(data, "mean", weight=w, mode="exact"), quotient.to(dtype))


def test_exact_reduce_does_not_round_twice():
    """In bf16, 1 + 2**-8 + 2**-30 rounds up to 1 + 2**-7; through an fp32 sum it would be the
    tie 1 + 2**-8 and round down to 1 (two roundings)."""
    losses = torch.tensor([1.0, 2.0**-8, 2.0**-30], dtype=torch.bfloat16)
    assert loss.reduce(losses, "sum", mode="fp32").item() == 1.0
    assert loss.reduce(losses, "sum", mode="exact").item() == 1 + 2.0**-7
    # Mean: (3 + 3 * 2**-8 + 3 * 2**-30) / 3, the same tie one step further down.
    three = torch.tensor([1.0, 2.0**-8, 2.0**-30] * 3, dtype=torch.bfloat16) * 3
    assert loss.reduce(three, "mean", mode="exact").item() == 1 + 2.0**-7
    weight = torch.ones(3, dtype=torch.bfloat16)
    assert loss.reduce(losses, "sum", weight=weight, mode="exact").item() == 1 + 2.0**-7


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_exact_reduce_gradient_is_the_other_modes(reduction):
    weight = torch.tensor([1.0, 2.0, 0.0, 1.0, 3.0, 1.0])
    for dtype in (torch.float32, torch.bfloat16):
        for w in (None, weight.to(dtype)):
            grads = []
            for mode in ("fp32", "exact"):
                losses = torch.rand(6, generator=torch.Generator().manual_seed(2)).to(dtype)
                losses.requires_grad_()
                loss.reduce(losses, reduction, weight=w, mode=mode).backward()
                grads.append(losses.grad)
            assert_same_bits(grads[1], grads[0])


def test_reduce_gradient_is_exact():
    losses = torch.rand(6, requires_grad=True)
    loss.reduce(losses).backward()
    assert_same_bits(losses.grad, torch.full((6,), 1 / 6))
    weight = torch.tensor([1.0, 2.0, 0.0, 1.0, 3.0, 1.0])
    losses.grad = None
    loss.reduce(losses, weight=weight).backward()
    assert torch.allclose(losses.grad, weight / weight.sum(), rtol=0, atol=1e-7)


def test_reduce_rejects_bad_input():
    with pytest.raises(ValueError, match="mode='autograd' has no meaning.*mode='fp32', "
                                         "'kahan' or 'exact'"):
        loss.reduce(torch.ones(3), mode="autograd")
    with pytest.raises(ValueError, match="losses is empty"):
        loss.reduce(torch.ones(0))
    with pytest.raises(TypeError, match="losses has dtype torch.int64"):
        loss.reduce(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction='max'"):
        loss.reduce(torch.ones(3), "max")
    with pytest.raises(ValueError, match=r"weight has shape \(2,\)"):
        loss.reduce(torch.ones(3), weight=torch.ones(2))
    with pytest.raises(NotImplementedError, match=r"^detsum.loss.reduce: detsum has no backend "
                                                  r"for meta tensors"):
        loss.reduce(torch.ones(3, device="meta"))


# ---- explain ----------------------------------------------------------------------------------

def random_per_sample_grads(seed=0, batch=16, features=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, features, generator=g)


def test_explain_tells_rounding_from_a_bug():
    grads = random_per_sample_grads()
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
    grads = random_per_sample_grads()
    report = detsum.explain(grads.sum(0), grads.mean(0))
    assert report.verdict == "not rounding" and report.constant_ratio == 16
    assert "scale mismatch" in str(report)


def test_explain_bound_is_the_documented_formula():
    a = torch.tensor([1.0])
    b = torch.nextafter(a, torch.tensor([2.0]))
    report = detsum.explain(a, b, terms=4, magnitude=3.0)
    # e(a) + e(b) with e(x) = g_4 * M + u * |x| + 4 * eta (explain's docstring), no absolute
    # tolerance: gamma_4 differs from g_4 by less than approx's default one would hide.
    u = 2.0**-24
    growth = 4 * u + 6 * u**2 + 4 * u**3 + u**4  # (1 + u)**4 - 1, exactly
    assert report.bound == pytest.approx(
        2 * growth * 3.0 + u * (1 + b.item()) + 2 * 4 * 2.0**-149, rel=1e-12, abs=0)
    assert report.verdict == "rounding" and report.max_ulps == 1
    with pytest.raises(ValueError, match="expected the same shape and dtype"):
        detsum.explain(a, a.double())


# ---- per-sample gradients, GradAccumulator, batch_grad ----------------------------------------

def mlp_problem(batch, *, seed=0, dtype=torch.float32, features=6, hidden=8, classes=3):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, classes)).to(dtype).eval()
    inputs = torch.randn(batch, features, generator=g).to(dtype)
    targets = torch.randint(0, classes, (batch,), generator=g)
    return model, inputs, targets


PER_SAMPLE_LOSS = torch.nn.CrossEntropyLoss(reduction="none")


def assert_same_grads(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert_same_bits(a[name], b[name])


def test_per_sample_grads_are_each_samples_gradient():
    model, x, y = mlp_problem(5)
    grads = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    assert list(grads) == [name for name, _ in model.named_parameters()]
    model64 = mlp_problem(5, dtype=torch.float64)[0]
    for i in range(5):
        model64.zero_grad()
        PER_SAMPLE_LOSS(model64(x[i:i + 1].double()), y[i:i + 1]).sum().backward()
        for name, p in model64.named_parameters():
            assert grads[name].shape == (5, *p.shape) and grads[name].dtype == torch.float32
            torch.testing.assert_close(grads[name][i], p.grad.float(), rtol=1e-5, atol=1e-6)


def test_per_sample_grads_skip_frozen_parameters():
    model, x, y = mlp_problem(3)
    model[0].bias.requires_grad_(False)
    assert list(loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)) == [
        "0.weight", "2.weight", "2.bias"]


class TokenBag(torch.nn.Module):
    """Embedding of 5 token ids per sample, averaged, then a linear head."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(40, 24)
        self.head = torch.nn.Linear(24, 3)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(1))


class Encoder(torch.nn.Module):
    """One transformer encoder layer (attention, layer norms, feed-forward), mean-pooled."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


class LastState(torch.nn.Module):
    """An LSTM over the sequence, its last hidden state into a linear head."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(6, 10, batch_first=True)
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def layer_problem(kind: str, batch: int):
    """A small eval-mode model of one layer family and a batch for it. Every feature count
    that a matmul row spans is odd or 6 (24 bytes), so the rows of a batch sit at different
    16-byte alignments: on the AMD EPYC CI machine, MKL gave a row of ``x @ W.t()`` other bits
    at an odd position than at an even one (the failure this suite caught)."""
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    nn = torch.nn
    if kind == "linear":
        return mlp_problem(batch, seed=1)
    if kind == "conv2d-batchnorm":
        model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU(),
                              nn.Conv2d(5, 5, 3, padding=1), nn.Flatten(), nn.Linear(5 * 5 * 5, 3))
        inputs = torch.randn(batch, 3, 7, 7, generator=g)
    elif kind == "conv1d-groupnorm":
        model = nn.Sequential(nn.Conv1d(3, 6, 5), nn.GroupNorm(3, 6), nn.GELU(), nn.Flatten(),
                              nn.Linear(6 * 9, 3))
        inputs = torch.randn(batch, 3, 13, generator=g)
    elif kind == "layernorm":
        model = nn.Sequential(nn.Linear(33, 21), nn.LayerNorm(21), nn.ReLU(), nn.Linear(21, 3))
        inputs = torch.randn(batch, 33, generator=g)
    elif kind == "embedding":
        model = TokenBag()
        inputs = torch.randint(0, 40, (batch, 5), generator=g)
    elif kind == "transformer":
        model = Encoder()
        inputs = torch.randn(batch, 7, 12, generator=g)
    else:
        model = LastState()
        inputs = torch.randn(batch, 5, 6, generator=g)
    # BatchNorm's running statistics are made non-trivial, then frozen by eval().
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5, generator=g)
                module.running_var.uniform_(0.5, 2.0, generator=g)
    return model.eval(), inputs, torch.randint(0, 3, (batch,), generator=g)


LAYER_KINDS = ["linear", "conv2d-batchnorm", "conv1d-groupnorm", "layernorm", "embedding",
               "transformer", "lstm"]


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_a_sample_has_the_same_bits_in_any_batch_at_any_position(kind):
    """Sample i's gradient alone equals its row of the whole batch's, and its row of a batch
    that starts 3 samples later (every sample at another position), whatever chunk_size."""
    model, x, y = layer_problem(kind, 11)
    whole = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    assert all(g.shape[0] == 11 for g in whole.values())
    shifted = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x[3:], y[3:], chunk_size=4)
    for i in range(11):
        alone = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x[i:i + 1], y[i:i + 1])
        assert_same_grads(alone, {name: g[i:i + 1] for name, g in whole.items()})
        if i >= 3:
            assert_same_grads({name: g[i - 3:i - 2] for name, g in shifted.items()}, alone)


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_a_sample_has_the_bits_of_its_own_backward(kind):
    """Each per-sample gradient is what ``loss.backward()`` gives the sample alone: the same
    torch operations on the same tensors. The nn.Linear weights, formed from their factors,
    may differ there in the sign of a zero product only (loss.OuterProducts)."""
    model, x, y = layer_problem(kind, 5)
    got = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    linear_weights = {f"{name}.weight".lstrip(".") for name, module in model.named_modules()
                      if type(module) is torch.nn.Linear}
    for i in range(5):
        model.zero_grad()
        PER_SAMPLE_LOSS(model(x[i:i + 1].clone()), y[i:i + 1].clone()).sum().backward()
        for name, p in model.named_parameters():
            if name in linear_weights:
                assert_same_bits(got[name][i] + 0.0, p.grad + 0.0)
            else:
                assert_same_bits(got[name][i], p.grad)


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_batch_grad_same_bits_for_every_split_and_chunk_size(kind):
    model, x, y = layer_problem(kind, 13)
    want = loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode="kahan")
    for microbatch, chunk in ((1, 32), (3, 2), (5, None), (None, 1), (None, 4)):
        assert_same_grads(loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode="kahan",
                                          microbatch_size=microbatch, chunk_size=chunk), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_batch_grad_is_the_canonical_sum_of_per_sample_grads(mode, dtype):
    """batch_grad = one segment_sum over the samples (then / B), for every micro-batch size."""
    model, x, y = mlp_problem(37, seed=2, dtype=dtype)
    per_sample = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    offsets = torch.tensor([0, 37])
    summed = {name: detsum.segment_sum(g, offsets, mode=mode)[0]
              for name, g in per_sample.items()}
    for microbatch in (1, 3, 8, 37, None):
        got = loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, reduction="sum", mode=mode,
                              microbatch_size=microbatch, chunk_size=8)
        assert_same_grads(got, summed)
    mean = loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode=mode, chunk_size=8)
    for name, g in per_sample.items():
        all_in_one = torch.zeros_like(g, dtype=torch.long)
        want = detsum.scatter_reduce(torch.zeros_like(g[:1]), 0, all_in_one, g, "mean",
                                     include_self=False, mode=mode)[0]
        assert_same_bits(mean[name], want)


@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_batch_grad_over_more_than_one_chunk_of_samples(mode):
    """300 samples cross the 256-term chunk boundary of the canonical order."""
    model = torch.nn.Linear(4, 3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 4, generator=g) * torch.logspace(-2, 2, 300).view(300, 1)
    y = torch.randint(0, 3, (300,), generator=g)
    per_sample = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    want = {name: detsum.segment_sum(g, torch.tensor([0, 300]), mode=mode)[0]
            for name, g in per_sample.items()}
    for microbatch in (7, 256, None):
        assert_same_grads(loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, reduction="sum",
                                          mode=mode, microbatch_size=microbatch,
                                          chunk_size=16), want)


def test_grad_accumulator_any_chunking_same_bits():
    model, x, y = mlp_problem(20, seed=4)
    per_sample = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    results = []
    for step in (1, 6, 20):
        accumulator = loss.GradAccumulator(model.named_parameters(), mode="kahan")
        for start in range(0, 20, step):
            accumulator.add({name: g[start:start + step] for name, g in per_sample.items()})
        assert accumulator.count == 20
        results.append((accumulator.result("sum"), accumulator.result("mean")))
    for sums, means in results[1:]:
        assert_same_grads(sums, results[0][0])
        assert_same_grads(means, results[0][1])


def test_grad_accumulator_refuses_bad_chunks_and_changes_nothing():
    model, x, y = mlp_problem(4)
    grads = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    accumulator = loss.GradAccumulator(model.named_parameters())
    accumulator.add(grads)
    before = accumulator.result("sum")
    with pytest.raises(ValueError, match=r"missing \['2.bias'\], unexpected \[\]"):
        accumulator.add({name: g for name, g in grads.items() if name != "2.bias"})
    uneven = dict(grads, **{"2.bias": grads["2.bias"][:3]})
    with pytest.raises(ValueError, match="the same number of samples"):
        accumulator.add(uneven)
    wrong = dict(grads, **{"2.bias": grads["2.bias"].double()})
    with pytest.raises(ValueError, match=r"per_sample_grads\['2.bias'\] is torch.float64"):
        accumulator.add(wrong)
    with pytest.raises(TypeError, match="must be a dict"):
        accumulator.add(list(grads.values()))
    listed = dict(grads, **{"2.bias": grads["2.bias"].tolist()})
    with pytest.raises(TypeError, match=r"per_sample_grads\['2.bias'\] is a list; expected a "
                                        r"tensor \[k, \*param.shape\] or OuterProducts"):
        accumulator.add(listed)
    assert accumulator.count == 4
    assert_same_grads(accumulator.result("sum"), before)
    with pytest.raises(ValueError, match="reduction='max'"):
        accumulator.result("max")
    with pytest.raises(ValueError, match="no samples were added"):
        loss.GradAccumulator(model.named_parameters()).result()


def test_gradient_functions_reject_bad_input():
    model, x, y = mlp_problem(4)
    mean_loss = torch.nn.CrossEntropyLoss()  # a scalar, not one loss per sample
    with pytest.raises(ValueError, match=r"loss_fn returned shape \(\) for a batch of 1 sample; "
                                         r"expected one loss per sample"):
        loss.per_sample_grads(model, mean_loss, x, y)
    with pytest.raises(ValueError, match="loss_fn returned shape"):
        loss.batch_grad(model, mean_loss, x, y)
    with pytest.raises(ValueError, match="inputs has 4 samples but targets has 3"):
        loss.batch_grad(model, PER_SAMPLE_LOSS, x, y[:3])
    with pytest.raises(ValueError, match="the batch is empty"):
        loss.per_sample_grads(model, PER_SAMPLE_LOSS, x[:0], y[:0])
    with pytest.raises(ValueError, match="reduction='none'; expected one of"):
        loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, reduction="none")
    with pytest.raises(ValueError, match="^detsum.loss.batch_grad: mode='autograd' has no "
                                         "meaning"):
        loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode="autograd")
    with pytest.raises(ValueError, match="^detsum.loss.batch_grad: mode='fp64' is not"):
        loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode="fp64")
    with pytest.raises(ValueError, match="chunk_size=0; expected a positive int or None"):
        loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y, chunk_size=0)
    with pytest.raises(ValueError, match="microbatch_size=-1"):
        loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, microbatch_size=-1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        loss.per_sample_grads(lambda t: t, PER_SAMPLE_LOSS, x, y)
    with pytest.raises(TypeError, match="targets must be a torch.Tensor"):
        loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, [0, 1, 2, 3])
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    for function in (loss.per_sample_grads, loss.batch_grad):
        with pytest.raises(ValueError, match=f"^detsum.loss.{function.__name__}: model has no "
                                             f"parameter with requires_grad=True"):
            function(frozen, PER_SAMPLE_LOSS, torch.ones(2, 2), torch.zeros(2).long())


@pytest.mark.parametrize("pairs", [
    pytest.param(lambda model: model.parameters(), id="parameters"),
    pytest.param(lambda model: [("weight", 3)], id="not-a-tensor"),
    pytest.param(lambda model: [model.weight], id="tensors")])
def test_grad_accumulator_refuses_what_is_not_named_parameters(pairs):
    """``model.parameters()`` in place of ``named_parameters()`` is a TypeError that says so
    (its tensors would otherwise unpack along their first dimension as names and values)."""
    model = torch.nn.Linear(4, 2)  # a weight of two rows: the unpacking would not fail
    with pytest.raises(TypeError, match=r"^detsum.loss.GradAccumulator: named_parameters gave "
                                        r".*; expected \(name, tensor\) pairs"):
        loss.GradAccumulator(pairs(model))


@pytest.mark.parametrize("given", [3, torch.zeros(3)], ids=["int", "tensor"])
def test_grad_accumulator_refuses_what_is_not_an_iterable_of_pairs(given):
    with pytest.raises(TypeError, match=r"^detsum.loss.GradAccumulator: named_parameters=.*; "
                                        r"expected \(name, tensor\) pairs"):
        loss.GradAccumulator(given)


def test_per_sample_grads_refuses_a_loss_that_is_not_callable():
    with pytest.raises(TypeError, match=r"^detsum.loss.per_sample_grads: loss_fn=3 is not "
                                        r"callable"):
        loss.per_sample_grads(torch.nn.Linear(2, 2), 3, torch.zeros(2, 2), torch.zeros(2))


class CallCounting(torch.nn.Module):
    """A linear layer whose output grows with the number of forward calls so far (a stand-in for
    any state a forward changes between calls); ``scaled=False`` only counts."""

    def __init__(self, scaled: bool = True):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)
        self.scaled, self.calls = scaled, 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x) * (1 + self.calls * 2**-10 if self.scaled else 1)


class NumpyNoise(torch.nn.Module):
    """Input noise from numpy's generator, which neither torch's generator nor vmap can see."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)
        self.rng = np.random.default_rng(0)

    def forward(self, x):
        noise = torch.from_numpy(self.rng.normal(0, 1e-3, tuple(x.shape)).astype(np.float32))
        return self.linear(x + noise)


@pytest.mark.parametrize("make_model", [CallCounting, NumpyNoise], ids=["state", "numpy-rng"])
def test_a_forward_that_is_not_a_function_of_the_sample_is_refused(make_model):
    """Its per-sample gradients would depend on the split; the first call for the model
    evaluates sample 0 twice, finds two gradients and raises, before adding or returning
    anything, leaving the parameters as they were."""
    torch.manual_seed(0)
    model = make_model().eval()
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])
    before = {name: p.clone() for name, p in model.named_parameters()}
    for function, caller in ((loss.batch_grad, "batch_grad"),
                             (loss.per_sample_grads, "per_sample_grads")):
        with pytest.raises(ValueError, match=rf"detsum.loss.{caller}: the model's forward is not "
                                             r"a deterministic function of one sample: sample "
                                             r"0, evaluated twice, gave two gradients "
                                             r"\(\d+ of \d+ elements of '[a-z.]+' differ"):
            function(model, PER_SAMPLE_LOSS, x, y)
    assert_same_grads(dict(model.named_parameters()), before)


def test_a_forward_that_draws_random_numbers_is_refused():
    model, x, y = mlp_problem(4)
    model.insert(1, torch.nn.Dropout(0.5))
    model.train()
    state = torch.get_rng_state()
    for function in (loss.batch_grad, loss.per_sample_grads):
        with pytest.raises(ValueError, match=r"the model's forward \(or loss_fn\) drew random "
                                             r"numbers from torch's generator while samples 0 to 3 "
                                             r"were evaluated .* call model.eval\(\)"):
            function(model, PER_SAMPLE_LOSS, x, y)
    model.eval()  # the same model without its dropout is accepted
    loss.batch_grad(model, PER_SAMPLE_LOSS, x, y)
    assert not torch.equal(state, torch.get_rng_state())  # the refused calls did draw


def test_the_self_check_costs_one_evaluation_on_a_models_first_call():
    model = CallCounting(scaled=False).eval()
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])
    loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    assert model.calls == 6  # 5 samples, sample 0 twice
    loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, microbatch_size=2)
    assert model.calls == 11  # checked already: 5 samples once


def test_seed_scenario_example(capsys):
    """docs/loss_example.py: the careless way is "not rounding" and named; the careful ones are
    rounding; with detsum.loss every way and micro-batch size gives the same bits."""
    results = run_docs_example("loss_example")
    out = capsys.readouterr().out
    verdicts = results["torch"]
    careless = verdicts["4. one at a time (careless)"]
    assert careless.verdict == "not rounding" and careless.max_abs > 1e-3
    assert "view across zero_grad()" in out
    for name, report in verdicts.items():
        if name != "4. one at a time (careless)":
            assert report.verdict in ("identical", "rounding"), (name, str(report))
    assert any(r.verdict == "rounding" for r in verdicts.values())  # torch's ways do differ
    for mode, result in results["detsum"].items():
        assert all(result["same_bits"].values()), (mode, result["same_bits"])
        assert len(result["ways"]) == 7
        assert result["against_autograd"].verdict in ("identical", "rounding")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_batch_grad_split_invariant_on_cuda(mode):
    """On the GPU: the Triton carry path, and each sample, evaluated alone, getting the same bits
    from cuBLAS in every split."""
    model, x, y = mlp_problem(37, seed=5)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    per_sample = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    offsets = torch.tensor([0, 37], device="cuda")
    summed = {name: detsum.segment_sum(g, offsets, mode=mode)[0]
              for name, g in per_sample.items()}
    for microbatch in (1, 3, None):
        assert_same_grads(loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, reduction="sum",
                                          mode=mode, microbatch_size=microbatch, chunk_size=8),
                          summed)


def test_a_forward_that_changes_its_buffers_is_refused_in_detsum_words():
    """A BatchNorm in training mode updates its running statistics in place (then fails on a
    batch of one, in torch's words): refused for the change, which is put back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Linear(3, 2))
    inputs, targets = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def lossf(out, t):
        return torch.nn.functional.cross_entropy(out, t, reduction="none")

    before = {name: t.clone() for name, t in model.state_dict().items()}
    for call in (lambda: loss.batch_grad(model, lossf, inputs, targets),
                 lambda: loss.per_sample_grads(model, lossf, inputs, targets)):
        with pytest.raises(ValueError, match=r"changes its buffers in place .*'1' \(BatchNorm1d\)"
                           r".*model\.eval\(\)"):
            call()
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    model.eval()
    assert loss.batch_grad(model, lossf, inputs, targets)["0.weight"].shape == (3, 4)
