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
    #: Neumaier-compensated sum in the accumulator type, rounded once. For N values (terms and
    #: init) with exact sum S: ``|out - S| <= ulp(out) + 2 N**2 u**2 sum|x_i|`` (u = 2**-24 for
    #: an fp32 accumulator, 2**-53 for fp64): within 1 ulp unless the terms cancel heavily.
    KAHAN = "kahan"
    #: Accumulate in fp32 (fp64 for fp64 data) in canonical order, round once. The default.
    FP32 = "fp32"
    #: The exact sum, rounded once: correctly rounded, and the same bits for any order of the
    #: terms, any split and any backend or device.
    EXACT = "exact"

    def __str__(self) -> str:
        return self.value


MODES: tuple[str, ...] = tuple(m.value for m in Mode)
#: Each mode by its name: a dict lookup, where ``Mode(name)`` costs an Enum call.
MODE_BY_NAME: dict[str, Mode] = {m.value: m for m in Mode}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

# The numbers of the modes' arithmetic that code outside the kernels needs; the kernels, which
# compute that arithmetic, define them (see ``detsum.kernels``). The chunk length of the
# canonical order of "fp32" and "kahan" (part of the determinism contract):
CHUNK_TERMS = kernels.CHUNK_TERMS
# The exact state of "exact": limbs of LIMB_BITS bits, EXACT_LIMBS of them per element ("fp32"
# units for fp32-family data, "fp64" units for fp64), each dtype's rounding of an exact sum
# (EXACT_TARGETS), and the terms a normalised state absorbs (also the largest count an exact
# mean divides by):
LIMB_BITS = kernels.LIMB_BITS
EXACT_LIMBS = kernels.EXACT_LIMBS
EXACT_TARGETS = kernels.EXACT_TARGETS
MAX_TERMS_PER_STATE = kernels.MAX_TERMS_PER_STATE
# The accumulator type of each data dtype, which every mode but "autograd" sums in:
acc_dtype = kernels.acc_dtype


def parse_mode(mode: object, *, caller: str) -> Mode:
    """Return the Mode for ``mode`` (a string or a Mode) or raise ValueError naming the choices."""
    # A membership test rather than Mode(mode) in a try: torch.compile cannot trace an Enum
    # lookup that fails.
    if isinstance(mode, Mode):
        return mode
    if isinstance(mode, str) and mode in MODES:
        return MODE_BY_NAME[mode]
    raise ValueError(f"{caller}: mode={mode!r} is not a detsum mode; expected one of {MODES}")


def parse_ordered_mode(mode: object, *, caller: str, why_not_autograd: str) -> Mode:
    """``parse_mode`` for the sums that torch never computes itself (a running sum, a batch
    reduction): ``"autograd"`` has nothing to reproduce there and is refused, with the reason."""
    mode = parse_mode(mode, caller=caller)
    if mode is Mode.AUTOGRAD:
        raise ValueError(f"{caller}: mode='autograd' has no meaning {why_not_autograd}; "
                         f"use mode='fp32', 'kahan' or 'exact'")
    return mode


def rule_for(mode: Mode, reduce: str, device_type: str, slice_size: int) -> int:
    """The kernel rule that implements ``mode`` for ``reduce`` on ``device_type``.

    ``slice_size`` is the number of elements after the reduced dim (1 for an element-wise
    scatter): torch's CUDA ``index_put_`` picks its kernel, and so its arithmetic, by it.

    "autograd" mode reproduces torch on the device: for ``sum`` that is index_put_'s
    accumulation (CPU: round to the dtype after every add; CUDA: one of three kernels by slice
    size, see ``detsum.kernels``); for ``mean`` it is torch's CPU ``scatter_reduce``, which
    rounds the fp32 sum to the dtype before dividing by the count it keeps in the dtype (the
    kernels' ROUND_EACH applied to a mean). On CUDA, ``scatter_reduce``'s "autograd" mean is
    torch's deterministic one, this module's sum rule and then torch's division
    (``scatter_reduce._torch_cuda_mean``), which asks for the "sum" rule.
    ``prod``/``amax``/``amin`` have no rounding choice: "autograd" keeps torch's unsplit
    serial order (ROUND_EACH), the other modes the chunked canonical order (WIDE);
    ``amax``/``amin`` are exact either way, so "exact" takes WIDE there. "exact" is the EXACT
    rule for ``sum`` and ``mean`` on every device; it has no ``prod`` (callers refuse it: see
    ``scatter_reduce``).
    """
    if reduce not in ("sum", "mean"):
        if mode is Mode.EXACT and reduce == "prod":
            raise ValueError("mode='exact' has no rule for a product")
        return kernels.ROUND_EACH if mode is Mode.AUTOGRAD else kernels.WIDE
    if mode is Mode.EXACT:
        return kernels.EXACT
    if mode is Mode.KAHAN:
        return kernels.KAHAN
    if mode is Mode.FP32:
        return kernels.WIDE
    if device_type == "cpu" or reduce == "mean":
        return kernels.ROUND_EACH
    if device_type == "cuda":
        if slice_size > 32:
            return kernels.ROUND_EACH  # indexing_backward_kernel
        if slice_size > 1:
            return kernels.CUDA_SMALL_STRIDE  # indexing_backward_kernel_small_stride
        return kernels.CUDA_STRIDE_1  # indexing_backward_kernel_stride_1
    raise NotImplementedError(f"'autograd' mode on {device_type!r} tensors is not implemented")
