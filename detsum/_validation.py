"""Argument checks shared by the primitives.

Metadata checks (types, shapes, devices) run in the public functions, before any operator is
called, so they also run at trace time under torch.compile. Checks that read index values run
inside the operators, fused with the pass that builds the segments, before anything is written.
Every message names the function, the argument, what came and what was expected.
"""

from __future__ import annotations

import numbers

import torch

from detsum.modes import FLOAT_DTYPES, INDEX_DTYPES


def check_float(caller: str, name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{caller}: {name} has dtype {t.dtype}; expected one of "
            f"{', '.join(str(d) for d in FLOAT_DTYPES)}"
        )
    if t.dim() == 0:
        raise ValueError(f"{caller}: {name} is 0-dimensional; expected at least 1 dimension")


def check_index(caller: str, name: str, t: object, *, one_d: bool,
                dtype_error: type[Exception] = TypeError) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise dtype_error(f"{caller}: {name} has dtype {t.dtype}; expected torch.int32 or torch.int64")
    if one_d and t.dim() != 1:
        raise ValueError(f"{caller}: {name} must be 1-D, got shape {tuple(t.shape)}")


def check_dim(caller: str, dim: object, ndim: int) -> int:
    """Normalise ``dim`` (negative counts from the end) or raise IndexError."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{caller}: dim must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise IndexError(f"{caller}: dim={dim} is out of range for a {ndim}-D tensor "
                         f"(expected {-ndim} <= dim < {ndim})")
    return int(dim) % ndim


def check_same_device(caller: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"{caller}: all tensors must be on one device; got {listed}")


def check_same_dtype(caller: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{caller}: {name_b} has dtype {b.dtype} but {name_a} has {a.dtype}; "
                         f"expected the same dtype")


def check_shapes_except_dim(caller: str, name_a: str, a: torch.Tensor, name_b: str,
                            b: torch.Tensor, dim: int) -> None:
    """``a`` and ``b`` must agree in rank and in every size except along ``dim``."""
    if a.dim() != b.dim() or any(
        sa != sb for d, (sa, sb) in enumerate(zip(a.shape, b.shape)) if d != dim
    ):
        raise ValueError(
            f"{caller}: {name_b} has shape {tuple(b.shape)} but {name_a} has "
            f"{tuple(a.shape)}; expected the same shape except along dim {dim}"
        )


def check_alpha(caller: str, alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"{caller}: alpha must be a real number, got {alpha!r}")
    return float(alpha)


def raise_index_out_of_range(caller: str, name: str, index: torch.Tensor, position: int,
                             size: int, what: str) -> None:
    value = int(index.reshape(-1)[position])
    where = f"{name}[{position}]" if index.dim() == 1 else (
        f"{name}{list(_unravel(position, index.shape))}")
    raise IndexError(f"{caller}: {where} = {value} is out of range for {what} = {size} "
                     f"(expected 0 <= {name} < {size})")


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))
