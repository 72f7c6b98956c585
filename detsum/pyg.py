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
- :func:`make_deterministic`: runs a whole model, forward and backward, under detsum's switch
  (:func:`detsum.deterministic`), which takes torch's own accumulating ops: PyG's code and
  modules stay as they are (see there for exactly what it covers), and the switch is undone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading

import torch

import detsum
from detsum import scatter_compat, switch
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
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{caller}: dim={dim!r} is a {type(dim).__name__}; expected an int in "
                        f"[{-src.dim()}, {src.dim() - 1}]")
    if not -src.dim() <= dim < src.dim():
        raise ValueError(f"{caller}: dim={dim!r} is out of range for src with {src.dim()} "
                         f"dimensions; expected an int in [{-src.dim()}, {src.dim() - 1}]")
    return dim + src.dim() if dim < 0 else dim


def _scatter_for(caller: str, src: torch.Tensor, index: torch.Tensor, dim: int,
                 dim_size: int | None, reduce: str, mode: object,
                 size_name: str | None = None) -> torch.Tensor:
    """:func:`detsum.scatter`'s result, its errors in ``caller``'s words (``size_name``: how
    the caller's arguments name ``dim_size``, if not so)."""
    return scatter_compat._scatter(caller, src, index, dim, None, dim_size, reduce, mode,
                                   want_arg=False, size_name=size_name)[0]


def _segment_csr_for(caller: str, src: torch.Tensor, pointer: torch.Tensor, reduce: str,
                     mode: object) -> torch.Tensor:
    """:func:`detsum.segment_csr`'s result, its errors in ``caller``'s words (``pointer``: the
    caller's ``ptr``)."""
    return scatter_compat._segment_csr(caller, src, pointer, None, reduce, mode,
                                       want_arg=False, pointer_name="ptr")[0]


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
    if not isinstance(reduce, str):
        raise TypeError(f"{caller}: reduce={reduce!r} is a {type(reduce).__name__}; expected "
                        f"a str, one of {tuple(SCATTER_REDUCES)}")
    if reduce not in SCATTER_REDUCES:
        raise ValueError(f"{caller}: reduce={reduce!r} is not supported; expected one of "
                         f"{tuple(SCATTER_REDUCES)}")
    d = _normalized_dim(caller, dim, src)
    reduction = SCATTER_REDUCES[reduce]
    if reduction in ("min", "max"):
        return _extreme_with_pygs_gradient(
            src, lambda v: _scatter_for(caller, v, index, d, dim_size, reduction, mode),
            lambda: _lined_up(index, src, d), d)
    return _scatter_for(caller, src, index, d, dim_size, reduction, mode)


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
    return _softmax("detsum.pyg.softmax", src, index, ptr, num_nodes, "num_nodes", dim, mode)


def _softmax(caller: str, src: torch.Tensor, index: torch.Tensor | None,
             ptr: torch.Tensor | None, num_nodes: int | None, size_name: str, dim: int,
             mode: object) -> torch.Tensor:
    """:func:`softmax`'s body, its errors in ``caller``'s words (``size_name``: its argument
    ``num_nodes``)."""
    if not isinstance(src, torch.Tensor) or not src.is_floating_point():
        raise TypeError(f"{caller}: src must be a floating-point torch.Tensor, got "
                        f"{getattr(src, 'dtype', type(src).__name__)}")
    d = _normalized_dim(caller, dim, src)
    for name, value in (("index", index), ("ptr", ptr)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{caller}: {name} must be a torch.Tensor or None, got "
                            f"{type(value).__name__}")
    # (A traced call's count may be symbolic: only a plain int is compared here.)
    if num_nodes is not None and (isinstance(num_nodes, bool)
                                  or not isinstance(num_nodes, (int, torch.SymInt))):
        raise TypeError(f"{caller}: {size_name}={num_nodes!r} is a {type(num_nodes).__name__}; "
                        f"expected a non-negative int or None (index.max() + 1)")
    if isinstance(num_nodes, int) and num_nodes < 0:
        raise ValueError(f"{caller}: {size_name}={num_nodes!r}; expected a non-negative int or "
                         f"None (index.max() + 1)")
    if ptr is not None and (ptr.dim() == 1 or index is None):
        pointer = ptr.view((1,) * d + (-1,)) if ptr.dim() == 1 else ptr
        first, last = (int(v) for v in ptr.reshape(-1)[[0, -1]]) if ptr.numel() else (0, 0)
        if (first, last) != (0, src.shape[d]):
            raise ValueError(f"{caller}: ptr runs from {first} to {last}; expected 0 to "
                             f"src.size({d}) = {src.shape[d]}")
        with torch.no_grad():
            top = _segment_csr_for(caller, src.detach(), pointer, "max", mode)
        exps = (src - detsum.gather_csr(top, pointer)).exp()
        totals = _segment_csr_for(caller, exps, pointer, "sum", mode) + 1e-16
        return exps / detsum.gather_csr(totals, pointer, mode=mode)
    if index is None:
        raise ValueError(f"{caller}: neither index nor ptr was given; expected one of them")
    with torch.no_grad():
        # Without num_nodes, the maximum's scatter reads index.max() + 1 (0 for an empty
        # index), as PyG counts the nodes; the sum takes the same size from its result, a
        # size of a tensor, where a second read would be a data-dependent guard while compiling.
        top = _scatter_for(caller, src.detach(), index, d, num_nodes, "max", mode,
                           size_name if num_nodes is not None else None)
    exps = (src - top.index_select(d, index)).exp()
    totals = _scatter_for(caller, exps, index, d, top.shape[d], "sum", mode) + 1e-16
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
                x, lambda v: _segment_csr_for(caller, v, pointer, reduce, mode),
                lambda: _segments_of(pointer, x), pointer.dim() - 1)
        return _segment_csr_for(caller, x, pointer, reduce, mode)
    if index is None:
        raise ValueError(f"{caller}: reduce='mul' needs index; got ptr alone (PyG's "
                         f"MulAggregation takes index only)")
    if extreme:
        return _extreme_with_pygs_gradient(
            x, lambda v: _scatter_for(caller, v, index, d, dim_size, reduce, mode),
            lambda: _lined_up(index, x, d), d)
    return _scatter_for(caller, x, index, d, dim_size, reduce, mode)


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
                weights = _softmax(caller, logits, index, ptr, dim_size, "dim_size", dim,
                                   self.mode)
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


# ---- make_deterministic: a model's forward and backward under detsum's switch --------------------

#: The attribute that marks a module made deterministic: its mode's name. A plain str in the
#: module's ``__dict__``, so a pickled, saved or copied module is marked as its original was.
MODE_ATTRIBUTE = "_detsum_pyg_mode"
#: What a switched call's error says turned the switch on in a marked module's forward and
#: backward.
OPENER = "detsum.pyg.make_deterministic"

# .blocks: [(module, the layer of its switch's block)], the marked forwards running in this
# thread.
_open = threading.local()
# The switch's blocks opened by backward calls that reached a marked module's output, by the
# autograd engine's graph task id: (the thread that opened it, the layer of the block).
_backward_blocks: dict[int, tuple[int, object]] = {}


def _switch_on(module: torch.nn.Module, args) -> None:
    """Forward pre-hook of a marked module: the switch on in the module's mode until its
    forward returns or raises (``_switch_off``)."""
    if torch._C._current_graph_task_id() == -1:
        _close_failed_backward_blocks()
    layer = switch._open_block(getattr(module, MODE_ATTRIBUTE), OPENER)
    _open.__dict__.setdefault("blocks", []).append((module, layer))


def _switch_off(module: torch.nn.Module, args, output) -> None:
    """Forward hook of a marked module, run also after a forward that raised: the switch as it
    was before the forward, and each output that autograd records turns the switch on again
    when the backward reaches it (``_switch_on_in_backward``)."""
    blocks = getattr(_open, "blocks", [])
    if blocks and blocks[-1][0] is module:
        switch._close_block(blocks.pop()[1])
    mode = getattr(module, MODE_ATTRIBUTE, None)
    if mode is None or output is None or not torch.is_grad_enabled():
        return
    # A pre-hook of the node that computed each output, not a hook of the tensor: it runs at
    # the same point of the backward (before that node), and a tensor hook costs about 6 us
    # more to register and to call (benches/NOTES.md, the twenty-first session). Once per
    # node; an output without one is a leaf that the module passed through, no op of its own.
    nodes = []
    for tensor in _tensors(output):
        node = tensor.grad_fn
        if node is not None and all(node is not seen for seen in nodes):
            nodes.append(node)
            node.register_prehook(functools.partial(_switch_on_in_backward, mode))


def _switch_on_in_backward(mode: str, grads: tuple[torch.Tensor | None, ...]) -> None:
    """Pre-hook of the autograd node of a marked module's output: the switch on in ``mode``
    from here to the end of this backward call, once per call (the first marked output it
    reaches sets the mode). The backward of the module's own ops has no end that autograd
    announces; the end of the call is the first point after all of them. The engine's final
    callback closes the block; it does not run when the backward raises, and then the
    thread's next marked forward closes it (``_close_failed_backward_blocks``)."""
    task = torch._C._current_graph_task_id()
    if task in _backward_blocks:
        return
    _backward_blocks[task] = (threading.get_ident(), switch._open_block(mode, OPENER))
    torch.autograd.Variable._execution_engine.queue_callback(
        functools.partial(_close_backward_block, task))


def _close_backward_block(task: int) -> None:
    entry = _backward_blocks.pop(task, None)
    if entry is not None:
        switch._close_block(entry[1])


def _close_failed_backward_blocks() -> None:
    """Close the blocks of this thread's backward calls, called outside any backward: those
    calls are over, and the blocks still open are of calls that raised. (A CPU backward runs
    its hooks in the calling thread; a GPU one in the engine's device threads, which run no
    forward: their blocks stay open until their call ends.)"""
    thread = threading.get_ident()
    for task in [task for task, (owner, _) in _backward_blocks.items() if owner == thread]:
        _close_backward_block(task)


def _tensors(value: object):
    """The tensors in a module's output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


# The hooks that turn the switch on and off run eagerly, never traced by Dynamo: under
# torch.compile(model) the module's hooks run before and after its compiled forward, so the
# switch is on when Dynamo traces the forward (Inductor then leaves the switched ops to the
# dispatcher) and whenever the compiled code runs. torch.compiler.disable imports Dynamo:
# these are made on first use (make_deterministic, or unpickling a marked module), not at
# import detsum.
_EAGER_HOOKS = {"detsum_switch_on": _switch_on, "detsum_switch_off": _switch_off}


@functools.cache
def _eager_hook(name: str):
    hook = torch.compiler.disable(
        _EAGER_HOOKS[name],
        reason="detsum.pyg: the hooks of a module made deterministic turn detsum's switch on "
               "and off around its forward, eagerly; compile the marked module itself "
               "(torch.compile(model), model.compile()), or compile without fullgraph=True")
    # pickle finds a hook as detsum.pyg.<name> (through the module __getattr__ below).
    hook.__name__ = hook.__qualname__ = name
    hook.__module__ = __name__
    return hook


def __getattr__(name: str):
    # The aggregation classes subclass PyG's, so they exist once torch_geometric is imported:
    # on first access, not at `import detsum`.
    if name in AGGREGATION_REDUCES or name == "SoftmaxAggregation":
        _import_pyg(f"detsum.pyg.{name}")
        return _aggregation_classes()[name]
    if name in _EAGER_HOOKS:
        return _eager_hook(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _refuse_uncovered_inputs(layer: torch.nn.Module, args, kwargs) -> None:
    """Forward pre-hook of each MessagePassing layer of a marked model: refuse an adjacency
    that sends PyG onto code the switch does not reach, before the layer computes anything.
    Traced by Dynamo when the model is compiled (it only reads types and layouts)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            kind = f"a sparse tensor (layout {value.layout})"
        elif type(value).__name__ == "SparseTensor":
            kind = "a sparse tensor (SparseTensor)"
        elif type(value).__name__ == "EdgeIndex":
            kind = "an EdgeIndex"
        else:
            continue
        raise ValueError(
            f"detsum.pyg: {type(layer).__name__}, a layer of a model made deterministic, was "
            f"called with {kind}; "
            f"make_deterministic covers edge_index given as a plain integer tensor of shape "
            f"[2, num_edges] (with a sparse adjacency or an EdgeIndex PyG runs sparse "
            f"matmuls and CSR reductions, torch_sparse's, torch_scatter's or pyg_lib's, "
            f"that detsum's switch does not reach; an EdgeIndex converts with .as_tensor())")


class DeterministicSwitch:
    """What :func:`make_deterministic` changed in a model, and how to undo it: ``undo()``, or
    leave a ``with`` block.

    Attributes:
        model: the marked model.
        mode: the detsum mode its forward and backward run in.
        layers: the paths (``model.named_modules()`` names) of its MessagePassing layers.
        aggregations: always empty: the model keeps PyG's aggregation modules (kept for
            code that read the modules an earlier version replaced).
        active: True until ``undo()``.
    """

    def __init__(self, model: torch.nn.Module, mode: Mode):
        self.model, self.mode = model, mode
        self.layers: list[str] = []
        self.aggregations: list[tuple[str, str]] = []
        self._undo_steps: list = []
        self.active = True

    def undo(self) -> None:
        """Remove the mark and the hooks from the model (not from copies of it: a pickled,
        loaded or deep-copied model keeps its own). Undoing twice does nothing the second
        time."""
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


def make_deterministic(model: torch.nn.Module, *, mode: str | Mode = "fp32",
                       strict: bool = True) -> DeterministicSwitch:
    """Run a PyG model's forward and backward under detsum's switch
    (:func:`detsum.deterministic`) in ``mode``, so that every accumulation PyG computes with
    torch's ops runs on detsum; returns a :class:`DeterministicSwitch` whose ``undo()`` (or
    the end of a ``with`` block) puts the model back as it was.

    ::

        switch = detsum.pyg.make_deterministic(model, mode="fp32")   # for good, or:
        with detsum.pyg.make_deterministic(model, mode="fp32"):
            loss = criterion(model(x, edge_index), y)
            loss.backward()

    The model keeps PyG's code, its classes, modules, parameters, ``state_dict`` and ``repr``:
    nothing of PyG is replaced. It is marked (an attribute holding the mode's name) and given
    forward hooks, so that PyG's CPU path runs on detsum throughout: the gather of messages
    (``index_select``, whose backward is ``index_add_``), the aggregations (``scatter_add_``;
    ``scatter_reduce_`` for min, max and mul; ``segment_reduce``), ``gcn_norm``'s degree sum
    and its ``deg_inv_sqrt[row]`` backward, the attention softmax of GATConv and the others,
    pooling (``global_add_pool``: a ``scatter_add_``), and any other op the switch takes
    (docs/enable.md lists them), forward and backward. Pickling, ``torch.save``/``torch.load``
    of the whole model and ``copy.deepcopy`` keep the mark; a ``state_dict`` holds none.

    When: while the model's forward runs, the switch is on in ``mode`` (process-wide, as
    :func:`detsum.deterministic` says: other threads' ops too; inside an open block, the
    model's mode during its forward). When a backward call reaches one of the model's outputs,
    the switch is on in ``mode`` from there to the end of that call: the backward of the
    model's own ops has no end that autograd announces, so the backward of what ran before the
    model runs on the switch too (a call that reaches marked models of several modes runs in
    the first one's). A backward that raises skips autograd's final callback, which turns the
    switch off; the thread's next call of a marked model does. Call the model itself: its
    layers called directly run outside the switch.

    Compiled: ``torch.compile(model)`` (``fullgraph=True`` too) and ``model.compile()`` run
    the hooks around the compiled forward, so the compiled forward and backward send the same
    ops to detsum as eager code; so does a model whose layers are compiled one by one.
    Inductor's own arithmetic around those ops (the elementwise ops it fuses) may round
    otherwise than eager code (docs/enable.md). A function that calls a marked model, compiled
    with ``fullgraph=True``, is refused by Dynamo (the hooks are not traced); compile it
    without ``fullgraph``, or leave the model unmarked and call the compiled function inside
    ``detsum.deterministic(mode)``. TorchScript refuses the hooks: script an unmarked model
    (or one after ``undo()``) and run it inside ``detsum.deterministic(mode)``, where scripted
    code reaches the switch too.

    Not covered: what is not an op the switch takes (matmuls, dropout); a sparse adjacency
    (``torch.sparse`` or ``SparseTensor``) or an ``EdgeIndex`` given to a MessagePassing
    layer (refused with an error naming the layer: PyG then runs sparse matmuls and CSR
    reductions of torch_sparse, torch_scatter or pyg_lib, which the switch does not reach);
    on a GPU where torch_scatter is installed, PyG's min, max and mul with gradient
    (torch_scatter's kernels); CUDA tensors in general (the switch's CUDA path is untested).

    Args:
        model: any ``torch.nn.Module`` (a PyG layer, or a model holding them).
        mode: keyword only: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.
        strict: keyword only: refuse, before anything changes, a ``MulAggregation`` with
            ``mode="exact"`` (detsum has no exact product: the switch leaves the product to
            torch's kernel); with ``strict=False`` torch's kernel runs it.

    Bits, on a CPU: each accumulation has the switch's bits in ``mode`` (docs/enable.md),
    around PyG's own arithmetic. For fp32 data, ``"autograd"`` gives PyG's own forward and
    backward bits for GCNConv, SAGEConv and GATConv (torch's CPU ``scatter_add_`` and
    ``index_add_`` add each node's terms in fp32 in order of appearance, rounding after every
    add), and so does ``"fp32"`` wherever a node receives at most 256 terms (longer sums it
    takes in chunks of 256). For bf16 data both do too: torch's CPU sums keep bf16 in an fp32
    buffer, ``"fp32"`` mode's arithmetic, and the switch leaves bf16 sums in ``"autograd"``
    mode to torch's kernel. docs/switching.md has the table per mode and dtype. A mean is
    PyG's: the sum rounded to the dtype, then divided (:class:`MeanAggregation` divides before
    rounding). Min and max are exact, and their gradient is PyG's CPU gradient (torch's
    ``scatter_reduce`` backward: tied members share it evenly, as :class:`MaxAggregation`
    says), its count of ties summed on detsum.
    """
    caller = "detsum.pyg.make_deterministic"
    pyg = _import_pyg(caller)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if type(model).forward is torch.nn.Module.forward:
        raise TypeError(f"{caller}: model is a {type(model).__name__}, which has no forward: "
                        f"its hooks would never run; expected the module you call (each "
                        f"layer of a container that you call, made deterministic apart)")
    mode = parse_mode(mode, caller=caller)
    if not isinstance(strict, bool):
        raise TypeError(f"{caller}: strict={strict!r}; expected True or False")
    if MODE_ATTRIBUTE in vars(model):
        raise ValueError(f"{caller}: the model is switched already, in mode "
                         f"{getattr(model, MODE_ATTRIBUTE)!r}; undo the earlier switch first")
    modules = list(model.named_modules())
    if strict and mode is Mode.EXACT:
        products = [f"{path or '<model>'} ({type(module).__name__})" for path, module in modules
                    if isinstance(module, pyg.nn.aggr.MulAggregation)]
        if products:
            raise ValueError(f"{caller}: {', '.join(products)} multiplies, and detsum's "
                             f"reduce='mul' has no mode='exact' (torch's kernel would run "
                             f"it); expected mode 'fp32', 'kahan' or 'autograd', or "
                             f"strict=False to let torch's kernel run the product")

    switch = DeterministicSwitch(model, mode)
    steps = switch._undo_steps
    for path, module in modules:
        if isinstance(module, pyg.nn.conv.MessagePassing):
            steps.append(module.register_forward_pre_hook(_refuse_uncovered_inputs,
                                                          with_kwargs=True).remove)
            switch.layers.append(path)
    # The mark first, then the switch's hooks around everything else the module's call runs
    # (its other hooks too): the pre-hook first in line, the hook last.
    setattr(model, MODE_ATTRIBUTE, mode.value)
    steps.append(lambda: delattr(model, MODE_ATTRIBUTE))
    steps.append(model.register_forward_pre_hook(_eager_hook("detsum_switch_on"),
                                                 prepend=True).remove)
    steps.append(model.register_forward_hook(_eager_hook("detsum_switch_off"),
                                             always_call=True).remove)
    return switch
