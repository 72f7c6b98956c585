"""RunningSum: a sum over rows that arrive in pieces, with the bits of one call over all of them.

The canonical order of ``"fp32"`` and ``"kahan"`` cuts a long sum into chunks of
``CHUNK_TERMS`` terms at fixed positions (see ``detsum.kernels``). A RunningSum keeps the state
of that computation between calls, in the acc type: the folded total, the chunk in progress and,
under ``"kahan"``, both compensations. Pieces are cut where they cross a chunk boundary, and each
part continues the state through the kernels' carried-compensation launch. So the result
depends on the terms and their order only, never on where the pieces were cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detsum import _segments, _validation, reference
from detsum.backend import current_backend
from detsum.kernels import CHUNK_TERMS, KAHAN, WIDE
from detsum.modes import FLOAT_DTYPES, Mode, acc_dtype, parse_ordered_mode

__all__ = ["RunningSum"]


def _resume(total: torch.Tensor, comp: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Continue the running sum ``total`` (1-D, acc type; ``comp`` its Kahan compensation, or
    None for a plain wide sum) over ``rows`` ``[n, total.numel()]``, in place."""
    n = rows.shape[0]
    if n == 0:
        return
    backend_name = current_backend(total.device.type, "detsum.RunningSum.add")
    if backend_name == "reference":
        s, c = reference.resume_sum(total, comp, list(rows))
        total.copy_(s)
        if comp is not None:
            comp.copy_(c)
        return
    state3 = total.view(1, 1, -1)
    _segments.launch(backend_name, rows.unsqueeze(0), None, _segments.one_segment(n, total.device),
                     state3, state3, reduce="sum", rule=KAHAN if comp is not None else WIDE,
                     alpha=1.0, include_base=True,
                     carry3=None if comp is None else comp.view(1, 1, -1))


class RunningSum:
    """A deterministic sum of rows added in any number of pieces.

    ``add`` takes rows ``[k, *shape]``; ``sum()`` and ``mean()`` return the reduction over all
    rows added so far, in the order added. The bits are those of ``detsum.segment_sum`` over
    all the rows at once (dim 0, one segment) in the same mode, whatever the sizes of the
    pieces: 1, 3 or all rows at a time give the same result.

    Args:
        shape: the shape of one row.
        dtype: the rows' dtype (float32, float16, bfloat16 or float64). The state is kept in
            the acc type (fp64 for float64, fp32 otherwise); results are rounded once to dtype.
        device: where the rows and the state live.
        mode: ``"fp32"`` (default) or ``"kahan"``. ``"autograd"`` has no meaning for a sum
            that torch never computes in pieces, and is refused.

    Memory: the state is two (``"fp32"``) or four (``"kahan"``) acc-type tensors of ``shape``;
    a piece is converted to the acc type before it is added (a copy only for float16/bfloat16).

    Example:
        >>> import torch, detsum
        >>> rows = torch.randn(10, 3)
        >>> running = detsum.RunningSum((3,), mode="kahan")
        >>> running.add(rows[:4]); running.add(rows[4:])
        >>> offsets = torch.tensor([0, 10])
        >>> torch.equal(running.sum(), detsum.segment_sum(rows, offsets, mode="kahan")[0])
        True
    """

    def __init__(self, shape: Sequence[int] | torch.Size, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", mode: str | Mode = "fp32"):
        caller = "detsum.RunningSum"
        self.mode = parse_ordered_mode(
            mode, caller=caller,
            why_not_autograd="for a sum that arrives in pieces (torch computes none to reproduce)")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{caller}: dtype={dtype}; expected one of "
                            f"{', '.join(str(d) for d in FLOAT_DTYPES)}")
        self.shape = _validation.check_shape(caller, "shape", shape)
        device = _validation.check_device(caller, "device", device)
        self.dtype = dtype
        self.count = 0
        acc = acc_dtype(dtype)
        kahan = self.mode is Mode.KAHAN
        numel = self.shape.numel()
        # Chunk 0 and the folded total of the later chunks (the contract folds into chunk 0).
        self._total = torch.zeros(numel, dtype=acc, device=device)
        # The device as tensors report it ("cuda" -> "cuda:0", "cpu:0" -> "cpu"), so that
        # add() can compare it with its rows' device.
        self.device = self._total.device
        self._total_comp = torch.zeros_like(self._total) if kahan else None
        # The chunk in progress after chunk 0: it starts from its own first term.
        self._part = torch.empty_like(self._total)
        self._part_comp = torch.empty_like(self._total) if kahan else None

    def add(self, rows: torch.Tensor) -> None:
        """Add ``rows`` ``[k, *shape]`` (k may be 0) after the rows added so far."""
        caller = "detsum.RunningSum.add"
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"{caller}: rows must be a torch.Tensor, got {type(rows).__name__}")
        if rows.dtype != self.dtype:
            raise TypeError(f"{caller}: rows has dtype {rows.dtype}; expected {self.dtype} "
                            f"(the dtype this sum was created with)")
        if rows.dim() != len(self.shape) + 1 or rows.shape[1:] != self.shape:
            raise ValueError(f"{caller}: rows has shape {tuple(rows.shape)}; expected "
                             f"[k, {', '.join(map(str, self.shape))}]")
        if rows.device != self.device:
            raise ValueError(f"{caller}: rows is on {rows.device}; expected {self.device}")
        flat = rows.reshape(rows.shape[0], self._total.numel()).to(self._total.dtype)
        start = 0
        while start < flat.shape[0]:
            filled = self.count % CHUNK_TERMS
            piece = flat[start:start + CHUNK_TERMS - filled]
            start += piece.shape[0]
            if self.count < CHUNK_TERMS:
                _resume(self._total, self._total_comp, piece)
            else:
                if filled == 0:
                    self._part.copy_(piece[0])
                    if self._part_comp is not None:
                        self._part_comp.zero_()
                    _resume(self._part, self._part_comp, piece[1:])
                else:
                    _resume(self._part, self._part_comp, piece)
            self.count += piece.shape[0]
            if self.count > CHUNK_TERMS and self.count % CHUNK_TERMS == 0:
                self._fold_part(self._total, self._total_comp)

    def _fold_part(self, total: torch.Tensor, total_comp: torch.Tensor | None) -> None:
        """Fold the chunk in progress into (total, total_comp): the contract's chunk fold."""
        _resume(total, total_comp, self._part.unsqueeze(0))
        if total_comp is not None:
            _resume(total_comp, None, self._part_comp.unsqueeze(0))

    def _value(self) -> torch.Tensor:
        """The sum so far in the acc type: state left as it is, so adding may go on."""
        total = self._total.clone()
        total_comp = None if self._total_comp is None else self._total_comp.clone()
        if self.count > CHUNK_TERMS and self.count % CHUNK_TERMS != 0:
            self._fold_part(total, total_comp)
        if total_comp is None:
            return total
        compensated = total.clone()
        _resume(compensated, None, total_comp.unsqueeze(0))
        # The kernels' final step: s + c only for a finite s and a nonzero c.
        return torch.where(torch.isfinite(total) & (total_comp != 0), compensated, total)

    def sum(self) -> torch.Tensor:
        """The sum of every row added, rounded once to dtype (zeros before any row)."""
        return self._value().to(self.dtype).view(self.shape)

    def mean(self) -> torch.Tensor:
        """The sum divided by the row count in the acc type, rounded once to dtype."""
        if self.count == 0:
            raise ValueError("detsum.RunningSum.mean: no rows were added; the mean of nothing "
                             "is undefined")
        return (self._value() / self.count).to(self.dtype).view(self.shape)

