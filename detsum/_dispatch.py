"""When a primitive may run its implementation without going through torch's dispatcher.

Each primitive is a registered operator (``torch.library.custom_op``), so that autograd,
``torch.compile``, fake tensors and functorch see one opaque call. Getting there costs about
40 microseconds a call on CPU (autograd wrapper, redispatch, dynamo's guard), three times
torch's own ``index_add_`` on a small input. In plain eager code with nothing to record, the
operator would only call the implementation: then the public function calls it directly,
which computes exactly what the operator computes (it *is* the operator's body).
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def direct_call_ok(*tensors: torch.Tensor | None) -> bool:
    """True when the operator would do nothing but call its implementation on ``tensors``:
    eager mode (not tracing), no tensor that autograd must record, no dispatch or function
    mode active (fake tensors, tracing and debugging modes), no forward-mode AD level open
    (a tensor may carry a tangent), and plain tensors only (no subclass, no functorch
    wrapper from ``vmap`` or ``grad``)."""
    if torch.compiler.is_compiling() or forward_ad._current_level >= 0:
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    grad_enabled = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or _is_functorch_wrapped(t):
            return False
        if grad_enabled and t.requires_grad:
            return False
    return True
