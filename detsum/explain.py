"""``detsum.explain``: is the difference between two results rounding, or a bug?"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from detsum import _transforms, _validation, reference
from detsum.modes import FLOAT_DTYPES, acc_dtype

__all__ = ["Explanation", "Explanations", "explain"]

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


# Significant digits that tell any two values of the dtype apart.
_DIGITS = {torch.float64: 17, torch.float32: 9, torch.float16: 5, torch.bfloat16: 4}


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
    #: The largest distance in units in the last place of the dtype over all elements (its
    #: element is ``max_ulps_where``, not necessarily ``where``).
    max_ulps: float
    #: The rounding bound at ``where``, the element of the largest difference.
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
    #: The distance in ulps at ``where`` (the element of the largest absolute difference).
    ulps_at_where: float = 0.0
    #: Where the largest distance in ulps is (None if identical).
    max_ulps_where: tuple[int, ...] | None = None
    #: The largest relative difference ``|a - b| / max(|a|, |b|)`` (0 where both are 0; 2 at
    #: most between finite values, 2 exactly for opposite signs; inf where the difference
    #: is), and where it is (None if identical).
    max_rel: float = 0.0
    max_rel_where: tuple[int, ...] | None = None
    #: The shape of ``a`` and ``b``.
    shape: tuple[int, ...] = ()
    #: ``(a, b)`` at each element named above, as Python floats.
    values_at: dict[tuple[int, ...], tuple[float, float]] = dataclasses.field(
        default_factory=dict, repr=False)

    def __str__(self) -> str:
        if self.verdict == "identical":
            return (f"identical: all {self.numel} elements have the same bits "
                    f"({_name(self.dtype)})")
        lines = [f"verdict: {self.verdict}", *self._figures(),
                 "assumed: " + self._arithmetic(), "assumed: " + self._magnitude(),
                 *self._warnings()]
        if self.verdict == "not rounding":
            lines.append(_CAUSES)
        return "\n".join(lines)

    def _at(self, where: tuple[int, ...]) -> str:
        """``[i, j]: a = ..., b = ...``: an element and both values there."""
        digits = _DIGITS[self.dtype]
        a, b = self.values_at[where]
        return f"{list(where)}: a = {a:.{digits}g}, b = {b:.{digits}g}"

    def _figures(self) -> list[str]:
        """The differences, each at its own element, and the count beyond the bound."""
        dtype = _name(self.dtype)
        lines = [
            f"largest difference {self.max_abs:.3g} ({self.ulps_at_where:.0f} ulps of {dtype}) "
            f"at {self._at(self.where)}; rounding bound there {self.bound:.3g}",
            f"largest distance {self.max_ulps:.0f} ulps at {self._at(self.max_ulps_where)}",
            f"largest relative difference {self.max_rel:.3g} at {self._at(self.max_rel_where)}",
            f"{self.exceeding} of {self.numel} elements exceed their rounding bound",
        ]
        if self.nonfinite_mismatches:
            lines.append(
                f"NaN or infinite in one tensor only (or infinities of opposite sign) at "
                f"{self.nonfinite_mismatches} of them: never rounding, but an overflow, an "
                f"inf - inf or a 0/0 in one of the two computations")
        return lines

    def _warnings(self) -> list[str]:
        """What makes the verdict say less than it seems: a vacuous bound, a scale mismatch."""
        lines = []
        if self.vacuous:
            lines.append(
                f"the bound is as large as the terms' magnitude itself ({self.terms} terms are "
                f"too many for {self._rounding_words()}): any difference up to it may be "
                f"rounding, so this comparison cannot tell a bug from rounding; pass terms="
                f"{'' if self.rounded_once else ' or rounded_once=True'} if you can")
        # A constant ratio within the bound (a 1-ulp difference on equal values) is rounding.
        if self.constant_ratio is not None and (self.verdict == "not rounding" or self.vacuous):
            lines.append(f"a / b = {self.constant_ratio:.6g} everywhere: a scale mismatch")
        return lines

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


@dataclasses.dataclass(frozen=True)
class Explanations(Mapping):
    """The comparison of two dicts of tensors (``name -> tensor``, as
    :func:`detsum.loss.batch_grad` returns), name by name: a read-only mapping from each name
    to its :class:`Explanation`, in ``a``'s order, with an overall verdict."""

    #: name -> the :class:`Explanation` of ``a[name]`` against ``b[name]``.
    parts: dict[object, Explanation]

    @property
    def verdict(self) -> str:
        """"not rounding" if any name's verdict is; else "rounding" if any name's is; else
        "identical" (also for two empty dicts)."""
        verdicts = {part.verdict for part in self.parts.values()}
        for verdict in ("not rounding", "rounding"):
            if verdict in verdicts:
                return verdict
        return "identical"

    def __getitem__(self, name: object) -> Explanation:
        return self.parts[name]

    def __iter__(self) -> Iterator:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __str__(self) -> str:
        """The overall verdict; a line per name, with the figures of those that are not
        rounding; the assumptions once."""
        parts = self.parts
        if self.verdict == "identical":
            return f"identical: all {len(parts)} tensors have the same bits"
        by_verdict = {verdict: [name for name, part in parts.items() if part.verdict == verdict]
                      for verdict in ("not rounding", "rounding", "identical")}
        counts = [f"{len(names)} {verdict}" for verdict, names in by_verdict.items() if names]
        lines = [f"verdict: {self.verdict} (of {len(parts)} tensors: {', '.join(counts)})"]
        assumptions = []
        for name, part in parts.items():
            head = f"{name!r}, {_name(part.dtype)} {list(part.shape)}: {part.verdict}"
            if part.verdict == "identical":
                lines.append(head)
                continue
            assumptions.append("assumed: " + part._arithmetic())
            if part.verdict == "rounding":
                lines.append(f"{head}, largest difference {part.max_abs:.3g} at "
                             f"{list(part.where)}, rounding bound there {part.bound:.3g}")
                lines += ["  " + line for line in part._warnings()]
                continue
            extra = part._warnings()
            if part.magnitude_estimated:
                extra.append(f"every term assumed at most {part.largest_term:.3g} in size")
            lines.append(head)
            lines += ["  " + line for line in (*part._figures(), *extra)]
        if any(part.magnitude_estimated for part in parts.values()):
            judged = next(part for part in parts.values() if part.verdict != "identical")
            assumptions.append(
                f"assumed: no magnitude given: in each tensor every term at most the largest "
                f"finite |a| or |b| of that tensor, so their absolute values sum to at most "
                f"{judged.terms} times that at every element; pass magnitude= (a dict with a's "
                f"names) for a sharper bound, and where the terms are much larger than every "
                f"result")
        else:
            assumptions.append("assumed: magnitude given (the sum of the terms' absolute "
                               "values)")
        lines += list(dict.fromkeys(assumptions))  # once each, in order
        if by_verdict["not rounding"]:
            lines.append(_CAUSES)
        return "\n".join(lines)


def explain(a: torch.Tensor | Mapping, b: torch.Tensor | Mapping, *,
            terms: int | None = None, magnitude: torch.Tensor | float | Mapping | None = None,
            rounded_once: bool = False) -> Explanation | Explanations:
    """Compare two tensors that should hold the same quantity computed two ways, or two dicts
    of them, name by name.

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

    The report names each figure at its own element: the largest absolute difference (with
    its distance in ulps and the rounding bound there), the largest distance in ulps (between
    values of opposite signs it counts every value down to 0 and up again: 0.01 and -0.01 are
    2e9 float32 ulps apart) and the largest relative difference, ``|a - b| / max(|a|, |b|)``,
    are often three different elements.

    Dicts of tensors (``name -> tensor``, as :func:`detsum.loss.batch_grad` returns; any
    mapping): ``a`` and ``b`` must hold the same names, and each ``a[name]`` is compared with
    ``b[name]`` as two tensors are, with the same ``terms`` and ``rounded_once``; without
    ``magnitude``, each tensor's bound assumes every term at most its own largest finite
    value. The result is an :class:`Explanations`, a mapping from each name (in ``a``'s
    order) to its :class:`Explanation`, whose ``verdict`` is "not rounding" if any name's
    is, else "rounding" if any name's is, else "identical"; ``str()`` of it gives a line per
    name, the figures of each name that is not rounding, and the assumptions once.

    An argument of the wrong type raises TypeError, a wrong value ValueError, each naming the
    argument (``a['0.weight']`` for a dict's tensor), its value and what was expected; two
    dicts with different names raise ValueError naming the names in one only; a tensor of
    ``torch.func.vmap`` raises RuntimeError (a report is not a tensor: call it outside
    ``vmap``).

    Args:
        a, b: same shape and float dtype; or two dicts with the same names, of such pairs.
        terms: how many values each element sums, or an upper bound on it (the batch size for
            an averaged gradient, the longest segment of a segmented sum): a positive int (not
            a bool or a float). Default 1024, generous for per-sample sums.
        magnitude: the sum of the terms' absolute values, per element (a tensor broadcastable
            to ``a``'s shape) or one number; finite and >= 0. For an averaged gradient, the
            mean of the per-sample gradients' absolute values. For dicts: one number, or a
            dict with ``a``'s names (each a number or a tensor broadcastable to that name's).
            Default: ``terms * T`` above.
        rounded_once: True when both ``a`` and ``b`` were accumulated in the acc type and
            rounded to the dtype once (detsum's ``"fp32"`` and ``"kahan"`` modes, torch's
            reductions with an fp32 accumulator): a sharper bound for bfloat16 and float16.
            Default False: the bound also covers rounding to the dtype after every add.

    Returns:
        An :class:`Explanation` (for dicts, an :class:`Explanations`); ``str()`` of it is a
        short report that states the assumptions and names the likely causes when the verdict
        is "not rounding".

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
        >>> grads = {"weight": torch.tensor([1.0, 2.0]), "bias": torch.tensor([0.5])}
        >>> report = detsum.explain(grads, {"weight": grads["weight"] * 2, "bias": grads["bias"]})
        >>> report.verdict, report["weight"].verdict, report["bias"].verdict
        ('not rounding', 'not rounding', 'identical')
    """
    caller = "detsum.explain"
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return _explain_each(caller, a, b, terms, magnitude, rounded_once)
    _check_pair(caller, "a", a, "b", b)
    n = _check_terms(caller, terms)
    _validation.check_flag(caller, "rounded_once", rounded_once)
    given_magnitude = _check_magnitude(caller, "magnitude", magnitude, "a", a.shape)
    return _compare(a, b, n, terms is None, given_magnitude, rounded_once)


def _explain_each(caller: str, a: object, b: object, terms: object, magnitude: object,
                  rounded_once: object) -> Explanations:
    """``explain`` of two dicts, name by name; every argument checked before any comparison."""
    if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
        raise TypeError(f"{caller}: a is a {type(a).__name__} but b is a {type(b).__name__}; "
                        f"expected two tensors, or two dicts of tensors (name -> tensor, as "
                        f"detsum.loss.batch_grad returns)")
    _check_same_names(caller, "b", b, a)
    for name in a:
        _check_pair(caller, f"a[{name!r}]", a[name], f"b[{name!r}]", b[name])
    n = _check_terms(caller, terms)
    _validation.check_flag(caller, "rounded_once", rounded_once)
    if isinstance(magnitude, Mapping):
        _check_same_names(caller, "magnitude", magnitude, a)
        magnitudes = {name: _check_magnitude(caller, f"magnitude[{name!r}]", magnitude[name],
                                             f"a[{name!r}]", a[name].shape) for name in a}
    elif isinstance(magnitude, torch.Tensor):
        raise TypeError(f"{caller}: magnitude is a tensor of shape {tuple(magnitude.shape)} but "
                        f"a and b are dicts; expected None, one number, or a dict with a's "
                        f"names")
    else:
        magnitudes = {name: _check_magnitude(caller, "magnitude", magnitude, f"a[{name!r}]",
                                             a[name].shape) for name in a}
    return Explanations({name: _compare(a[name], b[name], n, terms is None, magnitudes[name],
                                        rounded_once) for name in a})


def _check_same_names(caller: str, name: str, mapping: Mapping, a: Mapping) -> None:
    only_here = [key for key in mapping if key not in a]
    only_a = [key for key in a if key not in mapping]
    if only_here or only_a:
        raise ValueError(f"{caller}: a and {name} hold different names: {only_a} in a only, "
                         f"{only_here} in {name} only; expected the same names")


def _check_pair(caller: str, a_name: str, a: object, b_name: str, b: object) -> None:
    for name, t in ((a_name, a), (b_name, b)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{caller}: {name} must be a float tensor, got {got}")
    _refuse_vmap(caller, a_name, a)
    _refuse_vmap(caller, b_name, b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{caller}: {a_name} is {a.dtype} {tuple(a.shape)} but {b_name} is "
                         f"{b.dtype} {tuple(b.shape)}; expected the same shape and dtype")


def _refuse_vmap(caller: str, name: str, t: torch.Tensor) -> None:
    if _transforms.batched(t):
        raise RuntimeError(f"{caller}: {name} is a tensor of torch.func.vmap; explain compares "
                           f"two whole tensors and returns a report, not a tensor, so it cannot "
                           f"run per sample: call it outside vmap")


def _largest(values: torch.Tensor, shape: torch.Size) -> tuple[float, tuple[int, ...]]:
    """The largest of ``values`` (float64 of ``shape``, not empty, no NaN) and its element:
    the first one, in row-major order, where several are equal."""
    first = int(torch.argmax(values))
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), shape)) if len(
        shape) else ()
    return float(values[where]), where


def _compare(a: torch.Tensor, b: torch.Tensor, n: int, terms_assumed: bool,
             given_magnitude: torch.Tensor | None, rounded_once: bool) -> Explanation:
    """The :class:`Explanation` of two checked tensors."""
    a, b = a.detach().cpu(), b.detach().cpu()
    same = _same_bits(a, b)
    values = _elementwise(a, b)
    counted = min(n, _MANY_TERMS)
    largest_term = None
    if given_magnitude is None:
        # Norm-wise: one bound for every element, from the largest finite value anywhere, so an
        # element whose terms cancel is judged as leniently as the largest one.
        largest_term = (float(torch.maximum(values.abs_a.max(), values.abs_b.max()))
                        if a.numel() else 0.0)
        magnitude_sum = torch.tensor(counted * largest_term, dtype=torch.float64)
    else:
        magnitude_sum = given_magnitude
    growth = _growth(counted, _step_roundoff(a.dtype, rounded_once))
    bound = (_error_bound(values.abs_a, a.dtype, counted, magnitude_sum, growth)
             + _error_bound(values.abs_b, a.dtype, counted, magnitude_sum, growth)
             ).expand_as(values.diff)
    exceeding = int(((values.diff > bound) | values.nonfinite_mismatch).sum())
    verdict = "identical" if same else ("rounding" if exceeding == 0 else "not rounding")
    figures = _figures(a, b, values, bound, same) if a.numel() else {}
    return Explanation(
        verdict=verdict, **{"max_abs": 0.0, "where": None, "max_ulps": 0.0, "bound": 0.0,
                            **figures},
        exceeding=exceeding, numel=a.numel(), terms=n, terms_assumed=terms_assumed,
        magnitude_estimated=given_magnitude is None, dtype=a.dtype,
        constant_ratio=None if same else _constant_ratio(values),
        rounded_once=rounded_once, largest_term=largest_term,
        nonfinite_mismatches=int(values.nonfinite_mismatch.sum()), vacuous=growth >= 1,
        shape=tuple(a.shape))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits, NaN compared by position alone."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(nan_a, nan_b) and torch.equal(
        a.masked_fill(nan_a, 0).contiguous().view(bits),
        b.masked_fill(nan_b, 0).contiguous().view(bits))


class _Elementwise(NamedTuple):
    """Two tensors compared element by element, in float64."""

    da: torch.Tensor
    db: torch.Tensor
    #: |a| and |b| where finite, 0 elsewhere.
    abs_a: torch.Tensor
    abs_b: torch.Tensor
    both_finite: torch.Tensor
    #: NaN or infinite on one side only, or infinities of opposite sign.
    nonfinite_mismatch: torch.Tensor
    #: |a - b| where both are finite, inf at a mismatch, 0 at the same NaN or infinity.
    diff: torch.Tensor


def _elementwise(a: torch.Tensor, b: torch.Tensor) -> _Elementwise:
    da, db = a.double(), b.double()
    finite_a, finite_b = torch.isfinite(da), torch.isfinite(db)
    both_finite = finite_a & finite_b
    # The same NaN or infinity on both sides is the same value computed two ways; any other
    # non-finite element came from an overflow or an invalid operation on one side only.
    same_special = (torch.isnan(a) & torch.isnan(b)) | (~finite_a & (da == db))
    nonfinite_mismatch = ~both_finite & ~same_special
    diff = torch.where(both_finite, (da - db).abs(), torch.zeros_like(da))
    diff = diff.masked_fill(nonfinite_mismatch, math.inf)
    abs_a = torch.where(finite_a, da.abs(), torch.zeros_like(da))
    abs_b = torch.where(finite_b, db.abs(), torch.zeros_like(db))
    return _Elementwise(da, db, abs_a, abs_b, both_finite, nonfinite_mismatch, diff)


def _step_roundoff(dtype: torch.dtype, rounded_once: bool) -> float:
    """``u_op`` of ``explain``'s docstring: the unit roundoff of one rounding step."""
    acc_unit_roundoff = _UNIT_ROUNDOFF[acc_dtype(dtype)]
    if rounded_once or acc_dtype(dtype) == dtype:
        return acc_unit_roundoff
    # An add in the acc type, then its result rounded to the dtype: two roundings per add.
    return (1 + _UNIT_ROUNDOFF[dtype]) * (1 + acc_unit_roundoff) - 1


def _error_bound(abs_x: torch.Tensor, dtype: torch.dtype, terms: int,
                 magnitude_sum: torch.Tensor, growth: float) -> torch.Tensor:
    """``e(x)`` of ``explain``'s docstring at every element, ``abs_x`` holding ``|x|``."""
    cap = abs_x + magnitude_sum
    if math.isinf(growth):
        return cap  # growth * 0 would be NaN where the magnitude is 0
    underflow = terms * _SMALLEST_SUBNORMAL[dtype]
    return torch.minimum(growth * magnitude_sum + _UNIT_ROUNDOFF[dtype] * abs_x + underflow, cap)


def _constant_ratio(values: _Elementwise) -> float | None:
    """a / b where it is the same number (not 1) wherever both are nonzero, and every other
    finite element is 0 on both sides; else None."""
    da, db, both_finite = values.da, values.db, values.both_finite
    both = both_finite & (da != 0) & (db != 0)
    if not both.any() or values.nonfinite_mismatch.any():
        return None
    ratios = (da[both] / db[both])
    if bool((ratios == ratios[0]).all()) and ratios[0] != 1 and (~both).logical_and(
            (da != 0) | (db != 0)).logical_and(both_finite).sum() == 0:
        return float(ratios[0])
    return None


def _figures(a: torch.Tensor, b: torch.Tensor, values: _Elementwise, bound: torch.Tensor,
             same: bool) -> dict:
    """The figures of :class:`Explanation` for two tensors that are not empty."""
    # Each figure at its own element: the largest difference in absolute terms, in ulps
    # (values of opposite signs are far apart in ulps, every value down to 0 counting) and
    # relative to the values are often three different elements.
    ulps = reference.ulp_distance(a, b)
    larger = torch.maximum(values.abs_a, values.abs_b)
    relative = torch.where(larger > 0, values.diff / larger, torch.zeros_like(values.diff))
    relative = relative.masked_fill(values.nonfinite_mismatch, math.inf)
    max_abs, where = _largest(values.diff, a.shape)
    max_ulps, max_ulps_where = _largest(ulps, a.shape)
    max_rel, max_rel_where = _largest(relative, a.shape)
    figures = dict(max_abs=max_abs, bound=float(bound[where]), max_ulps=max_ulps,
                   ulps_at_where=float(ulps[where]), max_rel=max_rel)
    if not same:
        figures.update(where=where, max_ulps_where=max_ulps_where, max_rel_where=max_rel_where,
                       values_at={w: (float(values.da[w]), float(values.db[w]))
                                  for w in (where, max_ulps_where, max_rel_where)})
    return figures


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


def _check_magnitude(caller: str, name: str, magnitude: object, target: str,
                     shape: torch.Size) -> torch.Tensor | None:
    """The magnitude ``name`` of the tensor ``target`` as float64 on the CPU, or None; refused
    in detsum's words."""
    if magnitude is None:
        return None
    expected = (f"expected one number or a tensor broadcastable to {target}'s shape "
                f"{tuple(shape)}")
    must_be = "expected finite and >= 0 (the sum of the terms' absolute values)"
    if isinstance(magnitude, torch.Tensor):
        _refuse_vmap(caller, name, magnitude)
        if magnitude.dtype == torch.bool or magnitude.is_complex():
            raise TypeError(f"{caller}: {name} has dtype {magnitude.dtype}; {expected}, "
                            f"of real numbers")
        try:
            fits = torch.broadcast_shapes(magnitude.shape, shape) == shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"{caller}: {name} has shape {tuple(magnitude.shape)}; "
                             f"{expected}")
        values = magnitude.detach().cpu().double()
        bad = ~torch.isfinite(values) | (values < 0)
        if bad.any():
            raise ValueError(f"{caller}: {name} holds {values[bad][0].item()}; {must_be}")
        return values
    if isinstance(magnitude, bool) or not isinstance(magnitude, numbers.Real):
        raise TypeError(f"{caller}: {name}={magnitude!r}; {expected}")
    try:
        value = float(magnitude)
    except OverflowError:  # an int beyond float range
        value = math.inf
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{caller}: {name}={magnitude!r}; {must_be}")
    return torch.tensor(value, dtype=torch.float64)
