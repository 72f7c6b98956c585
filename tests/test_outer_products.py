"""Sums of outer products (loss.OuterProducts): the bits of the rows they stand for, on every
backend, and batch_grad's nn.Linear weights taken as factors."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad

import detsum
from conftest import DTYPES, TRITON_ON_CPU, assert_same_bits, dtype_id, make_data
from detsum import loss
from detsum.kernels import CHUNK_TERMS
from detsum.kernels.numba import outer as numba_outer

SPLIT_MODES = ("fp32", "kahan", "exact")
# Chunk 0, a whole later chunk and a partial one; not a multiple of the kernel's 4 samples.
ROWS = 2 * CHUNK_TERMS + 87
PER_SAMPLE_LOSS = torch.nn.CrossEntropyLoss(reduction="none")


def factors(n, rows, cols, dtype, seed):
    """Factors over many binades with both signs: a change in the order of the sum, in the
    rounding of a product or a chunk fold shows in the bits."""
    return (make_data((n, rows), dtype, seed=seed, spread=True),
            make_data((n, cols), dtype, seed=seed + 1, spread=True))


def formed(left, right):
    return left.unsqueeze(2) * right.unsqueeze(1)


def products_in_pieces(left, right, piece, mode, device="cpu"):
    running = detsum.RunningSum((left.shape[1], right.shape[1]), dtype=left.dtype, mode=mode,
                                device=device)
    for start in range(0, left.shape[0], piece):
        running._add_products(left[start:start + piece], right[start:start + piece])
    return running


@pytest.mark.parametrize("backend", ["numba", "reference", TRITON_ON_CPU])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_products_give_the_bits_of_the_rows_they_stand_for(mode, dtype, backend):
    n = ROWS if backend != "reference" else CHUNK_TERMS + 9
    left, right = factors(n, 3, 5, dtype, seed=len(mode) + n)
    rows = formed(left, right)
    whole = detsum.RunningSum((3, 5), dtype=dtype, mode=mode)
    whole.add(rows)
    pieces = (1, 3, CHUNK_TERMS, CHUNK_TERMS + 1, n) if backend == "numba" else (7, n)
    with detsum.backend(backend):
        for piece in pieces:
            running = products_in_pieces(left, right, piece, mode)
            assert running.count == n
            assert_same_bits(running.sum(), whole.sum())
            assert_same_bits(running.mean(), whole.mean())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_special_products(mode, dtype):
    """Zeros of both signs, infinities and NaNs among the factors: -0.0 * 1, 0 * -1, inf * 0
    (NaN), inf * -1, NaN * 2, and products that overflow the dtype."""
    big = torch.finfo(dtype).max
    left = torch.tensor([[0.0, -0.0, 1.0], [float("inf"), 1.0, -0.0], [float("nan"), 2.0, 0.0],
                         [big, -1.0, 3.0], [0.0, 0.0, -0.0]], dtype=dtype)
    right = torch.tensor([[-1.0, 1.0], [0.0, -1.0], [2.0, -0.0], [big, 1.0], [-1.0, -0.0]],
                         dtype=dtype)
    rows = formed(left, right)
    for n in range(1, 6):
        whole = detsum.RunningSum((3, 2), dtype=dtype, mode=mode)
        whole.add(rows[:n])
        assert_same_bits(products_in_pieces(left[:n], right[:n], 2, mode).sum(), whole.sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", ["fp32", "kahan"])
def test_the_kernel_gives_the_same_bits_on_any_thread_count(mode, dtype, monkeypatch):
    """Every launch parallel (threshold 1) on 1 and 2 threads, factors not contiguous."""
    monkeypatch.setattr(numba_outer, "_MIN_PARALLEL_PRODUCTS", 1)
    left, right = factors(45, 33, 70, dtype, seed=3)
    left, right = left.t().contiguous().t(), right[:, ::1]
    want = detsum.RunningSum((33, 70), dtype=dtype, mode=mode)
    want.add(formed(left, right))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert_same_bits(products_in_pieces(left, right, 45, mode).sum(), want.sum())
    finally:
        torch.set_num_threads(threads)


def test_empty_pieces_and_empty_matrices():
    left, right = factors(6, 4, 3, torch.float32, seed=5)
    for mode in SPLIT_MODES:
        running = products_in_pieces(left, right, 6, mode)
        running._add_products(left[:0], right[:0])
        want = detsum.RunningSum((4, 3), mode=mode)
        want.add(formed(left, right))
        assert running.count == 6
        assert_same_bits(running.sum(), want.sum())
        empty = products_in_pieces(left[:, :0], right, 6, mode)
        assert empty.sum().shape == (0, 3)


def test_accumulator_takes_factors_with_the_bits_of_formed_rows():
    torch.manual_seed(0)
    params = [("w", torch.zeros(4, 6, requires_grad=True)), ("b", torch.zeros(4, requires_grad=True))]
    left, right = factors(40, 4, 6, torch.float32, seed=9)
    bias_rows = make_data((40, 4), torch.float32, seed=11)
    for mode in SPLIT_MODES:
        factored = loss.GradAccumulator(params, mode=mode)
        formed_rows = loss.GradAccumulator(params, mode=mode)
        for start in range(0, 40, 13):
            rows = slice(start, start + 13)
            factored.add({"w": loss.OuterProducts(left[rows], right[rows]), "b": bias_rows[rows]})
            formed_rows.add({"w": formed(left[rows], right[rows]), "b": bias_rows[rows]})
        for reduction in ("sum", "mean"):
            got, want = factored.result(reduction), formed_rows.result(reduction)
            for name in want:
                assert_same_bits(got[name], want[name])
        assert torch.equal(loss.OuterProducts(left, right).materialise(), formed(left, right))


def test_accumulator_refuses_bad_factors_and_changes_nothing():
    params = [("w", torch.zeros(4, 6, requires_grad=True)), ("b", torch.zeros(4, requires_grad=True))]
    accumulator = loss.GradAccumulator(params, mode="kahan")
    left, right = factors(3, 4, 6, torch.float32, seed=1)
    good_bias = torch.ones(3, 4)
    accumulator.add({"w": loss.OuterProducts(left, right), "b": good_bias})
    before = accumulator.result("sum")
    bad = [
        (loss.OuterProducts(left.double(), right.double()), r"OuterProducts of torch.float64"),
        (loss.OuterProducts(left[:, :3], right), r"expected torch.float32 \[k, O\] and \[k, K\]"),
        (loss.OuterProducts(left, right[:, :5]), r"parameter of shape \(4, 6\) = \[O, K\]"),
        (loss.OuterProducts(left, right[:2]), r"the same number of samples first"),
        (loss.OuterProducts(left[0], right[0]), r"the same number of samples first"),
        (loss.OuterProducts(left, right.bfloat16()), r"OuterProducts of torch.float32"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            accumulator.add({"w": value, "b": good_bias})
    with pytest.raises(ValueError, match=r"per_sample_grads\['b'\] is OuterProducts"):
        accumulator.add({"w": loss.OuterProducts(left, right),
                         "b": loss.OuterProducts(left, right[:, :1])})
    assert accumulator.count == 3
    after = accumulator.result("sum")
    for name in before:
        assert_same_bits(after[name], before[name])


# ---- batch_grad: nn.Linear weights as factors ------------------------------------------------


def reference_per_sample(model, inputs, targets):
    """Each sample alone by torch.func.grad, every weight formed by torch's matrix product."""
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}

    def sample_loss(p, x, y):
        return PER_SAMPLE_LOSS(functional_call(model, p, (x,)), y)[0]

    rows = [grad(sample_loss)(params, inputs[i:i + 1].clone(), targets[i:i + 1].clone())
            for i in range(inputs.shape[0])]
    return {name: torch.stack([r[name] for r in rows]) for name in params}


def reference_batch_grad(model, inputs, targets, mode):
    accumulator = loss.GradAccumulator(model.named_parameters(), mode=mode)
    accumulator.add(reference_per_sample(model, inputs, targets))
    return accumulator.result("mean")


def mlp(dtype=torch.float32, inplace=False):
    torch.manual_seed(3)
    nn = torch.nn
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(inplace=inplace), nn.Linear(9, 5),
                         nn.Tanh(), nn.Linear(5, 3)).to(dtype).eval()


class TwiceUsed(torch.nn.Module):
    """One layer applied twice per sample: its per-sample gradient is a sum of two products."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


class OverTokens(torch.nn.Module):
    """A layer over a sequence (several rows per sample), then pooled into a head."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x.view(x.shape[0], 2, 3).repeat(1, 1, 2))).mean(1))


class Tied(torch.nn.Module):
    """Two layers sharing one weight."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6, bias=False)
        self.b = torch.nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class ScaledLinear(torch.nn.Linear):
    """A subclass whose forward is not nn.Linear's."""

    def forward(self, x):
        return super().forward(x) * 0.5


class SometimesUsed(torch.nn.Module):
    """A layer that only samples with a positive first feature go through: some samples of
    a chunk get its weight as factors, the others (a zero gradient) from autograd."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 6)
        self.gate = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if x[0, 0] > 0:
            h = torch.tanh(self.gate(h))
        return self.head(h)


class WeightReadOutside(torch.nn.Module):
    """A layer's weight also read by the parent's forward (tied by hand): the layer's output
    carries only part of the weight's gradient."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x) + 0.5 * torch.nn.functional.linear(
            x, self.lin.weight)))


class BiasReadOutside(torch.nn.Module):
    """A layer's bias added again by the parent, on the samples with a positive first
    feature only: some samples of a joint group use it outside the layer, the others not."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if x[0, 0] > 0:
            h = h * self.lin.bias
        return self.head(h)


def scaled_head():
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), ScaledLinear(6, 3)).eval()


MODELS = {
    "mlp": mlp,
    "mlp-inplace-relu": lambda: mlp(inplace=True),
    "twice-used": lambda: TwiceUsed().eval(),
    "over-tokens": lambda: OverTokens().eval(),
    "tied": lambda: Tied().eval(),
    "subclass": scaled_head,
    "sometimes-used": lambda: SometimesUsed().eval(),
    "weight-read-outside": lambda: WeightReadOutside().eval(),
    "bias-read-outside": lambda: BiasReadOutside().eval(),
}


def batch_for(model, n=19, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = next(model.parameters()).shape[1]
    dtype = next(model.parameters()).dtype
    return (torch.randn(n, features, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g))


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_batch_grad_equals_the_sum_of_formed_per_sample_gradients(kind, mode):
    """The factored evaluation gives the bits of torch.func per-sample gradients (weights
    formed by torch's matrix product) summed in order, for every split; the models cover each
    way a layer falls back to autograd for its weight."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    x, y = batch_for(model)
    if kind in ("sometimes-used", "bias-read-outside"):
        x[::3, 0] = x[::3, 0].abs()
        x[1::3, 0] = -x[1::3, 0].abs()
    want = reference_batch_grad(model, x, y, mode)
    for microbatch, chunk in ((None, 32), (4, 3), (None, 1)):
        got = loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode=mode,
                              microbatch_size=microbatch, chunk_size=chunk)
        assert list(got) == list(want)
        for name in want:
            assert_same_bits(got[name], want[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
def test_per_sample_weights_are_the_products_of_their_factors(dtype):
    """per_sample_grads forms a factored weight's rows as IEEE products: torch's matrix
    product's values, with the zero signs of a product (torch's bf16 and fp16 products give
    +0.0 for 0 * -1); every other parameter has torch.func's bits."""
    model = mlp(dtype)
    x, y = batch_for(model, n=9)
    got = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    want = reference_per_sample(model, x, y)
    weights = {f"{i}.weight" for i in (0, 2, 4)}
    zero_products = 0
    for name in want:
        if name in weights:
            assert torch.equal(got[name], want[name])  # values: -0.0 == +0.0
            assert_same_bits(got[name] + 0.0, want[name] + 0.0)
            zero_products += int((got[name] == 0).sum())
        else:
            assert_same_bits(got[name], want[name])
    assert zero_products > 0  # dead ReLU units: zero output gradients were multiplied


def test_factors_skip_forming_the_weight_gradients():
    """The evaluation asks autograd for the layers' outputs, not their weights: no matrix
    product of a weight's shape runs per sample."""
    model = mlp()
    x, y = batch_for(model, n=4)
    loss.batch_grad(model, PER_SAMPLE_LOSS, x, y)  # the first call's self-check
    with torch.profiler.profile(record_shapes=True) as profile:
        loss.batch_grad(model, PER_SAMPLE_LOSS, x, y)
    products = [event.input_shapes for event in profile.events()
                if event.name in ("aten::mm", "aten::addmm")]
    # A weight's gradient for one sample: [O, 1] @ [1, K], a product of inner dimension 1.
    outer = [shapes for shapes in products if shapes and len(shapes[0]) == 2
             and shapes[0][1] == 1]
    assert products and not outer, outer


def test_a_model_changed_in_place_downstream_keeps_its_factors():
    """ReLU(inplace=True) after a layer overwrites the tensor the layer returned: the factor
    (the gradient of that output) is taken from the layer's own output, not the overwritten
    one. Same bits as the same model with an out-of-place ReLU."""
    x, y = batch_for(mlp())
    plain = loss.batch_grad(mlp(), PER_SAMPLE_LOSS, x, y, mode="kahan")
    inplace = loss.batch_grad(mlp(inplace=True), PER_SAMPLE_LOSS, x, y, mode="kahan")
    for name in plain:
        assert_same_bits(inplace[name], plain[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_samples_run_together_have_the_bits_of_each_alone(dtype, monkeypatch):
    """An nn.Linear-only model's samples go through one torch.autograd.grad call per
    JOINT_SAMPLES of them, and each gets the bits it gets alone, in every group and across
    their boundaries."""
    model = mlp(dtype)
    n = 2 * loss.JOINT_SAMPLES + 3
    x, y = batch_for(model, n=n)
    loss.per_sample_grads(model, PER_SAMPLE_LOSS, x[:1], y[:1])  # the model's self-check
    engine_calls = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad",
                        lambda *args, **kwargs: engine_calls.append(1) or grad(*args, **kwargs))
    together = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    monkeypatch.undo()
    assert len(engine_calls) == -(-n // loss.JOINT_SAMPLES)
    for i in range(n):
        alone = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x[i:i + 1], y[i:i + 1])
        for name, g in alone.items():
            assert_same_bits(together[name][i], g[0])
