"""kvgroups_torch: the PyTorch backend of kvgroups.

Moves paged KV-cache blocks between engine caches and memory objects for the core's
:class:`~kvgroups_core.plan.TransferPlan`:

- CUDA tensors: one NVRTC-compiled kernel launch per kernel group (``kernels/page_copy.cu``,
  compiled at first use and cached on disk, see :mod:`kvgroups_torch.nvrtc`), on PyTorch's
  current stream, never synchronising. Objects may be in GPU memory or in pinned host memory:
  by default ("staged", the faster on an H200) the kernel works on a transient device buffer
  and the touched regions move in one bulk copy each; ``TorchBackend(pinned="direct")`` has
  the kernel read and write pinned memory through UVA instead (no extra device memory).
- CPU tensors: plain torch byte views with ``index_select`` / ``index_copy_``
  (:mod:`kvgroups_torch.torch_path`).

Normal use goes through the core: ``kvgroups_core.store(...)`` / ``load(...)`` find this
backend from the tensors (registry name ``"torch"``).

Block ids on the device
-----------------------
The core validates host ids before anything moves. Ids that live on the GPU are checked by
the kernel: an id outside ``[0, num_blocks)`` moves nothing for its block and sets a
per-device flag; :func:`check_device_errors` synchronises, reads and clears it (raising
``KVGroupsIndexError``). No id, whatever its value, makes a kernel touch memory outside the
given tensors.

torch.compile and CUDA graphs
-----------------------------
:class:`BoundPlan` binds a plan to its tensors and does every piece of host work up
front (kernel load, plane pointer tables on the device, packed launch parameters)::

    prep = kvgroups_torch.BoundPlan(plan, caches, objects)   # outside capture
    ids = torch.empty(n, dtype=torch.int32, device="cuda")          # static id buffer
    ids.copy_(first_ids)
    prep.run(ids)                                                   # warm-up, eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prep.run(ids)                                               # captured launch
    ids.copy_(next_ids); graph.replay()                             # moves the new blocks

``run`` dispatches the custom ops ``torch.ops.kvgroups.store_pages`` /
``torch.ops.kvgroups.load_pages`` (with fake implementations), so it also works inside
``torch.compile``-d functions. CUDA id tensors are read when the kernel runs; host ids are
baked into the launch parameters (a graph then replays the ids of capture time). Caches and
objects are bound by address: a graph replays into the same tensors.
"""

from __future__ import annotations

from kvgroups_core import __version__

from .backend import DEFAULT_PINNED_MODE, TorchBackend
from .bound_plan import BoundPlan
from .cuda_path import check_device_errors
from .describe import describe_tensor, dtype_of, torch_dtype
from .distributed import check_same_grouping as check_same_grouping
from .driver import KernelLaunchError
from .nvrtc import cache_dir, cache_key, compile_cubin, get_cubin
from .objects import allocate_objects

__all__ = [
    "DEFAULT_PINNED_MODE",
    "KernelLaunchError",
    "BoundPlan",
    "TorchBackend",
    "__version__",
    "allocate_objects",
    "cache_dir",
    "cache_key",
    "check_device_errors",
    "compile_cubin",
    "describe_tensor",
    "dtype_of",
    "get_cubin",
    "torch_dtype",
]
