"""``python -m detsum.kernels.native``: build the switch's C++ kernels now, not at the first
``detsum.enable``."""

import sys

from detsum.kernels.native import build, library_path

reason = build()
print(reason or f"built: {library_path()}")
sys.exit(1 if reason else 0)
