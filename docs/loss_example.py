"""Four ways to average a batch's gradient, a bug that hides among them, and detsum's answer.

Run: ``python docs/loss_example.py`` (the test suite runs it too, tests/test_loss.py).

The question this answers: someone computes the average gradient of a cross-entropy loss over
a batch of 16 in four ways, as people write them:

1. the ``reduction="none"`` losses, ``backward`` on each one, then the average;
2. ``reduction="sum"``, ``backward``, divided by 16;
3. ``reduction="mean"``, ``backward``;
4. one sample at a time, keeping a running total of the gradients.

Written carelessly, way 4 keeps ``p.grad.view(-1)`` as its first total: the next in-place
``zero_grad()`` and ``backward`` overwrite it, so sample 0's gradient is replaced by sample 1's.
Its result is off by far more than rounding, and the ``retain_graph=True`` the user suspects
has nothing to do with it. The script shows:

- what ``detsum.explain`` says of each way against way 3: "rounding" for the correct ones,
  "not rounding" (and the likely cause) for the careless one;
- that with ``detsum.loss`` every way, and every micro-batch size, gives the same bits (in
  "fp32" and in "kahan" mode), within the rounding bound of autograd's ``"mean"`` gradient.

See docs/loss.md for the explanation in words.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import detsum
from detsum import loss

BATCH, FEATURES, HIDDEN, CLASSES = 16, 20, 32, 5
MICROBATCH_SIZES = (1, 3, 16, None)


def make_problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    model.eval()  # no dropout / batch-norm statistics: one well-defined gradient per sample
    inputs = torch.randn(BATCH, FEATURES)
    targets = torch.randint(0, CLASSES, (BATCH,))
    return model, inputs, targets


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # cat copies


# ---- the four ways, written as users write them -----------------------------------------------

def none_then_average(model, x, y):
    losses = F.cross_entropy(model(x), y, reduction="none")
    grads = []
    for i in range(len(losses)):
        model.zero_grad()
        losses[i].backward(retain_graph=True)
        grads.append(flat_grad(model))
    return torch.stack(grads).mean(0)


def sum_divided(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    return flat_grad(model) / len(x)


def mean_reduction(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="mean").backward()
    return flat_grad(model)


def one_at_a_time(model, x, y, *, careless: bool):
    total = None
    for i in range(len(x)):
        model.zero_grad(set_to_none=False)  # zeroes p.grad in place
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward(retain_graph=True)
        if careless:
            grads = [p.grad.view(-1) for p in model.parameters()]  # views of p.grad
        else:
            grads = [p.grad.view(-1).clone() for p in model.parameters()]
        # The careless first total *is* p.grad: the next zero_grad() and backward overwrite it.
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return torch.cat(total) / len(x)


# ---- the same four ways with detsum.loss ------------------------------------------------------

def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads.values()])


def detsum_ways(model, x, y, mode: str) -> dict[str, torch.Tensor]:
    """Every way of getting the averaged gradient with detsum.loss, flattened."""
    per_sample_loss = nn.CrossEntropyLoss(reduction="none")
    ways = {}
    for microbatch in MICROBATCH_SIZES:
        ways[f"batch_grad, micro-batch {microbatch}"] = flat(loss.batch_grad(
            model, per_sample_loss, x, y, mode=mode, microbatch_size=microbatch))
    ways["batch_grad 'sum' / 16"] = flat(loss.batch_grad(
        model, per_sample_loss, x, y, reduction="sum", mode=mode)) / len(x)
    whole = loss.GradAccumulator(model.named_parameters(), mode=mode)
    whole.add(loss.per_sample_grads(model, per_sample_loss, x, y))
    ways["per-sample grads, averaged"] = flat(whole.result("mean"))
    single = loss.GradAccumulator(model.named_parameters(), mode=mode)
    for i in range(len(x)):
        single.add(loss.per_sample_grads(model, per_sample_loss, x[i:i + 1], y[i:i + 1]))
    ways["one sample at a time"] = flat(single.result("mean"))
    return ways


def main() -> dict:
    model, x, y = make_problem()
    per_sample = loss.per_sample_grads(model, nn.CrossEntropyLoss(reduction="none"), x, y)
    # The rounding bound of a mean of 16 per-sample gradients: 16 terms of size |g_i| / 16.
    magnitude = torch.cat([g.reshape(BATCH, -1) for g in per_sample.values()], 1).abs().mean(0)
    torch_ways = {
        "1. 'none', backward each, average": none_then_average(model, x, y),
        "2. 'sum' / 16": sum_divided(model, x, y),
        "3. 'mean'": mean_reduction(model, x, y),
        "4. one at a time (careful)": one_at_a_time(model, x, y, careless=False),
        "4. one at a time (careless)": one_at_a_time(model, x, y, careless=True),
    }
    reference_grad = torch_ways["3. 'mean'"]
    print("Plain torch, each way against way 3 ('mean'):")
    verdicts = {}
    for name, grad in torch_ways.items():
        report = detsum.explain(grad, reference_grad, terms=BATCH, magnitude=magnitude)
        verdicts[name] = report
        print(f"  {name:38s} max |diff| {report.max_abs:9.3g}  -> {report.verdict}")
    print("\nWhat detsum.explain says of the careless way:")
    print("  " + str(verdicts["4. one at a time (careless)"]).replace("\n", "\n  "))

    detsum_results = {}
    for mode in ("fp32", "kahan"):
        ways = detsum_ways(model, x, y, mode)
        first = next(iter(ways.values()))
        same = {name: torch.equal(grad, first) for name, grad in ways.items()}
        against_autograd = detsum.explain(first, reference_grad, terms=BATCH,
                                          magnitude=magnitude)
        detsum_results[mode] = {"ways": ways, "same_bits": same,
                                "against_autograd": against_autograd}
        print(f"\ndetsum.loss, mode={mode!r}: every way against the first one")
        for name in ways:
            print(f"  {name:38s} {'same bits' if same[name] else 'DIFFERENT'}")
        print(f"  against autograd's 'mean' gradient: {against_autograd.verdict} "
              f"(max |diff| {against_autograd.max_abs:.3g}, bound {against_autograd.bound:.3g})")
    return {"torch": verdicts, "detsum": detsum_results}


if __name__ == "__main__":
    main()
