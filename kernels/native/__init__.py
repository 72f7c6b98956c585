"""The switch's C++ kernels (``switch_kernels.cpp``): built once per machine and torch, loaded
with ctypes.

The library is compiled from its one source file with the system's C++ compiler (``CXX``, else
``c++``) against the running torch's headers and libraries, and kept in a cache folder
(``DETSUM_CACHE_DIR``, else ``$XDG_CACHE_HOME/detsum``, else ``~/.cache/detsum``) under a name
that holds a digest of the source, torch's version and the compile command: a changed source
or another torch builds anew, and each build is written under a name of its own first, then
renamed into place, so processes building at once never read a half-written file.

``library()`` returns the loaded library, or None where it is not built yet; ``build()`` builds
it (seconds to tens of seconds) and returns None or the reason it could not be built.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("switch_kernels.cpp")

#: The flags that decide the bits: no contraction of a multiply and an add into one rounding,
#: no fast-math reassociation (the default, stated). And no trapping math: floating-point
#: operations raise no traps, so the compiler may compute both arms of a select (the KAHAN
#: rule's two error terms) and vectorise the loop; every value is IEEE's all the same.
_NUMERIC_FLAGS = ("-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math")

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None


def _compile_command(output: str) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    include, lib = torch_dir / "include", torch_dir / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-fPIC", "-shared",
            *_NUMERIC_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
            f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
            str(SOURCE), "-o", output, f"-L{lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{lib}"]


def cache_dir() -> Path:
    """The folder that keeps the built library."""
    base = os.environ.get("DETSUM_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "detsum"


def library_path() -> Path:
    """Where the library built from this source, for this torch, lies (or will)."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(_compile_command("out")).encode())
    return cache_dir() / f"switch_kernels-{digest.hexdigest()[:16]}.so"


def library() -> ctypes.CDLL | None:
    """The library, loaded (once a process); None where it is not built."""
    global _loaded
    with _lock:
        if _loaded is None:
            path = library_path()
            if path.exists():
                _loaded = _declared(ctypes.CDLL(str(path)))
        return _loaded


def build() -> str | None:
    """Builds the library unless it is there: None, or why it could not be built (the
    compiler's last lines)."""
    path = library_path()
    if path.exists():
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(path.parent)
        handle, partial = tempfile.mkstemp(suffix=".so.partial", dir=path.parent)
        os.close(handle)
    except OSError as error:
        return f"cannot write the cache folder {path.parent}: {error}"
    try:
        done = subprocess.run(_compile_command(partial), capture_output=True, text=True)
    except OSError as error:
        os.unlink(partial)
        return f"no C++ compiler ({error})"
    if done.returncode != 0:
        os.unlink(partial)
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        return f"the compiler failed: {tail}"
    os.replace(partial, path)
    return None


def _remove_abandoned(folder: Path) -> None:
    """Partial builds older than ten minutes: a process that ended while its build thread ran
    left them (a build takes seconds)."""
    now = time.time()
    for partial in folder.glob("*.so.partial"):
        try:
            if now - partial.stat().st_mtime > 600:
                partial.unlink()
        except OSError:  # another process removed it, or renamed it into place
            pass


def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with its functions' argument and result types set."""
    lib.detsum_native_install.restype = ctypes.c_int
    lib.detsum_native_install.argtypes = []
    lib.detsum_native_uninstall.restype = None
    lib.detsum_native_uninstall.argtypes = []
    lib.detsum_native_error.restype = ctypes.c_char_p
    lib.detsum_native_configure.restype = None
    lib.detsum_native_configure.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.detsum_native_capture_torch.restype = ctypes.c_int
    lib.detsum_native_capture_torch.argtypes = []
    lib.detsum_native_set_inside.restype = None
    lib.detsum_native_set_inside.argtypes = [ctypes.c_int]
    lib.detsum_native_take_counts.restype = None
    lib.detsum_native_take_counts.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.detsum_native_op_name.restype = ctypes.c_char_p
    lib.detsum_native_op_name.argtypes = [ctypes.c_int]
    lib.detsum_native_op_count.restype = ctypes.c_int
    return lib

