"""How detsum's operators and autograd Functions meet torch.func's transforms and forward mode.

torch 2.11 to 2.13 runs an operator's ``register_autograd`` formula through an
``autograd.Function`` that it builds without a ``setup_context``, and torch.func's ``grad``,
``vjp`` and ``jacrev`` refuse such a Function ("must override the setup_context
staticmethod"); forward-mode AD passes the operator by and drops the tangents (``jacfwd``
gives zeros). So inside a transform, or while a forward-mode level is open, the public
functions call each operator through an ``autograd.Function`` of detsum's own, written the way
torch.func supports ("Extending torch.func with autograd.Function"): forward runs the same
operator, ``setup_context`` and ``backward`` are the formula registered for it (so a gradient
has the bits that ``torch.autograd.grad`` gives through the operator), vmap runs the operator
under vmap as before, and forward mode is refused in detsum's words. In plain eager code
(``_dispatch.eager_route``) they call the operator's body: directly where nothing is to be
recorded, and where autograd records the call, through another ``autograd.Function`` of
detsum's own, the same formula around the body, without the dispatcher's two passes (see
``_dispatch``). Elsewhere (``torch.compile``, ``torch.jit.trace``, fake tensors, modes,
subclasses) they call the operator itself.

detsum's own autograd Functions (``detsum.loss``, ``detsum.scatter_compat``) follow the same
rules. The ``jvp`` that refuses forward mode belongs to a subclass used only inside a
transform or a forward-mode level: dynamo refuses to trace a Function that defines one, and
``torch.compile`` must keep tracing them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad

from detsum import _dispatch, _validation

#: The transforms, named where a call inside one is refused.
TRANSFORMS = "torch.func.grad, vjp, jacrev, jvp, jacfwd or vmap"


def active() -> bool:
    """True inside a torch.func transform (grad, vjp, jacrev, jvp, jacfwd, vmap, ...) or a
    forward-mode AD level (``torch.autograd.forward_ad.dual_level``)."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def _forward_mode_refused(caller: str) -> NotImplementedError:
    """The error for a forward-mode derivative (a tangent reached ``caller``)."""
    return NotImplementedError(
        f"{caller}: forward-mode differentiation (torch.func.jvp, torch.func.jacfwd, "
        f"torch.autograd.forward_ad) is not supported: detsum defines reverse-mode gradients "
        f"only; use torch.func.jacrev, vjp or grad for the same derivatives (a Hessian: "
        f"jacrev(jacrev(f)))")


def _refuse_compiled(caller: str) -> None:
    raise NotImplementedError(
        f"{caller}: a torch.func transform inside torch.compile is not supported (torch "
        f"cannot trace detsum's operators under one); run the transform eagerly, or compile "
        f"the function and differentiate it with torch.autograd, which works")


_refusing: dict[tuple[type[torch.autograd.Function], str], type[torch.autograd.Function]] = {}


def _function_of_older_form(name: str, forward, setup_context, backward
                            ) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` named ``name`` of the older form, whose forward takes ``ctx``
    and does ``setup_context``'s work after ``forward``'s (a forward without ``ctx``), with
    ``backward``: the newer form's ``apply`` binds its arguments through
    ``inspect.signature`` at every call (11 of the 16 us of a small one, benches/NOTES.md),
    the older one's does not. Eager code only: torch.func needs the newer form."""
    def older_forward(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(older_forward), "backward": staticmethod(backward)})


_older_forms: dict[type[torch.autograd.Function], type[torch.autograd.Function]] = {}


def _older_form(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """``function`` (a Function of the newer form) in the older form
    (``_function_of_older_form``): the same forward, ``setup_context`` and backward."""
    form = _older_forms.get(function)
    if form is None:
        form = _older_forms[function] = _function_of_older_form(
            function.__name__, function.forward, function.setup_context, function.backward)
    return form


def apply(function: type[torch.autograd.Function], caller: str, *args: Any) -> Any:
    """``function.apply(*args)`` (``args``: every argument of its forward, none left to its
    default); in plain eager code (``_dispatch.eager_route``) through its older form (the
    same forward, formula and bits; ``_older_form``); inside a transform or a forward-mode
    level, through a subclass whose ``jvp`` refuses forward mode in ``caller``'s name (and
    under ``torch.compile`` there, a refusal in detsum's words)."""
    if not active():
        if _dispatch.eager_route(args) is not _dispatch.THROUGH_OPERATOR:
            return _older_form(function).apply(*args)
        return function.apply(*args)
    if torch.compiler.is_compiling():
        _validation.run_check(_refuse_compiled, caller)
    key = (function, caller)
    if key not in _refusing:
        def jvp(ctx, *tangents):
            raise _forward_mode_refused(caller)

        _refusing[key] = type(function.__name__, (function,), {"jvp": staticmethod(jvp)})
    return _refusing[key].apply(*args)


def _nothing_to_save(ctx, inputs, output) -> None:
    pass


def register_autograd(op, backward: Callable[..., Any], *,
                      setup_context: Callable[..., Any] | None = None,
                      caller: str) -> Callable[..., Any]:
    """Register ``backward`` and ``setup_context`` as ``op``'s autograd formula, and return
    the function that calls ``op`` with it from anywhere: ``call(*args, caller=caller)``
    takes ``op``'s arguments, every one given, and calls ``op`` itself, ``op``'s body (the
    function it was made from, in plain eager code with nothing to record), or the same
    formula through an ``autograd.Function`` of detsum's: inside a transform (or a
    forward-mode level) one that torch.func accepts, and in plain eager code that autograd
    records one around the body. Each gives the operator's bits and gradients. ``caller``
    names the public function where forward mode is refused (by default the one given
    here)."""
    op.register_autograd(backward, setup_context=setup_context)
    save = setup_context or _nothing_to_save
    # The function the operator was made from, which its backend kernel calls. The direct
    # routes skip what the dispatcher does for an operator that changes its arguments (their
    # version counters): none of detsum's registered with a formula does. A torch that keeps
    # either elsewhere calls the operator every time.
    body = getattr(op, "_init_fn", None)
    schema = getattr(getattr(op, "_opoverload", None), "_schema", None)
    direct = body is not None and schema is not None and not schema.is_mutable

    recorded = _function_of_older_form(caller, body, save, backward)

    def forward(*args):
        return op(*args)

    function = type(caller, (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(save),
        "backward": staticmethod(backward),
        # vmap over forward runs the operator under vmap (torch's per-sample fallback: the
        # bits of the eager operator), and vmap over backward runs the formula under vmap.
        "generate_vmap_rule": True,
    })

    def call(*args, caller: str = caller):
        if active():
            return apply(function, caller, *args)
        route = _dispatch.eager_route(args) if direct else _dispatch.THROUGH_OPERATOR
        if route is _dispatch.BODY:
            return body(*args)
        if route is _dispatch.RECORDED_BODY:
            return recorded.apply(*args)
        return op(*args)

    return call


def refuse_second_order(caller: str, what: str) -> Callable[..., Any]:
    """A ``backward`` for an operator that computes a first derivative (``what``) and has no
    derivative of its own: a second derivative through it is refused in ``caller``'s name."""
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{caller}: a second derivative through {what} is not supported (detsum's "
            f"gradient there has no gradient of its own); first derivatives are")

    return backward


def refuse_inside(caller: str, why: str) -> None:
    """Refuse a call made inside a transform or a forward-mode level, where ``caller`` cannot
    work (``why``)."""
    if active():
        raise RuntimeError(f"{caller}: called inside a torch.func transform ({TRANSFORMS}) or "
                           f"a forward-mode AD level; {why}")


def refuse_transformed(caller: str, name: str, t: torch.Tensor, why: str) -> None:
    """Refuse a tensor of a transform, or one that carries a forward-mode tangent, where
    ``caller`` keeps state between calls (``why``): such a tensor would reach it outside the
    transform's reach, and its gradient would be lost without a word."""
    if torch._C._functorch.is_functorch_wrapped_tensor(t) or (
            forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None):
        raise RuntimeError(f"{caller}: {name} is a tensor of a torch.func transform "
                           f"({TRANSFORMS}) or carries a forward-mode tangent; {why}")


def batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor of a ``vmap``, at any level of the transforms."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False
