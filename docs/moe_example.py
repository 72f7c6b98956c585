"""Why a hand-written MoE permute backward differs from autograd in half precision, and the fix.

Run: ``python docs/moe_example.py`` (the test suite runs it too, tests/test_moe.py).

The setup of the question this answers: a mixture-of-experts layer (seq_len=32, hidden=64,
num_experts=4, topk in {1, 4, 8}) permutes tokens with a custom ``autograd.Function`` whose
backward is written by hand as "unpermute, then ``reshape(T, topk, H).sum(1)``". Its gradient
matches autograd in float32 but not in float16 / bfloat16. The script prints, per dtype and
topk, the largest difference from autograd's gradient for:

- the naive recipe;
- ``detsum.index_add(..., mode="autograd")`` in the same Function: exactly 0;
- and the error of each recipe against the exact gradient (summed exactly, rounded once), in
  ulps of the dtype: where "fp32" and "kahan" beat autograd.

See docs/moe.md for the explanation in words.
"""

from __future__ import annotations

import torch

import detsum
from detsum import moe, reference

SEQ_LEN, HIDDEN, NUM_EXPERTS = 32, 64, 4
ULP_COLUMNS = ("autograd", "naive", "fp32", "kahan")


class NaivePermute(torch.autograd.Function):
    """The hand-written recipe: gather forward; backward unpermutes and sums over topk."""

    @staticmethod
    def forward(ctx, x, gather_indices, topk):
        ctx.save_for_backward(gather_indices)
        ctx.topk = topk
        return x[gather_indices // topk]

    @staticmethod
    def backward(ctx, grad):
        (gather_indices,) = ctx.saved_tensors
        unpermuted = torch.empty_like(grad).index_copy(0, gather_indices, grad)
        # The sum over topk: fp32 accumulator, slot by slot, ONE rounding at the end.
        return unpermuted.reshape(-1, ctx.topk, grad.shape[1]).sum(1), None, None


class DetsumPermute(torch.autograd.Function):
    """The same Function with its backward sum done by detsum in a chosen mode."""

    @staticmethod
    def forward(ctx, x, gather_indices, topk, mode):
        ctx.save_for_backward(gather_indices)
        ctx.topk, ctx.mode, ctx.num_tokens = topk, mode, x.shape[0]
        return x[gather_indices // topk]

    @staticmethod
    def backward(ctx, grad):
        (gather_indices,) = ctx.saved_tensors
        zeros = grad.new_zeros(ctx.num_tokens, grad.shape[1])
        # Rows added in order of appearance: what autograd's index_put_ does.
        grad_x = detsum.index_add(zeros, 0, gather_indices // ctx.topk, grad, mode=ctx.mode)
        return grad_x, None, None, None


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def main() -> list[dict]:
    rows = []
    print("max |difference| from autograd's gradient, and error against the exact gradient in "
          "ulps (mean/max over all elements)")
    print("  ".join([f"{'dtype':9} {'topk':>4}", f"{'naive vs autograd':>17}",
                     f"{'mode=autograd vs autograd':>25}"]
                    + [f"{'ulps ' + name:>14}" for name in ULP_COLUMNS]))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for topk in (1, 4, 8):
            gen = torch.Generator().manual_seed(topk)
            selected = torch.randint(0, NUM_EXPERTS, (SEQ_LEN, topk), generator=gen)
            gather_indices, _ = moe.route(selected, NUM_EXPERTS)
            x = torch.randn(SEQ_LEN, HIDDEN, generator=gen).to(dtype)
            grad = torch.randn(SEQ_LEN * topk, HIDDEN, generator=gen).to(dtype)

            def gradient(fn, *args):
                leaf = x.clone().requires_grad_()
                fn(leaf, *args).backward(grad)
                return leaf.grad

            autograd = gradient(lambda v: v[gather_indices // topk])
            naive = gradient(NaivePermute.apply, gather_indices, topk)
            by_mode = {mode: gradient(DetsumPermute.apply, gather_indices, topk, mode)
                       for mode in detsum.MODES}
            # The exact gradient: each token's rows summed exactly, rounded once to the dtype.
            tokens = gather_indices // topk
            exact = torch.stack([reference.exact_sum_rounded(grad[tokens == t].double(), dtype)
                                 for t in range(SEQ_LEN)])

            def ulps(g):
                distance = reference.ulp_distance(g, exact)
                return round(distance.mean().item(), 2), int(distance.max())

            row = {"dtype": str(dtype).removeprefix("torch."), "topk": topk,
                   "naive_vs_autograd": max_abs_diff(naive, autograd),
                   "autograd_mode_vs_autograd": max_abs_diff(by_mode["autograd"], autograd),
                   "ulps_autograd": ulps(autograd), "ulps_naive": ulps(naive),
                   **{f"ulps_{mode}": ulps(by_mode[mode]) for mode in ("fp32", "kahan")}}
            rows.append(row)
            cells = [f"{row['dtype']:9} {topk:>4}", f"{row['naive_vs_autograd']:>17.6f}",
                     f"{row['autograd_mode_vs_autograd']:>25.6f}"]
            cells += [f"{'%.2f/%d' % row['ulps_' + name]:>14}" for name in ULP_COLUMNS]
            print("  ".join(cells))
    return rows


if __name__ == "__main__":
    main()
