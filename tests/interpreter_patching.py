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
"""

from __future__ import annotations


def install() -> bool:
    """Make Triton's interpreter patch the language once per launch; whether it was installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
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
