"""When a primitive may run its implementation without going through torch's dispatcher.

Each primitive is a registered operator (``torch.library.custom_op``), so that autograd,
``torch.compile``, fake tensors and functorch see one opaque call. Getting there costs about
40 microseconds a call on CPU (autograd wrapper, redispatch, dynamo's guard), three times
torch's own ``index_add_`` on a small input. In plain eager code with nothing to record, the
operator would only call the implementation: then the public function calls it directly,
which computes exactly what the operator computes (it *is* the operator's body).

In plain eager code where autograd must record the call (``eager_route``), the operator
would run its registered formula through an ``autograd.Function`` that torch builds, whose
forward re-reads the operator's schema at every call (``torch._library.utils.fill_defaults``:
29 of the 47 us of a small ``index_add`` with a plan, stubbed device, benches/NOTES.md), and
then call the implementation through the dispatcher again. ``_transforms.register_autograd``
records such a call itself instead: the same formula, around the operator's body. Its call
function takes the direct path too where nothing is to be recorded, for the callers that
always call it (``moe.permute`` and ``unpermute``, the backward formulas).
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_Parameter = torch.nn.Parameter


def _eager() -> bool:
    """Plain eager code: nothing traces the call (``torch.compile``, ``torch.jit.trace``), no
    dispatch or function mode is active (fake tensors, tracing and debugging modes) and no
    forward-mode AD level is open (a tensor may carry a tangent)."""
    return not (torch.compiler.is_compiling() or forward_ad._current_level >= 0
                or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled() or torch._C._is_tracing())


def _plain(t: torch.Tensor) -> bool:
    """A tensor the dispatcher would hand the implementation as it is: a ``torch.Tensor`` or
    an ``nn.Parameter`` (whose ``__torch_function__`` is off), not another subclass or a
    functorch wrapper from ``vmap`` or ``grad``."""
    return (type(t) is torch.Tensor or type(t) is _Parameter) and not _is_functorch_wrapped(t)


def direct_call_ok(*tensors: torch.Tensor | None) -> bool:
    """True when the operator would do nothing but call its implementation on ``tensors``
    (None for an absent one): ``eager_route`` says ``BODY``."""
    return eager_route(tensors) is BODY


#: How ``eager_route`` says an operator's call is to be made.
THROUGH_OPERATOR, BODY, RECORDED_BODY = "operator", "body", "recorded body"


def eager_route(args: tuple) -> str:
    """How a call of an operator that mutates nothing, with ``args`` (its arguments, every
    one given), is made: ``BODY`` where the operator would only call its implementation
    (``direct_call_ok`` of the tensors among ``args``), ``RECORDED_BODY`` where it would
    also record its autograd formula, and nothing else (eager mode, grad enabled, every
    tensor plain, one at least requiring grad), else ``THROUGH_OPERATOR``."""
    if not _eager():
        return THROUGH_OPERATOR
    grad_enabled = torch.is_grad_enabled()
    recorded = False
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if not _plain(arg):
                return THROUGH_OPERATOR
            recorded = recorded or (grad_enabled and arg.requires_grad)
    return RECORDED_BODY if recorded else BODY
