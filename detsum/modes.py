"""The accumulation modes and the arithmetic each one stands for.

A mode is what users choose; a *rule* (an integer code from ``detsum.kernels``) is what a kernel
executes. The mapping from (mode, reduction, dtype, device) to rule lives here and nowhere
else, so a new mode or a new device is one edit.
"""

from __future__ import annotations

import enum

import torch

from detsum import kernels


class Mode(str, enum.Enum):
    """Accumulation modes. Each member compares equal to its string value."""

    #: Bit-identical to what PyTorch autograd computes on the same device (the gradient of
    #: ``x[index]``, i.e. ``index_put_(..., accumulate=True)``).
    AUTOGRAD = "autograd"
    #: Neumaier-compensated sum in the accumulator type, rounded once: within 1 ulp of exact.
    KAHAN = "kahan"
    #: Accumulate in fp32 (fp64 for fp64 data) in canonical order, round once. The default.
    FP32 = "fp32"

    def __str__(self) -> str:
        return self.value


MODES: tuple[str, ...] = tuple(m.value for m in Mode)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def parse_mode(mode: object, *, caller: str) -> Mode:
    """Return the Mode for ``mode`` (a string or a Mode) or raise ValueError naming the choices."""
    try:
        return Mode(mode)
    except ValueError:
        raise ValueError(
            f"{caller}: mode={mode!r} is not a detsum mode; expected one of {MODES}"
        ) from None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator type of SPEC: fp64 for fp64 data, fp32 for everything narrower."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rule_for(mode: Mode, reduce: str, device_type: str) -> int:
    """The kernel rule that implements ``mode`` for ``reduce`` on ``device_type``.

    "autograd" mode reproduces torch on the device: for ``sum`` that is index_put_'s
    accumulation (on CPU: round to the dtype after every add); for ``mean`` it is torch's
    ``scatter_reduce``, which rounds the fp32 sum to the dtype before dividing (the kernels'
    ROUND_EACH applied to a mean). ``prod`` is the wide serial product in every mode (torch's
    CPU ``scatter_reduce`` computes exactly that); ``amax``/``amin`` are exact, so their rule
    is irrelevant.
    """
    if mode is Mode.KAHAN and reduce in ("sum", "mean"):
        return kernels.KAHAN
    if mode is Mode.AUTOGRAD and reduce in ("sum", "mean"):
        if device_type == "cpu":
            return kernels.ROUND_EACH
        raise NotImplementedError(
            f"'autograd' mode on {device_type!r} tensors is not implemented yet"
        )
    return kernels.WIDE
