"""Mixture-of-experts token permutation with a backward that is deterministic and, on request,
bit-identical to autograd.

A top-k MoE layer sends each of ``T`` tokens to ``topk`` experts. ``route`` sorts the ``T * topk``
(token, slot) pairs by expert; ``permute`` gathers the token rows in that order (each token
``topk`` times); ``unpermute`` brings expert outputs back to (token, slot) order and, by
default, combines each token's ``topk`` rows, weighted by the routing probabilities.

Flat slot ``j = t * topk + k`` is slot ``k`` of token ``t``; ``gather_indices[p]`` is the flat slot
at permuted position ``p``, so ``gather_indices // topk`` are the token ids of the permuted rows.

Every sum is a ``detsum.segment_sum`` over the ``topk`` rows of a token, or a kernel of
``detsum._kernel_ops`` with the same bits. ``"autograd"`` is bit-identical to autograd of the
naive torch composition on the same device; ``"fp32"`` / ``"kahan"`` sum in fp32
(compensated for ``"kahan"``) and round once. Each function checks its routing as ``check``
says, with the primitives' levels; backward passes never check again and, on a GPU, never
read back (docs/moe.md, "Checks and host reads").

The gradients are the same under ``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``vmap``;
forward mode (``jvp``, ``jacfwd``) raises NotImplementedError, and so does a second derivative
through the weighted ``unpermute`` on CPU in ``"fp32"``/``"kahan"`` (docs/determinism.md).
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from detsum import _dispatch, _kernel_ops, _segments, _transforms, _validation
from detsum.modes import CHUNK_TERMS, Mode, acc_dtype, parse_mode
from detsum.ops.segment_sum import call_segment_sum

__all__ = ["Routing", "permute", "route", "unpermute"]


# ---- check levels -------------------------------------------------------------------------------

def _check_level(caller: str, check: object, *, false_means: str) -> str:
    """The ``check`` argument as a level: "host", "device" or "off" (as the primitives take
    it); True is "host", False ``false_means``."""
    if isinstance(check, bool):
        return "host" if check else false_means
    if not isinstance(check, str) or check not in _validation.CHECK_LEVELS:
        error = TypeError if not isinstance(check, str) else ValueError
        raise error(f"{caller}: check={check!r}; expected one of 'host', 'device', 'off' "
                    f"(or True or False, the flag's old values)")
    return check


# ---- routing ------------------------------------------------------------------------------------

class Routing(tuple):
    """What :func:`route` returns: unpacks as ``(gather_indices, tokens_per_expert)``, and
    carries what ``permute`` and ``unpermute`` would otherwise derive from ``gather_indices``
    on every call, forward and backward. Pass it in place of ``gather_indices``, or pass its
    ``gather_indices`` alone: while that tensor is unchanged, the calls find its Routing."""

    def __new__(cls, gather_indices: torch.Tensor, tokens_per_expert: torch.Tensor,
                positions: torch.Tensor, token_table: torch.Tensor | None = None) -> Routing:
        routing = super().__new__(cls, (gather_indices, tokens_per_expert))
        #: ``positions[j] = p`` with ``gather_indices[p] == j``: where each (token, slot) row
        #: sits in expert order, the inverse permutation (int64 [T * topk]).
        routing.positions = positions
        #: Under the triton backend (from route's one launch; elsewhere None, and derived
        #: where needed), int64: ``[ok (1) | tokens (T * topk) | token_rows (T * topk) |
        #: token_offsets (T + 1)]``: whether the ids were in range, each row's token
        #: ``gather_indices // topk``, each token's rows in increasing position (permute's
        #: backward sums them in that order) and the token offsets ``t * topk``.
        routing.token_table = token_table if token_table is not None and token_table.numel() \
            else None
        return routing

    @property
    def gather_indices(self) -> torch.Tensor:
        """[T * topk] int64: the flat (token, slot) of each row in expert order."""
        return self[0]

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """[E] int64: how many rows each expert receives."""
        return self[1]


def _token_table_parts(token_table: torch.Tensor, n: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, token_rows, token_offsets) of a Routing's ``token_table`` of ``n`` rows."""
    return token_table[1:n + 1], token_table[n + 1:2 * n + 1], token_table[2 * n + 1:]


def _route(selected_experts: torch.Tensor, num_experts: int, check: str
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operator's body (also called directly, see ``_dispatch``): gather_indices,
    tokens_per_expert, positions, and the token table of the triton backend (empty
    elsewhere; see ``Routing``)."""
    caller = "detsum.moe.route"
    flat = selected_experts.reshape(-1)
    experts, gather_indices = _kernel_ops.sort_expert_ids(flat, num_experts, check)
    topk = selected_experts.shape[1] if selected_experts.dim() == 2 else 1
    n = flat.numel()
    tables = _kernel_ops.route_tables(experts, gather_indices, flat, topk, num_experts) if n \
        else None
    if tables is not None:
        positions, tokens_per_expert, token_table = tables
        if check == "device":
            _validation.assert_on_device(token_table[0], caller,
                                         f"selected_experts has a value outside [0, "
                                         f"num_experts = {num_experts})")
        elif check == "host" and not token_table[0].item():
            _validation.raise_first_out_of_range(caller, "selected_experts", selected_experts,
                                                 num_experts, "num_experts")
        return gather_indices, tokens_per_expert, positions, token_table
    # The sort puts the smallest and the largest id at the ends: checking costs no pass.
    if check == "device" and n:
        _validation.assert_on_device((experts[0] >= 0) & (experts[-1] < num_experts), caller,
                                     f"selected_experts has a value outside [0, num_experts = "
                                     f"{num_experts})")
    elif check == "host" and n:
        low, high = experts[[0, -1]].tolist()
        if low < 0 or high >= num_experts:
            _validation.raise_first_out_of_range(caller, "selected_experts", selected_experts,
                                                 num_experts, "num_experts")
    boundaries = torch.arange(num_experts + 1, dtype=flat.dtype, device=flat.device)
    starts = torch.searchsorted(experts, boundaries)
    # A sort's indices are a permutation whatever the ids: its inverse is one scatter, with no
    # two writes to one place.
    positions = torch.empty_like(gather_indices).scatter_(
        0, gather_indices, torch.arange(n, device=flat.device))
    return gather_indices, starts[1:] - starts[:-1], positions, gather_indices.new_empty(0)


# An operator, so that the host read of check="host" runs inside it: under torch.compile the
# call stays in the graph instead of breaking it on a data-dependent branch.
@torch.library.custom_op("detsum::moe_route", mutates_args=())
def route_op(selected_experts: torch.Tensor, num_experts: int, check: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _route(selected_experts, num_experts, check)


@route_op.register_fake
def _(selected_experts, num_experts, check):
    n = selected_experts.numel()
    table = 0
    if n and _kernel_ops.triton_runs(selected_experts, "detsum.moe.route"):
        topk = selected_experts.shape[1] if selected_experts.dim() == 2 else 1
        table = 1 + 2 * n + n // topk + 1
    return (selected_experts.new_empty(n, dtype=torch.int64),
            selected_experts.new_empty(num_experts, dtype=torch.int64),
            selected_experts.new_empty(n, dtype=torch.int64),
            selected_experts.new_empty(table, dtype=torch.int64))


def route(selected_experts: torch.Tensor, num_experts: int, *, check: str | bool = "host"
          ) -> Routing:
    """Group the (token, slot) pairs by expert: the permutation ``permute`` and ``unpermute`` use.

    Args:
        selected_experts: ``[T, topk]`` (or ``[T]`` for top-1) int32/int64 expert ids.
        num_experts: the number of experts ``E``: a positive int (a NumPy or 0-d tensor int
            too).
        check: how the ids are checked to lie in ``[0, E)``. ``"host"`` (default): the
            smallest and largest id read back (one host read of two numbers), with an error
            naming the first bad position. ``"device"``: compared on the ids' device, with no
            host read; a bad id fails at the next synchronisation (on CPU at once).
            ``"off"``: not checked; an id below 0 or from ``E`` up is then counted by no
            expert: its pair still has its place in ``gather_indices`` (before expert 0's
            pairs, or after the last expert's), and ``tokens_per_expert`` sums to fewer than
            ``T * topk``. True means ``"host"`` and False ``"off"``.

    Returns:
        A :class:`Routing`, which unpacks as ``(gather_indices, tokens_per_expert)``:
        ``gather_indices`` [T * topk] int64 is the stable argsort of
        ``selected_experts.view(-1)`` (expert by expert; within an expert, tokens in order),
        ``tokens_per_expert`` [E] int64 the rows each expert receives. It also holds the
        inverse permutation: passed to ``permute`` and ``unpermute`` in place of
        ``gather_indices``, it spares them checking and inverting it, forward and backward,
        with the same bits. So does ``gather_indices`` passed alone while that tensor is
        unchanged (its version counter, which a write through ``.data`` or a NumPy view does
        not move); a copy, an index changed in place or one made in ``torch.inference_mode``
        is checked and inverted as any other. No host synchronisation besides ``"host"``'s
        check; ``torch.compile(fullgraph=True)`` traces it at every level.

    Raises:
        IndexError: with ``check="host"``, an id outside ``[0, E)``, named with its position.
        RuntimeError: with ``check="device"``, an id outside ``[0, E)`` (from
            ``torch._assert_async``, naming ``selected_experts``; on a GPU at the next
            synchronisation).
        ValueError: a bad ``num_experts``, ``selected_experts`` shape or ``check``.
        TypeError: ``selected_experts`` not an integer tensor, or ``check`` neither a string
            nor a bool.

    Example:
        >>> import torch
        >>> from detsum import moe
        >>> moe.route(torch.tensor([[1, 0], [1, 2]]), 3)
        (tensor([1, 0, 2, 3]), tensor([1, 2, 1]))
    """
    level, num_experts = _validation.run_check(_check_route, selected_experts, num_experts,
                                               check)
    if _dispatch.direct_call_ok(selected_experts):
        routing = Routing(*_route(selected_experts, num_experts, level))
    else:
        routing = Routing(*route_op(selected_experts, num_experts, level))
    _remember(routing)
    return routing


def _check_route(selected_experts, num_experts, check):
    caller = "detsum.moe.route"
    _validation.check_index(caller, "selected_experts", selected_experts, one_d=False)
    level = _check_level(caller, check, false_means="off")
    if not 1 <= selected_experts.dim() <= 2:
        raise ValueError(f"{caller}: selected_experts must be [T, topk] or [T], got shape "
                         f"{tuple(selected_experts.shape)}")
    return level, _validation.check_positive_int(caller, "num_experts", num_experts)


# ---- route's gather_indices, given bare ---------------------------------------------------------

#: What ``route`` returned with each ``gather_indices``, by that tensor (weak keys compared by
#: identity: an entry goes with its tensor): the tensor's ``_stamp`` then, and the rest of its
#: Routing (tokens_per_expert, positions, token_table).
_ROUTINGS = WeakIdKeyDictionary()


def _stamp(gather_indices: torch.Tensor) -> tuple:
    """What must not change for a Routing to still describe its ``gather_indices``: the
    tensor's memory, layout and version counter (which every in-place change moves, made
    through the tensor or any view of it)."""
    return (gather_indices._version, gather_indices.data_ptr(), gather_indices.shape,
            gather_indices.stride(), gather_indices.dtype, gather_indices.device)


def _has_stamp(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain eager tensor with a version counter: not traced (a traced
    tensor has neither memory nor counter), no subclass or functorch wrapper, no inference
    tensor (torch keeps no counter for those)."""
    return (not torch.compiler.is_compiling() and type(tensor) is torch.Tensor
            and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)
            and not tensor.is_inference())


def _remember(routing: Routing) -> None:
    if _has_stamp(routing.gather_indices):
        # The entry holds none of the key's own tensor: it would keep itself alive.
        _ROUTINGS[routing.gather_indices] = (_stamp(routing.gather_indices),
                                             routing.tokens_per_expert, routing.positions,
                                             routing.token_table)


def _as_routing(gather_indices: torch.Tensor | Routing) -> torch.Tensor | Routing:
    """``gather_indices`` as ``permute`` and ``unpermute`` take it: the ``gather_indices`` that
    ``route`` returned, unchanged since, as the whole Routing (a sort's indices need no check
    and route has inverted them); anything else as it is."""
    if (isinstance(gather_indices, Routing) or not isinstance(gather_indices, torch.Tensor)
            or not _has_stamp(gather_indices)):
        return gather_indices
    remembered = _ROUTINGS.get(gather_indices)
    if remembered is None or remembered[0] != _stamp(gather_indices):
        return gather_indices
    return Routing(gather_indices, *remembered[1:])


# ---- shared index plumbing ----------------------------------------------------------------------

def _slot_positions(gather_indices: torch.Tensor, unreached: int = 0) -> torch.Tensor:
    """positions[j] = p with gather_indices[p] == j: where each (token, slot) row sits, the
    inverse of the permutation. Defined for any values in [0, n], n being a spare slot that is
    dropped: a slot that no value names gets ``unreached``, one that several name the largest
    of their p."""
    n = gather_indices.numel()
    device = gather_indices.device
    positions = torch.full((n + 1,), unreached, dtype=torch.int64, device=device)
    # amax rather than scatter_: with a repeated value (a promise broken under check="off")
    # scatter_ leaves the winner unspecified, and on a GPU it can change from run to run.
    positions.scatter_reduce_(0, gather_indices.to(torch.int64),
                              torch.arange(n, device=device), "amax")
    return positions[:n]


def _gather_indices_in_range(gather_indices: torch.Tensor, check: str) -> torch.Tensor:
    """gather_indices as the operators compute with it: checked values as they are; under
    check="off", each value outside [0, n) taken as the nearest bound (one pass over the
    indices, nothing read back), so that a broken promise still reads and writes inside every
    tensor."""
    n = gather_indices.numel()
    if check != "off" or n == 0:
        return gather_indices
    return gather_indices.clamp(0, n - 1)


def _token_offsets(num_tokens: int, topk: int, device) -> torch.Tensor:
    return torch.arange(num_tokens + 1, device=device) * topk


def _no_chunks(topk: int) -> int:
    """A sum over each token's topk rows as ``segment_sum`` takes its chunk split: 0 (no
    segment long enough to split) when topk is at most CHUNK_TERMS, else -1 (count them)."""
    return 0 if topk <= CHUNK_TERMS else -1


def _check_bounds(caller: str, gather_indices: torch.Tensor) -> None:
    """0 <= gather_indices < T * topk: one fused min/max pass and one host read, no sort."""
    n = gather_indices.numel()
    if n == 0:
        return
    low, high = torch.stack(list(torch.aminmax(gather_indices))).tolist()
    if low < 0 or high >= n:
        _validation.raise_first_out_of_range(caller, "gather_indices", gather_indices, n,
                                             "T * topk")


def _check_permutation(caller: str, gather_indices: torch.Tensor, check: str) -> torch.Tensor:
    """Verify that gather_indices holds each of 0 .. n-1 once, read back (check="host") or on
    the device (check="device"), and return its inverse (``_slot_positions``): one O(n)
    scatter, no sort."""
    n = gather_indices.numel()
    # n values in [0, n) that reach all n slots are a permutation. An out-of-range value goes
    # to the spare slot n, so the check itself cannot fail in torch's words.
    in_range = (gather_indices >= 0) & (gather_indices < n)
    positions = _slot_positions(torch.where(in_range, gather_indices, n), unreached=-1)
    out_of_range, slot_without_row = ~in_range.all(), (positions < 0).any()
    if check == "device":
        _validation.assert_on_device(~out_of_range, caller,
                                     f"gather_indices has a value outside [0, T * topk = {n})")
        _validation.assert_on_device(~slot_without_row, caller,
                                     f"gather_indices holds a value more than once; expected "
                                     f"a permutation of 0 .. T * topk - 1 = {n - 1}")
        return positions
    out_of_range, slot_without_row = torch.stack([out_of_range, slot_without_row]).tolist()
    if out_of_range:
        _validation.raise_first_out_of_range(caller, "gather_indices", gather_indices, n,
                                             "T * topk")
    if slot_without_row:
        values = torch.sort(gather_indices).values
        repeated = int(values[1:][values[1:] == values[:-1]][0])
        raise ValueError(f"{caller}: gather_indices holds {repeated} more than once; expected a "
                         f"permutation of 0 .. T * topk - 1 = {n - 1} (as route() returns)")
    return positions


def _check_common(caller, rows_name, rows, gather_indices, mode, n_expected):
    """Mode, and gather_indices' dtype, shape and device (its values are checked in the ops)."""
    mode = parse_mode(mode, caller=caller)
    _validation.check_index(caller, "gather_indices", gather_indices, one_d=True)
    if gather_indices.shape[0] != n_expected:
        raise ValueError(f"{caller}: gather_indices has length {gather_indices.shape[0]}; "
                         f"expected T * topk = {n_expected}")
    _validation.check_same_device(caller, **{rows_name: rows, "gather_indices": gather_indices})
    return mode


def _unrouted(gather_indices: torch.Tensor | Routing
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(gather_indices, its inverse when a :class:`Routing` brought it, else None)."""
    if isinstance(gather_indices, Routing):
        return gather_indices.gather_indices, gather_indices.positions
    return gather_indices, None


def _token_table(routing: torch.Tensor | Routing, topk: int) -> torch.Tensor | None:
    """The ``token_table`` of a :class:`Routing` that has one for ``topk`` slots per token
    (see ``Routing``), else None."""
    if not isinstance(routing, Routing) or routing.token_table is None:
        return None
    n = routing.gather_indices.numel()
    return routing.token_table if routing.token_table.numel() == 2 * n + n // topk + 2 else None


# ---- permute ------------------------------------------------------------------------------------

#: permute's level for check=False: the bounds alone, read back as under "host", a repeated
#: value allowed.
_BOUNDS_ONLY = "bounds"
#: The level of a Routing's gather_indices: a sort's indices, a permutation by construction,
#: given with their inverse: nothing to check, clamp or invert.
_ROUTED = "routed"


@torch.library.custom_op("detsum::moe_permute", mutates_args=())
def permute_op(x: torch.Tensor, gather_indices: torch.Tensor, topk: int, acc_mode: str,
               check: str, positions: torch.Tensor | None = None,
               token_table: torch.Tensor | None = None) -> torch.Tensor:
    # The index checks that read values back run here, inside the operator: under
    # torch.compile they run with it instead of breaking the graph.
    caller = "detsum.moe.permute"
    if check == _BOUNDS_ONLY:
        _check_bounds(caller, gather_indices)
    elif check not in ("off", _ROUTED):
        _check_permutation(caller, gather_indices, check)
    if token_table is not None:
        return x.index_select(0, token_table[1:gather_indices.numel() + 1])
    return x.index_select(0, _gather_indices_in_range(gather_indices, check) // topk)


@permute_op.register_fake
def _(x, gather_indices, topk, acc_mode, check, positions=None, token_table=None):
    return x.new_empty((gather_indices.shape[0],) + tuple(x.shape[1:]))


def _permute_setup(ctx, inputs, output):
    x, gather_indices, topk, acc_mode, check, *routed = inputs
    routed = (routed + [None] * 2)[:2]
    ctx.save_for_backward(gather_indices, *routed)
    ctx.num_tokens, ctx.topk, ctx.acc_mode, ctx.check = x.shape[0], topk, acc_mode, check


def _permute_backward(ctx, grad):
    gather_indices, positions, token_table = ctx.saved_tensors
    if token_table is not None:
        # route's one launch made the tables: the sum is the only launch here.
        tokens, token_rows, token_offsets = _token_table_parts(token_table,
                                                               gather_indices.numel())
        grad_x = call_segment_sum(grad, token_offsets, 0, token_rows, ctx.acc_mode, "off",
                                  tokens, None, _no_chunks(ctx.topk))
        return grad_x, *(None,) * 6
    if positions is not None:
        # Token t's rows sit at positions[t * topk:(t + 1) * topk]; sorted, they are in the
        # canonical order.
        token_rows = positions.view(-1, ctx.topk).sort(dim=1).values.view(-1)
        grad_x = call_segment_sum(grad, _token_offsets(ctx.num_tokens, ctx.topk, grad.device),
                                  0, token_rows, ctx.acc_mode, "off", gather_indices // ctx.topk,
                                  None, _no_chunks(ctx.topk))
        return grad_x, *(None,) * 6
    # Increasing permuted position is the order in which autograd's index_put_ meets a
    # token's rows. A stable sort by token finds them without assuming a permutation (under
    # check=False or "off" a token may have more rows than topk, or fewer).
    tokens = _gather_indices_in_range(gather_indices, ctx.check) // ctx.topk
    sorted_tokens, token_rows = torch.sort(tokens, stable=True)
    boundaries = torch.arange(ctx.num_tokens + 1, dtype=tokens.dtype, device=tokens.device)
    grad_x = call_segment_sum(grad, torch.searchsorted(sorted_tokens, boundaries), 0, token_rows,
                              ctx.acc_mode, "off")
    return grad_x, *(None,) * 6


call_permute = _transforms.register_autograd(permute_op, _permute_backward,
                                             setup_context=_permute_setup,
                                             caller="detsum.moe.permute")


def permute(x: torch.Tensor, gather_indices: torch.Tensor | Routing, topk: int, *,
            mode: str | Mode = "fp32", check: str | bool = "host") -> torch.Tensor:
    """Gather token rows into expert order: ``y[p] = x[gather_indices[p] // topk]``.

    Args:
        x: ``[T, ...]`` token rows, float32/float16/bfloat16/float64.
        gather_indices: ``[T * topk]``, a permutation of ``0 .. T * topk - 1`` (from ``route``),
            or the :class:`Routing` that ``route`` returned: then it is neither checked
            (``check`` does not apply: it is a permutation by construction) nor inverted,
            forward or backward. So is the ``gather_indices`` tensor that ``route`` returned,
            while unchanged (see ``route``).
        topk: slots per token: a positive int (a NumPy or 0-d tensor int too).
        mode: how backward sums each token's ``topk`` gradient rows: ``"fp32"`` (default),
            ``"kahan"`` or ``"autograd"``.
        check: how ``gather_indices`` is checked to be a permutation. ``"host"`` (default):
            one O(T * topk) scatter and one host read, before anything is computed, with an
            error naming the first bad position or the repeated value. ``"device"``: the same
            conditions on ``gather_indices``' device, with no host read (no synchronisation:
            the call can be captured in a CUDA graph); a bad value fails at the next
            synchronisation (on CPU at once). ``"off"``: not checked (see below what a bad
            value then gives). True means ``"host"``; False: the bounds only, read back (one
            min/max pass and one host read), a repeated value allowed.

    Returns:
        ``[T * topk, ...]``. Forward is an exact gather in every mode.

    Raises:
        IndexError: with ``check="host"`` or False, a value of ``gather_indices`` outside
            ``[0, T * topk)``, named with its position; before anything is computed.
        ValueError: with ``check="host"``, a repeated value; before anything is computed.
            Also a bad ``topk``, ``mode``, ``check`` or ``gather_indices`` length.
        RuntimeError: with ``check="device"``, either mistake (from ``torch._assert_async``,
            naming ``gather_indices`` but not the position; on a GPU at the next
            synchronisation).

    A repeated value is no hazard for ``permute`` itself: the result and the gradient are
    exactly those of ``x[gather_indices // topk]``; the check catches a routing mistake. Under
    ``"off"`` a value outside ``[0, T * topk)`` is taken as the nearest bound (below 0: slot 0
    of token 0; from ``T * topk`` up: the last slot of token ``T - 1``), forward and backward,
    so nothing is read or written outside ``x``, the result or the gradient; the result and
    gradient are then those of ``x[gather_indices.clamp(0, T * topk - 1) // topk]``.

    Backward: ``grad_x[t]`` sums the ``topk`` rows ``grad_y[p]`` with
    ``gather_indices[p] // topk == t`` in increasing ``p`` (the order autograd meets them),
    starting from 0: ``"autograd"`` rounds to the dtype after every add as torch's
    ``index_put_`` does (on CUDA: torch's CUDA arithmetic, see the determinism contract), so
    it is bit-identical to the gradient of ``x[gather_indices // topk]``; ``"fp32"``
    accumulates in fp32 and rounds once; ``"kahan"`` compensates as well. Deterministic in
    every mode. It checks nothing again and, on a GPU, reads nothing back, at every level.

    Example:
        >>> import torch
        >>> from detsum import moe
        >>> gather_indices, _ = moe.route(torch.tensor([[1, 0], [1, 2]]), 3)
        >>> moe.permute(torch.tensor([[1.0], [2.0]]), gather_indices, 2)
        tensor([[1.],
                [1.],
                [2.],
                [2.]])
    """
    routing = _as_routing(gather_indices)
    gather_indices, positions = _unrouted(routing)
    mode, level, topk = _validation.run_check(_check_permute, x, gather_indices, topk, mode,
                                              check)
    if positions is not None:
        level = _ROUTED
    return call_permute(x, gather_indices, topk, mode.value, level, positions,
                        _token_table(routing, topk))


def _check_permute(x, gather_indices, topk, mode, check):
    caller = "detsum.moe.permute"
    topk = _validation.check_positive_int(caller, "topk", topk)
    _validation.check_float(caller, "x", x)
    level = _check_level(caller, check, false_means=_BOUNDS_ONLY)
    return (_check_common(caller, "x", x, gather_indices, mode, x.shape[0] * topk), level,
            topk)


# ---- unpermute ----------------------------------------------------------------------------------

def _combined_dtype(y: torch.Tensor, weights: torch.Tensor | None) -> torch.dtype:
    """The dtype of the combined rows: torch's promotion of ``y * weights``, the dtype the naive
    composition returns (bf16 rows and fp32 weights give fp32)."""
    return y.dtype if weights is None else torch.promote_types(y.dtype, weights.dtype)


def _naive_combination(y: torch.Tensor, positions: torch.Tensor, topk: int,
                       slot_weights: torch.Tensor | None) -> torch.Tensor:
    """The naive composition itself, for "autograd": the rows in (token, slot) order, times the
    slots' weights, summed over the slots by torch's ``sum(1)`` on the same shapes and layout.

    torch's sum over the slots picks its order by the shape, the dtype and the CPU's vector
    width (or the GPU's reduction kernel): no fixed order reproduces it on every machine, so
    "autograd" runs torch's own operations, and has torch's bits wherever it runs."""
    slots = y.index_select(0, positions).view((-1, topk) + tuple(y.shape[1:]))
    if slot_weights is not None:
        slots = slots * slot_weights.view((-1, topk) + (1,) * (y.dim() - 1))
    return slots.sum(1)


def _weighted_rows(y: torch.Tensor, position_weights: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """y[p] * w[p] in the accumulator type of the output, one rounding per product."""
    shape = (-1,) + (1,) * (y.dim() - 1)
    # Both factors convert to the accumulator exactly (it is at least as wide as either), and
    # the multiply promotes y on the fly: one pass, one rounding per product.
    return y * position_weights.to(acc_dtype(out_dtype)).view(shape)


def _runs_in_token_blocks(device: torch.device, acc_mode: str) -> bool:
    """Whether the weighted unpermute runs by blocks of tokens: on CPU, where the cache is what
    a pass through memory costs, and for "fp32"/"kahan" ("autograd" is torch's own
    composition). Each token's sum and each row's dot product involve its own rows only, so
    the blocks give the same bits as one pass."""
    return device.type == "cpu" and acc_mode != Mode.AUTOGRAD.value


@torch.library.custom_op("detsum::moe_unpermute", mutates_args=())
def unpermute_op(y: torch.Tensor, gather_indices: torch.Tensor, topk: int,
                 weights: torch.Tensor | None, reduce: bool, acc_mode: str,
                 check: str = "host", positions: torch.Tensor | None = None) -> torch.Tensor:
    # Checked inside the operator: under torch.compile the host read of "host" runs with it
    # instead of breaking the graph.
    if check == _ROUTED:
        pass  # a routing: a permutation by construction, and its inverse
    elif check == "off":
        gather_indices = _gather_indices_in_range(gather_indices, check)
        positions = _slot_positions(gather_indices)
    else:
        positions = _check_permutation("detsum.moe.unpermute", gather_indices, check)
    if not reduce:
        return y.index_select(0, positions)
    num_tokens = y.shape[0] // topk
    out_dtype = _combined_dtype(y, weights)
    slot_weights = None
    if weights is not None:
        slot_weights = weights.reshape(-1)
        if check == "off":
            # Each slot weighted as the row it takes, on every path: the same weights for a
            # permutation; for a broken one (unchecked), a slot that no row names takes row 0
            # with row 0's weight.
            slot_weights = slot_weights.index_select(0, gather_indices).index_select(0, positions)
    if acc_mode == Mode.AUTOGRAD.value:
        return _naive_combination(y, positions, topk, slot_weights)
    if weights is not None and (_runs_in_token_blocks(y.device, acc_mode)
                                or _kernel_ops.fused_weighted_rule(
                                    y, weights.dtype, out_dtype, acc_mode, topk) is not None):
        return _kernel_ops.weighted_token_sums(y, positions, slot_weights, topk, out_dtype,
                                               acc_mode).to(out_dtype)
    rows = y
    if weights is not None:
        rows = _weighted_rows(y, weights.reshape(-1).index_select(0, gather_indices), out_dtype)
    # Offsets built here and positions already checked (or in range by construction): "off".
    out = torch.ops.detsum.segment_sum(rows, _token_offsets(num_tokens, topk, y.device), 0,
                                       positions, acc_mode, "off", gather_indices // topk,
                                       None, _no_chunks(topk))
    return out.to(out_dtype)


@unpermute_op.register_fake
def _(y, gather_indices, topk, weights, reduce, acc_mode, check="host", positions=None):
    if not reduce:
        return y.new_empty(y.shape)
    return y.new_empty((y.shape[0] // topk,) + tuple(y.shape[1:]),
                       dtype=_combined_dtype(y, weights))


def _unpermute_setup(ctx, inputs, output):
    y, gather_indices, topk, weights, reduce, acc_mode, check, *positions = inputs
    ctx.save_for_backward(y, gather_indices, weights, positions[0] if positions else None)
    ctx.topk, ctx.reduce, ctx.acc_mode, ctx.check = topk, reduce, acc_mode, check


_NO_MORE_GRADIENTS = (None,) * 4


def _unpermute_backward(ctx, grad):
    y, gather_indices, weights, positions = ctx.saved_tensors
    # Checked by the forward call, as its level said: nothing checked or read back here.
    gather_indices = _gather_indices_in_range(gather_indices, ctx.check)
    if (ctx.reduce and weights is not None and not torch.is_grad_enabled()
            and _kernel_ops.fused_weighted_rule(y, weights.dtype, grad.dtype, ctx.acc_mode,
                                                ctx.topk) is not None):
        # Dots stored by slot only when every slot is named once (checked, or a routing's).
        by_slot = ctx.check != "off"
        gradients = (_kernel_ops.weighted_gradients_in_one_launch
                     if _dispatch.direct_call_ok(grad, y, gather_indices, weights)
                     else call_weighted_gradients_in_one_launch)
        grad_y, dots = gradients(grad, y, gather_indices, weights.reshape(-1), ctx.topk,
                                 ctx.acc_mode, by_slot)
        if not by_slot:
            dots = dots.index_select(0, positions if positions is not None
                                     else _slot_positions(gather_indices))
        return grad_y, None, None, dots.view(weights.shape), *_NO_MORE_GRADIENTS
    if positions is None and ctx.reduce and weights is not None:
        positions = _slot_positions(gather_indices)
    if not ctx.reduce:
        return grad.index_select(0, gather_indices), None, None, None, *_NO_MORE_GRADIENTS
    tokens = gather_indices // ctx.topk
    if weights is None:
        return grad.index_select(0, tokens), None, None, None, *_NO_MORE_GRADIENTS
    position_weights = weights.reshape(-1).index_select(0, gather_indices)
    if _runs_in_token_blocks(y.device, ctx.acc_mode):
        # A plain eager backward calls the operator's body itself (see detsum/_dispatch.py).
        gradients = (_kernel_ops.weighted_gradients_in_blocks
                     if _dispatch.direct_call_ok(grad, y, tokens, position_weights)
                     else call_weighted_gradients_in_blocks)
        grad_y, dots = gradients(grad, y, tokens, position_weights, ctx.acc_mode)
        grad_weights = dots.index_select(0, positions)
        return (grad_y, None, None, grad_weights.view(weights.shape).to(weights.dtype),
                *_NO_MORE_GRADIENTS)
    grad_rows = grad.index_select(0, tokens)
    # torch's multiply backward, for autograd's bits in every mode: g * w in the promoted
    # dtype, then rounded to y's.
    grad_y = (grad_rows * position_weights.view((-1,) + (1,) * (grad.dim() - 1))).to(y.dtype)
    # Spelled out: a reshape to -1 is ambiguous when there are no rows.
    features = math.prod(y.shape[1:])
    if ctx.acc_mode == Mode.AUTOGRAD.value:
        # torch leaves the order of this sum open: only its own reduction, the one autograd
        # runs for the broadcast weights, gives autograd's bits.
        dots = (grad_rows * y).reshape(y.shape[0], features).sum(1)
    else:
        products = grad_rows.to(acc_dtype(grad.dtype)).mul_(y)  # exact for half grad and y
        products = products.reshape(y.shape[0], features)
        dots = call_segment_sum(products, _segments.one_segment(products.shape[1], y.device), 1,
                                None, ctx.acc_mode, "off").view(-1)
    grad_weights = dots.index_select(0, positions)
    return (grad_y, None, None, grad_weights.view(weights.shape).to(weights.dtype),
            *_NO_MORE_GRADIENTS)


@torch.library.custom_op("detsum::moe_unpermute_weighted_backward", mutates_args=())
def _weighted_gradients_in_blocks_op(grad: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor,
                                     position_weights: torch.Tensor, acc_mode: str
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """An operator of its own, so that a compiled backward sees one call, not a loop of
    blocks."""
    return _kernel_ops.weighted_gradients_in_blocks(grad, y, tokens, position_weights, acc_mode)


@_weighted_gradients_in_blocks_op.register_fake
def _(grad, y, tokens, position_weights, acc_mode):
    return (torch.empty_like(y, memory_format=torch.contiguous_format),
            y.new_empty(y.shape[0], dtype=acc_dtype(grad.dtype)))


@torch.library.custom_op("detsum::moe_unpermute_weighted_slot_gradients", mutates_args=())
def _weighted_gradients_in_one_launch_op(grad: torch.Tensor, y: torch.Tensor,
                                         slots: torch.Tensor, slot_weights: torch.Tensor,
                                         topk: int, acc_mode: str, by_slot: bool
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """An operator, so that a compiled backward sees the launch as one call."""
    return _kernel_ops.weighted_gradients_in_one_launch(grad, y, slots, slot_weights, topk,
                                                        acc_mode, by_slot)


@_weighted_gradients_in_one_launch_op.register_fake
def _(grad, y, slots, slot_weights, topk, acc_mode, by_slot):
    return (torch.empty_like(y, memory_format=torch.contiguous_format),
            slot_weights.new_empty(slot_weights.numel() if by_slot else y.shape[0]))


call_weighted_gradients_in_one_launch = _transforms.register_autograd(
    _weighted_gradients_in_one_launch_op,
    _transforms.refuse_second_order("detsum.moe.unpermute", "the gradient of weighted rows"),
    caller="detsum.moe.unpermute")


call_weighted_gradients_in_blocks = _transforms.register_autograd(
    _weighted_gradients_in_blocks_op,
    _transforms.refuse_second_order("detsum.moe.unpermute", "the gradient of weighted rows"),
    caller="detsum.moe.unpermute")


call_unpermute = _transforms.register_autograd(unpermute_op, _unpermute_backward,
                                               setup_context=_unpermute_setup,
                                               caller="detsum.moe.unpermute")


def unpermute(y: torch.Tensor, gather_indices: torch.Tensor | Routing, topk: int, *,
              weights: torch.Tensor | None = None, reduce: bool = True,
              mode: str | Mode = "fp32", check: str | bool = "host") -> torch.Tensor:
    """Bring expert-ordered rows back to their tokens, and combine each token's ``topk`` rows.

    Args:
        y: ``[T * topk, ...]`` rows in expert order (as ``permute`` made them).
        gather_indices: as for ``permute``: ``[T * topk]``, a permutation of
            ``0 .. T * topk - 1``, or the :class:`Routing` that ``route`` returned (neither
            checked nor inverted, forward or backward; nor is ``route``'s ``gather_indices``
            tensor while unchanged).
        topk: slots per token: a positive int (a NumPy or 0-d tensor int too).
        weights: ``[T, topk]`` routing probabilities (any float dtype, not necessarily ``y``'s),
            or None for plain sums. Only with ``reduce=True``.
        reduce: True: ``[T, ...]``, ``out[t] = sum_k weights[t, k] * y[position of (t, k)]``.
            False: ``[T * topk, ...]`` in (token, slot) order, ``out[gather_indices[p]] = y[p]``
            (exact).
        mode: ``"fp32"`` (default), ``"kahan"`` or ``"autograd"``.
        check: how ``gather_indices`` is checked to be a permutation, in the pass that
            inverts it (no sort): ``"host"`` (default), ``"device"`` or ``"off"``, as for
            ``permute`` (``"off"``: see below what a bad value then gives). True and False
            both mean ``"host"``.

    Returns:
        ``reduce=True`` with weights: dtype ``torch.promote_types(y.dtype, weights.dtype)``
        in every mode, the dtype of the naive composition below (bf16 rows and fp32 weights
        give fp32). Otherwise ``y``'s dtype.

    Raises:
        IndexError: with ``check="host"`` (or True, or False), a value of ``gather_indices``
            outside ``[0, T * topk)``, named with its position; before anything is computed.
        ValueError: with ``check="host"`` (or True, or False), a repeated value; before
            anything is computed. Also a bad ``topk``, ``mode``, ``check``, ``reduce`` or
            shape.
        RuntimeError: with ``check="device"``, either mistake (from ``torch._assert_async``,
            naming ``gather_indices`` but not the position; on a GPU at the next
            synchronisation).

    Under ``"off"`` a bad ``gather_indices`` is a broken promise that still reads and writes
    inside every tensor, and gives the same bits on every run. With
    ``v = gather_indices.clamp(0, T * topk - 1)``, slot ``j`` takes the row at the last
    position ``p`` with ``v[p] == j``, or row 0 when there is none (``reduce=False``:
    ``out[j] = y[p]``); with weights, each row ``p`` is weighted by ``weights.view(-1)[v[p]]``;
    the sums are those below. Backward
    applies its formulas to ``v`` (each row ``p`` receives the gradient of the slot ``v[p]``),
    which is then not the gradient of that output.

    Order and rounding of ``reduce=True`` (slots ``k = 0 .. topk - 1`` in order, from 0), with
    ``R`` the output dtype and ``acc`` its accumulator (fp32; fp64 when ``R`` is float64).
    Weights are never rounded to ``y``'s dtype: fp32 weights stay fp32, forward and backward.

    - ``"autograd"``: the naive composition itself,
      ``u = torch.empty_like(y).index_copy(0, gather_indices, y)`` then
      ``(u.view(T, topk, H) * weights[..., None]).sum(1)``, run by torch on the same shapes:
      torch's bits for every ``topk``, ``H`` and pair of dtypes, on every CPU and GPU.
    - ``"fp32"``: products and sum in ``acc``, in slot order, one rounding to ``R``.
    - ``"kahan"``: products in ``acc``, Neumaier-compensated sum, one rounding: within
      ``Mode.KAHAN``'s bound of the exact sum of those products (1 ulp unless they cancel
      heavily).

    A product in ``acc`` is exact when ``y`` and the weights are both half precision
    (fp16/bf16); bf16 rows times fp32 weights, or fp32 times fp32, round it once to fp32.

    Gradients: ``grad_y[p] = grad[t] * weights[t, k]`` as torch's multiply computes it (in
    ``R``), then rounded to ``y``'s dtype: autograd's bits in every mode.
    ``grad_weights[t, k] = <grad[t], y[p]>`` over the features: in ``"fp32"``/``"kahan"``,
    products in ``acc`` (exact when ``grad`` and ``y`` are both half precision) summed in order
    (``"kahan"``: compensated), one rounding to the weights' dtype; in ``"autograd"``,
    autograd's bits: products rounded to ``R``, summed by torch's own ``sum`` over the features
    (in an order torch leaves open, the same on every run and thread count), then rounded to
    the weights' dtype.

    **Deterministic in every mode.**

    Example:
        >>> import torch
        >>> from detsum import moe
        >>> gather_indices, _ = moe.route(torch.tensor([[1, 0], [1, 2]]), 3)
        >>> y = torch.tensor([[10.0], [20.0], [30.0], [40.0]])
        >>> moe.unpermute(y, gather_indices, 2, weights=torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
        tensor([[15.],
                [30.]])

        bf16 rows with fp32 weights give fp32, from the weights' fp32 values (rounded to bf16
        first, 1/3 and 2/3 would make the first row 13.375):

        >>> w = torch.tensor([[1 / 3, 2 / 3], [1.0, 0.0]])
        >>> moe.unpermute(y.bfloat16(), gather_indices, 2, weights=w)
        tensor([[13.3333],
                [30.0000]])
    """
    gather_indices, positions = _unrouted(_as_routing(gather_indices))
    mode, level, topk = _validation.run_check(_check_unpermute, y, gather_indices, topk,
                                              weights, reduce, mode, check)
    if positions is not None:
        level = _ROUTED
    return call_unpermute(y, gather_indices, topk, weights, reduce, mode.value, level,
                          positions)


def _check_unpermute(y, gather_indices, topk, weights, reduce, mode, check):
    caller = "detsum.moe.unpermute"
    topk = _validation.check_positive_int(caller, "topk", topk)
    _validation.check_float(caller, "y", y)
    _validation.check_flag(caller, "reduce", reduce)
    level = _check_level(caller, check, false_means="host")
    if y.shape[0] % topk:
        raise ValueError(f"{caller}: y has {y.shape[0]} rows; expected a multiple of "
                         f"topk = {topk} (T * topk rows)")
    mode = _check_common(caller, "y", y, gather_indices, mode, y.shape[0])
    if weights is not None:
        if not reduce:
            raise ValueError(f"{caller}: weights apply to the combined rows; pass reduce=True "
                             f"or weights=None")
        _validation.check_float(caller, "weights", weights)
        expected = (y.shape[0] // topk, topk)
        if tuple(weights.shape) != expected and not (topk == 1 and weights.dim() == 1
                                                     and weights.shape[0] == expected[0]):
            raise ValueError(f"{caller}: weights has shape {tuple(weights.shape)}; expected "
                             f"[T, topk] = {list(expected)}")
        _validation.check_same_device(caller, y=y, weights=weights)
    return mode, level, topk
