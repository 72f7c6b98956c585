"""detsum/_replay.py: a call without a plan on a GPU's path, made again from the record of an
earlier call of its signature, gives the bits of its whole path, raises what it raises, and is
made again only where its whole path reads nothing back.

Here the calls take a GPU's path on CPU tensors (the triton backend in Triton's interpreter, a
GPU's check levels and its counting sort) and the interpreter's launches are recorded
(``launch.RECORD_INTERPRETED``): a replay makes its ops again and its launches through
``Kernel``. tests/launch_check.py compares the launches a replay hands the driver with the
whole path's, with the kernels compiled for sm_90.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import detsum
from conftest import assert_same_bits, make_data, seed_of
from detsum import _replay, _segments, kernels
from detsum.kernels import CHUNK_TERMS
from detsum.ops import index_add as index_add_module

pytestmark = pytest.mark.interpreter

SEGMENTS = 7


@pytest.fixture
def gpu_path(monkeypatch):
    """A GPU's path with its launches recorded; no tape kept from before; yields the list of
    the tapes replayed, one entry a replay."""
    from detsum.kernels.triton import launch

    monkeypatch.setattr(launch, "RECORD_INTERPRETED", True)
    monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
    monkeypatch.setattr(kernels, "COUNTING_SORT_ON_CPU", True)
    # The counting sort at any size (a GPU's above 4096 keys).
    monkeypatch.setattr(kernels, "NARROW_SORT_ABOVE", 0)
    monkeypatch.setattr(_replay, "_TAPES", type(_replay._TAPES)())
    replayed = []
    replay = _replay.Tape.replay

    def counted(self, tensors):
        replayed.append(self)
        return replay(self, tensors)

    monkeypatch.setattr(_replay.Tape, "replay", counted)
    with detsum.backend("triton"):
        yield replayed


def _whole_path(call):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_replay, "REPLAY", False)
        return call()


def _index(rows: int, seed: int, long: bool, dtype=torch.int64) -> torch.Tensor:
    index = torch.randint(0, SEGMENTS, (rows,), generator=torch.Generator().manual_seed(seed))
    if long:
        index[:CHUNK_TERMS + 9] = 3  # longer than a chunk: chunk programs, their counters
    return index.to(dtype)


# (name, rows, long segment, dtype, mode, alpha, dim, strided source, int32 index, check)
CASES = [
    ("fp32, long segment", 300, True, torch.float32, "fp32", 1.0, 0, False, False, "device"),
    ("fp32, short segments, off", 300, False, torch.float32, "fp32", 1.0, 0, False, False,
     "off"),
    ("kahan bf16, alpha", 300, True, torch.bfloat16, "kahan", 0.5, 0, False, False, "off"),
    ("autograd fp16", 300, False, torch.float16, "autograd", 1.0, 0, False, False, "device"),
    ("fp64, outer rows, int32", 300, True, torch.float64, "fp32", 1.0, 1, False, True,
     "device"),
    ("fp32, strided source", 300, False, torch.float32, "fp32", -2.0, 0, True, False,
     "device"),
    ("fp32, scanned (at most a chunk of terms)", CHUNK_TERMS, False, torch.float32, "fp32",
     1.0, 0, False, False, "device"),
]


def _problem(case, seed):
    _, rows, long, dtype, _, _, dim, strided, int32, _ = case
    gen_seed = seed_of("replay", case[0], seed)
    shape = [3, rows, 4] if dim == 1 else [rows, 5]
    if strided:
        shape[-1] *= 2
    source = make_data(tuple(shape), dtype, seed=gen_seed, spread=True)
    if strided:
        source = source[..., ::2]
    input_shape = list(source.shape)
    input_shape[dim] = SEGMENTS
    input = make_data(tuple(input_shape), dtype, seed=gen_seed + 1, spread=True)
    index = _index(rows, gen_seed, long, torch.int32 if int32 else torch.int64)
    return input, index, source


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_call_made_again_gives_its_whole_paths_bits(gpu_path, case):
    """``index_add`` and ``index_add_`` without a plan, on new tensors at each call: recorded
    at the second call of a signature, made again from the third, each call with the bits of
    its whole path (outputs NaN-filled before their launches): long segments (a workspace,
    ticket counters), alpha, every mode, outer rows, an int32 index, a strided source, an
    index short enough to be scanned unsorted; check "device" and "off"."""
    _, _, _, _, mode, alpha, dim, _, _, check = case
    for seed in range(3):
        input, index, source = _problem(case, seed)
        in_place = input.clone()

        def out_of_place():
            return detsum.index_add(input, dim, index, source, alpha=alpha, mode=mode,
                                    check=check)

        out = out_of_place()
        detsum.index_add_(in_place, dim, index, source, alpha=alpha, mode=mode, check=check)
        expected = _whole_path(out_of_place)
        assert_same_bits(out, expected)
        assert_same_bits(in_place, expected)
    # The first two calls of each signature (out of place, in place) ran their whole paths.
    assert len(gpu_path) == 2


@pytest.mark.parametrize("check", ["off", "device"])
def test_what_only_launches_take_is_one_allocation_and_no_view(gpu_path, check):
    """A tape allocates once for every tensor that only its launches take (the counting sort's
    ranks, table, values, order and offsets and, at "off", the reduction's workspace: pieces of
    one workspace) and makes none of the views only launches take (the sort's partials and tile
    sums: places in the table's piece); the ops that read or write a tensor remain.
    ``index_add_`` of 300 rows with a long segment, poison off (the poison is a fill, which
    takes what it fills): at "off" the replay runs the workspace's allocation beside its five
    launches (the sort's four, the reduction); at "device" also the launch's flag (a view of a
    workspace of its own, which the assert reads) and the assert. Each piece's memory is apart
    from every other's (the bits: the tests above)."""
    from detsum.kernels.triton import launch

    input, index, source = _problem(CASES[0], 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_segments, "POISON_OUTPUTS", False)
        for _ in range(3):
            detsum.index_add_(input.clone(), 0, index, source, check=check)
        (tape,) = gpu_path
        seeing = _Seeing()
        target = input.clone()
        with seeing:  # the operator's body under a dispatch mode: its whole path
            index_add_module._index_add_inplace(target, 0, index, source, 1.0, "fp32", check)
    assert len(gpu_path) == 1
    ops = [step for step in tape.steps if step[0] is _replay._OP]
    names = [getattr(step[1], "__name__", str(step[1])) for step in ops]
    launches = [step for step in tape.steps if step[0] is _replay._LAUNCH]
    whole = [str(func) for func, _, _ in seeing.seen]
    if check == "off":
        assert names == ["empty"]
    else:
        assert names == ["empty", "empty", "__getitem__", "_assert_async"]
    assert ops[0][3]["dtype"] is torch.uint8
    assert len(launches) == 5 and all(isinstance(step[1], launch.InterpretedLaunch)
                                      for step in launches)
    # The whole path allocated each piece apart and made views for its launches.
    assert sum(op.startswith("aten.empty") for op in whole) >= 6 + (check == "device")
    assert any(op in ("aten.unsqueeze.default", "aten.view.default") for op in whole)
    places = {place[2] for step in launches for place in step[3]
              if place[1] == tape.slot_count - 1}
    # The ranks, table, values, order and offsets, and at "off" the reduction's workspace,
    # each a piece at a whole 256-byte unit; and the partials and tile sums, places within
    # the table's piece.
    assert len(places) == 7 + (check == "off")
    assert sum(offset % 256 == 0 for offset in places) >= 5 + (check == "off")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("reduce,include_self,mode,form,check", [
    ("sum", True, "fp32", "rows", "off"), ("sum", True, "fp32", "torch's", "device"),
    ("mean", False, "kahan", "torch's", "device"), ("amax", True, "fp32", "rows", "device"),
    ("prod", False, "autograd", "rows", "device")])
def test_a_scatter_reduce_made_again_gives_its_whole_paths_bits(gpu_path, reduce, include_self,
                                                                mode, form, check):
    """``scatter_reduce`` without a plan, each reduction, with and without the input, a 1-D
    row index and torch's own form of it (the index expanded to the source's shape), long
    segments: made again from the third call, with the whole path's bits."""
    for seed in range(3):
        input, index, source = _problem(CASES[0], seed)
        if form == "torch's":
            index = index[:, None].expand(source.shape)

        def call():
            return detsum.scatter_reduce(input, 0, index, source, reduce,
                                         include_self=include_self, mode=mode, check=check)

        assert_same_bits(call(), _whole_path(call))
    assert len(gpu_path) == 1


@pytest.mark.parametrize("mode,dtype,perm,check", [
    ("fp32", torch.float32, False, "off"), ("kahan", torch.bfloat16, True, "device"),
    ("autograd", torch.float16, False, "device"), ("exact", torch.float32, True, "off"),
    ("fp32", torch.float64, True, "device")])
def test_a_segment_sum_made_again_gives_its_whole_paths_bits(gpu_path, mode, dtype, perm,
                                                            check):
    """``segment_sum`` without a plan, over offsets with an empty segment and one longer than
    a chunk, with and without ``perm``: made again from the third call, each call on new
    tensors, with the whole path's bits; at "device" an offset out of order still raises."""
    offsets = torch.tensor([0, 10, 10, 290, 300])
    for seed in range(3):
        gen_seed = seed_of("replay segment_sum", mode, seed)
        src = make_data((300, 5), dtype, seed=gen_seed, spread=True)
        order = (torch.randperm(300, generator=torch.Generator().manual_seed(gen_seed))
                 if perm else None)

        def call():
            return detsum.segment_sum(src, offsets.clone(), perm=order, mode=mode, check=check)

        assert_same_bits(call(), _whole_path(call))
    assert len(gpu_path) == 1
    if check == "device":
        with pytest.raises(RuntimeError, match="offsets"):
            detsum.segment_sum(src, torch.tensor([0, 10, 5, 290, 300]), perm=order, mode=mode,
                               check=check)
        assert len(gpu_path) == 2


def test_a_bad_index_raises_as_its_whole_path_and_later_calls_hold(gpu_path):
    """At check="device", a call made again with a value out of range raises the whole
    path's error (the CPU's assert, at once); the long segment's ticket counters are set back
    as the whole path sets them, so the calls after it give their whole paths' bits."""
    case = CASES[0]
    for seed in range(3):
        input, index, source = _problem(case, seed)
        detsum.index_add_(input, 0, index, source, check="device")
    input, index, source = _problem(case, 5)
    index[7] = SEGMENTS
    with pytest.raises(RuntimeError) as whole:
        _whole_path(lambda: detsum.index_add_(input.clone(), 0, index, source, check="device"))
    replays = len(gpu_path)
    with pytest.raises(RuntimeError) as again:
        detsum.index_add_(input.clone(), 0, index, source, check="device")
    assert len(gpu_path) == replays + 1
    assert str(again.value) == str(whole.value)
    for seed in range(6, 8):
        input, index, source = _problem(case, seed)
        out = input.clone()
        detsum.index_add_(out, 0, index, source, check="device")
        assert_same_bits(out, _whole_path(lambda: detsum.index_add(input, 0, index, source,
                                                                   check="device")))


class _Seeing(TorchDispatchMode):
    """A dispatch mode that sees every op (func, args, kwargs) and runs it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _calls_made_again(call, replayed: list, times: int = 4) -> int:
    """How many of ``times`` calls of ``call`` were made again (``replayed``: ``gpu_path``'s
    list)."""
    before = len(replayed)
    for _ in range(times):
        call()
    return len(replayed) - before


def test_calls_that_read_back_or_cannot_be_replaced_are_never_made_again(gpu_path,
                                                                          monkeypatch):
    """Never made again: a call at check="host" (a read back of the check); a whole path that
    reads a value back (an op giving data-dependent output), uses a tensor that shares a
    tensor's memory but was made without torch's dispatch (``torch.from_numpy``), or returns
    such a tensor; a body run under a dispatch mode (whose ops the mode must see). The
    calls still give their bits."""
    input, index, source = _problem(CASES[1], 0)
    expected = _whole_path(lambda: detsum.index_add(input, 0, index, source, check="off"))

    def call(check="off"):
        out = detsum.index_add(input, 0, index, source, check=check)
        assert_same_bits(out, expected)

    assert _calls_made_again(lambda: call("host"), gpu_path) == 0

    def body_under_a_mode():  # as inside torch's dispatch, a mode seeing every op
        with _Seeing():
            out = index_add_module._index_add(input, 0, index, source, 1.0, "fp32", "off")
        assert_same_bits(out, expected)

    assert _calls_made_again(body_under_a_mode, gpu_path) == 0
    run = index_add_module._run
    for change in (lambda out: (out.sum().item(), out)[1],  # a value read back
                   # memory shared with the output, not made by torch's dispatch
                   lambda out: (torch.from_numpy(out.numpy()).add_(0), out)[1],
                   lambda out: torch.from_numpy(out.numpy())):  # a result not seen made
        _replay._TAPES.clear()
        with monkeypatch.context() as patch:
            patch.setattr(index_add_module, "_run",
                          lambda *args, change=change, **options: change(run(*args, **options)))
            assert _calls_made_again(call, gpu_path) == 0, change
    _replay._TAPES.clear()
    # The same call, unchanged: made again at its third and fourth.
    assert _calls_made_again(call, gpu_path) == 2


def test_a_signature_seen_once_pays_no_record(gpu_path, monkeypatch):
    """A call whose signature changes at every call (a batch of another size each time) runs
    its whole path alone: recorded at a signature's second call, never at its first."""
    recorded = []
    record = _replay._record

    def counted(*args):
        recorded.append(args[0])
        return record(*args)

    monkeypatch.setattr(_replay, "_record", counted)
    for rows in range(300, 310):
        index = _index(rows, rows, False)
        source = make_data((rows, 5), torch.float32, seed=rows)
        detsum.index_add(torch.zeros(SEGMENTS, 5), 0, index, source, check="off")
    assert recorded == []
    detsum.index_add(torch.zeros(SEGMENTS, 5), 0, index, source, check="off")
    assert len(recorded) == 1


def test_the_switch_makes_its_calls_again(gpu_path):
    """Under ``detsum.enable`` on a GPU's path, torch's own ``index_add_``, ``scatter_add_``,
    ``scatter_reduce_`` (a maximum), the backward of ``x[idx]`` (``index_put_`` with
    ``accumulate=True``) and ``segment_reduce`` (a sum over lengths) on new tensors at each
    call are made again from the third call of each, with the bits of their whole paths."""
    def calls(seed):
        input, index, source = _problem(CASES[0], seed)
        x = source.clone().requires_grad_()
        with detsum.deterministic("fp32"):
            added = input.clone().index_add_(0, index, source)
            scattered = input.clone().scatter_add_(0, index[:, None].expand(source.shape),
                                                   source)
            largest = input.clone().scatter_reduce_(0, index[:, None].expand(source.shape),
                                                    source, "amax")
            (x[index] * 2).sum().backward()  # rows 0 to 6 of x, each many times
            summed = torch.segment_reduce(source, "sum", lengths=torch.tensor([10, 0, 290]))
        return added, scattered, largest, x.grad, summed

    for seed in range(3):
        for out, whole in zip(calls(seed), _whole_path(lambda: calls(seed))):
            assert_same_bits(out, whole)
    assert len(gpu_path) == 5  # each of the five at its third call


def test_each_op_replayed_through_a_python_function_gives_the_ops_result():
    """Every op a tape replays through one of torch's Python functions (``_replay``'s
    ``_FUNCTIONS`` and ``_FACTORIES``, and a slice through indexing), called as the tape calls
    it with the arguments a call handed the op, gives the op's own result: the same shape,
    strides and dtype, and the same values where the op makes any."""
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    seeing = _Seeing()
    with seeing:
        x.unsqueeze(0), x.view(12), x.view(torch.int32), x.permute(1, 0), x.select(0, 1)
        x[None].expand(2, 4, 3), x.transpose(0, 1), x[1:], x[:, 1:3], x[::2]
        torch.cumsum(x, 0), torch.cumsum(x, 0, dtype=torch.float64), torch.cummax(x, 1)
        x.clamp(-0.5, 0.5), x.clamp(0), x.clamp(max=0.25)
        y = x.clone(memory_format=torch.contiguous_format)
        y.fill_(2.0), y.zero_(), y.copy_(x), torch._assert_async(torch.tensor(True), "m")
        torch.empty_like(x), torch.empty_strided((2, 3), (1, 2))
        torch.empty(3, dtype=torch.int16), torch.zeros(3, 2), torch.full((2,), 1.5)
    replaced = set()
    for func, args, kwargs in seeing.seen:
        theirs = func(*args, **kwargs)
        step = _replay._op_step(func, args, kwargs, tuple(range(len(tree_flatten(theirs)[0]))),
                                _replay._form_of(theirs))
        function = step[1]
        if function is func:
            continue
        replaced.add(func)
        ours = function(*step[2], **step[3])
        if theirs is None:
            assert ours is None, func
            continue
        # As the tape reads an op's tensors: flattened (cummax gives two).
        ours, theirs = tree_flatten(ours)[0], tree_flatten(theirs)[0]
        assert len(ours) == len(theirs), func
        for our, their in zip(ours, theirs):
            assert (our.shape, our.stride(), our.dtype) == (their.shape, their.stride(),
                                                            their.dtype), func
            if func not in (torch.ops.aten.empty_like.default,
                            torch.ops.aten.empty_strided.default,
                            torch.ops.aten.empty.memory_format):
                assert_same_bits(our, their)
    assert replaced == {*_replay._FUNCTIONS, *_replay._FACTORIES, torch.ops.aten.slice.Tensor}
