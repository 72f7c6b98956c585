"""Which implementation runs a primitive: the documented switch for tests and users.

The default is the fastest backend for the tensors' device (Numba on CPU). Inside
``with detsum.backend(name):`` every detsum primitive called from this thread (or asyncio
task) uses ``name`` instead. The choice is read when the operator runs, not when it is traced,
so it also applies to compiled functions.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator

BACKENDS: tuple[str, ...] = ("numba", "reference", "triton")

_DEFAULT_BY_DEVICE = {"cpu": "numba", "cuda": "triton"}

_forced_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "detsum_forced_backend", default=None
)

# How many ``backend`` blocks, in any thread, force a backend other than Numba's now; and what
# to call when that number changes. The switch's C++ kernels compute the Numba backend's bits
# for CPU tensors and take no call while any block forces another (detsum/switch.py): the
# forced backend then runs the call, as it was asked to.
_forcing_lock = threading.Lock()
_forcing_other_than_numba = 0
_forcing_listeners: list[Callable[[], None]] = []


def forcing_other_than_numba() -> int:
    """How many open ``backend`` blocks force a backend other than Numba's, in any thread."""
    return _forcing_other_than_numba


def on_forcing_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever :func:`forcing_other_than_numba` changes."""
    _forcing_listeners.append(listener)


def _count_forcing(step: int) -> None:
    global _forcing_other_than_numba
    with _forcing_lock:
        _forcing_other_than_numba += step
    for listener in _forcing_listeners:
        listener()


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Force every detsum primitive in the block to run on backend ``name``.

    Args:
        name: ``"numba"`` (CPU kernels), ``"reference"`` (slow Python loops from the
            determinism contract; for tests) or ``"triton"`` (GPU kernels; on CPU tensors
            only under ``TRITON_INTERPRET=1``, set before triton is first imported).

    Every backend gives the same bits for the "fp32" and "kahan" modes; that is what the test
    suite checks by running each case under each backend.

    Example:
        >>> import torch, detsum
        >>> with detsum.backend("reference"):
        ...     detsum.segment_sum(torch.ones(3, 2), torch.tensor([0, 1, 3]))
        tensor([[1., 1.],
                [2., 2.]])
    """
    if name not in BACKENDS:
        raise ValueError(f"detsum.backend: name={name!r} is not a backend; expected one of {BACKENDS}")
    token = _forced_backend.set(name)
    other = name != "numba"
    if other:
        _count_forcing(1)
    try:
        yield
    finally:
        _forced_backend.reset(token)
        if other:
            _count_forcing(-1)


def current_backend(device_type: str, caller: str) -> str:
    """The backend that runs now for tensors on ``device_type``, checked to run them."""
    name = _forced_backend.get()
    if name is None:
        try:
            name = _DEFAULT_BY_DEVICE[device_type]
        except KeyError:
            raise NotImplementedError(f"{caller}: detsum has no backend for {device_type} "
                                      f"tensors; expected CPU or CUDA tensors") from None
    check_backend_runs(name, device_type, caller)
    return name


def check_backend_runs(name: str, device_type: str, caller: str) -> None:
    """Raise, in ``caller``'s words, if backend ``name`` cannot run ``device_type`` tensors."""
    if name == "numba" and device_type != "cpu":
        raise ValueError(f"{caller}: the numba backend runs CPU tensors only, got "
                         f"{device_type} tensors; expected the default backend or "
                         f"detsum.backend('triton') for them")
    if name != "triton" or device_type != "cpu":
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{caller}: the triton backend runs CPU tensors only in Triton's "
                         f"interpreter; expected TRITON_INTERPRET=1 set before triton is first "
                         f"imported, or CUDA tensors, or another backend")
    from detsum.kernels.triton.segment import interpreted

    if not interpreted():
        raise ValueError(f"{caller}: the triton backend runs CPU tensors only in Triton's "
                         f"interpreter, and TRITON_INTERPRET=1 was set after triton was first "
                         f"imported (or after detsum's Triton kernels were), so triton made "
                         f"its functions for a GPU; expected TRITON_INTERPRET=1 set before "
                         f"triton is first imported (by anything), or CUDA tensors, or another "
                         f"backend")
