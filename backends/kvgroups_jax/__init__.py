"""kvgroups JAX backend: Pallas page-copy kernels (Triton and Mosaic GPU lowerings, Mosaic TPU
DMA kernels), a plain XLA fallback, descriptors for JAX arrays and DLPack imports of foreign
caches.

The core finds this package through its registry (``"jax"``, for ``jax.Array``); to force a
lowering, register an instance under another name::

    from kvgroups_core.tensors.arrays import register_backend
    register_backend("jax-triton", JaxBackend(lowering="triton"))
"""

from .backend import JaxBackend
from .buckets import PAD_ID, pad_block_ids
from .describe import describe_array
from .executor import execute_plan, lower_plan, trace_count
from .foreign import InPlaceCopyWarning, InPlaceWriteLostError, import_dlpack
from .lowerings.choice import LOWERINGS
from .lowerings.tuning import LoweringTuning

__all__ = [
    "JaxBackend",
    "LOWERINGS",
    "LoweringTuning",
    "PAD_ID",
    "InPlaceCopyWarning",
    "InPlaceWriteLostError",
    "describe_array",
    "execute_plan",
    "import_dlpack",
    "lower_plan",
    "pad_block_ids",
    "trace_count",
]


def __getattr__(name: str):
    # InPlaceWriteLost, the old name of InPlaceWriteLostError: deprecated.
    from kvgroups_core.errors import deprecated_alias

    from . import foreign

    return deprecated_alias(__name__, name, foreign.DEPRECATED_ALIASES, vars(foreign))
