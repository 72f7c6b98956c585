"""detsum's Triton launches on the host, with no GPU: the kernels compiled for an H100 (sm_90)
and the driver's launch replaced by a record of it.

For a process that imports triton without TRITON_INTERPRET (the kernels are then compiled,
as on a GPU machine), after ``install()``:

- Triton's active driver is ``StubDriver``: device 0, stream 0, target sm_90; a compiled
  kernel "loads" without a GPU, and its launcher (what ``CompiledKernel.run`` calls, the
  driver's launch) calls the launch hooks it is handed, as the driver does, records the call
  in ``LAUNCHES`` and launches nothing. Everything before it runs as on a GPU: detsum's
  launcher, ``JITFunction.run`` (binding, specialising, its cache, compiling on a miss) or
  the direct launch of ``detsum.kernels.triton.launch``.
- ``cpu_tensors_as_cuda()`` lets CPU tensors stand for CUDA ones in detsum's public calls:
  the triton backend, which then takes them (nothing reads their memory: the launch does
  nothing), values checked as a GPU's, and the weighted ``moe.unpermute`` in one pass.
  ``moe.route``'s launch, stubbed, writes no tables: its call returns valid ones of the same
  shapes (all rows of token 0, ids in range), made once per shape, so that the later calls,
  which gather by them on the host's tensors, stay in range.

Used by tests/launch_check.py (run by tests/test_triton_launch.py) and
benches/host_launch.py.
"""

from __future__ import annotations

import contextlib
import sys
import unittest.mock

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

import detsum
from detsum import _segments, moe
from detsum.kernels.triton import moe as moe_kernels

TARGET = GPUTarget("cuda", 90, 32)

#: (launcher, args) of each launch that reached the driver since the list was last cleared.
LAUNCHES: list[tuple[object, tuple]] = []


class StubLauncher:
    """Stands for the driver's launch of one compiled kernel (``CompiledKernel.run``): calls
    the launch hooks it is handed, as the driver does, and records the call."""

    def __init__(self, src, metadata):
        self.name = metadata.name

    def __call__(self, *args):
        self._hooks(*args)
        LAUNCHES.append((self, args))

    @staticmethod
    def _hooks(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
               enter_hook, exit_hook, *args):
        for hook in (enter_hook, exit_hook):
            if hook is not None:
                hook(launch_metadata)


class _NoLaunch(StubLauncher):
    def __call__(self, *args):
        self._hooks(*args)


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        # (module, function, registers, spills, most threads per block)
        return 1, 1, 32, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    def unload_module(self, module):
        pass


class StubDriver:
    """The part of Triton's driver interface that compiling and launching use."""

    def __init__(self, launcher_cls=StubLauncher):
        self.utils = _Utils()
        self.launcher_cls = launcher_cls

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET


def install(record: bool = True) -> None:
    """Make ``StubDriver`` Triton's active driver; ``record=False``: launches leave no record
    (for timing)."""
    from detsum.kernels.triton import segment

    if segment.interpreted():
        raise RuntimeError("triton_stub: the kernels run in Triton's interpreter; expected a "
                           "process without TRITON_INTERPRET=1")
    driver.set_active(StubDriver(StubLauncher if record else _NoLaunch))


@contextlib.contextmanager
def cpu_tensors_as_cuda():
    """detsum's public calls on CPU tensors take the path CUDA tensors take (see the module
    docstring); the other choices by device (``rule_for``) differ only in "autograd" mode."""
    backend_module = sys.modules["detsum.backend"]
    check_backend_runs = backend_module.check_backend_runs

    def runs_as_cuda(name, device_type, caller):
        return check_backend_runs(name, "cuda" if device_type == "cpu" else device_type, caller)

    runs_in_token_blocks = moe._runs_in_token_blocks
    with contextlib.ExitStack() as stack:
        stack.enter_context(detsum.backend("triton"))
        for module in (backend_module, _segments):
            stack.enter_context(unittest.mock.patch.object(module, "check_backend_runs",
                                                           runs_as_cuda))
        stack.enter_context(unittest.mock.patch.object(_segments, "GPU_CHECKS_ON_CPU", True))
        stack.enter_context(unittest.mock.patch.object(
            moe, "_runs_in_token_blocks",
            lambda device, acc_mode: runs_in_token_blocks(torch.device("cuda"), acc_mode)))
        stack.enter_context(unittest.mock.patch.object(moe_kernels, "route_tables",
                                                       _route_tables_in_range))
        yield


_ROUTE_TABLES = moe_kernels.route_tables
_valid_tables: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _route_tables_in_range(experts, gather, selected, topk, num_experts):
    """``route_tables``, launched (the launch does nothing), then tables that hold valid
    values (see the module docstring)."""
    made = _ROUTE_TABLES(experts, gather, selected, topk, num_experts)
    key = tuple(t.shape for t in made)
    if key not in _valid_tables:
        positions, counts, table = (t.zero_() for t in made)
        table[0] = 1
        _valid_tables[key] = positions, counts, table
    return _valid_tables[key]
