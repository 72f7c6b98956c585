"""The suite's Triton's interpreter (tests/interpreter_patching.py, installed by conftest.py):
``triton.language`` patched once per launch, not at every call of a jitted helper, and six
shortcuts in its arithmetic; the same bits as Triton's own way, and the language left as
Triton leaves it."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import TRITON_RUNS_CPU_TENSORS, assert_same_bits

pytestmark = pytest.mark.skipif(not TRITON_RUNS_CPU_TENSORS,
                                reason="Triton's interpreter only (on a GPU the kernels run)")
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


@pytest.fixture
def patch_once_per_launch():
    patch = interpreter._patch_lang
    if not getattr(patch, "once", False):
        pytest.skip("this Triton's interpreter patches the language in another way: the "
                    "suite runs it as it is")
    return patch


def _sums(mode: str) -> list[torch.Tensor]:
    """Sums whose kernels call helpers in their loops: long segments in chunks, many short
    ones in tiles, and a scatter's mean."""
    gen = torch.Generator().manual_seed(3)
    index = torch.randint(0, 40, (1000,), generator=gen).sort().values
    index[:500] = 7  # a long segment
    src = torch.randn(1000, 5, generator=gen)
    init = torch.randn(40, 5, generator=gen)
    with detsum.backend("triton"):
        return [detsum.index_add(init, 0, index, src, mode=mode),
                detsum.scatter_reduce(init, 0, index, src, "mean", mode=mode)]


@pytest.mark.parametrize("mode", ["fp32", "exact"])
def test_a_launch_patches_the_language_once_and_restores_it(monkeypatch, patch_once_per_launch,
                                                            mode):
    """Counted over the calls: the language's builtins are patched a few times a launch, while
    the kernels call their jitted helpers many times; afterwards triton.language holds what it
    held before; and the sums have the bits of Triton's own way (a patch at every call)."""
    _sums(mode)  # the first calls' one-time set-up, outside the counts
    counts = {"launches": 0, "helper calls": 0, "patched modules": 0}
    launch = interpreter.GridExecutor.__call__
    helper_call = interpreter.InterpretedFunction.__call__
    patch_builtins = interpreter._patch_builtin

    def counted(key, function):
        def count(*args, **kwargs):
            counts[key] += 1
            return function(*args, **kwargs)
        return count

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted("launches", launch))
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__",
                        counted("helper calls", helper_call))
    monkeypatch.setattr(interpreter, "_patch_builtin",
                        counted("patched modules", patch_builtins))
    language_before = dict(vars(tl))
    once = _sums(mode)
    assert dict(vars(tl)) == language_before
    # A launch patches triton.language's builtins, its tensor's, math's and the tensor
    # descriptor's (4); the first helper of triton's own (tl.zeros), which sees both
    # triton.language and its core, those and the core's two once more (6).
    assert counts["launches"] > 0
    assert counts["patched modules"] <= 10 * counts["launches"], counts
    assert counts["helper calls"] > 20 * counts["launches"], counts
    monkeypatch.setattr(interpreter, "_patch_lang", patch_once_per_launch.at_every_call)
    for fast, triton_way in zip(once, _sums(mode), strict=True):
        assert_same_bits(fast, triton_way)


@pytest.fixture
def shortcuts():
    """The shortcuts installed, by the name of the step each stands for; each has Triton's own
    step as ``triton_own``."""
    numpy_dtype = interpreter._get_np_dtype
    if not getattr(numpy_dtype, "shortcut", False):
        pytest.skip("this Triton's interpreter lacks a step the shortcuts replace: the suite "
                    "runs it as it is")
    semantic = interpreter.interpreter_semantic
    return {"_get_np_dtype": numpy_dtype, "get_block_ty": semantic.builder.get_block_ty,
            **{step: getattr(semantic, step).__func__ for step in SEMANTIC_STEPS}}


#: The steps of the interpreter's own semantic object that a shortcut stands for.
SEMANTIC_STEPS = ("broadcast_impl_value", "binary_op_type_checking_impl", "make_tensor", "cast")

SCALAR_TYPES = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64,
                tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64]


def test_the_kept_numpy_dtypes_are_tritons_own(shortcuts):
    numpy_dtype = shortcuts["_get_np_dtype"]
    for scalar in SCALAR_TYPES:
        for triton_dtype in (scalar, tl.block_type(scalar, [4]), tl.block_type(scalar, [2, 8]),
                             tl.pointer_type(scalar), tl.block_type(tl.pointer_type(scalar), [4])):
            for _ in range(2):  # worked out, then kept
                assert numpy_dtype(triton_dtype) == numpy_dtype.triton_own(triton_dtype), \
                    triton_dtype


def test_kept_block_types_and_tensors_are_tritons_own(shortcuts):
    """A kept block type equals the one Triton makes, a pointer's kept per address space (its
    name leaves that out), and gives the kept type of another element type; a tensor made the
    short way has every attribute of the one Triton makes, equal, a pointer's of the same
    address space."""
    block_type_of, make_tensor = shortcuts["get_block_ty"], shortcuts["make_tensor"]
    semantic = interpreter.interpreter_semantic
    handle = object()
    pointers = [tl.pointer_type(scalar, space, const) for scalar in (tl.float32, tl.int64)
                for space in (1, 3) for const in (False, True)]
    for scalar in SCALAR_TYPES + pointers:
        for shape in ([4], [2, 8]):
            own = tl.block_type(scalar, shape)
            for _ in range(2):  # made, then kept
                kept = block_type_of(scalar, own.shape)
                assert kept == own and kept.name == own.name and kept.numel == own.numel
                for tensor_type in (own, scalar):
                    fast = make_tensor(semantic, handle, tensor_type)
                    triton_way = make_tensor.triton_own(handle, tensor_type)
                    assert type(fast) is type(triton_way)
                    assert vars(fast).keys() == vars(triton_way).keys()
                    for name, value in vars(triton_way).items():
                        assert getattr(fast, name) == value, (tensor_type, name)
                    if scalar.is_ptr():
                        assert fast.dtype.address_space == scalar.address_space
                if scalar.is_ptr():
                    assert kept.element_ty.address_space == scalar.address_space
            for other in (tl.int1, tl.float64, pointers[-1]):  # a kept type's own
                changed = kept.with_element_ty(other)
                assert changed == tl.block_type(other, shape)
                assert changed is block_type_of(other, own.shape)
                if other.is_ptr():
                    assert changed.element_ty.address_space == other.address_space
                else:
                    assert changed.element_ty is other


def _tensor(scalar, values, block=True):
    """A tensor of the interpreter: a block of the four ``values``, or a scalar of the first."""
    import numpy as np

    if scalar == tl.bfloat16:  # held as its bits
        data = (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        data = np.asarray(values, dtype=interpreter._get_np_dtype(scalar))
    if not block:
        data = data[:1]
    handle = interpreter.TensorHandle(data, scalar)
    return tl.tensor(handle, tl.block_type(scalar, [4]) if block else scalar)


def _operand_values():
    """Tensors of the interpreter (blocks of 4 and scalars) of every kind of type the typing
    step sees, pointers among them, and Python numbers at and past the types' ranges."""
    values = []
    for scalar in SCALAR_TYPES:
        numbers = [0, 1, 1, 0] if scalar == tl.int1 else [3, -2, 7, 0] if (
            scalar.is_int_signed() or scalar.is_floating()) else [3, 2, 7, 0]
        values += [_tensor(scalar, numbers), _tensor(scalar, numbers, block=False)]
    pointer = tl.pointer_type(tl.float32)
    addresses = [4096, 4100, 4104, 4108]
    values += [_tensor(pointer, addresses), _tensor(pointer, addresses, block=False),
               _tensor(tl.pointer_type(tl.int64), addresses)]
    return values + [0, -1, 7, 2**31 - 1, 2**31, -2**31 - 1, 2**40, 2**63, -2**63 - 1, 2**64,
                     1.5, -0.25, 1e300, True]


def _typed(outcome):
    """What a typing step gave, comparable: each operand's type and bits, or the error."""
    if isinstance(outcome, Exception):
        return type(outcome)
    return [(str(t.type), t.handle.dtype.name, t.handle.data.dtype, t.handle.data.shape,
             t.handle.data.tobytes()) for t in outcome]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_the_operand_shortcuts_give_tritons_own_operands_for_every_pair(shortcuts):
    """Every pair of operand kinds (both orders): under every flag the typing step takes, the
    broadcast, and a cast of each tensor to every scalar type (and to two block types) with
    each rounding, the shortcut gives the types and values Triton's own step gives, or the
    same error."""
    import itertools

    semantic = interpreter.interpreter_semantic
    values = _operand_values()
    tensors = [value for value in values if isinstance(value, tl.tensor)]

    def compare(shortcut, *arguments):
        outcomes = []
        for step in (lambda *a: shortcut(semantic, *a), shortcut.triton_own):
            try:
                outcome = step(*arguments)
                outcomes.append(_typed(outcome if isinstance(outcome, tuple) else [outcome]))
            except Exception as error:  # noqa: BLE001 - the same error is the check
                outcomes.append(_typed(error))
        assert outcomes[0] == outcomes[1], (arguments, outcomes)

    operands = shortcuts["binary_op_type_checking_impl"]
    for lhs, rhs in itertools.product(values, repeat=2):
        if isinstance(lhs, tl.tensor) or isinstance(rhs, tl.tensor):
            for flags in itertools.product([False, True], repeat=4):
                compare(operands, lhs, rhs, *flags)
    for lhs, rhs in itertools.product(tensors, repeat=2):
        compare(shortcuts["broadcast_impl_value"], lhs, rhs)
    # Values that each rounding rounds its own way, past the narrower types' ranges.
    awkward = [1 / 3, -2.7, 3.4e38, 65520.0, 1e-40, float("inf"), -0.0, 2.5]
    tensors += [_tensor(scalar, awkward[start:start + 4], block)
                for scalar in (tl.float32, tl.float64) for start in (0, 4)
                for block in (True, False)]
    targets = SCALAR_TYPES + [tl.pointer_type(tl.int8)]
    targets += [tl.block_type(scalar, [4]) for scalar in (tl.int8, tl.float32)]
    for tensor, target, rounding in itertools.product(tensors, targets, [None, "rtne", "rtz"]):
        compare(shortcuts["cast"], tensor, target, rounding)


@pytest.mark.parametrize("mode", ["fp32", "exact"])
def test_the_shortcuts_are_taken_and_give_tritons_own_bits(monkeypatch, shortcuts, mode):
    """Counted: with the shortcuts, Triton's own steps they stand for run less often than
    without them; and the sums have the bits of Triton's own way."""
    _sums(mode)  # the first calls' one-time set-up, outside the counts
    calls = dict.fromkeys(shortcuts, 0)

    def counted(name, step):
        def count(*args):
            calls[name] += 1
            return step(*args)
        return count

    counted_steps = {name: counted(name, shortcut.triton_own)
                     for name, shortcut in shortcuts.items()}
    for name, shortcut in shortcuts.items():
        monkeypatch.setattr(shortcut, "triton_own", counted_steps[name])
    with_shortcuts = _sums(mode)
    taken = dict(calls)
    semantic = interpreter.interpreter_semantic
    monkeypatch.setattr(interpreter, "_get_np_dtype", counted_steps["_get_np_dtype"])
    monkeypatch.setattr(semantic.builder, "get_block_ty", counted_steps["get_block_ty"])
    for step in SEMANTIC_STEPS:
        monkeypatch.setattr(semantic, step, counted_steps[step])
    calls.update(dict.fromkeys(shortcuts, 0))
    for fast, triton_way in zip(with_shortcuts, _sums(mode), strict=True):
        assert_same_bits(fast, triton_way)
    for step in shortcuts:
        assert taken[step] < 0.9 * calls[step], (step, taken, calls)
