"""The consumers' operations that have kernels of their own, and the one place that picks
which implementation runs them.

A Numba kernel does each of these on CPU in one pass (``kernels/numba/``); everywhere else
torch operations, or the segment kernel of the backend that runs, do the same with the same
bits. Each operation here has one signature on every backend, and the choice is made here
alone: the Numba kernel runs for CPU tensors under the numba backend (their default, see
``detsum.backend``), the others for other devices and under ``detsum.backend("reference")``
or ``("triton")``. Consumers and adapters call these (and the primitives), never
``detsum.kernels``; so does code that needs the CPU kernels loaded (``load_cpu_kernels``) or
run on a given number of threads (``cpu_threads``).

- Running sums (``detsum.RunningSum``): ``resume_sum``, ``resume_outer_products``,
  ``kahan_result``, ``add_exact_outer_products``.
- The exact state (``detsum._limbs``): ``add_exact_terms``, ``normalise_limbs``,
  ``round_exact_state``.
- MoE's weighted combination (``detsum.moe.unpermute``): ``weighted_token_sums``,
  ``weighted_gradients_in_blocks`` (on CPU), ``fused_weighted_rule``,
  ``weighted_gradients_in_one_launch`` (the triton backend's kernels); a routing's tables
  (``detsum.moe.route``): ``route_tables``.
- A state on the wire of a sum over ranks (``detsum.distributed``): ``outgoing_states``,
  ``decode_state``.
- The switch's C++ kernels (``detsum.switch``, ``kernels/native``): ``switch_native_library``,
  ``build_switch_native``, ``switch_native_sum_rule``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from detsum import _limbs, _segments, _wire, kernels, reference
from detsum.backend import current_backend
from detsum.kernels import CHUNK_TERMS, EXACT_TARGETS, KAHAN, SMALL_CALL_ELEMENTS, WIDE
from detsum.modes import Mode, acc_dtype


def _numba_runs(tensor: torch.Tensor, caller: str) -> bool:
    """Whether the CPU kernels do the work for ``tensor``: a CPU tensor under the numba
    backend. Raises in ``caller``'s words where the backend forced cannot run CPU tensors."""
    return tensor.device.type == "cpu" and current_backend("cpu", caller) == "numba"


def load_cpu_kernels() -> None:
    """Load the CPU kernels now. Loading starts Numba's threading layer and keeps torch's
    thread count (``kernels/numba/__init__.py``): code that reads or sets Numba's thread count
    calls this first, so that it sees the layer the kernels run on."""
    from detsum.kernels import numba  # noqa: F401


def cpu_threads(n: int):
    """A context in which the CPU kernels run on ``n`` Numba threads; on leaving it, Numba's
    and torch's thread counts are what they were (Numba's OpenMP layer shares its runtime with
    torch, so setting one can move the other). Loads the CPU kernels."""
    from detsum.kernels.numba.common import threads

    return threads(n)


# ---- running sums ------------------------------------------------------------------------------

_RUNNING_SUM = "detsum.RunningSum.add"


def resume_sum(total: torch.Tensor, comp: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Continue the running sum ``total`` (1-D, acc type; ``comp`` its Kahan compensation, or
    None for a plain wide sum) over ``rows`` ``[n, total.numel()]`` (acc type), in place: the
    serial sum of the canonical order, from ``total`` as its base and ``comp`` as its carried
    compensation, without a chunk split (the caller cuts its pieces at the chunk
    boundaries) and without the final ``s + c``."""
    n = rows.shape[0]
    if n == 0:
        return
    backend_name = current_backend(total.device.type, _RUNNING_SUM)
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


def kahan_result(total: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    """The KAHAN rule's final step on the running sum ``total`` and its compensation ``comp``
    as ``resume_sum`` leaves them (1-D, acc type, left unchanged): a new tensor holding
    ``total + comp``, or ``total`` where ``total`` is not finite or ``comp == 0``. The torch
    form of the kernels' own final step (``kernels/numba/common.py``'s ``kahan_result``), for
    a state on any device; the addition is the backend's, through ``resume_sum``."""
    compensated = total.clone()
    resume_sum(compensated, None, comp.unsqueeze(0))
    # A non-finite total's comp is NaN (inf - inf), which would turn an inf sum into NaN; a
    # zero comp would turn a sum of -0.0 terms into +0.0: the total stands in both cases.
    return torch.where(torch.isfinite(total) & (comp != 0), compensated, total)


#: Products formed at once where a backend has no kernel that forms them itself (elements).
_PRODUCT_BLOCK = 1 << 22


def _products(left: torch.Tensor, right: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """The rows ``left[i] (x) right[i]`` materialised, ``[k, O * K]`` in ``acc``: each product
    rounded once to the data dtype (torch's elementwise multiply, IEEE), then widened."""
    return (left.unsqueeze(2) * right.unsqueeze(1)).reshape(left.shape[0], -1).to(acc)


def _product_blocks(left: torch.Tensor, right: torch.Tensor):
    """(rows lo, hi, output rows o_lo, o_hi) covering the products in blocks of at most about
    ``_PRODUCT_BLOCK`` elements: whole output rows, all rows of a block before the next."""
    k, rows = left.shape
    cols = right.shape[1]
    per_row = max(1, min(rows, _PRODUCT_BLOCK // max(cols, 1)))
    per_block = max(1, _PRODUCT_BLOCK // max(per_row * cols, 1))
    for o_lo in range(0, rows, per_row):
        for lo in range(0, k, per_block):
            yield lo, min(k, lo + per_block), o_lo, min(rows, o_lo + per_row)


def resume_outer_products(total: torch.Tensor, comp: torch.Tensor | None, left: torch.Tensor,
                          right: torch.Tensor) -> None:
    """``resume_sum`` over the rows ``left[i] (x) right[i]`` (``left`` ``[k, O]``, ``right``
    ``[k, K]``, one data dtype; ``total`` ``O * K`` elements): each element
    ``RN_dtype(left[i, o] * right[i, k])``, widened. The kernel never forms the rows; the torch
    operations form them block by block (each block of output rows runs over the terms in
    order, so the bits are those of one launch over the materialised rows)."""
    if left.shape[0] == 0:
        return
    if current_backend(total.device.type, _RUNNING_SUM) == "numba":
        from detsum.kernels.numba.outer import resume_products

        resume_products(total, comp, left, right, KAHAN if comp is not None else WIDE)
        return
    cols = right.shape[1]
    for lo, hi, o_lo, o_hi in _product_blocks(left, right):
        columns = slice(o_lo * cols, o_hi * cols)
        resume_sum(total[columns], None if comp is None else comp[columns],
                   _products(left[lo:hi, o_lo:o_hi], right[lo:hi], total.dtype))


def add_exact_outer_products(state: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                             acc: torch.dtype) -> None:
    """Add the rows ``left[i] (x) right[i]`` to an ``"exact"`` state of acc type ``acc``
    (``_limbs``; columns: the ``O * K`` elements), formed block by block: an exact sum needs
    no order."""
    cols = right.shape[1]
    for lo, hi, o_lo, o_hi in _product_blocks(left, right):
        add_exact_terms(state[:, o_lo * cols:o_hi * cols],
                        _products(left[lo:hi, o_lo:o_hi], right[lo:hi], acc))


# ---- the exact state ---------------------------------------------------------------------------

_EXACT_STATE = "detsum exact state"


def add_exact_terms(state: torch.Tensor, terms: torch.Tensor) -> None:
    """Add ``terms`` ``[k, numel]`` (fp32 or fp64, the acc type) into ``state``, in place, and
    normalise it (``_limbs.add_terms``: any ``k``; ``state`` may be a slice of columns of a
    larger state)."""
    if _numba_runs(state, _EXACT_STATE):
        from detsum.kernels.numba import exact_state

        exact_state.add_terms(state, terms)
        return
    _limbs.add_terms(state, terms)


def normalise_limbs(limbs: torch.Tensor) -> None:
    """Carry every limb (row) but the last into ``[0, 2**LIMB_BITS)``, in place; the value is
    unchanged (``_limbs.normalise``)."""
    if _numba_runs(limbs, _EXACT_STATE):
        from detsum.kernels.numba import exact_state

        exact_state.normalise(limbs)
        return
    _limbs.normalise(limbs)


def round_exact_state(state: torch.Tensor, acc_dtype: torch.dtype, dtype: torch.dtype,
                      count: int | None = None) -> torch.Tensor:
    """The sum of each element's state (or, with ``count``, the sum over ``count``) rounded
    once to ``dtype`` (ties to even): a 1-D tensor of ``dtype``; the state is not changed
    (``_limbs.round_state``: ``count`` at most ``MAX_TERMS_PER_STATE``)."""
    if _numba_runs(state, _EXACT_STATE):
        from detsum.kernels.numba import exact_state

        precision, min_quantum, _, _ = EXACT_TARGETS[dtype]
        return exact_state.round_state(state, precision, min_quantum,
                                       EXACT_TARGETS[acc_dtype][2], count).to(dtype)
    return _limbs.round_state(state, acc_dtype, dtype, count)


# ---- MoE's weighted combination on CPU ---------------------------------------------------------

_UNPERMUTE = "detsum.moe.unpermute"

#: The weighted unpermute's products, per block of tokens, on CPU (about 2 MB: they stay in
#: the cache between the multiply and the sum). One buffer of all products was a pass through
#: memory each way (512 MB at T=16384, top-8, H=1024) and made the forward 1.6x and the
#: backward 3.8x the naive composition.
_PRODUCT_BLOCK_BYTES = 1 << 21


def _rows_per_block(features: int, acc: torch.dtype) -> int:
    return max(1, _PRODUCT_BLOCK_BYTES // (max(1, features) * acc.itemsize))


def _segment_sum_body(rows: torch.Tensor, offsets: torch.Tensor, dim: int,
                      acc_mode: str) -> torch.Tensor:
    # The operator's body, called within an operator's own body: the dispatcher has done its
    # work once already, and a block costs about what a dispatch does. The offsets are built
    # here, right by construction: nothing to check, nothing read back.
    from detsum.ops.segment_sum import _segment_sum

    return _segment_sum(rows, offsets, dim, None, acc_mode, "off")


def _fused_rule(y: torch.Tensor, acc: torch.dtype, acc_mode: str) -> int | None:
    """The rule of the fused kernels (kernels/numba/weighted.py: the products consumed where
    they are made, the bits of the blocks below), or None where they do not apply: another
    backend, "exact", or an acc type wider than y's own (fp32 rows with fp64 weights)."""
    if (acc_mode not in (Mode.FP32.value, Mode.KAHAN.value) or acc != acc_dtype(y.dtype)
            or not _numba_runs(y, _UNPERMUTE)):
        return None
    return KAHAN if acc_mode == Mode.KAHAN.value else WIDE


def weighted_token_sums(y: torch.Tensor, positions: torch.Tensor, slot_weights: torch.Tensor,
                        topk: int, out_dtype: torch.dtype, acc_mode: str) -> torch.Tensor:
    """``out[t]`` = the sum over ``k`` of ``RN_acc(acc(y[positions[t * topk + k]]) *
    acc(w[t * topk + k]))``, in order of ``k``, as ``segment_sum`` in ``acc_mode`` sums those
    products (one segment of ``topk`` per token): ``[T, *y.shape[1:]]`` in ``acc``, the acc
    type of ``out_dtype``. ``positions``: ``T * topk`` row numbers of ``y`` (int64, in range);
    ``slot_weights`` ``w``: ``T * topk`` weights in slot order. CPU tensors: the kernel
    consumes each product where it makes it; the torch operations form the products per block
    of tokens (they stay in the cache until summed)."""
    acc = acc_dtype(out_dtype)
    triton_rule = fused_weighted_rule(y, slot_weights.dtype, out_dtype, acc_mode, topk)
    if triton_rule is not None:
        from detsum.kernels.triton.moe import gather_scale_sum

        return gather_scale_sum(y, positions, slot_weights, topk, triton_rule, acc)
    rule = _fused_rule(y, acc, acc_mode)
    if rule is not None and topk <= CHUNK_TERMS:
        from detsum.kernels.numba.weighted import gather_scale_sum

        return gather_scale_sum(y, positions, slot_weights.to(acc), topk, rule)
    num_tokens = positions.numel() // topk
    features = math.prod(y.shape[1:])
    tokens_per_block = max(1, _rows_per_block(features, acc) // topk)
    weights_acc = slot_weights.to(acc).view((-1,) + (1,) * (y.dim() - 1))
    offsets = torch.arange(min(tokens_per_block, num_tokens) + 1, device=y.device) * topk
    out = torch.empty((num_tokens,) + tuple(y.shape[1:]), dtype=acc, device=y.device)
    for t0 in range(0, num_tokens, tokens_per_block):
        t1 = min(num_tokens, t0 + tokens_per_block)
        slots = slice(t0 * topk, t1 * topk)
        # Converting first is exact; the multiply then rounds once in acc, as y * w_acc does.
        products = y.index_select(0, positions[slots]).to(acc).mul_(weights_acc[slots])
        out[t0:t1] = _segment_sum_body(products, offsets[:t1 - t0 + 1], 0, acc_mode)
    return out


def weighted_gradients_in_blocks(grad: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor,
                                 position_weights: torch.Tensor, acc_mode: str
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``weighted_token_sums`` for the output gradient ``grad`` ``[T, ...]``:
    ``grad_y[p] = grad[tokens[p]] * position_weights[p]`` in grad's dtype, then rounded to
    y's (``y``'s shape, contiguous); ``dots[p]`` = the sum over the features ``h`` of
    ``RN_acc(acc(grad[tokens[p], h]) * y[p, h])`` in order of ``h``, as ``segment_sum`` in
    ``acc_mode`` sums them (``[P]`` in the acc type of grad's dtype). CPU tensors: the kernel
    consumes each product where it makes it; the torch operations form them per block of rows,
    never more than a block in memory."""
    acc = acc_dtype(grad.dtype)
    features = math.prod(y.shape[1:])
    rows_per_block = _rows_per_block(features, acc)
    scale_shape = (-1,) + (1,) * (grad.dim() - 1)
    grad_y = torch.empty_like(y, memory_format=torch.contiguous_format)
    rule = _fused_rule(y, acc, acc_mode)
    if rule is not None:
        from detsum.kernels.numba.weighted import row_dots

        for p0 in range(0, y.shape[0], rows_per_block):
            block = slice(p0, min(y.shape[0], p0 + rows_per_block))
            grad_y[block] = (grad.index_select(0, tokens[block])
                             * position_weights[block].view(scale_shape))
        return grad_y, row_dots(grad.to(acc), tokens, y, rule)
    dots = torch.empty(y.shape[0], dtype=acc, device=y.device)
    one_segment = _segments.one_segment(features, y.device)
    for p0 in range(0, y.shape[0], rows_per_block):
        block = slice(p0, min(y.shape[0], p0 + rows_per_block))
        grad_rows = grad.index_select(0, tokens[block])
        # The product in grad's dtype, then (the copy) rounded to y's, as in one pass.
        grad_y[block] = grad_rows * position_weights[block].view(scale_shape)
        # (The row count spelled out: a reshape to -1 is ambiguous when there are no features.)
        products = grad_rows.to(acc).mul_(y[block]).reshape(grad_rows.shape[0], features)
        # Feature-major, each row's sum over its features is a sum of contiguous rows, which
        # the kernel reads in place: 0.8 ns a product with the transposing copy, against 1.6
        # for the kernel's strided read of row-major products (one element per cache line).
        dots[block] = _segment_sum_body(products.T.contiguous(), one_segment, 0,
                                        acc_mode).view(-1)
    return grad_y, dots


def fused_weighted_rule(y: torch.Tensor, weights_dtype: torch.dtype, out_dtype: torch.dtype,
                        acc_mode: str, topk: int) -> int | None:
    """The rule under which the triton backend's kernels do the weighted combination and its
    gradients, each in one launch (``kernels/triton/moe.py``: the bits of the products formed
    and summed by ``segment_sum``), or None where they do not: another backend for ``y``'s
    device, "autograd" or "exact", ``topk`` above one chunk, an acc type wider than y's own
    (fp32 rows with fp64 weights), or half-precision weights with fp64 rows (whose gradient
    torch rounds through fp32)."""
    if acc_mode not in (Mode.FP32.value, Mode.KAHAN.value) or topk > CHUNK_TERMS:
        return None
    acc = acc_dtype(out_dtype)
    if acc != acc_dtype(y.dtype) or (acc == torch.float64
                                     and weights_dtype not in (torch.float32, torch.float64)):
        return None
    if current_backend(y.device.type, _UNPERMUTE) != "triton":
        return None
    return KAHAN if acc_mode == Mode.KAHAN.value else WIDE


def weighted_gradients_in_one_launch(grad: torch.Tensor, y: torch.Tensor,
                                     slots: torch.Tensor, slot_weights: torch.Tensor, topk: int,
                                     acc_mode: str, by_slot: bool
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``fused_weighted_rule`` gives a rule: the gradients of ``weighted_token_sums`` in
    one launch, each row ``p`` of ``y`` taken as slot ``slots[p]`` (in range) of token
    ``slots[p] // topk`` with weight ``slot_weights[slots[p]]``: ``grad_y`` as
    ``weighted_gradients_in_blocks`` gives it, and the dot products in ``slot_weights``' dtype,
    stored by slot (``by_slot``: ``slots`` is a permutation, so these are the weights' gradient in
    slot order) or by row."""
    from detsum.kernels.triton.moe import weighted_gradients_by_slot

    rule = fused_weighted_rule(y, slot_weights.dtype, grad.dtype, acc_mode, topk)
    return weighted_gradients_by_slot(grad, y, slots, slot_weights, topk, rule, by_slot)


def triton_runs(tensor: torch.Tensor, caller: str) -> bool:
    """Whether the triton backend runs ``tensor``'s device now."""
    return current_backend(tensor.device.type, caller) == "triton"


def sort_expert_ids(flat: torch.Tensor, num_experts: int, check: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sorted ids, gather_indices): the stable sort of ``moe.route``'s flat expert ids.

    Under the triton backend at check "host" and "device", the ids are sorted as the narrow
    keys their experts need (``kernels.sort_by_segment``: on a GPU, from int64 ids 10 of
    CUB's launches fewer, past 4096 ids): ids in ``[0, E)`` take exactly the places torch's
    sort gives them, and a bad id fails the check, so where it sorts is never returned (the
    route kernel ranks a token's ids as they were sorted: ``route_tables``). At "off", whose
    bad ids keep their places in ``gather_indices`` (the stable argsort of the ids), and under
    the other backends (on the CPU, torch's sort of int16 ids is the slower one): torch's
    sort of the ids as they are."""
    if check != "off" and triton_runs(flat, "detsum.moe.route"):
        return kernels.sort_by_segment(flat, num_experts)
    return torch.sort(flat, stable=True)


def route_tables(experts: torch.Tensor, gather_indices: torch.Tensor,
                 selected_experts: torch.Tensor, topk: int, num_experts: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Under the triton backend, one launch after the sort of the expert ids:
    ``kernels/triton/moe.py``'s ``route_tables``, ``(positions, tokens_per_expert, table)``
    (the inverse permutation, the rows per expert, and one int64 buffer of whether every id
    lies in ``[0, num_experts)``, each sorted row's token, each token's rows in increasing
    position and the token offsets). None under the other backends, whose torch operations
    compute what the caller needs."""
    if not triton_runs(experts, "detsum.moe.route"):
        return None
    from detsum.kernels.triton.moe import route_tables as triton_route_tables

    return triton_route_tables(experts, gather_indices, selected_experts.contiguous(), topk,
                               num_experts)


# ---- a state on the wire of a sum over ranks ---------------------------------------------------

class _KernelOutgoing:
    """``_wire.Outgoing`` computed by the kernels: the header values in one pass over the
    state, the payload in another; the same integers."""

    kernels = True

    def __init__(self, state: torch.Tensor, count: int):
        from detsum.kernels.numba import wire

        self.state, self.count = state, count
        self.n_limbs = state.shape[0] - _limbs.COUNTERS
        self._header = wire.scan(state, count)

    def header(self) -> list[int]:
        return self._header

    def write(self, part: torch.Tensor, bottom: int, rows: int, kinds: Sequence[int],
              fields: int, bits: int) -> None:
        from detsum.kernels.numba import wire

        wire.encode(self.state, self.count, part.numpy(), bottom, rows, kinds, fields, bits)


def outgoing_states(states: Sequence[tuple[torch.Tensor, int]]
                    ) -> list[_wire.Outgoing | _KernelOutgoing]:
    """This rank's exact ``(state, count)`` pairs as it sends them, each with ``header()`` and
    ``write(part, bottom, rows, kinds, fields, bits)`` (see ``_wire.Outgoing``). The payload
    goes on the first state's device; where that is the CPU, the kernels do the work of every
    CPU state under the numba backend."""
    on_cpu = bool(states) and states[0][0].device.type == "cpu"
    return [_KernelOutgoing(state, count) if on_cpu and _numba_runs(state, _EXACT_STATE)
            else _wire.Outgoing(state, count) for state, count in states]


def decode_state(part: torch.Tensor, bottom: int, rows: int, kinds: Sequence[int], fields: int,
                 bits: int, total: int, summed: torch.Tensor) -> None:
    """A state's ``part`` of the summed payload, of ``total`` rows, into ``summed``, normalised
    (``_wire.decode``)."""
    if part.device.type == "cpu" and _numba_runs(summed, _EXACT_STATE):
        from detsum.kernels.numba import wire

        wire.decode(part.numpy(), bottom, rows, kinds, fields, bits, total, summed)
        return
    _wire.decode(part, bottom, rows, kinds, fields, bits, total, summed)


def switch_native_library():
    """The switch's C++ kernels' library (``kernels/native``), loaded with ctypes; None where
    it is not built."""
    from detsum.kernels import native

    return native.library()


def build_switch_native() -> str | None:
    """Build the switch's C++ kernels unless built: None, or why they could not be."""
    from detsum.kernels import native

    return native.build()


def switch_native_sum_rule(rule: int) -> int:
    """The C++ kernels' code for the kernel rule of a sum (their ``SumRule``): 1 for WIDE, 3
    for KAHAN (both split past CHUNK_TERMS terms a row: such a call is not theirs), 2 for
    ROUND_EACH, 0 for a rule they have not."""
    return {WIDE: 1, kernels.ROUND_EACH: 2, KAHAN: 3}.get(rule, 0)
