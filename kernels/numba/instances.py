"""Compiling only what a launch needs: one function per data format and mode, cached on disk
on its own, run over thread blocks by one small parallel driver.

- :func:`instance`: a module-level template compiled with ``cache=True`` under a name of its
  own, its mode and its format's conversions bound as compile-time constants. A first call
  compiles the variant it needs alone (a few seconds), and a later process loads it alone.
- :class:`Blocks`: such a kernel, the work of one thread block, run over the blocks by a
  small parallel driver, which calls it through its address. The driver is the same for
  every variant and is compiled once per argument types; the variant is compiled once,
  serial.

Why the address: a ``parallel=True`` function compiles its loop body again as a function of
its own and links every function it calls into each of the two (Numba links callees as LLVM
IR), so a variant's code went through LLVM's optimizer and code generator three or four
times (measured: the parallel kernel took about twice the CPU time of the same code
compiled serial). Called through an address, the variant is linked nowhere. The call uses
Numba's own calling convention, so the arguments pass exactly as in a direct call; the
driver checks, before it calls, that the address was taken for its argument types.
"""

from __future__ import annotations

import hashlib
from types import FunctionType

import numpy as np
from llvmlite import ir
from numba import typeof, types
from numba.core import cgutils
from numba.core.callconv import RETCODE_NONE, RETCODE_OK, excinfo_t
from numba.extending import intrinsic

from . import njit, parallel_njit

__all__ = ["instance", "Blocks", "call_at", "types_key_of", "DONE", "OTHER_TYPES"]


def instance(template, name, *, parallel=False, **bound):
    """``template``, a module-level function, compiled with ``cache=True`` as a function of its
    own, named ``<template's name>_<name>``, in which each global name in ``bound`` stands for
    the value given: the functions and constants of one data format and one mode, fixed when
    it compiles. ``parallel=True`` gives a :func:`parallel_njit` kernel.

    Why not a closure, as the factories' inner functions are: Numba keys a cached function
    with a closure by its cells' pickled contents, and a compiled function pickles with an
    identifier drawn anew in every process, so a closure over one never loads from the cache
    and compiles again in every process. A module-level function's globals are no part of the
    key: its name keeps the instances apart, each with an index file of its own, which a call
    loads alone. As for every cached kernel, the cache sees a change to the template's file,
    not to a bound function's code in another file: delete ``kernels/numba/__pycache__``
    after editing one.
    """
    fn = FunctionType(template.__code__, {**template.__globals__, **bound},
                      f"{template.__name__}_{name}", template.__defaults__)
    fn.__qualname__ = f"{template.__qualname__}_{name}"
    fn.__module__ = template.__module__
    fn.__doc__ = template.__doc__
    return (parallel_njit if parallel else njit)(cache=True)(fn)


def _types_key(argument_types) -> int:
    """A 64-bit number for a tuple of Numba types, the same in every process."""
    digest = hashlib.blake2b(str(argument_types).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@intrinsic
def types_key_of(typingctx, args):
    """:func:`_types_key` of the type of ``args``, a constant of the compiled code."""
    key = _types_key(args)

    def codegen(context, builder, signature, llargs):
        return context.get_constant(types.int64, key)

    return types.int64(args), codegen


@intrinsic
def call_at(typingctx, address, b, args):
    """Call the compiled function at ``address`` as ``f(b, *args)`` (Numba's calling
    convention; ``b`` an int64, and f returns None); True when it returned without an
    error."""
    if (not isinstance(address, types.Integer) or b != types.int64
            or not isinstance(args, types.BaseTuple)):
        return None
    argument_types = (types.int64,) + tuple(args.types)

    def codegen(context, builder, signature, llargs):
        fnty = context.call_conv.get_function_type(types.none, argument_types)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        values = [llargs[1]] + cgutils.unpack_tuple(builder, llargs[2], len(args))
        result = cgutils.alloca_once(builder, fnty.args[0].pointee)
        builder.store(cgutils.get_null_value(fnty.args[0].pointee), result)
        excinfo = cgutils.alloca_once(builder, ir.PointerType(excinfo_t))
        packed = context.get_arg_packer(argument_types).as_arguments(builder, values)
        code = builder.call(fn, [result, excinfo] + list(packed))
        ok = builder.or_(builder.icmp_signed("==", code, RETCODE_OK),
                         builder.icmp_signed("==", code, RETCODE_NONE))
        return ok

    return types.boolean(address, b, args), codegen


#: A driver's answers (see Blocks).
DONE, OTHER_TYPES = 0, 1


class Blocks:
    """A kernel, ``block_kernel(b, *args)`` (an :func:`instance`: the work of thread block
    ``b``), launched over ``n_blocks`` blocks by a driver:
    ``Blocks(driver, block_kernel)(n_blocks, args)``.

    The driver, one per kernel module, is a :func:`parallel_njit` function of
    ``(address, types_key, failed, *args)``, its parameters spelled out (a parallel loop
    cannot take a tuple of arrays): it returns OTHER_TYPES, having run nothing, when
    ``types_key_of(args)`` is not ``types_key``; otherwise it calls
    ``call_at(address, b, args)`` for every block ``b < len(failed)`` in a ``prange`` loop,
    sets ``failed[b]`` where a call returned an error (none can: a safeguard), and returns
    DONE. (Flags, not a count: a reduction in the parallel loop cost its driver a third more
    compile time.)

    The address is taken for the argument types of the first launch (compiling the kernel for
    them, or loading it from the cache), and again whenever a launch has others: each launch
    runs code compiled for its own types, as a direct call would. A launch of one block calls
    the kernel directly, on the calling thread.
    """

    def __init__(self, driver, block_kernel):
        self.driver = driver
        self.block_kernel = block_kernel
        self._address = 0
        self._types_key = -1

    def _take_address(self, args):
        args_type = typeof(args)
        signature = (types.int64,) + tuple(args_type.types)
        self.block_kernel.compile(signature)
        compiled = self.block_kernel.overloads[signature]
        self._address = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
        self._types_key = _types_key(args_type)

    def __call__(self, n_blocks, args):
        if n_blocks == 1:
            # No driver to compile, and no parallel region to enter, for a small launch.
            self.block_kernel(0, *args)
            return
        failed = np.zeros(n_blocks, dtype=np.uint8)
        answer = self.driver(self._address, self._types_key, failed, *args)
        if answer == OTHER_TYPES:
            self._take_address(args)
            answer = self.driver(self._address, self._types_key, failed, *args)
        if answer != DONE or failed.any():
            raise RuntimeError(f"{self.block_kernel.py_func.__qualname__}: a block failed "
                               f"({'argument types' if answer == OTHER_TYPES else 'an error'})")
