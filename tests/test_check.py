"""The primitives' ``check`` levels: "host" (default), "device" (no host read), "off".

A GPU's launch path is the one every backend but Numba takes: the plan from torch ops on the
index's device. Here it runs on the CPU through the triton backend (Triton's interpreter), and
a host read anywhere in detsum's own code (detsum/ and its kernels/) fails the test: the
Python ways of reading a tensor's values are replaced for the duration.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys

import pytest
import torch

import detsum
import detsum.kernels
from conftest import assert_same_bits

pytest.importorskip("triton")

_OWN_CODE = (str(pathlib.Path(detsum.__file__).parent),
             str(pathlib.Path(detsum.kernels.__file__).parent))
_TENSOR_READS = ("tolist", "item", "numpy", "cpu", "nonzero", "__bool__", "__int__",
                 "__index__", "__float__")
_FUNCTION_READS = ("unique", "nonzero", "bincount")


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """Every read of a tensor's values into Python from detsum's own code raises HostRead."""
    def guarded(name, original):
        def read(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(_OWN_CODE):
                raise HostRead(f"{name} called from {caller}")
            return original(*args, **kwargs)
        return read

    saved = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in _TENSOR_READS]
    saved += [(torch, name, getattr(torch, name)) for name in _FUNCTION_READS]
    try:
        for owner, name, original in saved:
            setattr(owner, name, guarded(name, original))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, 6, (40,), generator=gen)
    src = torch.randn(40, 3, generator=gen)
    init = torch.randn(6, 3, generator=gen)
    offsets = torch.tensor([0, 10, 10, 25, 40])
    perm = torch.randperm(40, generator=gen)
    return init, index, src, offsets, perm


def _calls(check, init, index, src, offsets, perm):
    """name -> a call of each primitive (and layout) with this check level."""
    return {
        "index_add": lambda: detsum.index_add(init, 0, index, src, check=check),
        "index_add-kahan": lambda: detsum.index_add(init, 0, index, src, mode="kahan",
                                                    check=check),
        "scatter_reduce-mean": lambda: detsum.scatter_reduce(init, 0, index, src, "mean",
                                                             check=check),
        "scatter_reduce-amax": lambda: detsum.scatter_reduce(init, 0, index, src, "amax",
                                                             check=check),
        "scatter_reduce-sorted": lambda: detsum.scatter_reduce(
            init, 0, index.sort().values, src, "sum", sorted=True, check=check),
        "scatter_reduce-elementwise": lambda: detsum.scatter_reduce(
            init, 0, index.view(-1, 1).expand(-1, 3), src, "sum", check=check),
        "segment_sum": lambda: detsum.segment_sum(src, offsets, check=check),
        "segment_sum-perm": lambda: detsum.segment_sum(src, offsets, perm=perm, check=check),
    }


CALLS = list(_calls("host", *_inputs()))


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("check", ["device", "off"])
def test_no_host_read_in_the_gpu_launch_path(check, call):
    """Forward and backward, with the plan of a GPU: not one value read into Python."""
    init, index, src, offsets, perm = _inputs()
    src.requires_grad_(True)
    with detsum.backend("triton"), no_host_reads():
        out = _calls(check, init, index, src, offsets, perm)[call]()
        out.backward(torch.ones_like(out))
    assert torch.isfinite(src.grad).all()


@pytest.mark.parametrize("call", CALLS)
def test_the_host_level_reads_values_back(call):
    """The guard sees the reads the default level makes (so the test above can fail)."""
    with detsum.backend("triton"), no_host_reads(), pytest.raises(HostRead):
        _calls("host", *_inputs())[call]()


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("backend", ["numba", "triton"])
def test_every_level_gives_the_same_bits(backend, call):
    results = {}
    with detsum.backend(backend):
        for check in ("host", "device", "off"):
            results[check] = _calls(check, *_inputs(1))[call]()
    assert_same_bits(results["device"], results["host"])
    assert_same_bits(results["off"], results["host"])


@pytest.mark.parametrize("primitive", ["index_add", "scatter_reduce", "segment_sum"])
def test_device_level_fails_on_a_bad_index_naming_the_argument(primitive):
    """On a GPU the failure comes at the next synchronisation; on the CPU's copy of the GPU's
    path (the triton backend here) at once. Either way in detsum's words."""
    init, index, src, offsets, perm = _inputs()
    bad_index = index.clone()
    bad_index[7] = 6
    bad_perm = perm.clone()
    bad_perm[3] = 40
    call = {
        "index_add": lambda: detsum.index_add(init, 0, bad_index, src, check="device"),
        "scatter_reduce": lambda: detsum.scatter_reduce(init, 0, bad_index, src, "sum",
                                                        check="device"),
        "segment_sum": lambda: detsum.segment_sum(src, offsets, perm=bad_perm, check="device"),
    }[primitive]
    argument = "perm" if primitive == "segment_sum" else "index"
    with detsum.backend("triton"), pytest.raises(RuntimeError,
                                                 match=f"detsum.{primitive}: {argument} has a "
                                                       f"value outside.*check='device'"):
        call()


@pytest.mark.parametrize("check", ["device", "off"])
def test_cpu_checks_at_every_level(check):
    """On the CPU the plan's own pass checks the index for free: the usual error, with the
    position, whatever the level."""
    init, index, src, _, _ = _inputs()
    index[7] = 6
    with pytest.raises(IndexError, match=r"index\[7\] = 6 is out of range"):
        detsum.index_add(init, 0, index, src, check=check)


@pytest.mark.parametrize("call", [
    lambda: detsum.index_add(torch.zeros(2), 0, torch.tensor([0]), torch.ones(1), check="never"),
    lambda: detsum.index_add_(torch.zeros(2), 0, torch.tensor([0]), torch.ones(1), check=True),
    lambda: detsum.scatter_reduce(torch.zeros(2), 0, torch.tensor([0]), torch.ones(1), "sum",
                                  check="never"),
    lambda: detsum.segment_sum(torch.ones(1), torch.tensor([0, 1]), check="never"),
], ids=["index_add", "index_add_", "scatter_reduce", "segment_sum"])
def test_a_bad_level_is_refused(call):
    with pytest.raises(ValueError, match=r"check=.*expected one of 'host', 'device', 'off'"):
        call()


def test_compiled_device_level_gives_eager_bits():
    init, index, src, offsets, perm = _inputs(2)

    def layer(init, index, src):
        return (detsum.index_add(init, 0, index, src, check="device")
                + detsum.scatter_reduce(init, 0, index, src, "mean", check="off"))

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_same_bits(compiled(init, index, src), layer(init, index, src))


@pytest.mark.cuda
@pytest.mark.parametrize("call", CALLS)
def test_no_synchronisation_on_cuda(call):
    """torch's own detector of host synchronisations, forward and backward."""
    init, index, src, offsets, perm = (t.cuda() for t in _inputs())
    src.requires_grad_(True)
    calls = _calls("device", init, index, src, offsets, perm)
    calls[call]()  # compile the kernels and warm the caches first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = calls[call]()
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    """A forward and backward of index_add with check="device", captured once and replayed,
    gives the eager bits."""
    init, index, src, _, _ = (t.cuda() for t in _inputs())
    grad_out = torch.ones_like(init)

    def step(src):
        leaf = src.detach().requires_grad_(True)
        out = detsum.index_add(init, 0, index, leaf, mode="kahan", check="device")
        out.backward(grad_out)
        return out, leaf.grad

    expected = step(src)
    static_src = src.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(static_src)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static_src)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected):
        assert_same_bits(got, want)
