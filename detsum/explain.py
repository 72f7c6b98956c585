"""``detsum.explain``: is the difference between two results rounding, or a bug?"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator

import torch

from detsum import _transforms, _validation, reference
from detsum.modes import FLOAT_DTYPES, acc_dtype

__all__ = ["Explanation", "explain"]

#: Terms assumed per element when ``explain`` is not told: generous for per-sample sums over a
#: batch, so that honest rounding is never called a bug; pass ``terms`` for a sharper verdict.
DEFAULT_TERMS = 1024

_UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11,
                  torch.bfloat16: 2.0**-8}
# A rounding into the subnormal range errs by up to half of these in absolute terms, where a
# bound relative to the result says nothing.
_SMALLEST_SUBNORMAL = {torch.float64: 2.0**-1074, torch.float32: 2.0**-149,
                       torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
# Beyond this many terms every dtype's growth factor is already infinite (the bound is its cap),
# so counting further changes no verdict, and Python ints past 1e308 would not convert to float.
_MANY_TERMS = 2**64

_CAUSES = """\
What to look for when a difference exceeds the rounding bound:
- a gradient kept as a view across zero_grad(): `g = p.grad.view(-1)` (or `.data`, or a list of
  `p.grad` tensors) is overwritten in place by the next backward; clone() it before zeroing;
- a forgotten zero_grad(): gradients of two backward passes were added together;
- dropout or batch-norm in train mode: each forward sees other randomness or batch statistics
  (use model.eval(), or fix the seed and the batch composition);
- a different reduction scale: "mean" against "sum", or a missing / n (a constant ratio between
  the two results is the sign)."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The comparison of two tensors that should hold the same quantity computed two ways."""

    #: "identical" (same bits; NaN compared by position), "rounding" (every difference within
    #: the rounding bound) or "not rounding".
    verdict: str
    #: The largest absolute difference, and where it is (an index tuple; None if identical).
    #: inf where one side is NaN or infinite and the other is not.
    max_abs: float
    where: tuple[int, ...] | None
    #: The largest distance in units in the last place of the dtype.
    max_ulps: float
    #: The rounding bound at the element of the largest difference.
    bound: float
    #: How many elements exceed their bound (NaN or inf mismatches included), of how many.
    exceeding: int
    numel: int
    terms: int
    terms_assumed: bool
    #: True when no ``magnitude`` was given and the bound assumed every term at most
    #: ``largest_term``.
    magnitude_estimated: bool
    dtype: torch.dtype
    #: a / b when it is the same number wherever both are nonzero (a scale mismatch), else None.
    constant_ratio: float | None
    #: Whether the bound assumed that both sides rounded to the dtype once (``rounded_once``);
    #: False: it also covers rounding to the dtype after every add.
    rounded_once: bool = False
    #: Without ``magnitude``: the size assumed for every term, the largest finite |a| or |b|.
    largest_term: float | None = None
    #: Elements NaN or infinite in one tensor only, or infinities of opposite sign.
    nonfinite_mismatches: int = 0
    #: True when the bound is at least the terms' magnitude itself (too many terms for the
    #: precision): differences that large may be rounding, so the verdict tells nothing.
    vacuous: bool = False

    def __str__(self) -> str:
        dtype = _name(self.dtype)
        if self.verdict == "identical":
            return f"identical: all {self.numel} elements have the same bits ({dtype})"
        lines = [
            f"verdict: {self.verdict}",
            f"largest difference {self.max_abs:.3g} at {list(self.where)}, "
            f"{self.max_ulps:.0f} ulps of {dtype}; rounding bound there {self.bound:.3g}",
            f"{self.exceeding} of {self.numel} elements exceed their rounding bound",
        ]
        if self.nonfinite_mismatches:
            lines.append(
                f"NaN or infinite in one tensor only (or infinities of opposite sign) at "
                f"{self.nonfinite_mismatches} of them: never rounding, but an overflow, an "
                f"inf - inf or a 0/0 in one of the two computations")
        lines.append("assumed: " + self._arithmetic())
        lines.append("assumed: " + self._magnitude())
        if self.vacuous:
            lines.append(
                f"the bound is as large as the terms' magnitude itself ({self.terms} terms are "
                f"too many for {self._rounding_words()}): any difference up to it may be "
                f"rounding, so this comparison cannot tell a bug from rounding; pass terms="
                f"{'' if self.rounded_once else ' or rounded_once=True'} if you can")
        # A constant ratio within the bound (a 1-ulp difference on equal values) is rounding.
        if self.constant_ratio is not None and (self.verdict == "not rounding" or self.vacuous):
            lines.append(f"a / b = {self.constant_ratio:.6g} everywhere: a scale mismatch")
        if self.verdict == "not rounding":
            lines.append(_CAUSES)
        return "\n".join(lines)

    def _terms_words(self) -> str:
        default = " (the default: pass terms=)" if self.terms_assumed else ""
        return f"at most {self.terms} terms{default}"

    def _rounding_words(self) -> str:
        dtype, acc = _name(self.dtype), _name(acc_dtype(self.dtype))
        if dtype == acc:
            return dtype
        return f"{acc} rounded once to {dtype}" if self.rounded_once else (
            f"{dtype} rounding after every add")

    def _arithmetic(self) -> str:
        dtype, acc = _name(self.dtype), _name(acc_dtype(self.dtype))
        if dtype == acc:
            return f"a and b each sum {self._terms_words()} in {dtype}, in any order"
        if self.rounded_once:
            return (f"a and b each sum {self._terms_words()} in {acc} and round once to "
                    f"{dtype} (rounded_once=True)")
        return (f"a and b each sum {self._terms_words()} in {acc} and round once to {dtype}, "
                f"or round to {dtype} after every add (as \"autograd\" mode does); pass "
                f"rounded_once=True if neither did, for a sharper bound")

    def _magnitude(self) -> str:
        if not self.magnitude_estimated:
            return "magnitude given (the sum of the terms' absolute values)"
        return (f"no magnitude given: every term at most {self.largest_term:.3g} in size (the "
                f"largest finite |a| or |b|), so their absolute values sum to at most "
                f"{self.terms} x {self.largest_term:.3g} at every element; pass magnitude= "
                f"for a sharper bound, and where the terms are much larger than every result")


def explain(a: torch.Tensor, b: torch.Tensor, *, terms: int | None = None,
            magnitude: torch.Tensor | float | None = None,
            rounded_once: bool = False) -> Explanation:
    """Compare two tensors that should hold the same quantity computed two ways.

    Each of ``a`` and ``b`` is taken to be a sum of at most ``n = terms`` values, the same values
    for both, computed in floating point in any order. Every term then passes through at most
    ``n`` roundings of relative size at most ``u_op``: ``n - 1`` adds, and one more operation
    (the scaling of a mean, or the product of an inner product, as in a matmul). So elementwise,
    for ``x`` each of ``a`` and ``b``,

    ``|x - exact| <= e(x) = min(g_n * M + u * |x| + n * eta, |x| + M)``,
    ``g_n = (1 + u_op)**n - 1``

    where ``M`` is the sum of the terms' absolute values (``magnitude``), ``u`` the dtype's unit
    roundoff and ``eta`` its smallest subnormal. The difference is "rounding" where
    ``|a - b| <= e(a) + e(b)`` at every element, "not rounding" elsewhere.

    - ``g_n`` bounds a product of ``n`` factors ``1 + delta`` with ``|delta| <= u_op`` (the
      standard model of floating-point arithmetic). It is at most ``gamma_n = n u_op / (1 - n
      u_op)`` and equal to it to first order (Higham, *Accuracy and Stability of Numerical
      Algorithms*, 2nd ed., Lemma 3.1 and eq. 4.4), but stays valid and finite where ``n u_op
      >= 1``, where ``gamma_n`` does not.
    - ``u * |x|``: the final rounding to the dtype, relative to the rounded result (Higham eq.
      2.5). ``n * eta``: underflow, where relative bounds say nothing (up to ``eta / 2`` for
      each term's scaling and for the final rounding).
    - ``|x| + M`` caps it, since ``|x - exact| <= |x| + |exact| <= |x| + M`` always. Where
      ``g_n >= 1`` the bound is at least ``M`` and tells rounding from nothing: the
      :class:`Explanation` is then ``vacuous`` and its report says so.

    ``u_op`` is the unit roundoff of one rounding step. With ``rounded_once=True``, the acc
    type's (fp32: ``2**-24``; fp64 for float64): both sides accumulate in the acc type and
    round once to the dtype, as detsum's ``"fp32"`` mode does (``"kahan"`` errs less: about
    ``2 u_op M``, Higham section 4.3). By default, ``(1 + u) * (1 + u_acc) - 1``: either side
    may have rounded its running total to the dtype after every add, an add in the acc type
    rounded again to the dtype, as detsum's ``"autograd"`` mode and torch's per-add paths do on
    bfloat16 and float16. For float32 and float64, whose acc type is their own, the two agree.

    Without ``magnitude`` the bound is norm-wise: every term is assumed at most ``T``, the
    largest finite ``|a|`` or ``|b|`` anywhere in the two tensors, so ``M = n T`` at every
    element. Cancellation cannot defeat it (an element whose terms cancel gets the bound of
    the largest one), but it is only as sound as that assumption, which fails where the terms
    are much larger than every result (gradients near a minimum): pass ``magnitude`` there.
    The report states what was assumed.

    NaN against NaN, and an infinity against the same infinity, count as equal. NaN or an
    infinity on one side only, or infinities of opposite sign, are never rounding (the bound
    assumes no overflow): they count among the elements exceeding it.

    An argument of the wrong type raises TypeError, a wrong value ValueError, each naming the
    argument, its value and what was expected; a tensor of ``torch.func.vmap`` raises
    RuntimeError (a report is not a tensor: call it outside ``vmap``).

    Args:
        a, b: same shape and float dtype.
        terms: how many values each element sums, or an upper bound on it (the batch size for
            an averaged gradient, the longest segment of a segmented sum): a positive int (not
            a bool or a float). Default 1024, generous for per-sample sums.
        magnitude: the sum of the terms' absolute values, per element (a tensor broadcastable
            to ``a``'s shape) or one number; finite and >= 0. For an averaged gradient, the
            mean of the per-sample gradients' absolute values. Default: ``terms * T`` above.
        rounded_once: True when both ``a`` and ``b`` were accumulated in the acc type and
            rounded to the dtype once (detsum's ``"fp32"`` and ``"kahan"`` modes, torch's
            reductions with an fp32 accumulator): a sharper bound for bfloat16 and float16.
            Default False: the bound also covers rounding to the dtype after every add.

    Returns:
        An :class:`Explanation`; ``str()`` of it is a short report that states the
        assumptions and names the likely causes when the verdict is "not rounding".

    Example:
        >>> import torch, detsum
        >>> a = torch.tensor([1.0, 2.0, 3.0])
        >>> detsum.explain(a, a + torch.tensor([0.0, 2.0**-22, 0.0]), terms=16).verdict
        'rounding'
        >>> detsum.explain(a, a * 2).verdict
        'not rounding'
        >>> rows = torch.linspace(-1, 3, 256).reshape(64, 4).bfloat16()
        >>> offsets = torch.tensor([0, 64])
        >>> once = detsum.segment_sum(rows, offsets, mode="fp32")
        >>> every_add = detsum.segment_sum(rows, offsets, mode="autograd")
        >>> detsum.explain(once, every_add, terms=64).verdict
        'rounding'
    """
    caller = "detsum.explain"
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{caller}: {name} must be a float tensor, got {got}")
    for name, t in (("a", a), ("b", b), ("magnitude", magnitude)):
        if isinstance(t, torch.Tensor) and _transforms.batched(t):
            raise RuntimeError(f"{caller}: {name} is a tensor of torch.func.vmap; explain "
                               f"compares two whole tensors and returns a report, not a tensor, "
                               f"so it cannot run per sample: call it outside vmap")
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{caller}: a is {a.dtype} {tuple(a.shape)} but b is {b.dtype} "
                         f"{tuple(b.shape)}; expected the same shape and dtype")
    n = _check_terms(caller, terms)
    _validation.check_flag(caller, "rounded_once", rounded_once)
    given_magnitude = _check_magnitude(caller, magnitude, a.shape)
    a, b = a.detach().cpu(), b.detach().cpu()
    da, db = a.double(), b.double()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    same = torch.equal(nan_a, nan_b) and torch.equal(
        a.masked_fill(nan_a, 0).contiguous().view(bits),
        b.masked_fill(nan_b, 0).contiguous().view(bits))

    finite_a, finite_b = torch.isfinite(da), torch.isfinite(db)
    both_finite = finite_a & finite_b
    # The same NaN or infinity on both sides is the same value computed two ways; any other
    # non-finite element came from an overflow or an invalid operation on one side only.
    same_special = (nan_a & nan_b) | (~finite_a & (da == db))
    nonfinite_mismatch = ~both_finite & ~same_special
    diff = torch.where(both_finite, (da - db).abs(), torch.zeros_like(da))
    diff = diff.masked_fill(nonfinite_mismatch, math.inf)

    abs_a = torch.where(finite_a, da.abs(), torch.zeros_like(da))
    abs_b = torch.where(finite_b, db.abs(), torch.zeros_like(db))
    counted = min(n, _MANY_TERMS)
    largest_term = None
    if given_magnitude is None:
        # Norm-wise: one bound for every element, from the largest finite value anywhere, so an
        # element whose terms cancel is judged as leniently as the largest one.
        largest_term = float(torch.maximum(abs_a.max(), abs_b.max())) if a.numel() else 0.0
        magnitude_sum = torch.tensor(counted * largest_term, dtype=torch.float64)
    else:
        magnitude_sum = given_magnitude
    unit_roundoff = _UNIT_ROUNDOFF[a.dtype]
    acc_unit_roundoff = _UNIT_ROUNDOFF[acc_dtype(a.dtype)]
    if rounded_once or acc_dtype(a.dtype) == a.dtype:
        step_roundoff = acc_unit_roundoff
    else:
        # An add in the acc type, then its result rounded to the dtype: two roundings per add.
        step_roundoff = (1 + unit_roundoff) * (1 + acc_unit_roundoff) - 1
    growth = _growth(counted, step_roundoff)
    underflow = counted * _SMALLEST_SUBNORMAL[a.dtype]

    def error_of(abs_x: torch.Tensor) -> torch.Tensor:
        cap = abs_x + magnitude_sum
        if math.isinf(growth):
            return cap  # growth * 0 would be NaN where the magnitude is 0
        return torch.minimum(growth * magnitude_sum + unit_roundoff * abs_x + underflow, cap)

    bound = (error_of(abs_a) + error_of(abs_b)).expand_as(diff)
    flat = diff.reshape(-1)
    worst = int(torch.argmax(flat)) if flat.numel() else 0
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if (
        a.dim() and flat.numel()) else ()
    exceeding = int(((diff > bound) | nonfinite_mismatch).sum())
    both = both_finite & (da != 0) & (db != 0)
    ratio = None
    if not same and both.any() and not nonfinite_mismatch.any():
        ratios = (da[both] / db[both])
        if bool((ratios == ratios[0]).all()) and ratios[0] != 1 and (~both).logical_and(
                (da != 0) | (db != 0)).logical_and(both_finite).sum() == 0:
            ratio = float(ratios[0])
    verdict = "identical" if same else ("rounding" if exceeding == 0 else "not rounding")
    return Explanation(
        verdict=verdict, max_abs=float(flat[worst]) if flat.numel() else 0.0,
        where=None if same else where,
        max_ulps=float(reference.ulp_distance(a, b).max()) if a.numel() else 0.0,
        bound=float(bound.reshape(-1)[worst]) if flat.numel() else 0.0, exceeding=exceeding,
        numel=a.numel(), terms=n, terms_assumed=terms is None,
        magnitude_estimated=given_magnitude is None, dtype=a.dtype, constant_ratio=ratio,
        rounded_once=rounded_once, largest_term=largest_term,
        nonfinite_mismatches=int(nonfinite_mismatch.sum()), vacuous=growth >= 1)


def _growth(terms: int, step_roundoff: float) -> float:
    """``(1 + step_roundoff)**terms - 1``, without the cancellation of computing it so."""
    exponent = terms * math.log1p(step_roundoff)
    return math.expm1(exponent) if exponent < 700 else math.inf  # expm1 overflows past ~709


def _check_terms(caller: str, terms: object) -> int:
    if terms is None:
        return DEFAULT_TERMS
    expected = (f"expected a positive int (how many values each element sums), or None for "
                f"{DEFAULT_TERMS}")
    # bool is an int to Python, and 1.9 would truncate to 1: neither is a count of terms.
    is_bool = isinstance(terms, bool) or (isinstance(terms, torch.Tensor)
                                          and terms.dtype == torch.bool)
    try:
        count = None if is_bool else operator.index(terms)
    except TypeError:
        count = None
    if count is None:
        raise TypeError(f"{caller}: terms={terms!r}; {expected}")
    if count < 1:
        raise ValueError(f"{caller}: terms={terms!r}; {expected}")
    return count


def _check_magnitude(caller: str, magnitude: object, shape: torch.Size) -> torch.Tensor | None:
    """The magnitude as float64 on the CPU, or None; refused in detsum's words."""
    if magnitude is None:
        return None
    expected = f"expected one number or a tensor broadcastable to a's shape {tuple(shape)}"
    must_be = "expected finite and >= 0 (the sum of the terms' absolute values)"
    if isinstance(magnitude, torch.Tensor):
        if magnitude.dtype == torch.bool or magnitude.is_complex():
            raise TypeError(f"{caller}: magnitude has dtype {magnitude.dtype}; {expected}, "
                            f"of real numbers")
        try:
            fits = torch.broadcast_shapes(magnitude.shape, shape) == shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"{caller}: magnitude has shape {tuple(magnitude.shape)}; "
                             f"{expected}")
        values = magnitude.detach().cpu().double()
        bad = ~torch.isfinite(values) | (values < 0)
        if bad.any():
            raise ValueError(f"{caller}: magnitude holds {values[bad][0].item()}; {must_be}")
        return values
    if isinstance(magnitude, bool) or not isinstance(magnitude, numbers.Real):
        raise TypeError(f"{caller}: magnitude={magnitude!r}; {expected}")
    try:
        value = float(magnitude)
    except OverflowError:  # an int beyond float range
        value = math.inf
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{caller}: magnitude={magnitude!r}; {must_be}")
    return torch.tensor(value, dtype=torch.float64)
