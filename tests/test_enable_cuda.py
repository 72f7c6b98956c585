"""The switch on a GPU's tensors: ``detsum.enable`` registers its kernels at the CUDA key too,
where they run detsum's primitives on the triton backend.

- ``interpreter``: the switch's way to the triton backend, on CPU tensors in Triton's
  interpreter: every form gives the bits it gives on the Numba backend (each backend gives
  the same bits in every mode, ``tests/test_differential.py``).
- ``cuda``: on CUDA tensors, each form gives the same bits on every run; "exact" gives the
  CPU's bits (it is order-free); "autograd" gives torch's bits under
  ``torch.use_deterministic_algorithms(True)`` wherever torch has a deterministic kernel; and
  the ops torch refuses in that mode on CUDA run under the switch.

The forms are the ops the switch takes, on CUDA tensors as on CPU tensors (docs/enable.md
says where CUDA's "autograd" mode differs).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import detsum
from detsum import _segments, switch
from tests.conftest import assert_same_bits, host_reads

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def switched_off_after():
    yield
    switch._blocks.clear()
    detsum.disable()
    torch.use_deterministic_algorithms(False)


def _data(shape, dtype, seed, device):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def _hot_index(n, rows, seed, device):
    """Seven terms in ten on row 0 (past a 256-term chunk when ``n`` is 600), the rest
    spread."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, rows, (n,), generator=generator)
    index[torch.rand(n, generator=generator) < 0.7] = 0
    return index.to(device)


def forms(device, dtype=torch.float32, seed=0, n=600) -> dict:
    """(name -> function of nothing) for each form of the ops the switch takes on CUDA, ``n``
    rows of terms: the operator it reaches in the name's first word."""
    x = _data((7, 5), dtype, seed, device)
    src = _data((n, 5), dtype, seed + 1, device)
    weight = _data((7, 5), dtype, seed + 2, device).requires_grad_()
    index = _hot_index(n, 7, seed + 3, device)
    wide = index.view(-1, 1).expand(n, 5)
    scattered = _hot_index(5 * n, 7, seed + 4, device).view(n, 5)
    flat = _hot_index(5 * n, 35, seed + 5, device)
    cases = {
        "index_add": lambda: x.index_add(0, index, src),
        "index_add alpha": lambda: x.index_add(0, index, src, alpha=-2),
        "index_add dim 1": lambda: x.t().index_add(1, index, src.t()),
        "index_add int32": lambda: x.index_add(0, index.int(), src),
        "index_add_": lambda: x.clone().index_add_(0, index, src),
        "index_add_ select backward": lambda: torch.autograd.grad(
            weight.index_select(0, index), weight, src)[0],
        "scatter_add": lambda: x.scatter_add(0, wide, src),
        "scatter_add elementwise": lambda: x.scatter_add(0, scattered, src),
        "scatter_add gather backward": lambda: torch.autograd.grad(
            weight.gather(0, scattered[:7]), weight, src[:7])[0],
        "_index_put_impl_": lambda: x.index_put((index,), src, accumulate=True),
        "_index_put_impl_ x[idx] backward": lambda: torch.autograd.grad(
            weight[index], weight, src)[0],
        "_index_put_impl_ negative": lambda: x.index_put((index - 7,), src, accumulate=True),
        "put_": lambda: x.clone().put_(flat, src.reshape(-1), accumulate=True),
        "put_ negative": lambda: x.clone().put_(flat - 35, src.reshape(-1), accumulate=True),
        "bincount": lambda: torch.bincount(index, src[:, 0]),
        "embedding_dense_backward": lambda: torch.autograd.grad(
            torch.nn.functional.embedding(index, weight), weight, src)[0],
        "embedding_dense_backward padding": lambda: torch.autograd.grad(
            torch.nn.functional.embedding(index, weight, padding_idx=0), weight, src)[0],
    }
    for reduce in ("sum", "mean", "prod", "amax", "amin"):
        for include_self in (True, False):
            cases[f"scatter_reduce {reduce} {include_self}"] = (
                lambda r=reduce, s=include_self: x.scatter_reduce(
                    0, scattered, 1 + src / 64 if r == "prod" else src, r, include_self=s))
    for reduce in ("prod", "mean", "amax", "amin"):
        cases[f"index_reduce {reduce}"] = (
            lambda r=reduce: x.index_reduce(0, index, 1 + src / 64 if r == "prod" else src, r))
    # embedding_bag's backward: six bags, one empty, one past a chunk when n is 600.
    bags = torch.tensor([0, 5, 5, n // 2, n // 2 + 10, n - 2], device=device)
    for name, bag_mode, kwargs in (("sum", 0, {}), ("mean", 1, {}), ("max", 2, {}),
                                   ("padding", 1, {"padding_idx": 0}),
                                   ("per_sample_weights", 0,
                                    {"per_sample_weights": src[:, 0].contiguous()})):
        cases[f"_embedding_bag_dense_backward {name}"] = _embedding_bag_backward(
            weight.detach(), index, bags, bag_mode, seed, **kwargs)
    # segment_reduce: segments of rows (one empty), in lengths and in offsets; per batch
    # along dim 1; and lengths that leave rows out.
    lengths = torch.tensor([n // 2, 0, n // 4, n - n // 2 - n // 4], device=device)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    cases.update({
        "segment_reduce sum": lambda: torch.segment_reduce(src, "sum", lengths=lengths),
        "segment_reduce mean": lambda: torch.segment_reduce(src, "mean", lengths=lengths),
        "segment_reduce sum initial": lambda: torch.segment_reduce(
            src, "sum", lengths=lengths, initial=2),
        "segment_reduce amax offsets": lambda: torch.segment_reduce(
            src, "max", offsets=offsets),
        # PyG's form (a CSR pointer), and offsets that leave rows out at both ends.
        "segment_reduce sum offsets": lambda: torch.segment_reduce(src, "sum", offsets=offsets),
        "segment_reduce mean offsets inside": lambda: torch.segment_reduce(
            src, "mean", offsets=offsets.clamp(3, n - 5)),
        "segment_reduce mean axis 1": lambda: torch.segment_reduce(
            src.t().contiguous(), "mean", lengths=lengths.repeat(5, 1), axis=1),
        "segment_reduce sum unsafe": lambda: torch.segment_reduce(
            src, "sum", lengths=lengths // 2, unsafe=True),
        # histc: a given range (values outside it too), and the data's own.
        "histc": lambda: torch.histc(src[:, 0], bins=7, min=-1, max=1.5),
        "histc data range": lambda: torch.histc(src[:, 1], bins=5),
    })
    return cases


def _embedding_bag_backward(weight, index, bags, bag_mode, seed, per_sample_weights=None,
                            padding_idx=-1):
    """The weight gradient of a dense ``embedding_bag`` as its backward computes it (torch's
    ``_embedding_bag_backward``), the forward's bags run here, once: the form reaches the
    switched op alone (torch's CPU forward adds integers with ``index_add_``, which the switch
    leaves to torch)."""
    out, offset2bag, bag_size, maximum = torch.ops.aten._embedding_bag(
        weight, index, bags, False, bag_mode, False, per_sample_weights, False, padding_idx)
    grad = _data(out.shape, out.dtype, seed + 6, out.device)
    return lambda: torch.ops.aten._embedding_bag_backward(
        grad, index, bags, offset2bag, bag_size, maximum, weight.shape[0], False, bag_mode,
        False, per_sample_weights, padding_idx)


#: The operators the forms reach, each of which the switch takes in "fp32" mode.
_TAKEN = {"index_add", "index_add_", "scatter_add", "scatter_reduce.two", "index_reduce",
          "_index_put_impl_", "put_", "bincount", "embedding_dense_backward",
          "_embedding_bag_dense_backward", "segment_reduce", "histc"}

#: The forms that read values back into Python (on a GPU, a synchronisation), each once and
#: as torch's own kernel for it does: bincount its number of bins, segment_reduce its lengths
#: or offsets (torch's reads lengths twice, unless unsafe=True; a sum or mean from +0.0 over
#: 1-D bounds reads nothing, checked on the device), histc with no range given
#: the data's range (in ``switch._histc_edges``, which also reads the numbers its bin
#: arithmetic starts from, made on the host: not the device's). Form -> its reads on CPU
#: tensors.
_READERS = {"bincount": ["tolist"], "histc data range": [],
            **{f"segment_reduce {form}": ["numpy"] for form in (
                "sum initial", "amax offsets", "mean axis 1")}}


def _same_bits(actual, expected, name):
    try:
        assert_same_bits(actual, expected)
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from None


def _on_detsum(counts_before) -> set:
    """The operators that ran on detsum since ``counts_before``."""
    return {op for (op, how) in switch.counts - counts_before if how == "detsum"}


def _run(name, call):
    """(``call()``, whether the operator form ``name`` reaches, its first word, went to
    torch's kernel): the form then gives torch's bits, which on CUDA may be its atomics' (no
    bits to hold it to). Other operators on the way may go to torch harmlessly (torch's CPU
    ``embedding_bag`` adds integers with ``index_add_``)."""
    before = switch.counts.copy()
    result = call()
    return result, any(how == "torch" and op.split(".")[0] == name.split()[0]
                       for op, how in switch.counts - before)


# ---- the triton backend, in the interpreter ------------------------------------------------------

@pytest.mark.interpreter
def test_switched_forms_on_the_triton_backend_give_the_numba_backends_bits():
    """What the switch runs for a GPU's tensors, run on CPU tensors: the same primitives on
    the triton backend (Triton's interpreter), the Numba backend's bits. One mode and few
    terms: the interpreter is slow, and the kernels' modes and chunks are the differential
    tests' part; the switch's way to them is the same in every mode."""
    before = switch.counts.copy()
    for name, call in forms("cpu", n=40).items():
        with detsum.deterministic("fp32"):
            on_numba = call()
            with detsum.backend("triton"):
                on_triton = call()
        _same_bits(on_triton, on_numba, name)
    assert _TAKEN <= _on_detsum(before), _TAKEN - _on_detsum(before)


def _reads_outside_histc_edges(monkeypatch, on_read):
    """A maker of ``host_reads(on_read)`` contexts that leave out the reads of
    ``switch._histc_edges`` (numbers made on the host, or the data's range where torch's own
    histc reads it too)."""
    inside = []
    edges = switch._histc_edges

    def counted_edges(*args):
        inside.append(True)
        try:
            return edges(*args)
        finally:
            inside.pop()

    monkeypatch.setattr(switch, "_histc_edges", counted_edges)
    return lambda: host_reads(lambda what, where: None if inside else on_read(what, where))


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["fp32", "autograd"])
def test_on_a_gpus_path_the_switch_reads_nothing_back(monkeypatch, mode):
    """With a GPU's check levels (the triton backend, ``GPU_CHECKS_ON_CPU``), no switched form
    reads a value back into Python (on a GPU, a synchronisation) but ``_READERS``, each as
    torch's own kernel does; and each gives the host path's bits (negative indices too,
    turned into positions on the device; padding rows, empty bags and values outside a
    histogram sent to a spare row past the result)."""
    monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
    reads, current = [], []
    reading = _reads_outside_histc_edges(
        monkeypatch, lambda what, where: reads.append((current[0], what, where)))
    for name, call in forms("cpu", n=40).items():
        with detsum.deterministic(mode):
            on_host = call()  # the Numba backend checks on the host whatever it is asked
            current[:] = [name]
            with detsum.backend("triton"), reading():
                on_device = call()
        _same_bits(on_device, on_host, name)
    assert {name: [what for form, what, _ in reads if form == name]
            for name in {name for name, _, _ in reads} | _READERS.keys()} == _READERS, reads


# ---- CUDA ----------------------------------------------------------------------------------------

_MODES = ["autograd", "kahan", "fp32", "exact"]


def _taken_on_cuda(mode, dtype) -> set:
    """The operators of ``_TAKEN`` that run on detsum for CUDA tensors: all but, in "autograd"
    mode, embedding's backward and segment_reduce (torch's CUDA kernels are the one source of
    their bits), and float16 and bfloat16 index_add and scatter_add (torch's arithmetic there
    follows the layout); of embedding_bag's backward, its max only (sum and mean as
    embedding's; in float16 and bfloat16 as torch's deterministic scatter_add)."""
    taken = set(_TAKEN)
    if mode == "autograd":
        taken -= {"embedding_dense_backward", "segment_reduce"}
        if dtype != torch.float32:
            taken -= {"index_add", "index_add_", "scatter_add"}
    return taken


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", _MODES)
def test_switched_forms_on_cuda_give_the_same_bits_on_every_run(mode, dtype):
    """Every form the switch runs on detsum gives the same bits on a second run; in
    "autograd" mode every form, as the switch runs those it leaves to torch under torch's
    deterministic mode."""
    before = switch.counts.copy()
    with detsum.deterministic(mode):
        for name, call in forms("cuda", dtype).items():
            first, to_torch = _run(name, call)
            if not to_torch or mode == "autograd":
                _same_bits(call(), first, name)
    expected = _taken_on_cuda(mode, dtype)
    assert expected <= _on_detsum(before), expected - _on_detsum(before)


def _without_synchronising(body, strict: list):
    """``body`` (a switched op's, ``switch._BODIES``), with torch's synchronisation check set
    to raise while it and the function it returns run, when ``strict`` holds an item: what
    torch's own kernels do around the switched op (a forward, a fallback) is not checked."""
    @contextlib.contextmanager
    def checked():
        if strict:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def wrapped(mode, *args, **kwargs):
        with checked():
            run = body(mode, *args, **kwargs)
        if run is None:
            return None

        def checked_run():
            with checked():
                return run()
        return checked_run
    return wrapped


@pytest.mark.cuda
@pytest.mark.parametrize("mode", _MODES)
def test_switched_forms_on_cuda_do_not_synchronise(monkeypatch, mode):
    """Every form but ``_READERS`` runs its switched op with torch's synchronisation check set
    to raise (after a first run that compiles the kernels)."""
    strict = []
    # The switch registers _BODIES when it is turned on: off first, so that the bodies wrapped
    # here are the ones it registers.
    detsum.disable()
    monkeypatch.setattr(switch, "_BODIES", {name: _without_synchronising(body, strict)
                                           for name, body in switch._BODIES.items()})
    before = None
    with detsum.deterministic(mode):
        for name, call in forms("cuda").items():
            if name in _READERS:
                continue
            strict.clear()
            call()
            torch.cuda.synchronize()
            strict.append(True)
            before = switch.counts.copy() if before is None else before
            try:
                call()
            except RuntimeError as error:
                raise AssertionError(f"{name}: {error}") from None
    torch.cuda.synchronize()
    # Checked: every operator with a form that reads nothing (all of bincount's read).
    expected = _taken_on_cuda(mode, torch.float32) - {"bincount"}
    assert expected <= _on_detsum(before), expected - _on_detsum(before)


@pytest.mark.cuda
def test_exact_mode_on_cuda_gives_the_cpus_bits():
    """Every form the switch runs on detsum (all but the products, which "exact" leaves to
    torch) gives the CPU's bits: the exact sum has no order."""
    on_cuda, on_cpu = forms("cuda"), forms("cpu")
    compared = 0
    with detsum.deterministic("exact"):
        for name in on_cuda:
            result, to_torch = _run(name, on_cuda[name])
            if not to_torch:
                _same_bits(result.cpu(), on_cpu[name](), name)
                compared += 1
    assert compared == len(on_cuda) - sum("prod" in name for name in on_cuda)


@pytest.mark.cuda
def test_autograd_mode_on_cuda_gives_torchs_deterministic_bits():
    """Each float32 form the switch runs on detsum in "autograd" mode against torch itself
    under ``use_deterministic_algorithms(True)``, where torch has a deterministic CUDA kernel
    for it (the others it refuses)."""
    compared, differing = [], []
    for name, call in forms("cuda").items():
        torch.use_deterministic_algorithms(True)
        try:
            expected = call()
        except RuntimeError as error:
            if "deterministic" not in str(error):
                raise
            continue
        finally:
            torch.use_deterministic_algorithms(False)
        with detsum.deterministic("autograd"):
            result, to_torch = _run(name, call)
        if not to_torch:
            try:
                _same_bits(result, expected, name)
            except AssertionError as error:  # every form's verdict in one run
                differing.append(str(error))
            compared.append(name)
    assert not differing, "\n".join(differing)
    assert {"index_add", "scatter_add", "_index_put_impl_ x[idx] backward"} <= set(compared), (
        compared)


@pytest.mark.cuda
def test_ops_torch_refuses_in_deterministic_mode_run_under_the_switch_on_cuda():
    """``use_deterministic_algorithms(True)`` refuses some of these forms on CUDA (a product
    scatter, bincount with weights, put_ with accumulate, ...); under the switch every one
    runs, with the bits it has with torch's setting off."""
    cases = forms("cuda")
    with detsum.deterministic("fp32"):
        expected = {name: call() for name, call in cases.items()}
        torch.use_deterministic_algorithms(True)
        for name, call in cases.items():
            _same_bits(call(), expected[name], name)
