"""PyG (``torch_geometric``) on detsum: aggregation modules, PyG's ``scatter`` and ``softmax``
with a ``mode=``, and one call that makes every graph reduction of a model deterministic.

``torch_geometric`` is imported on first use (the aggregation classes, or a call), never by
``import detsum``.

- ``SumAggregation``, ``MeanAggregation``, ``MinAggregation``, ``MaxAggregation``,
  ``MulAggregation``, ``SoftmaxAggregation``: subclasses of PyG's aggregations of the same
  names (so ``isinstance`` checks still hold), taking PyG's arguments plus a keyword-only
  ``mode=``, that reduce with :func:`detsum.scatter` (``index``) or :func:`detsum.segment_csr`
  (``ptr``). Any of them plugs into ``MessagePassing(aggr=...)`` as an instance.
- :func:`scatter` and :func:`softmax`: ``torch_geometric.utils.scatter`` and ``softmax`` (the
  same arguments, defaults and values) on detsum, with a keyword-only ``mode=``.
- :func:`make_deterministic`: switches a whole model (see there for exactly what it covers)
  and undoes the switch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types

import torch

import detsum
from detsum.modes import Mode, parse_mode
from detsum.scatter_compat import _check_mode

__all__ = [
    "DeterministicSwitch", "MaxAggregation", "MeanAggregation", "MinAggregation",
    "MulAggregation", "SoftmaxAggregation", "SumAggregation", "make_deterministic", "scatter",
    "softmax",
]

AGGREGATION_REDUCES = {"SumAggregation": "sum", "MeanAggregation": "mean",
                       "MinAggregation": "min", "MaxAggregation": "max",
                       "MulAggregation": "mul"}
SCATTER_REDUCES = {"sum": "sum", "add": "sum", "mean": "mean", "mul": "mul", "min": "min",
                   "max": "max", "amin": "min", "amax": "max"}


def _import_pyg(caller: str):
    try:
        return importlib.import_module("torch_geometric")
    except ImportError as error:
        raise ImportError(f"{caller} needs torch_geometric, which is not installed "
                          f"(pip install torch_geometric)") from error


# ---- PyG's functional reductions, on detsum -------------------------------------------------------

def _normalized_dim(caller: str, dim: object, src: torch.Tensor) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -src.dim() <= dim < src.dim():
        raise ValueError(f"{caller}: dim={dim!r} is out of range for src with {src.dim()} "
                         f"dimensions; expected an int in [{-src.dim()}, {src.dim() - 1}]")
    return dim + src.dim() if dim < 0 else dim


def scatter(src: torch.Tensor, index: torch.Tensor, dim: int = 0, dim_size: int | None = None,
            reduce: str = "sum", *, mode: str | Mode = "fp32") -> torch.Tensor:
    """``torch_geometric.utils.scatter`` on :func:`detsum.scatter`: reduce ``src`` along
    ``dim`` into ``dim_size`` rows (default ``index.max() + 1``) at the 1-D ``index``.

    ``reduce`` is ``"sum"`` (or ``"add"``), ``"mean"``, ``"mul"``, ``"min"`` (or ``"amin"``)
    or ``"max"`` (or ``"amax"``); rows that receive nothing are 0 (1 for ``"mul"``), as in
    PyG. PyG's ``"any"`` (an arbitrary one of the values) is refused: it has no fixed result.
    Order and rounding are :func:`detsum.scatter`'s in ``mode``: in ``"fp32"`` the terms of
    each row are summed in fp32 in order of appearance and rounded once (a mean divides that
    sum before its rounding; PyG's mean rounds the sum to the dtype, then divides). Min and
    max are exact, and their gradient is PyG's in every mode (tied members share it; see
    :class:`MaxAggregation`).

    **This operation is fully deterministic**: the same bits on every run, for every thread
    count and every backend that implements the mode.

    Example:
        >>> import torch, detsum.pyg
        >>> detsum.pyg.scatter(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1, 1, 3]))
        tensor([0., 3., 0., 4.])
    """
    caller = "detsum.pyg.scatter"
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{caller}: src must be a torch.Tensor, got {type(src).__name__}")
    if isinstance(index, torch.Tensor) and index.dim() != 1:
        raise ValueError(f"{caller}: index has {index.dim()} dimensions; expected a 1-D index "
                         f"(PyG's scatter lines it up with dim)")
    if reduce not in SCATTER_REDUCES:
        raise ValueError(f"{caller}: reduce={reduce!r} is not supported; expected one of "
                         f"{tuple(SCATTER_REDUCES)}")
    d = _normalized_dim(caller, dim, src)
    reduction = SCATTER_REDUCES[reduce]
    if reduction in ("min", "max"):
        return _extreme_with_pygs_gradient(
            src, lambda v: detsum.scatter(v, index, d, dim_size=dim_size, reduce=reduction,
                                          mode=mode),
            lambda: _lined_up(index, src, d), d)
    return detsum.scatter(src, index, d, dim_size=dim_size, reduce=reduction, mode=mode)


def softmax(src: torch.Tensor, index: torch.Tensor | None = None,
            ptr: torch.Tensor | None = None, num_nodes: int | None = None, dim: int = 0, *,
            mode: str | Mode = "fp32") -> torch.Tensor:
    """``torch_geometric.utils.softmax`` on detsum: the softmax of ``src`` within each group of
    elements along ``dim`` that ``index`` sends to one node (or that ``ptr`` delimits, CSR).

    Computed as PyG defines it, ``exp(x - m) / (sum(exp(x - m)) + 1e-16)`` with ``m`` the
    group's maximum taken without gradient; the maximum by :func:`detsum.scatter` (or
    :func:`detsum.segment_csr`), exact in every mode; the sum in ``mode``; each group's
    maximum and total copied back to its elements by :func:`detsum.index_select` (or
    :func:`detsum.gather_csr`), whose gradient detsum also sums in ``mode``. With ``ptr``,
    it runs from 0 to ``src.size(dim)``.

    **This operation is fully deterministic**, forward and backward.

    Example:
        >>> import torch, detsum.pyg
        >>> detsum.pyg.softmax(torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 2]))
        tensor([0.5000, 0.5000, 1.0000, 1.0000])
    """
    caller = "detsum.pyg.softmax"
    if not isinstance(src, torch.Tensor) or not src.is_floating_point():
        raise TypeError(f"{caller}: src must be a floating-point torch.Tensor, got "
                        f"{getattr(src, 'dtype', type(src).__name__)}")
    d = _normalized_dim(caller, dim, src)
    if ptr is not None and (ptr.dim() == 1 or index is None):
        pointer = ptr.view((1,) * d + (-1,)) if ptr.dim() == 1 else ptr
        first, last = (int(v) for v in ptr.reshape(-1)[[0, -1]]) if ptr.numel() else (0, 0)
        if (first, last) != (0, src.shape[d]):
            raise ValueError(f"{caller}: ptr runs from {first} to {last}; expected 0 to "
                             f"src.size({d}) = {src.shape[d]}")
        with torch.no_grad():
            top = detsum.segment_csr(src.detach(), pointer, reduce="max", mode=mode)
        exps = (src - detsum.gather_csr(top, pointer)).exp()
        totals = detsum.segment_csr(exps, pointer, mode=mode) + 1e-16
        return exps / detsum.gather_csr(totals, pointer, mode=mode)
    if index is None:
        raise ValueError(f"{caller}: neither index nor ptr was given; expected one of them")
    if num_nodes is None:
        num_nodes = int(index.max()) + 1 if index.numel() else 0
    with torch.no_grad():
        top = detsum.scatter(src.detach(), index, d, dim_size=num_nodes, reduce="max",
                             mode=mode)
    exps = (src - top.index_select(d, index)).exp()
    totals = detsum.scatter(exps, index, d, dim_size=num_nodes, mode=mode) + 1e-16
    return exps / detsum.index_select(totals, d, index, mode=mode)


# ---- min and max, with PyG's gradient -------------------------------------------------------------

class _SharedExtreme(torch.autograd.Function):
    """A minimum or maximum that ``reduced(src)`` computes (detsum's: exact in every mode),
    with the gradient of PyG's CPU path, torch's ``zeros.scatter_reduce_(dim, index, src,
    "amax" or "amin", include_self=False)``, bit for bit: each output's gradient divided, in
    the dtype, by its count of members equal to it, plus one where it is 0 (torch counts the
    zero it starts from, though ``include_self=False`` leaves it out of the value); an equal
    member takes that quotient, any other ``0 *`` the quotient (``-0.0`` where it is
    negative, NaN where it is not finite: a NaN result has no equal member, so all of its
    members get NaN). The count is an integer sum, the same in any order, rounded once to the
    dtype as torch's CPU ``scatter_add_`` rounds it (in bf16, 301 ties count as 300)."""

    @staticmethod
    def forward(ctx, src, reduced, positions, dim):
        result = reduced(src)
        # The index after the reduction: the reduction checks it and names the caller's error.
        index = positions()
        ctx.save_for_backward(src, index, result)
        ctx.dim = dim
        return result

    @staticmethod
    def backward(ctx, grad):
        src, index, result = ctx.saved_tensors
        dim = ctx.dim
        is_member = src == result.gather(dim, index)
        members = torch.zeros(result.shape, dtype=torch.int32, device=result.device)
        members.scatter_add_(dim, index, is_member.to(torch.int32))
        members += result == 0
        shares = grad / members.to(grad.dtype)
        return is_member * shares.gather(dim, index), None, None, None


def _extreme_with_pygs_gradient(src: torch.Tensor, reduced, positions, dim: int
                                ) -> torch.Tensor:
    """``reduced(src)``, a min or max along ``dim``; while autograd records a floating
    ``src``, with PyG's gradient (``_SharedExtreme``). ``positions()``: each element's output
    position along ``dim``, an int64 tensor of ``src``'s shape (a broadcast view will do)."""
    if not (src.is_floating_point() and src.requires_grad and torch.is_grad_enabled()):
        return reduced(src)
    return _SharedExtreme.apply(src, reduced, positions, dim)


def _lined_up(index: torch.Tensor, src: torch.Tensor, dim: int) -> torch.Tensor:
    """A 1-D ``index`` along ``dim``, broadcast to ``src``'s shape, as PyG's ``scatter`` does."""
    shape = [1] * src.dim()
    shape[dim] = -1
    return index.to(torch.int64).view(shape).expand(src.shape)


def _segments_of(pointer: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The segment of every position along ``pointer``'s last dim that the (checked) CSR
    ``pointer`` delimits, broadcast to ``src``'s shape: the index ``pointer`` describes."""
    dim = pointer.dim() - 1
    count = src.shape[dim]
    positions = torch.arange(count, dtype=pointer.dtype, device=pointer.device)
    positions = positions.expand(*pointer.shape[:-1], count).contiguous()
    segments = torch.searchsorted(pointer.contiguous(), positions, right=True) - 1
    return segments.view(*segments.shape, *[1] * (src.dim() - dim - 1)).expand(src.shape)


# ---- aggregation modules (PyG's classes, built on first use) ---------------------------------------

def _aggregate(caller: str, x: torch.Tensor, index: torch.Tensor | None,
               ptr: torch.Tensor | None, dim_size: int | None, dim: int, reduce: str,
               mode: Mode) -> torch.Tensor:
    """What PyG's ``Aggregation.reduce`` computes, on detsum: ``segment_csr`` when ``ptr`` is
    given (the same bits as the scatter of the index it describes), else ``scatter``."""
    d = dim + x.dim() if dim < 0 else dim
    extreme = reduce in ("min", "max")
    if ptr is not None and reduce != "mul":
        pointer = ptr.view((1,) * d + (-1,)) if ptr.dim() == 1 else ptr
        if extreme:
            return _extreme_with_pygs_gradient(
                x, lambda v: detsum.segment_csr(v, pointer, reduce=reduce, mode=mode),
                lambda: _segments_of(pointer, x), pointer.dim() - 1)
        return detsum.segment_csr(x, pointer, reduce=reduce, mode=mode)
    if index is None:
        raise ValueError(f"{caller}: reduce='mul' needs index; got ptr alone (PyG's "
                         f"MulAggregation takes index only)")
    if extreme:
        return _extreme_with_pygs_gradient(
            x, lambda v: detsum.scatter(v, index, d, dim_size=dim_size, reduce=reduce,
                                        mode=mode),
            lambda: _lined_up(index, x, d), d)
    return detsum.scatter(x, index, d, dim_size=dim_size, reduce=reduce, mode=mode)


_REDUCTION_DOC = """PyG's ``{name}`` on detsum: ``{name}(mode="fp32")`` plugs into
    ``MessagePassing(aggr=...)`` or runs alone, ``aggr(x, index, ptr=None, dim_size=None,
    dim=-2)``, with PyG's arguments and values. It reduces with :func:`detsum.segment_csr` when
    ``ptr`` is given{ptr_note}, else with :func:`detsum.scatter` and ``index``, in ``mode``
    ({rounding}). Rows that receive nothing are {empty}.{gradient}"""

_EXTREME_GRADIENT = """

    The gradient is PyG's CPU gradient, bit for bit, in every mode: that of torch's
    ``zeros.scatter_reduce_(dim, index, x, "a{reduce}", include_self=False)``, which PyG's
    ``scatter`` runs on a CPU (and on a GPU without torch_scatter). The members equal to a
    row's {reduce}imum share its gradient evenly: it is divided, in the dtype, by their
    count, plus one where the {reduce}imum is 0 (torch counts the zero it starts from, so
    there the shares add up to less than the gradient); a NaN row gives its members NaN.
    With ``ptr``: the gradient of the index that ``ptr`` describes (PyG's ``ptr``-only path,
    torch's ``_segment_reduce``, shares ties otherwise). torch_scatter's rule, all of it to
    the first member, is :func:`detsum.scatter_{reduce}`'s, not this one's."""


def _reduction_class(base: type, reduce: str) -> type:
    name = base.__name__
    caller = f"detsum.pyg.{name}"

    def __init__(self, *, mode: str | Mode = "fp32"):
        base.__init__(self)
        self.mode = _check_mode(caller, mode, reduce)

    def forward(self, x, index=None, ptr=None, dim_size=None, dim=-2):
        return _aggregate(caller, x, index, ptr, dim_size, dim, reduce, self.mode)

    def __repr__(self):
        return f"{name}(mode={self.mode.value!r})"

    rounding = {"sum": "in ``\"fp32\"``: summed in fp32 in order of appearance, rounded once",
                "mean": "in ``\"fp32\"``: that sum divided before its one rounding; PyG "
                        "rounds the sum to the dtype, then divides",
                "mul": "the product in order in the acc type, rounded once; no "
                       "``\"exact\"``",
                "min": "exact in every mode; NaN propagates", "max":
                "exact in every mode; NaN propagates"}[reduce]
    doc = _REDUCTION_DOC.format(
        name=name, rounding=rounding, empty="1" if reduce == "mul" else "0",
        gradient=_EXTREME_GRADIENT.format(reduce=reduce) if reduce in ("min", "max") else "",
        ptr_note=" (``ptr`` is ignored: PyG's product takes ``index`` only)"
        if reduce == "mul" else "")
    return type(name, (base,), {"__init__": __init__, "forward": forward, "__repr__": __repr__,
                                "__doc__": doc, "__module__": __name__, "__qualname__": name})


def _softmax_class(base: type) -> type:
    caller = "detsum.pyg.SoftmaxAggregation"

    class SoftmaxAggregation(base):
        """PyG's ``SoftmaxAggregation`` (DeeperGCN's softmax aggregation: the sum of ``x``
        weighted by the softmax of ``t * x`` within each group) on detsum: PyG's arguments
        ``t``, ``learn``, ``semi_grad``, ``channels``, plus a keyword-only ``mode=``. The
        softmax is :func:`detsum.pyg.softmax`, the weighted sum :func:`detsum.scatter` (or
        :func:`detsum.segment_csr` with ``ptr``), both in ``mode``."""

        def __init__(self, t: float = 1.0, learn: bool = False, semi_grad: bool = False,
                     channels: int = 1, *, mode: str | Mode = "fp32"):
            super().__init__(t, learn, semi_grad, channels)
            self.mode = parse_mode(mode, caller=caller)

        def forward(self, x, index=None, ptr=None, dim_size=None, dim=-2):
            t = self.t
            if self.channels != 1:
                self.assert_two_dimensional_input(x, dim)
                t = t.view(-1, self.channels)
            logits = x if isinstance(t, (int, float)) and t == 1 else x * t
            with torch.no_grad() if self.semi_grad and not self.learn else \
                    contextlib.nullcontext():
                weights = softmax(logits, index, ptr, dim_size, dim, mode=self.mode)
            return _aggregate(caller, x * weights, index, ptr, dim_size, dim, "sum", self.mode)

        def __repr__(self):
            return f"SoftmaxAggregation(learn={self.learn}, mode={self.mode.value!r})"

    SoftmaxAggregation.__module__ = __name__  # pickle finds it as detsum.pyg.SoftmaxAggregation
    SoftmaxAggregation.__qualname__ = "SoftmaxAggregation"
    return SoftmaxAggregation


@functools.cache
def _aggregation_classes() -> dict[str, type]:
    aggr = importlib.import_module("torch_geometric.nn.aggr")
    classes = {name: _reduction_class(getattr(aggr, name), reduce)
               for name, reduce in AGGREGATION_REDUCES.items()}
    classes["SoftmaxAggregation"] = _softmax_class(aggr.SoftmaxAggregation)
    return classes


def __getattr__(name: str):
    # The aggregation classes subclass PyG's, so they exist once torch_geometric is imported:
    # on first access, not at `import detsum`.
    if name in AGGREGATION_REDUCES or name == "SoftmaxAggregation":
        _import_pyg(f"detsum.pyg.{name}")
        return _aggregation_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- module-level functions of PyG's conv layers, routed while a switched layer runs -------------

_local = threading.local()  # .modes: the modes of the switched layers running in this thread
_patch_lock = threading.Lock()
_patch_users = 0
_patched: list[tuple[object, str, object]] = []  # (module, name, PyG's original)


def _current_mode() -> Mode | None:
    modes = getattr(_local, "modes", None)
    return modes[-1] if modes else None


def _routed_scatter(src, index, dim=0, dim_size=None, reduce="sum"):
    mode = _current_mode()
    if mode is None:  # another thread, outside any switched layer: PyG's own function
        return _original("scatter")(src, index, dim, dim_size, reduce)
    return scatter(src, index, dim, dim_size, reduce, mode=mode)


def _routed_softmax(src, index=None, ptr=None, num_nodes=None, dim=0):
    mode = _current_mode()
    if mode is None:
        return _original("softmax")(src, index, ptr, num_nodes, dim)
    return softmax(src, index, ptr, num_nodes, dim, mode=mode)


def _original(name: str):
    return getattr(importlib.import_module("torch_geometric.utils"), name)


@functools.cache
def _routed_functions() -> tuple[tuple[object, str, object, object], ...]:
    """(module, name, PyG's original, detsum's) for every ``scatter`` and ``softmax`` that a
    module of ``torch_geometric.nn.conv`` imported from ``torch_geometric.utils``. Looked up
    once (a walk over sys.modules takes milliseconds; a layer's forward installs the routes)."""
    utils = importlib.import_module("torch_geometric.utils")
    importlib.import_module("torch_geometric.nn.conv")
    found = []
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("torch_geometric.nn.conv.") or module is None:
            continue
        for name, routed in (("scatter", _routed_scatter), ("softmax", _routed_softmax)):
            original = getattr(utils, name)
            if vars(module).get(name) is original:
                found.append((module, name, original, routed))
    return tuple(found)


@contextlib.contextmanager
def _routing(mode: Mode):
    """PyG's conv modules call detsum's ``scatter``/``softmax`` in ``mode`` inside this block;
    the first block to open installs the routes, the last to close restores PyG's originals."""
    global _patch_users
    modes = _local.__dict__.setdefault("modes", [])
    with _patch_lock:
        if _patch_users == 0:
            for module, name, original, routed in _routed_functions():
                if vars(module).get(name) is original:  # never over someone else's patch
                    setattr(module, name, routed)
                    _patched.append((module, name, original))
        _patch_users += 1
    modes.append(mode)
    try:
        yield
    finally:
        modes.pop()
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                while _patched:
                    module, name, original = _patched.pop()
                    setattr(module, name, original)


# ---- the switch ---------------------------------------------------------------------------------

def _is_sparse(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.layout != torch.strided
    return type(value).__name__ == "SparseTensor"


class _SwitchedForward:
    """A switched layer's ``forward`` (bound to the layer as a method, so a deep copy of the
    layer binds it to the copy): the layer's class ``forward``, during which PyG's conv modules
    call detsum's ``scatter`` and ``softmax``."""

    def __init__(self, mode: Mode, path: str):
        self.mode, self.path = mode, path

    def __call__(self, layer, *args, **kwargs):
        for value in (*args, *kwargs.values()):
            if _is_sparse(value):
                raise ValueError(
                    f"detsum.pyg: {type(layer).__name__} at {self.path!r} was called with a "
                    f"sparse tensor ({type(value).__name__}, layout "
                    f"{getattr(value, 'layout', '-')}); make_deterministic covers edge_index "
                    f"given as an integer tensor of shape [2, num_edges] (PyG's sparse path "
                    f"runs a sparse matmul that detsum does not replace)")
        with _routing(self.mode):
            return type(layer).forward(layer, *args, **kwargs)


class _SwitchedIndexSelect:
    """A switched layer's ``_index_select`` (PyG's gather of ``x_j``/``x_i``), bound as a
    method: :func:`detsum.index_select` along the layer's ``node_dim``."""

    def __init__(self, mode: Mode):
        self.mode = mode

    def __call__(self, layer, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return detsum.index_select(src, layer.node_dim, index, mode=self.mode)


_MISSING = object()


class DeterministicSwitch:
    """What :func:`make_deterministic` changed in a model, and how to undo it: ``undo()``, or
    leave a ``with`` block.

    Attributes:
        model: the switched model.
        mode: the detsum mode of every switched reduction.
        layers: the paths (``model.named_modules()`` names) of the switched MessagePassing
            layers.
        aggregations: ``(path, PyG class name)`` of every aggregation module replaced by
            detsum's.
        active: True until ``undo()``.
    """

    def __init__(self, model: torch.nn.Module, mode: Mode):
        self.model, self.mode = model, mode
        self.layers: list[str] = []
        self.aggregations: list[tuple[str, str]] = []
        self._undo_steps: list = []
        self.active = True

    def undo(self) -> None:
        """Put back every original: aggregation modules, the layers' ``forward``,
        ``_index_select`` and ``fuse``, and MultiAggregation's fused path. Undoing twice does
        nothing the second time."""
        while self._undo_steps:
            self._undo_steps.pop()()
        self.active = False

    def __enter__(self) -> DeterministicSwitch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return (f"DeterministicSwitch({state}, mode={self.mode.value!r}, "
                f"layers={len(self.layers)}, aggregations={len(self.aggregations)})")

    def _set(self, owner: object, name: str, value: object) -> None:
        """``setattr(owner, name, value)``, remembering how to undo it (an attribute that was
        not in the instance's own ``__dict__`` is deleted again, so the class's shows)."""
        if isinstance(owner, torch.nn.Module) and name in owner._modules:
            before = owner._modules[name]
        else:
            before = vars(owner).get(name, _MISSING)
        setattr(owner, name, value)

        def restore():
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)

        self._undo_steps.append(restore)


def _detsum_equivalent(aggregation: torch.nn.Module, mode: Mode) -> torch.nn.Module:
    classes = _aggregation_classes()
    name = type(aggregation).__name__
    if name == "SoftmaxAggregation":
        equivalent = classes[name](aggregation._init_t, aggregation.learn, aggregation.semi_grad,
                                   aggregation.channels, mode=mode)
        if aggregation.learn:
            equivalent.t = aggregation.t  # the same Parameter: an optimizer keeps updating it
    else:
        equivalent = classes[name](mode=mode)
    return equivalent.train(aggregation.training)


def make_deterministic(model: torch.nn.Module, *, mode: str | Mode = "fp32",
                       strict: bool = True) -> DeterministicSwitch:
    """Make every graph reduction of a PyG model deterministic, in ``mode``; returns a
    :class:`DeterministicSwitch` whose ``undo()`` (or the end of a ``with`` block) puts PyG's
    originals back.

    ::

        switch = detsum.pyg.make_deterministic(model, mode="fp32")   # for good, or:
        with detsum.pyg.make_deterministic(model, mode="fp32"):
            loss = criterion(model(x, edge_index), y)
            loss.backward()

    What it covers, for every ``MessagePassing`` layer in ``model`` (``model.modules()``):

    1. **Aggregation**: each ``SumAggregation``, ``MeanAggregation``, ``MinAggregation``,
       ``MaxAggregation``, ``MulAggregation`` and ``SoftmaxAggregation`` in the model (the
       ``aggr_module`` a layer built from ``aggr="add"``, ``"mean"``, ... or was given, and
       those inside a ``MultiAggregation``) is replaced by detsum's class of the same name
       (a learnable ``t`` stays the same Parameter); a ``MultiAggregation`` runs its
       aggregations one by one, not through PyG's fused kernel.
    2. **The gather of messages**: ``x_j``/``x_i`` (PyG's ``_index_select``, in ``propagate``
       and ``edge_updater``) go through :func:`detsum.index_select`, whose backward is
       detsum's ``index_add`` (torch's is an ``index_add_`` with atomics on a GPU).
    3. **Module-level reductions of the conv layers**: while a switched layer's ``forward``
       runs, the ``scatter`` and ``softmax`` that PyG's conv modules import from
       ``torch_geometric.utils`` are :func:`scatter` and :func:`softmax` in ``mode``: the
       degree sum of ``gcn_norm`` (GCNConv), the attention softmax of GATConv, GATv2Conv,
       TransformerConv and the others, the aggregations of EGConv and RGCNConv. They are
       PyG's own again as soon as that ``forward`` returns or raises, and in other threads
       all along.
    4. Layers that would take a fused ``message_and_aggregate`` run message and aggregate
       apart (``fuse = False``).

    Not covered: anything outside those reductions (dense layers: torch's matmuls; dropout);
    a sparse adjacency (``torch.sparse`` or ``SparseTensor``: refused with an error, as its
    sparse matmul is torch's); the gradient of ``gcn_norm`` with respect to edge weights
    (``deg_inv_sqrt[row]``: torch's advanced-index backward); aggregation modules of other
    kinds (LSTM, Set2Set, Std, ...; with ``strict=True`` they are refused, naming each,
    before anything changes; with ``strict=False`` they keep PyG's code); PyG's pooling and
    ``torch_geometric.utils`` called outside a switched layer's ``forward``; models run
    under ``torch.compile`` or TorchScript (not tested).

    Args:
        model: any ``torch.nn.Module`` holding PyG layers (or a layer itself).
        mode: keyword only: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.
        strict: keyword only: refuse aggregation modules detsum cannot replace (default).

    Bits, on a CPU, for fp32 data: ``"autograd"`` gives PyG's own forward and backward bits
    for GCNConv, SAGEConv and GATConv (torch's CPU ``scatter_add_`` and ``index_add_`` add
    each node's terms in fp32 in order of appearance, rounding after every add), and so does
    ``"fp32"`` wherever a node receives at most 256 terms (longer sums it takes in chunks of
    256); docs/switching.md has the table per mode and dtype. Min and max aggregations are
    exact, and their gradient is PyG's CPU gradient in every mode and dtype (tied members
    share it evenly, as :class:`MaxAggregation` says), so the layers built on them (SAGEConv
    or GINConv with ``aggr="max"``, EdgeConv) differ from PyG only where their sums do.
    """
    caller = "detsum.pyg.make_deterministic"
    pyg = _import_pyg(caller)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    mode = parse_mode(mode, caller=caller)
    if not isinstance(strict, bool):
        raise TypeError(f"{caller}: strict={strict!r}; expected True or False")
    aggr = pyg.nn.aggr
    message_passing = pyg.nn.conv.MessagePassing
    if not callable(getattr(message_passing, "_index_select", None)):
        raise RuntimeError(f"{caller}: torch_geometric {pyg.__version__} has no "
                           f"MessagePassing._index_select, the gather the switch replaces; "
                           f"expected torch_geometric 2.5 or later (tested with 2.8)")
    replaceable = tuple(getattr(aggr, name) for name in (*AGGREGATION_REDUCES,
                                                         "SoftmaxAggregation"))
    ours = tuple(_aggregation_classes().values())
    paths = {id(module): path for path, module in model.named_modules()}

    # Plan everything first: a refusal leaves the model untouched.
    replacements, multis, refused = [], [], []
    fused_of_multis = {id(m.fused_aggr) for m in model.modules()
                       if isinstance(m, aggr.MultiAggregation) and m.fused_aggr is not None}
    for module in model.modules():
        if isinstance(module, message_passing) and "_index_select" in vars(module):
            raise ValueError(f"{caller}: the layer at {paths[id(module)]!r} is switched "
                             f"already; undo the earlier switch first")
        if isinstance(module, message_passing) and "forward" in vars(module):
            raise ValueError(f"{caller}: the layer at {paths[id(module)]!r} has a forward of "
                             f"its own (an instance attribute); expected its class's forward, "
                             f"which the switch wraps")
        if isinstance(module, aggr.MultiAggregation):
            multis.append(module)
        for name, child in module.named_children():
            if type(child) in replaceable:
                replacements.append((module, name, child,
                                     _detsum_equivalent(child, mode)))
    for module in model.modules():
        if (isinstance(module, aggr.Aggregation) and not isinstance(module, ours)
                and type(module) not in replaceable
                and not isinstance(module, aggr.MultiAggregation)
                and id(module) not in fused_of_multis):
            refused.append(f"{paths[id(module)] or '<model>'} ({type(module).__name__})")
    if type(model) in replaceable:
        refused.append(f"<model> ({type(model).__name__}: pass the module that holds it, or "
                       f"use detsum.pyg.{type(model).__name__} directly)")
    if strict and refused:
        raise ValueError(f"{caller}: detsum has no replacement for the aggregation modules "
                         f"{', '.join(refused)}; expected Sum, Mean, Min, Max, Mul, Softmax or "
                         f"a MultiAggregation of them (strict=False keeps PyG's code for the "
                         f"others)")

    switch = DeterministicSwitch(model, mode)
    for module, name, old, new in replacements:
        switch._set(module, name, new)
        switch.aggregations.append((f"{paths[id(module)]}.{name}".lstrip("."),
                                    type(old).__name__))
    for multi in multis:
        if multi.fused_aggr is not None:
            switch._set(multi, "fused_aggr", None)
    for module in model.modules():
        if isinstance(module, message_passing):
            path = paths[id(module)]
            switch._set(module, "_index_select",
                        types.MethodType(_SwitchedIndexSelect(mode), module))
            switch._set(module, "forward",
                        types.MethodType(_SwitchedForward(mode, path or "<model>"), module))
            if module.fuse:
                switch._set(module, "fuse", False)
            switch.layers.append(path)
    return switch
