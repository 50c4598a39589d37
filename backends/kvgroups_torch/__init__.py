"""kvgroups_torch: the PyTorch backend of kvgroups.

Moves paged KV-cache blocks between engine caches and memory objects for the core's
:class:`~kvgroups_core.transfer.plan.TransferPlan`:

- CUDA tensors: one NVRTC-compiled kernel launch per kernel group
(``kvgroups_cuda/kernels/page_copy.cu``,
  compiled at first use and cached on disk, see :mod:`kvgroups_cuda.nvrtc`), on PyTorch's
  current stream, never synchronising. Objects may be in GPU memory or in pinned host memory:
  by default ("staged", docs/PERFORMANCE.md) the kernel works on a transient device buffer
  and the touched regions move in one bulk copy each; ``TorchBackend(pinned="direct")`` has
  the kernel read and write pinned memory through UVA instead (no extra device memory).
- CPU tensors: plain torch byte views with ``index_select`` / ``index_copy_``
  (:mod:`kvgroups_torch.cpu`).

Normal use goes through the core: ``kvgroups_core.store(...)`` / ``load(...)`` find this
backend from the tensors (registry name ``"torch"``).

Block ids on the device
-----------------------
The core validates host ids (lists, NumPy arrays, CPU tensors) before anything moves. CUDA
id tensors (flat, or one per engine group) and a load's ``skip_first_n_tokens`` given as a
CUDA tensor are never copied to the host: the kernels read them where they are and check
them. An out-of-range id moves nothing for its item; the first bad value, the engine group
whose ids held it and the bound are recorded on the device. :func:`check_errors` (also run by
``TorchBackend.synchronize``) synchronises, reads and clears the record and raises
``KVGroupsIndexError`` naming ``block_ids[g]`` and the value (``KVGroupsValueError`` for a
skip outside the tokens covered, which is clamped). No id, whatever its value, makes a
kernel touch memory outside the given tensors.

Streams, graphs, SM budget
--------------------------
Every call enqueues on PyTorch's current stream and never synchronises. With device ids a
prepared ``store`` / ``load`` is capturable in a CUDA graph: a replay reads the id and skip
tensors' current contents (write new ids in place). ``max_ctas=`` on the calls caps the
CTAs of each launch (each loops over its share), leaving SMs to concurrent work.
:class:`LayerwiseLoad` / :class:`LayerwiseSave` (:mod:`kvgroups_torch.layerwise`) queue a
step's per-layer loads and saves on a side stream with one CUDA event per layer, so each
layer's compute waits on the GPU for its own layer and a whole step is capturable.

Kernel or copy engine
---------------------
``path=`` on the calls picks how the bytes move: ``"kernel"`` (the page-copy kernels),
``"copy_engine"`` (one ``cuMemcpyBatchAsync`` of the pages' contiguous runs, computed on the
host from host ids: no SM used; pinned objects reached directly) or ``"auto"`` (default):
the faster of the two at the nearest point of a table measured on this GPU by
:func:`tune_copy_paths` and cached in ``$XDG_CACHE_HOME/kvgroups`` (see
:mod:`kvgroups_torch.copy_engine.paths`); until a table exists, and for device ids, ``"auto"`` is
the kernel.

torch.compile
-------------
``store``, ``load`` and the prepared calls work inside ``torch.compile(fullgraph=True)``
(:mod:`kvgroups_torch.compile.dynamo`): planning happens at trace time from shapes and dtypes, the
transfer is one custom op (``torch.ops.kvgroups.store_pages`` / ``load_pages``). Import
``kvgroups_torch`` before compiling.

:class:`BoundPlan` (a plan bound to its tensors ahead of time) is the lower-level form of
the same: ``run`` dispatches the same custom ops.
"""

from __future__ import annotations

from kvgroups_cuda.nvrtc import cache_dir, cache_key, compile_cubin, get_cubin

from kvgroups_core import __version__

from .backend import DEFAULT_PINNED_MODE, TorchBackend
from .bound_plan import BoundPlan
from .compile.dynamo import install as _install_compile_support
from .copy_engine.paths import tune_copy_paths
from .cuda.device import check_device_errors, check_errors
from .cuda.driver import KernelLaunchError
from .describe import describe_tensor, dtype_of, torch_dtype
from .distributed import check_same_grouping as check_same_grouping
from .layerwise import LayerwiseLoad, LayerwiseSave
from .objects import allocate_objects

__all__ = [
    "DEFAULT_PINNED_MODE",
    "KernelLaunchError",
    "LayerwiseLoad",
    "LayerwiseSave",
    "BoundPlan",
    "TorchBackend",
    "__version__",
    "allocate_objects",
    "cache_dir",
    "cache_key",
    "check_device_errors",
    "check_errors",
    "compile_cubin",
    "describe_tensor",
    "dtype_of",
    "get_cubin",
    "torch_dtype",
    "tune_copy_paths",
]

_install_compile_support()
