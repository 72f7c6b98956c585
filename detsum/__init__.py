"""detsum: deterministic accumulation primitives for PyTorch."""

from detsum.backend import backend
from detsum.modes import MODES, Mode
from detsum.ops.index_add import index_add, index_add_
from detsum.ops.running_sum import RunningSum
from detsum.ops.scatter_reduce import scatter_reduce
from detsum.ops.segment_sum import segment_sum
from detsum import loss, moe  # noqa: E402  (consumers: need the ops above registered)
from detsum.explain import Explanation, explain

__all__ = [
    "Explanation",
    "MODES",
    "Mode",
    "RunningSum",
    "backend",
    "explain",
    "index_add",
    "index_add_",
    "loss",
    "moe",
    "scatter_reduce",
    "segment_sum",
]
