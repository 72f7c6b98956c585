"""``detsum.explain``: is the difference between two results rounding, or a bug?"""

from __future__ import annotations

import dataclasses

import torch

from detsum import reference
from detsum.modes import FLOAT_DTYPES, acc_dtype

__all__ = ["Explanation", "explain"]

#: Terms assumed per element when ``explain`` is not told: generous for per-sample sums over a
#: batch, so that honest rounding is never called a bug; pass ``terms`` for a sharper verdict.
DEFAULT_TERMS = 1024

_UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11,
                  torch.bfloat16: 2.0**-8}

_CAUSES = """\
What to look for when a difference exceeds the rounding bound:
- a gradient kept as a view across zero_grad(): `g = p.grad.view(-1)` (or `.data`, or a list of
  `p.grad` tensors) is overwritten in place by the next backward; clone() it before zeroing;
- a forgotten zero_grad(): gradients of two backward passes were added together;
- dropout or batch-norm in train mode: each forward sees other randomness or batch statistics
  (use model.eval(), or fix the seed and the batch composition);
- a different reduction scale: "mean" against "sum", or a missing / n (a constant ratio between
  the two results is the sign)."""


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The comparison of two tensors that should hold the same quantity computed two ways."""

    #: "identical" (same bits; NaN compared by position), "rounding" (every difference within
    #: the rounding bound) or "not rounding".
    verdict: str
    #: The largest absolute difference, and where it is (an index tuple; None if identical).
    max_abs: float
    where: tuple[int, ...] | None
    #: The largest distance in units in the last place of the dtype.
    max_ulps: float
    #: The rounding bound at the element of the largest difference.
    bound: float
    #: How many elements exceed their bound, of how many.
    exceeding: int
    numel: int
    terms: int
    terms_assumed: bool
    magnitude_estimated: bool
    dtype: torch.dtype
    #: a / b when it is the same number wherever both are nonzero (a scale mismatch), else None.
    constant_ratio: float | None

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.verdict == "identical":
            return f"identical: all {self.numel} elements have the same bits ({dtype})"
        lines = [
            f"verdict: {self.verdict}",
            f"largest difference {self.max_abs:.3g} at {list(self.where)}, "
            f"{self.max_ulps:.0f} ulps of {dtype}; rounding bound there {self.bound:.3g}",
            f"{self.exceeding} of {self.numel} elements exceed their rounding bound "
            f"(summing {self.terms} terms{' (assumed)' if self.terms_assumed else ''} in "
            f"{str(acc_dtype(self.dtype)).removeprefix('torch.')}, each result rounded to "
            f"{dtype}; magnitude "
            f"{'estimated from the tensors: too small if the terms cancel' if self.magnitude_estimated else 'given'})",
        ]
        if self.constant_ratio is not None:
            lines.append(f"a / b = {self.constant_ratio:.6g} everywhere: a scale mismatch")
        if self.verdict == "not rounding":
            lines.append(_CAUSES)
        return "\n".join(lines)


def explain(a: torch.Tensor, b: torch.Tensor, *, terms: int | None = None,
            magnitude: torch.Tensor | float | None = None) -> Explanation:
    """Compare two tensors that should hold the same quantity computed two ways.

    The bound: if each of ``a`` and ``b`` is a sum of ``terms`` values, computed in the acc
    type (fp32; fp64 for float64) in any order and rounded once to the dtype, then

    ``|a - b| <= 2 * gamma_n * magnitude + u * (|a| + |b|)``, ``gamma_n = n u' / (1 - n u')``

    elementwise (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4),
    with ``n = terms``, ``u'`` the acc type's unit roundoff, ``u`` the dtype's, and
    ``magnitude`` the sum of the terms' absolute values. A difference within it is
    "rounding"; beyond it, something else changed the computation.

    Args:
        a, b: same shape and float dtype.
        terms: values summed per element (e.g. the batch size for an averaged gradient);
            default 1024, generous for per-sample sums.
        magnitude: sum of the terms' absolute values, per element (broadcastable) or one
            number; default ``max(|a|, |b|)``, which is right without cancellation and too
            small with it (the report says so).

    Returns:
        An :class:`Explanation`; ``str()`` of it is a short report that names the likely
        causes when the verdict is "not rounding".

    Example:
        >>> import torch, detsum
        >>> a = torch.tensor([1.0, 2.0, 3.0])
        >>> detsum.explain(a, a + torch.tensor([0.0, 2.0**-22, 0.0]), terms=16).verdict
        'rounding'
        >>> detsum.explain(a, a * 2).verdict
        'not rounding'
    """
    caller = "detsum.explain"
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{caller}: {name} must be a float tensor, got {got}")
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{caller}: a is {a.dtype} {tuple(a.shape)} but b is {b.dtype} "
                         f"{tuple(b.shape)}; expected the same shape and dtype")
    terms_assumed = terms is None
    n = DEFAULT_TERMS if terms is None else int(terms)
    if n < 1:
        raise ValueError(f"{caller}: terms={terms!r}; expected a positive int")
    a, b = a.detach().cpu(), b.detach().cpu()
    da, db = a.double(), b.double()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    same = torch.equal(nan_a, nan_b) and torch.equal(
        a.masked_fill(nan_a, 0).contiguous().view(bits),
        b.masked_fill(nan_b, 0).contiguous().view(bits))
    diff = (da - db).abs().nan_to_num(nan=float("inf"))
    diff = torch.where(nan_a & nan_b, torch.zeros_like(diff), diff)
    magnitude_estimated = magnitude is None
    mag = torch.maximum(da.abs(), db.abs()) if magnitude is None else torch.as_tensor(
        magnitude, dtype=torch.float64).abs()
    acc_u = _UNIT_ROUNDOFF[acc_dtype(a.dtype)]
    gamma = n * acc_u / (1 - n * acc_u)
    bound = (2 * gamma * mag + _UNIT_ROUNDOFF[a.dtype] * (da.abs() + db.abs())).expand_as(diff)
    flat = diff.reshape(-1)
    worst = int(torch.argmax(flat)) if flat.numel() else 0
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if (
        a.dim() and flat.numel()) else ()
    exceeding = int((diff > bound).sum())
    both = (da != 0) & (db != 0)
    ratio = None
    if not same and both.any():
        ratios = (da[both] / db[both])
        if bool((ratios == ratios[0]).all()) and ratios[0] != 1 and (~both).logical_and(
                (da != 0) | (db != 0)).sum() == 0:
            ratio = float(ratios[0])
    verdict = "identical" if same else ("rounding" if exceeding == 0 else "not rounding")
    return Explanation(
        verdict=verdict, max_abs=float(flat[worst]) if flat.numel() else 0.0,
        where=None if same else where,
        max_ulps=float(reference.ulp_distance(a, b).max()) if a.numel() else 0.0,
        bound=float(bound.reshape(-1)[worst]) if flat.numel() else 0.0, exceeding=exceeding,
        numel=a.numel(), terms=n, terms_assumed=terms_assumed,
        magnitude_estimated=magnitude_estimated, dtype=a.dtype, constant_ratio=ratio)
