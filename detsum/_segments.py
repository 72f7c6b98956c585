"""What the three primitives share: the [outer, rows, inner] view, the segment plan, the launch.

Every primitive is a segmented reduction: output row ``s`` (along ``dim``) reduces an ordered
list of source rows. ``order`` and ``offsets`` describe those lists in CSR form, built by one
stable pass over the index (its order *is* the canonical order of the determinism contract).
"""

from __future__ import annotations

import math

import torch

from detsum import kernels
from detsum._validation import raise_index_out_of_range

#: Tests set this to True: every output is NaN-filled before a kernel writes it, so an element
#: a kernel forgets to write fails the bitwise comparison instead of passing by luck.
POISON_OUTPUTS = False


def rows_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``[outer, t.size(dim), inner]``; a view whenever the strides allow one."""
    outer = math.prod(t.shape[:dim])
    inner = math.prod(t.shape[dim + 1:])
    return t.reshape(outer, t.shape[dim], inner)


def new_output(like3: torch.Tensor, num_segments: int) -> torch.Tensor:
    out = torch.empty((like3.shape[0], num_segments, like3.shape[2]), dtype=like3.dtype,
                      device=like3.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def plan_from_index(caller: str, index: torch.Tensor, num_segments: int, *,
                    index_name: str, size_name: str, promised_sorted: bool
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(order, offsets) of the segments that a 1-D ``index`` defines, after checking its values.

    One pass over the index validates the range (and, when the caller promised a sorted index,
    its order) and counts; a stable counting sort then lists each segment's positions in order
    of appearance. A promised-sorted index needs no order: its segments are contiguous.
    """
    if index.device.type != "cpu":
        raise NotImplementedError(f"{caller}: {index.device.type!r} tensors are not supported yet")
    from detsum.kernels.numba import plan

    if promised_sorted:
        offsets, first_bad, first_unsorted = plan.check_sorted_offsets(index, num_segments)
        if first_bad >= 0:
            raise_index_out_of_range(caller, index_name, index, first_bad, num_segments, size_name)
        if first_unsorted >= 0:
            raise ValueError(
                f"{caller}: sorted=True but {index_name} decreases at position {first_unsorted} "
                f"({int(index[first_unsorted - 1])} then {int(index[first_unsorted])}); "
                f"expected a nondecreasing index, or pass sorted=False")
        return None, offsets
    order, offsets, first_bad = plan.counting_sort(index, num_segments)
    if first_bad >= 0:
        raise_index_out_of_range(caller, index_name, index, first_bad, num_segments, size_name)
    return order, offsets


def plan_from_keys(keys: torch.Tensor, num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets) for 1-D ``keys`` already known to lie in ``[0, num_segments)``."""
    from detsum.kernels.numba import plan

    order, offsets, _ = plan.counting_sort(keys, num_segments)
    return order, offsets


def launch(backend_name: str, src3: torch.Tensor, order: torch.Tensor | None,
           offsets: torch.Tensor, base3: torch.Tensor | None, out3: torch.Tensor, *,
           reduce: str, rule: int, alpha: float, include_base: bool) -> None:
    """Run the segmented reduction on ``backend_name``'s kernel, writing ``out3``."""
    if backend_name == "numba":
        if src3.device.type != "cpu":
            raise ValueError(f"the numba backend runs CPU tensors only, got {src3.device}")
        from detsum.kernels.numba.segment import segment_reduce
    elif backend_name == "triton":
        raise NotImplementedError("the triton backend is not implemented yet")
    else:
        raise AssertionError(f"no kernel launcher for backend {backend_name!r}")
    segment_reduce(src3, order, offsets, base3, out3, reduce=kernels.REDUCE_CODES[reduce],
                   rule=rule, alpha=alpha, include_base=include_base)
