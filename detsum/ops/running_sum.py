"""RunningSum: a sum over rows that arrive in pieces, with the bits of one call over all of them.

The canonical order of ``"fp32"`` and ``"kahan"`` cuts a long sum into chunks of
``CHUNK_TERMS`` terms at fixed positions (see ``detsum.kernels``). A RunningSum keeps the state
of that computation between calls, in the acc type: the folded total, the chunk in progress and,
under ``"kahan"``, both compensations. Pieces are cut where they cross a chunk boundary, and each
part continues the state through the kernels' carried-compensation launch. So the result
depends on the terms and their order only, never on where the pieces were cut.

``"exact"`` needs none of that: its state is the exact sum itself, as integers (``_limbs``), so
pieces, merges and all-reduces of states add up to the same state in any order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detsum import _kernel_ops, _limbs, _transforms, _validation
from detsum.backend import current_backend
from detsum.modes import (CHUNK_TERMS, FLOAT_DTYPES, MAX_TERMS_PER_STATE, Mode, acc_dtype,
                          parse_ordered_mode)

__all__ = ["RunningSum"]


#: Why a RunningSum takes no tensor of a torch.func transform.
_OUTSIDE_TRANSFORMS = ("a RunningSum keeps its state between calls, outside every transform, and "
                       "has no gradient: add the rows outside the transform (or, for a "
                       "gradient, differentiate detsum.segment_sum over all the rows, the same "
                       "bits)")


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
        mode: ``"fp32"`` (default), ``"kahan"`` or ``"exact"``. ``"autograd"`` has no meaning
            for a sum that torch never computes in pieces, and is refused.

    ``"exact"``: ``sum()`` is the exact sum of every row added, rounded once (correctly
    rounded), and does not depend on the order of the rows either. Such sums also ``merge``
    (two running sums of rows added anywhere, in any order, give the state of one sum over
    all their rows), and their ``state()`` is an int64 tensor whose elementwise integer sum
    over several running sums is the state of the merged sum, so that
    ``torch.distributed.all_reduce(state, SUM)`` then ``load_state`` sums over ranks exactly;
    :func:`detsum.distributed.all_reduce_` does the same with a fraction of the bytes.

    State layout (``"exact"``): a 1-D int64 tensor, ``[rows added, element 0, element 1,
    ...]`` over the ``prod(shape)`` elements in row-major order; an element is ``L`` limbs
    (``L = 10`` for bf16/fp16/fp32 rows, 67 for fp64) and four counters: NaN terms, +inf
    terms, -inf terms, terms other than -0.0. The limbs hold the exact sum as an integer of
    units (``2**-149``, or ``2**-1074`` for fp64) in base ``2**32``, lowest limb first, kept
    normalised (every limb but the last in ``[0, 2**32)``) between calls. Limits: a normalised
    state takes ``2**30 - 1`` terms (about 10**9) before an int64 could overflow; ``add``
    normalises after every that many rows, so pieces may be of any size, and a merge or
    all-reduce of fewer than ``2**31`` normalised states cannot overflow. ``mean()`` divides
    by at most ``2**30 - 1`` rows and refuses more (a clear error, never a wrong result).

    Memory: the state is two (``"fp32"``) or four (``"kahan"``) acc-type tensors of ``shape``,
    or ``L + 4`` int64 per element (``"exact"``: 112 bytes per element for fp32-family rows,
    568 for fp64); a piece is converted to the acc type before it is added (a copy only for
    float16/bfloat16), and ``"exact"`` decomposes it in steps of about 4M terms.

    Example:
        >>> import torch, detsum
        >>> rows = torch.randn(10, 3)
        >>> running = detsum.RunningSum((3,), mode="kahan")
        >>> running.add(rows[:4]); running.add(rows[4:])
        >>> offsets = torch.tensor([0, 10])
        >>> torch.equal(running.sum(), detsum.segment_sum(rows, offsets, mode="kahan")[0])
        True
        >>> a, b = detsum.RunningSum((3,), mode="exact"), detsum.RunningSum((3,), mode="exact")
        >>> a.add(rows[7:]); b.add(rows[:7]); a.merge(b)
        >>> torch.equal(a.sum(), detsum.segment_sum(rows, offsets, mode="exact")[0])
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
        current_backend(device.type, caller)  # a device detsum runs (not "meta")
        self.dtype = dtype
        self.count = 0
        acc = acc_dtype(dtype)
        self._acc = acc
        kahan = self.mode is Mode.KAHAN
        numel = self.shape.numel()
        if self.mode is Mode.EXACT:
            self._state = _limbs.new_state(numel, acc, device)
            self.device = self._state.device
            return
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
        """Add ``rows`` ``[k, *shape]`` (k may be 0) after the rows added so far. The state
        holds values alone: rows that require grad are read as values (a logged loss, say),
        and ``sum()`` has no gradient (differentiate ``detsum.segment_sum`` over all the rows
        instead: the same bits). A tensor of a ``torch.func`` transform, or one that carries a
        forward-mode tangent, raises RuntimeError: the state outlives the transform."""
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
        _transforms.refuse_transformed(caller, "rows", rows, _OUTSIDE_TRANSFORMS)
        self._check_changeable(caller)
        if self.mode is Mode.EXACT:
            _kernel_ops.add_exact_terms(
                self._state, rows.reshape(rows.shape[0], self.shape.numel()).to(self._acc))
            self.count += rows.shape[0]
            return
        flat = rows.reshape(rows.shape[0], self._total.numel()).to(self._total.dtype)
        self._continue(flat.shape[0], lambda total, comp, lo, hi: _kernel_ops.resume_sum(
                           total, comp, flat[lo:hi]),
                       lambda i, out: out.copy_(flat[i]))

    def _check_changeable(self, caller: str, owner: str = "running sum") -> None:
        """This sum may change: a sum made under ``torch.inference_mode()`` keeps its state in
        inference tensors, which nothing may change outside inference mode. ``owner`` names
        what the caller made (an accumulator holds running sums)."""
        _validation.check_changeable(
            caller, f"the {owner}'s state", self._state if self.mode is Mode.EXACT
            else self._total, remedy=f"make the {owner} outside torch.inference_mode()")

    def _add_products(self, left: torch.Tensor, right: torch.Tensor) -> None:
        """Add the rows ``left[i] (x) right[i]`` (``[k, O]`` and ``[k, K]``, this sum's dtype,
        for a ``shape`` of ``(O, K)``): each element ``RN_dtype(left[i, o] * right[i, k])``,
        as ``add`` would add those rows materialised, with the same bits, without forming
        them. Arguments are the caller's to check (``detsum.loss.GradAccumulator``)."""
        k = left.shape[0]
        if self.mode is Mode.EXACT:
            _kernel_ops.add_exact_outer_products(self._state, left, right, self._acc)
            self.count += k
            return
        self._continue(k, lambda total, comp, lo, hi: _kernel_ops.resume_outer_products(
                           total, comp, left[lo:hi], right[lo:hi]),
                       lambda i, out: out.view(left.shape[1], right.shape[1]).copy_(
                           torch.mul(left[i].unsqueeze(1), right[i])))

    def _continue(self, n: int, resume, first_row) -> None:
        """Add ``n`` rows, cutting them at the contract's chunk boundaries: ``resume(total,
        comp, lo, hi)`` continues the running sum ``total`` (``comp``: its compensation, or
        None) over rows ``lo .. hi - 1``; ``first_row(i, out)`` writes row ``i`` into ``out``
        (acc type), where a later chunk starts from its own first term."""
        start = 0
        while start < n:
            filled = self.count % CHUNK_TERMS
            stop = min(n, start + CHUNK_TERMS - filled)
            if self.count < CHUNK_TERMS:
                resume(self._total, self._total_comp, start, stop)
            elif filled == 0:
                first_row(start, self._part)
                if self._part_comp is not None:
                    self._part_comp.zero_()
                resume(self._part, self._part_comp, start + 1, stop)
            else:
                resume(self._part, self._part_comp, start, stop)
            self.count += stop - start
            start = stop
            if self.count > CHUNK_TERMS and self.count % CHUNK_TERMS == 0:
                self._fold_part(self._total, self._total_comp)

    def _fold_part(self, total: torch.Tensor, total_comp: torch.Tensor | None) -> None:
        """Fold the chunk in progress into (total, total_comp): the contract's chunk fold."""
        _kernel_ops.resume_sum(total, total_comp, self._part.unsqueeze(0))
        if total_comp is not None:
            _kernel_ops.resume_sum(total_comp, None, self._part_comp.unsqueeze(0))

    def _value(self) -> torch.Tensor:
        """The sum so far in the acc type: state left as it is, so adding may go on."""
        total = self._total.clone()
        total_comp = None if self._total_comp is None else self._total_comp.clone()
        if self.count > CHUNK_TERMS and self.count % CHUNK_TERMS != 0:
            self._fold_part(total, total_comp)
        if total_comp is None:
            return total
        return _kernel_ops.kahan_result(total, total_comp)

    def sum(self) -> torch.Tensor:
        """The sum of every row added, rounded once to dtype (zeros before any row)."""
        if self.mode is Mode.EXACT:
            if self.count == 0:
                return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            return _kernel_ops.round_exact_state(self._state, self._acc,
                                                 self.dtype).view(self.shape)
        return self._value().to(self.dtype).view(self.shape)

    def mean(self) -> torch.Tensor:
        """The sum divided by the row count in the acc type, rounded once to dtype
        (``"exact"``: the exact sum divided by the count, rounded once)."""
        caller = "detsum.RunningSum.mean"
        if self.count == 0:
            raise ValueError(f"{caller}: no rows were added; the mean of nothing is undefined")
        if self.mode is Mode.EXACT:
            if self.count > MAX_TERMS_PER_STATE:
                raise ValueError(f"{caller}: {self.count} rows were added; an exact mean "
                                 f"divides by at most {MAX_TERMS_PER_STATE} (use sum())")
            return _kernel_ops.round_exact_state(self._state, self._acc, self.dtype,
                                                 count=self.count).view(self.shape)
        return (self._value() / self.count).to(self.dtype).view(self.shape)

    # ---- "exact" only: merging and the integer state ------------------------------------

    def _check_exact(self, caller: str) -> None:
        if self.mode is not Mode.EXACT:
            raise ValueError(f"{caller}: this running sum has mode={self.mode.value!r}; only "
                             f"mode='exact' sums can be merged or exchange their state (the "
                             f"others depend on the order of their rows)")

    def merge(self, other: RunningSum) -> None:
        """Add the rows of ``other`` (another ``"exact"`` running sum of the same shape, dtype
        and device) to this one, in place; ``other`` is unchanged. Merging in any order, or
        adding all the rows to one sum, gives the same state."""
        caller = "detsum.RunningSum.merge"
        self._check_exact(caller)
        if not isinstance(other, RunningSum):
            raise TypeError(f"{caller}: other must be a detsum.RunningSum, got "
                            f"{type(other).__name__}")
        mine = (self.shape, self.dtype, self.device, self.mode)
        theirs = (other.shape, other.dtype, other.device, other.mode)
        if mine != theirs:
            raise ValueError(f"{caller}: other has (shape, dtype, device, mode) = {theirs}; "
                             f"expected {mine}")
        self._check_changeable(caller)
        self._state += other._state
        _kernel_ops.normalise_limbs(self._state[:self._state.shape[0] - _limbs.COUNTERS])
        self.count += other.count

    def state(self) -> torch.Tensor:
        """A copy of the state as one 1-D int64 tensor (layout in the class docstring): the
        elementwise integer sum of several such tensors is the state of the merged sum."""
        self._check_exact("detsum.RunningSum.state")
        count = torch.tensor([self.count], dtype=torch.int64, device=self.device)
        # Element by element, as documented; kept limb by limb inside (detsum._limbs).
        return torch.cat([count, self._state.t().reshape(-1)])

    def load_state(self, state: torch.Tensor) -> None:
        """Replace this sum's state by ``state`` (from ``state()``, or an integer sum of
        several, e.g. after ``torch.distributed.all_reduce``); it is normalised on the way in.
        A tensor of a ``torch.func`` transform raises RuntimeError, the state unchanged."""
        caller = "detsum.RunningSum.load_state"
        self._check_exact(caller)
        expected = (1 + self._state.numel(),)
        if not isinstance(state, torch.Tensor) or state.dtype != torch.int64:
            raise TypeError(f"{caller}: state must be an int64 tensor, got "
                            f"{getattr(state, 'dtype', type(state).__name__)}")
        if tuple(state.shape) != expected:
            raise ValueError(f"{caller}: state has shape {tuple(state.shape)}; expected "
                             f"{expected} (the state() of a sum of this shape and dtype)")
        if state.device != self.device:
            raise ValueError(f"{caller}: state is on {state.device}; expected {self.device}")
        _transforms.refuse_transformed(caller, "state", state, _OUTSIDE_TRANSFORMS)
        count = int(state[0])
        if count < 0:
            raise ValueError(f"{caller}: state counts {count} rows; expected a count >= 0")
        if count == 0 and bool(state[1:].any()):
            # sum() of no rows is 0: such a state would lose its sum without a word.
            raise ValueError(f"{caller}: state counts 0 rows but holds a nonzero sum; expected "
                             f"the state() of a sum, or an integer sum of several, whose count "
                             f"is the number of rows added")
        self._check_changeable(caller)
        self._state.copy_(state[1:].view(self._state.shape[1], self._state.shape[0]).t())
        _kernel_ops.normalise_limbs(self._state[:self._state.shape[0] - _limbs.COUNTERS])
        self.count = count

