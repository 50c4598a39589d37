"""One compiled transfer for every request size: block ids padded to a bucket.

Inside an engine's jitted step, the shapes of the block ids and of the objects decide which
program runs, so every new request size would compile a new one (tpu-inference keeps one
program per power-of-two bucket of block counts). Pad the ids to a bucket stated once,
``max_chunks`` chunks, with :data:`PAD_ID`, and keep the objects in a pool of ``max_chunks``
rows: every request of 1 .. ``max_chunks`` chunks then runs the same program. The padding
items name no block, so the kernels drop them on the device: no DMA, no byte moved, the pool
rows past the request keep their bytes on a store. Like any out-of-range device id they are
reported under ``checkify`` (:mod:`kvgroups_jax.id_checks`).

Eager calls with host ids need no padding: their ids and kernel grids are padded to a
power-of-two bucket by the executor, one program per bucket and object shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvgroups_core.errors import KVGroupsValueError

#: The id of a padding item: outside every cache's blocks, so it moves nothing.
PAD_ID = -1


def pad_block_ids(ids, max_chunks: int, blocks_per_chunk: int) -> jax.Array:
    """``ids`` (1-D, the request's engine block ids) as int32 ``[max_chunks *
    blocks_per_chunk]``, :data:`PAD_ID` after the request's own. Traceable (under ``jax.jit``
    the request's length is static, its values need not be)."""
    ids = jnp.asarray(ids)
    size = int(max_chunks) * int(blocks_per_chunk)
    if ids.ndim != 1 or ids.shape[0] > size:
        raise KVGroupsValueError(
            f"ids: expected a 1-D array of at most {size} block ids ({max_chunks} chunks of "
            f"{blocks_per_chunk}), got shape {tuple(ids.shape)}"
        )
    return jnp.pad(ids.astype(jnp.int32), (0, size - ids.shape[0]), constant_values=PAD_ID)


__all__ = ["PAD_ID", "pad_block_ids"]
