"""The Numba CPU kernels.

Threading: the kernels run on Numba's OpenMP layer where it is available (unless the user
chose a layer with ``NUMBA_THREADING_LAYER`` or ``NUMBA_THREADING_LAYER_PRIORITY``). On Linux,
torch's wheels load ``libgomp.so.1`` first, and Numba's OpenMP layer then uses that same
runtime: one pool of threads for torch and the kernels, instead of two pools spinning against
each other on a loaded machine (Numba's default prefers TBB when it is installed). Each launch
runs on no more threads than torch is set to use, and leaves torch's setting as it found it
(``segment.segment_reduce``); so does starting the layer, below.
"""

import os

import numba
import torch

if not {"NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"} & os.environ.keys():
    # Read by Numba when its threading layer starts, just below.
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

# Starting Numba's threading layer (its first parallel launch, or any numba.get_num_threads())
# sets the OpenMP runtime's thread count to Numba's pool size, and torch reads that count as
# its own: start it here, once, and put torch's setting back. (Numba code the user ran before
# importing detsum has started the layer already; that is outside detsum's reach.)
_torch_threads = torch.get_num_threads()
numba.get_num_threads()
if torch.get_num_threads() != _torch_threads:
    torch.set_num_threads(_torch_threads)
