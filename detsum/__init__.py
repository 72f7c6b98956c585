"""detsum: deterministic accumulation primitives for PyTorch."""

from detsum._validation import IndexOutOfRangeError
from detsum.backend import backend
from detsum.modes import MODES, Mode
from detsum.ops.index_add import index_add, index_add_
from detsum.ops.running_sum import RunningSum
from detsum.ops.scatter_reduce import scatter_reduce
from detsum.ops.segment_sum import segment_sum
from detsum.plans import Plan, plan
from detsum import distributed, loss, moe  # noqa: E402  (consumers: need the ops above registered)
from detsum.scatter_compat import (  # torch_scatter's API, deterministic
    gather_coo, gather_csr, index_select, scatter, scatter_add, scatter_log_softmax,
    scatter_logsumexp, scatter_max, scatter_mean, scatter_min, scatter_mul, scatter_softmax,
    scatter_std, scatter_sum, segment_add_coo, segment_add_csr, segment_coo, segment_csr,
    segment_max_coo, segment_max_csr, segment_mean_coo, segment_mean_csr, segment_min_coo,
    segment_min_csr, segment_sum_coo, segment_sum_csr,
)
from detsum.explain import Explanation, Explanations, explain
from detsum import pyg  # noqa: E402  (PyG adapter: imports torch_geometric on first use only)
from detsum.switch import current_mode, deterministic, disable, enable

__all__ = [
    "Explanation",
    "Explanations",
    "IndexOutOfRangeError",
    "MODES",
    "Mode",
    "Plan",
    "RunningSum",
    "backend",
    "current_mode",
    "deterministic",
    "disable",
    "distributed",
    "enable",
    "explain",
    "gather_coo",
    "gather_csr",
    "index_add",
    "index_add_",
    "index_select",
    "loss",
    "moe",
    "plan",
    "pyg",
    "scatter",
    "scatter_add",
    "scatter_log_softmax",
    "scatter_logsumexp",
    "scatter_max",
    "scatter_mean",
    "scatter_min",
    "scatter_mul",
    "scatter_reduce",
    "scatter_softmax",
    "scatter_std",
    "scatter_sum",
    "segment_add_coo",
    "segment_add_csr",
    "segment_coo",
    "segment_csr",
    "segment_max_coo",
    "segment_max_csr",
    "segment_mean_coo",
    "segment_mean_csr",
    "segment_min_coo",
    "segment_min_csr",
    "segment_sum",
    "segment_sum_coo",
    "segment_sum_csr",
]
