"""Deterministic batch-loss reduction.

Every sum here is a ``detsum.segment_sum`` in index order, so the result has one order, the
canonical one, on every run, thread count and device; ``torch.sum`` picks its own order (a
vectorised cascade on CPU, a tree on GPU) and so does matmul inside autograd. ``"autograd"``
mode has no meaning here (autograd's batch reduction order lives inside matmul kernels), and is
refused.
"""

from __future__ import annotations

import torch

from detsum import _validation
from detsum.modes import Mode, acc_dtype, parse_mode

__all__ = ["reduce"]

REDUCTIONS = ("mean", "sum")


def _parse_mode(mode: object, caller: str) -> Mode:
    mode = parse_mode(mode, caller=caller)
    if mode is Mode.AUTOGRAD:
        raise ValueError(
            f"{caller}: mode='autograd' has no meaning for a batch reduction (autograd's order "
            f"there lives inside matmul kernels, and no detsum primitive can reproduce it); "
            f"use mode='fp32' or mode='kahan'")
    return mode


def _check_float_tensor(caller: str, name: str, t: object) -> None:
    """A tensor of a supported float dtype, of any shape (0-dim included)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
    _validation.check_float(caller, name, t.reshape(-1))


def _ordered_sum(values: torch.Tensor, mode: Mode) -> torch.Tensor:
    """0-dim sum of a 1-D acc-type tensor, in index order, in ``mode`` (no final rounding
    beyond the acc type)."""
    offsets = torch.arange(2, device=values.device) * values.shape[0]
    return torch.ops.detsum.segment_sum(values, offsets, 0, None, mode.value).view(())


def reduce(losses: torch.Tensor, reduction: str = "mean", *, weight: torch.Tensor | None = None,
           mode: str | Mode = "fp32") -> torch.Tensor:
    """Sum or average per-sample losses in a fixed order: the same bits on every run and device.

    Args:
        losses: per-sample (or per-element) losses, any shape, float32/float16/bfloat16/float64,
            at least one element.
        reduction: ``"mean"`` (default) or ``"sum"``.
        weight: optional weights of ``losses``' shape: the weighted mean
            ``sum(weight * losses) / sum(weight)`` (``"sum"``: ``sum(weight * losses)``).
        mode: ``"fp32"`` (default) or ``"kahan"``; ``"autograd"`` is refused (see the module).

    Returns:
        A 0-dim tensor of ``losses``' dtype.

    Order and rounding: the elements in index order (``losses.reshape(-1)``), converted
    exactly to the acc type (fp32; fp64 for float64), weighted products rounded once to the acc
    type, summed as ``detsum.segment_sum`` does in ``mode`` (``"kahan"``: within 1 ulp of the
    exact sum), divided in the acc type, rounded once to the dtype.

    Gradient: ``1 / n`` (``"mean"``), ``1`` (``"sum"``) or ``weight / sum(weight)`` for each
    element, computed in the acc type and rounded once.

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> loss.reduce(torch.tensor([1.0, 2.0, 4.0]), "mean")
        tensor(2.3333)
    """
    caller = "detsum.loss.reduce"
    mode = _parse_mode(mode, caller)
    _check_float_tensor(caller, "losses", losses)
    if losses.numel() == 0:
        raise ValueError(f"{caller}: losses is empty; expected at least one loss (an empty "
                         f"batch has no mean)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{caller}: reduction={reduction!r}; expected one of {REDUCTIONS}")
    acc = acc_dtype(losses.dtype)
    values = losses.reshape(-1).to(acc)
    if weight is not None:
        _check_float_tensor(caller, "weight", weight)
        if weight.shape != losses.shape:
            raise ValueError(f"{caller}: weight has shape {tuple(weight.shape)}; expected "
                             f"losses' shape {tuple(losses.shape)}")
        _validation.check_same_device(caller, losses=losses, weight=weight)
        weights = weight.reshape(-1).to(acc)
        total = _ordered_sum(values * weights, mode)
        if reduction == "mean":
            total = total / _ordered_sum(weights, mode)
    else:
        total = _ordered_sum(values, mode)
        if reduction == "mean":
            total = total / values.shape[0]
    return total.to(losses.dtype)
