"""Triton's interpreter, made to patch ``triton.language`` once per launch instead of once per
call of a ``@triton.jit`` helper.

The interpreter runs a kernel as Python: at each launch it swaps ``triton.language``'s builtins
for functions that compute on NumPy arrays, runs every program, and swaps them back. It also
swaps them again at every call of a jitted helper inside the kernel, and keeps no record of that
second swap: every builtin is already swapped by then, so the work (``inspect.getmembers`` over
``triton.language``, its ``core``, ``math`` and ``tensor``) changes nothing. The segment kernels
call helpers in their inner loops, tens of thousands of times a test, and that repeated swap
was more than half of such a test's time (tests/test_triton.py's tiles of many segments: 24.5 s
of 42.8 s, profiled, triton 3.9.0).

``install`` makes a helper's call skip the swap when the launch running it has already swapped
every language module the helper's module sees; a helper that sees one more still swaps, as
Triton does. The kernels compute the same values either way; only the interpreter's repeated
work goes. Triton 3.6.0 and 3.9.0 patch the language as described here; nothing is installed
where a Triton does it in another way, and the tests then run as slowly as before.

``install`` also gives the interpreter three shortcuts (:func:`install_shortcuts`), each for a
step whose answer it works out again at every operation of every program.
"""

from __future__ import annotations

import types


def install() -> bool:
    """Make Triton's interpreter patch the language once per launch, and take the shortcuts of
    :func:`install_shortcuts`; whether the first was installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    install_shortcuts(interpreter)
    patch_language = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if getattr(patch_language, "once", False):
        return True
    if patch_language is None or scope_type is None:
        return False
    language_modules = (interpreter.tl, interpreter.tl.core)
    modules_of_function: dict = {}
    # The language modules the launch running now has patched; None between launches.
    patched_now: frozenset | None = None

    def modules_seen_by(fn) -> frozenset:
        # Triton's own test: the language modules among the function's module's globals.
        modules = modules_of_function.get(fn)
        if modules is None:
            modules = frozenset(id(value) for value in fn.__globals__.values()
                                if any(value is module for module in language_modules))
            modules_of_function[fn] = modules
        return modules

    def patch_once_per_launch(fn):
        nonlocal patched_now
        modules = modules_seen_by(fn)
        if patched_now is not None and modules <= patched_now:
            return scope_type()  # a helper's call inside a launch: nothing left to patch
        scope = patch_language(fn)
        if patched_now is not None:
            # A helper that sees another language module (triton's own jitted functions, such
            # as tl.zeros, see triton.language.core): Triton leaves that patch in place, so the
            # launch's later helpers that see it have nothing left to patch either.
            patched_now = patched_now | modules
        else:
            # A launch: its scope's restore ends it.
            patched_now = modules
            restore = scope.restore

            def restore_and_end_the_launch() -> None:
                nonlocal patched_now
                patched_now = None
                restore()

            scope.restore = restore_and_end_the_launch
        return scope

    patch_once_per_launch.once = True
    patch_once_per_launch.at_every_call = patch_language  # Triton's own, for a test
    interpreter._patch_lang = patch_once_per_launch
    return True


def install_shortcuts(interpreter) -> bool:
    """Three steps of the interpreter's arithmetic, done without the work whose answer cannot
    change; whether they were installed (none is, where this Triton lacks one of the steps).

    - The NumPy dtype of a Triton dtype (``_get_np_dtype``): Triton builds a table of every
      dtype at each call, once or more for each operation of each program; here each scalar
      dtype's answer is kept (a pointer's is Triton's, unkept: its types are unhashable).
    - Two operands of a binary operation made to broadcast (``broadcast_impl_value``): for
      two blocks of one shape Triton works out their common shape dimension by dimension and
      compares it with each operand's shape through its tuple type's comparison, which
      normalises both sides element by element, and returns the operands as they are. Here
      blocks of one shape come back as they are at once; every other pair goes to Triton's
      own step.
    - The two operands of a binary operation typed (``binary_op_type_checking_impl``): for
      two tensors of one type Triton works out the type they compute in, casts each to it and
      broadcasts them, and gets them back as they are, except for a division or remainder of
      16-bit floats (computed in float32). Here two tensors of one type that is not a pointer
      come back at once, but for that division; every other pair goes to Triton's own step.

    They are installed on the interpreter alone (its module and its own semantic object),
    never on what Triton compiles for a GPU. The same values, with 0.71 of the Python calls
    (a test of tests/test_triton.py: 33.8 million against 47.4; the first two alone 36.6;
    tests/test_triton.py and tests/test_exact_triton.py with the first two: 244 s against 285
    on two workers; triton 3.9.0); ``tests/test_interpreter_patching.py`` compares the bits
    with and without them."""
    own_dtype = getattr(interpreter, "_get_np_dtype", None)
    semantic = getattr(interpreter, "interpreter_semantic", None)
    if own_dtype is None or not all(hasattr(semantic, step) for step in (
            "broadcast_impl_value", "binary_op_type_checking_impl")):
        return False
    if getattr(own_dtype, "shortcut", False):
        return True
    block_type = interpreter.tl.block_type
    known: dict = {}

    def numpy_dtype(triton_dtype):
        scalar = triton_dtype.element_ty if isinstance(triton_dtype, block_type) else triton_dtype
        try:
            return known[scalar]
        except KeyError:
            known[scalar] = own_dtype(scalar)
            return known[scalar]
        except TypeError:  # unhashable: a pointer type
            return own_dtype(triton_dtype)

    def broadcast(self, lhs, rhs):
        lhs_type, rhs_type = lhs.type, rhs.type
        if lhs_type.is_block() and rhs_type.is_block() and lhs_type.shape == rhs_type.shape:
            return lhs, rhs
        return broadcast.triton_own(lhs, rhs)

    tensor_type = interpreter.tl.tensor

    def operands(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                 arithmetic_check=True, div_or_mod=False):
        if type(lhs) is tensor_type and type(rhs) is tensor_type and lhs.type == rhs.type:
            scalar = lhs.dtype
            if not scalar.is_ptr() and not (div_or_mod and scalar.is_floating()
                                            and scalar.primitive_bitwidth < 32):
                return lhs, rhs
        return operands.triton_own(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check,
                                   div_or_mod)

    numpy_dtype.shortcut = True
    # Triton's own steps, for a test (and, for the semantic's, looked up at each call there).
    numpy_dtype.triton_own = own_dtype
    broadcast.triton_own = semantic.broadcast_impl_value
    operands.triton_own = semantic.binary_op_type_checking_impl
    interpreter._get_np_dtype = numpy_dtype
    semantic.broadcast_impl_value = types.MethodType(broadcast, semantic)
    semantic.binary_op_type_checking_impl = types.MethodType(operands, semantic)
    return True
