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

``install`` also gives the interpreter six shortcuts (:func:`install_shortcuts`), each for a
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
    """Six steps of the interpreter's arithmetic, done without the work whose answer cannot
    change; whether they were installed (none is, where this Triton lacks one of the steps).

    - The NumPy dtype of a Triton dtype (``_get_np_dtype``): Triton builds a table of every
      dtype at each call, once or more for each operation of each program; here each scalar
      dtype's answer is kept (a pointer's is Triton's, unkept: its types are unhashable).
    - Two operands of a binary operation made to broadcast (``broadcast_impl_value``): for
      two blocks of one shape Triton works out their common shape dimension by dimension and
      compares it with each operand's shape through its tuple type's comparison, which
      normalises both sides element by element, and returns the operands as they are. Here
      blocks of one shape come back as they are at once. A block and a scalar (``x + 1``)
      take Triton's own steps (the scalar splat to the block's shape), with the block type
      kept (below); every other pair goes to Triton's own step.
    - The two operands of a binary operation typed (``binary_op_type_checking_impl``):
      Triton works out the type they compute in, casts each operand to it (a Python number
      becomes a constant of it) and broadcasts them. Here the pairs a kernel meets most take
      Triton's own steps without working the type out through its general rules, where the
      answer is plain: two tensors of one type come back as they are, and two of one scalar
      type are broadcast, except for a division or remainder of 16-bit floats (computed in
      float32); two signed integer tensors compute in the wider type; a pointer and integer
      offsets (where the operation allows the pointer) are broadcast as they are; a signed
      integer tensor and a Python int within its type's range, or a float tensor and a
      Python float or an int Triton can type (within 64 bits; but for that division),
      compute in the tensor's type, the number made a constant of it. A pointer and a
      Python int take the int's own type, as Triton gives it. Every other pair, and every
      pair Triton refuses, goes to Triton's own step.
    - A cast (``cast``). To the scalar type the tensor has, Triton's first step returns the
      tensor, after comparing the two types through their comparison, which normalises the
      other side; here types that are not a pointer's compare by their names (which are
      equal exactly where the types are). Between two other types, Triton picks its builder
      step through a cascade of tests of both types and makes the result's block type anew;
      here a cast it makes in one step, with no rounding given, takes that step, kept per
      pair of type names, with the block type kept (below): between standard floats (not
      float16 and bfloat16 between them, nor a 16-bit float to float64), between integers,
      from float32 or float64 to an integer, from an integer to a standard float, none to a
      bool. Every other cast goes to Triton's own step (whose two-step casts come back here).
    - A block type (the interpreter builder's ``get_block_ty``, which every operation's result
      type goes through): Triton makes one anew each time, checking and normalising its shape
      and naming it. Here one of each element type and shape is kept (a pointer's, whose
      name leaves out its address space, per address space too) and given again, and so is
      the one a kept type's ``with_element_ty`` gives (the result type of a comparison, a
      load, a bitcast); block types are values, never changed once made.
    - A tensor of a type seen before (``make_tensor``, every operation's result): Triton
      works out its shape as a tuple of constants and its number of elements again. Here
      the tensor gets the shape, count and scalar type Triton worked out for the first tensor
      of its type (a pointer's per address space), the same objects, which nothing changes.

    They are installed on the interpreter alone (its module, its own semantic object and its
    own builder), never on what Triton compiles for a GPU. The same values, with fewer Python
    calls (tests/test_interpreter_patching.py's sums, "fp32" and "exact", six times: 85.2
    million with Triton's own steps, 34.2 million with the shortcuts; triton 3.9.0) and less
    time (benches/NOTES.md, the log's thirty-second and thirty-third sessions);
    ``tests/test_interpreter_patching.py`` compares the bits with and without them."""
    own_dtype = getattr(interpreter, "_get_np_dtype", None)
    semantic = getattr(interpreter, "interpreter_semantic", None)
    builder = getattr(semantic, "builder", None)
    semantic_steps = ("broadcast_impl_value", "binary_op_type_checking_impl", "make_tensor",
                      "cast")
    if own_dtype is None or not all(hasattr(semantic, step) for step in semantic_steps) or not all(
            hasattr(builder, step) for step in ("get_block_ty", "create_splat")):
        return False
    if getattr(own_dtype, "shortcut", False):
        return True
    block_type = interpreter.tl.block_type
    tensor_type = interpreter.tl.tensor
    dtype_type = interpreter.tl.dtype
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

    known_blocks: dict = {}
    shape_type = interpreter.tl.tuple

    def type_key(scalar, name):
        # A type's name tells it from every other type, but for a pointer's address space.
        return (name, scalar.address_space) if scalar.is_ptr() else name

    def block_type_of(element, shape):
        # A block type's shape is the language's tuple of ints.
        if type(shape) is not shape_type:
            return block_type_of.triton_own(element, shape)
        key = (type_key(element, element.name), *shape.values)
        kept = known_blocks.get(key)
        if kept is None:
            kept = known_blocks[key] = block_type_of.triton_own(element, shape)
            # Its own with_element_ty (comparisons', loads' and bitcasts' result types) gives
            # the kept type of that element type and this shape too.
            kept.with_element_ty = with_element_of(kept, shape)
        return kept

    def with_element_of(block, shape):
        triton_own = block.with_element_ty

        def with_element_ty(scalar):
            if isinstance(scalar, dtype_type) and not scalar.is_block():
                return block_type_of(scalar, shape)
            return triton_own(scalar)

        return with_element_ty

    def broadcast(self, lhs, rhs):
        lhs_type, rhs_type = lhs.type, rhs.type
        lhs_block, rhs_block = lhs_type.is_block(), rhs_type.is_block()
        if lhs_block and rhs_block:
            if lhs_type.shape == rhs_type.shape:
                return lhs, rhs
        elif lhs_block or rhs_block:
            # Triton's own steps for a block and a scalar, the block type kept.
            block, scalar = (lhs, rhs) if lhs_block else (rhs, lhs)
            splat_type = block_type_of(scalar.type.scalar, block.type.shape)
            splat = self.make_tensor(
                self.builder.create_splat(splat_type.to_ir(self.builder), scalar.handle),
                splat_type)
            return (lhs, splat) if lhs_block else (splat, rhs)
        return broadcast.triton_own(lhs, rhs)

    def operands(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                 arithmetic_check=True, div_or_mod=False):
        # Triton's own steps for the common pairs, each where it casts nothing it would not
        # (see the docstring); every other pair, and every pair it refuses, goes to Triton.
        lhs_tensor, rhs_tensor = type(lhs) is tensor_type, type(rhs) is tensor_type
        if lhs_tensor and rhs_tensor:
            lhs_scalar, rhs_scalar = lhs.dtype, rhs.dtype
            if lhs_scalar.is_ptr() or rhs_scalar.is_ptr():
                pointer, offset = (lhs_scalar, rhs_scalar) if lhs_scalar.is_ptr() else (
                    rhs_scalar, lhs_scalar)
                if (allow_lhs_ptr if pointer is lhs_scalar else allow_rhs_ptr) and (
                        offset.is_int()):  # not a pointer's type, whose name is no int's
                    return self.broadcast_impl_value(lhs, rhs)  # a pointer and its offsets
            # Types that are not a pointer's are equal where their names are.
            elif lhs_scalar.name == rhs_scalar.name:
                if not (div_or_mod and lhs_scalar.is_floating()
                        and lhs_scalar.primitive_bitwidth < 32):
                    if lhs.type.name == rhs.type.name:
                        return lhs, rhs
                    return self.broadcast_impl_value(lhs, rhs)
            elif arithmetic_check and lhs_scalar.is_int_signed() and rhs_scalar.is_int_signed():
                wider = (lhs_scalar if lhs_scalar.int_bitwidth > rhs_scalar.int_bitwidth
                         else rhs_scalar)
                return self.broadcast_impl_value(self.cast(lhs, wider), self.cast(rhs, wider))
        elif lhs_tensor or rhs_tensor:
            tensor, number = (lhs, rhs) if lhs_tensor else (rhs, lhs)
            scalar, kind = tensor.dtype, type(number)
            constant = None
            if scalar.is_ptr():
                if kind is int and (allow_lhs_ptr if lhs_tensor else allow_rhs_ptr):
                    constant = self.to_tensor(number)  # an offset of its own type
            elif arithmetic_check and (
                    kind is int and scalar.is_int_signed()
                    and scalar.get_int_min_value() <= number <= scalar.get_int_max_value()
                    or (kind is float or kind is int and -2**63 <= number < 2**64)
                    and scalar.is_floating()
                    and not (div_or_mod and scalar.primitive_bitwidth < 32)):
                constant = self.scalar_constant(number, dtype=scalar)  # the tensor's type
            if constant is not None:
                return self.broadcast_impl_value(*((tensor, constant) if lhs_tensor
                                                   else (constant, tensor)))
        return operands.triton_own(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check,
                                   div_or_mod)

    standard_floats = dtype_type.STANDARD_FP_TYPES
    known_conversions: dict = {}

    def conversion(source, target):
        # The one builder step Triton's cast takes from scalar type source to target with no
        # rounding given, and its last argument; None where it takes another way (two casts
        # through float32 from a 16-bit float, float16 and bfloat16 between them, to a bool).
        if source.name in standard_floats and target.name in standard_floats:
            if source.primitive_bitwidth > target.primitive_bitwidth:
                return "create_fp_trunc", ()
            if source.name in ("fp16", "bf16"):
                return ("create_fp_ext", ()) if target.name == "fp32" else None
            return ("create_fp_ext", ()) if target.name == "fp64" else None
        if target.is_bool():
            return None
        if source.is_int() and target.is_int():
            return "create_int_cast", (source.is_int_signed(),)
        if source.name in standard_floats and target.is_int():
            if source.name in ("fp16", "bf16"):
                return None
            return ("create_fp_to_si" if target.is_int_signed() else "create_fp_to_ui"), ()
        if source.is_int() and target.name in standard_floats:
            return ("create_si_to_fp" if source.is_int_signed() else "create_ui_to_fp"), ()
        return None

    def cast(self, input, dst_ty, fp_downcast_rounding=None):
        # Triton's first step: a cast to the scalar type the tensor has returns it. Then the
        # casts it makes in one builder step, the result's block type kept.
        source_type = input.type
        source, target = source_type.scalar, dst_ty.scalar
        if not source.is_ptr() and not target.is_ptr():
            if source.name == target.name:
                return input
            block = source_type.is_block()
            if fp_downcast_rounding is None and (block or not dst_ty.is_block()):
                pair = (source.name, target.name)
                try:
                    step = known_conversions[pair]
                except KeyError:
                    step = known_conversions[pair] = conversion(source, target)
                if step is not None:
                    result_type = block_type_of(target, source_type.shape) if block else dst_ty
                    name, last = step
                    handle = getattr(self.builder, name)(
                        input.handle, result_type.to_ir(self.builder), *last)
                    return self.make_tensor(handle, result_type)
        return cast.triton_own(input, dst_ty, fp_downcast_rounding)

    known_tensors: dict = {}
    new_tensor = object.__new__

    def make_tensor(self, handle, tensor_of):
        if type(tensor_of) is block_type:
            scalar = tensor_of.element_ty
        elif isinstance(tensor_of, dtype_type) and not tensor_of.is_block():
            scalar = tensor_of
        else:
            return make_tensor.triton_own(handle, tensor_of)
        key = type_key(scalar, tensor_of.name)
        kept = known_tensors.get(key)
        if kept is None:
            made = make_tensor.triton_own(handle, tensor_of)
            known_tensors[key] = (made.shape, made.numel, made.dtype)
            return made
        made = new_tensor(tensor_type)
        made.handle = handle
        made.shape, made.numel, made.dtype = kept
        made.type = tensor_of
        return made

    numpy_dtype.shortcut = True
    # Triton's own steps, for a test (and, for the semantic's, looked up at each call there).
    numpy_dtype.triton_own = own_dtype
    block_type_of.triton_own = builder.get_block_ty
    broadcast.triton_own = semantic.broadcast_impl_value
    operands.triton_own = semantic.binary_op_type_checking_impl
    make_tensor.triton_own = semantic.make_tensor
    cast.triton_own = semantic.cast
    interpreter._get_np_dtype = numpy_dtype
    builder.get_block_ty = block_type_of
    semantic.broadcast_impl_value = types.MethodType(broadcast, semantic)
    semantic.binary_op_type_checking_impl = types.MethodType(operands, semantic)
    semantic.make_tensor = types.MethodType(make_tensor, semantic)
    semantic.cast = types.MethodType(cast, semantic)
    return True
