"""detsum: deterministic accumulation primitives for PyTorch."""

from detsum.backend import backend
from detsum.modes import MODES, Mode
from detsum.ops.index_add import index_add, index_add_
from detsum.ops.scatter_reduce import scatter_reduce
from detsum.ops.segment_sum import segment_sum
from detsum import moe  # noqa: E402  (consumer: needs the ops above registered)

__all__ = [
    "MODES",
    "Mode",
    "backend",
    "index_add",
    "index_add_",
    "moe",
    "scatter_reduce",
    "segment_sum",
]
