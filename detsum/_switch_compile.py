"""The switch under ``torch.compile``: while it is on, Inductor leaves the switched ops to the
dispatcher, which runs the switch's kernels.

Inductor rewrites torch's accumulating ops into code of its own: ``index_add`` into an
``index_put`` with atomic adds, ``put`` likewise, ``index_reduce``'s mean into two
``index_add``, ``embedding_dense_backward`` into a masked ``index_put``, and ``scatter_add``,
``scatter_reduce`` and ``index_put`` with ``accumulate=True`` into its own scatter loops (on
CPU spread over threads, so their bits vary from run to run). Compiled code that does so
never reaches the switch's kernels. While the switch is on, each of those ops, wherever it
appears in a traced graph (forward or backward), becomes a call of an opaque custom op,
``torch.ops.detsum.switched_<op>``, that calls torch's op at run time: the dispatcher then
runs the switch's kernel in the mode of that moment (or torch's own, for an input the switch
does not take), as in eager mode. Inductor never looks inside a custom op.

Why the decomposition table and not Inductor's lowerings (``make_fallback``): AOTAutograd
traces the forward and the backward with that table when the compiled function is first
called, so the switch's state then is written into both graphs; Inductor lowers the backward
only at its first call, when the switch may be in another state, and its graph passes rewrite
aten ops (``index_put`` into ``index_put_`` and others) but never a custom op.

What keeps compiled code in step with the switch:

- the table: from the switch's first use on, Inductor's decomposition table maps each op of
  ``_TAKEN`` to an entry that reads the switch when a graph is traced: while it is on, the
  op's ``switched_`` op (for the float dtypes the switch takes), while it is off, Inductor's
  own entry (or none). Installed once, it costs turning the switch on and off nothing;
- Dynamo's cache: every frame compiled once this module is in use carries a guard on whether
  the switch was on when it was compiled, so code compiled with the switch off (Inductor's
  loops) is never run with it on, nor the reverse; the first call after the switch changes
  compiles once more, and later changes reuse both. Dynamo has no public hook for a guard on
  state that the traced code does not read: the guard is added where Dynamo adds its own
  guards on global state (``OutputGraph.init_ambient_guards``). Frames compiled before this
  module was first used carry no such guard: installing it resets Dynamo once
  (``torch._dynamo.reset()``), so they compile again at their next call;
- the caches on disk (FX graph, AOTAutograd), whose keys do not see the table:
  ``torch.compiler.config.cache_key_tag`` ends in ``_CACHE_TAG`` while the switch is on,
  from the first frame Dynamo compiles on (set as each frame's compile begins, and at every
  on and off after the first; a program that compiles nothing never pays for the write).

The mode is read at run time, so changing it (``"fp32"`` to ``"exact"``) compiles nothing.
This module imports Dynamo and Inductor: ``detsum.switch`` imports it at the first
``enable``, never ``import detsum``.
"""

from __future__ import annotations

import functools

import torch

from detsum import switch
from detsum.modes import FLOAT_DTYPES

aten = torch.ops.aten

#: Ends ``torch.compiler.config.cache_key_tag`` while the switch is on.
_CACHE_TAG = "+detsum.enable"


def _takes(tensor: torch.Tensor) -> bool:
    """A tensor of a dtype and device the switch's kernels sum (they check the rest at run
    time); Inductor keeps its own code for every other."""
    return tensor.dtype in FLOAT_DTYPES and tensor.device.type in ("cpu", "cuda")


def _first_takes(self, *args, **kwargs) -> bool:
    return _takes(self)


def _accumulates(self, indices, values, accumulate=False) -> bool:
    return accumulate and _takes(self)


# The functional ops that Inductor decomposes or lowers itself and the switch runs: what
# AOTAutograd's functionalization makes of the in-place and out= forms, and what autograd's
# backward formulas call (x[idx] -> index_put, gather -> scatter_add, embedding ->
# embedding_dense_backward), each with the test for the calls that go to the dispatcher.
# bincount, and the ops Inductor always leaves to torch's kernels (embedding_bag's,
# _segment_reduce's, histc), reach the switch without this.
_TAKEN = {
    aten.index_add.default: _first_takes,
    aten.scatter_add.default: _first_takes,
    aten.scatter_reduce.two: _first_takes,
    aten.index_reduce.default: _first_takes,
    aten.index_put.default: _accumulates,
    aten.put.default: _accumulates,
    aten.embedding_dense_backward.default: _first_takes,
}

_library = torch.library.Library("detsum", "FRAGMENT")


def _opaque(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """``torch.ops.detsum.switched_<op>``: torch's ``op`` (same schema) behind a custom op."""
    schema = str(op._schema)
    name = "switched_" + op._schema.name.split("::")[1]
    if op._overloadname != "default":
        name += "_" + op._overloadname
    _library.define(name + schema[schema.index("("):])

    def call_torch(*args, **kwargs):
        return op(*args, **kwargs)

    # CompositeExplicitAutograd serves every device and the meta tensors that tracing runs
    # on, with torch's own shapes; the graphs it appears in are already differentiated.
    _library.impl(name, call_torch, "CompositeExplicitAutograd")
    return getattr(torch.ops.detsum, name).default


def _decomposition(op: torch._ops.OpOverload, takes):
    opaque = _opaque(op)

    def decompose(*args, **kwargs):
        return opaque(*args, **kwargs) if takes(*args, **kwargs) else NotImplemented

    decompose.__name__ = f"switched_{op._schema.name.split('::')[1]}"
    return decompose


_DECOMPOSITIONS = {op: _decomposition(op, takes) for op, takes in _TAKEN.items()}

_installed = False

#: Whether Dynamo has begun to compile a frame since this module was installed. Until then
#: the cache tag, which only a compile reads, is left as it is.
_compiled = False


def follow(on: bool) -> None:
    """Keep compiled code in step with the switch being ``on`` or off: its entries in
    Inductor's decomposition tables and its guard installed at the first call, and once
    anything has been compiled, the cache tag set at every one (called by ``detsum.switch``
    with its lock held, whenever its state is applied). Before the first compile the tag is
    set where each frame's compile begins (``_install``): setting it at every on and off cost
    a model marked by ``detsum.pyg.make_deterministic`` (two blocks a step) about 38 us a
    step on a small graph (benches/NOTES.md), more than its reads and writes take alone."""
    global _installed
    if not _installed:
        _install()
        _install_tables()
        _installed = True
    if _compiled:
        _set_cache_tag(on)


def _install() -> None:
    from torch._dynamo import output_graph, reset
    from torch._dynamo.source import GlobalStateSource

    ambient = output_graph.OutputGraph.init_ambient_guards

    def init_ambient_guards(self) -> None:
        global _compiled
        ambient(self)
        # The caches on disk are looked up after the frame is traced: the tag must say now
        # what the trace sees (from here on, every on and off sets it too), as the guard does.
        with switch._lock:
            on = switch.current_mode() is not None
            _compiled = True
            _set_cache_tag(on)
        self.guards.add(GlobalStateSource().make_guard(functools.partial(_guard, on)))

    output_graph.OutputGraph.init_ambient_guards = init_ambient_guards
    reset()  # the frames compiled so far carry no guard on the switch


def _guard(on: bool, builder, guard) -> None:
    """Dynamo's guard builder for the switch: the frame's code runs only while the switch is
    on (off) as it was when the code was compiled."""
    builder.guard_manager.root.add_lambda_guard(
        lambda _: (switch.current_mode() is not None) is on,
        [f"detsum.switch {'on' if on else 'off'}, as when compiled"], guard.user_stack)


def _tables() -> tuple[dict, ...]:
    from torch._inductor import decomposition

    # select_decomp_table() returns one of these two, by Inductor's config; the second is
    # a copy of the first made at its first call, which this makes before changing either.
    return decomposition.decompositions, decomposition.fast_random_decomps()


def _following_the_switch(switched, own):
    """An entry of Inductor's decomposition table: ``switched`` while the switch is on when a
    graph is traced, else Inductor's own entry ``own`` (None: no decomposition)."""
    def entry(*args, **kwargs):
        if switch.current_mode() is not None:
            return switched(*args, **kwargs)
        return NotImplemented if own is None else own(*args, **kwargs)

    entry.__name__ = switched.__name__
    return entry


def _install_tables() -> None:
    """Put an entry following the switch (``_following_the_switch``) in each of Inductor's
    tables for each op of ``_DECOMPOSITIONS``, in place of Inductor's own."""
    for table in _tables():
        for op, switched in _DECOMPOSITIONS.items():
            table[op] = _following_the_switch(switched, table.get(op))


def _set_cache_tag(on: bool) -> None:
    config = torch.compiler.config
    tag = config.cache_key_tag
    if on and not tag.endswith(_CACHE_TAG):
        config.cache_key_tag = tag + _CACHE_TAG
    elif not on and tag.endswith(_CACHE_TAG):
        config.cache_key_tag = tag[:-len(_CACHE_TAG)]
