"""Same-width unsigned views: bit-exact copies of every dtype, for free.

Copying bf16 as bf16 is not bit-exact everywhere (jax 0.10.2 on CPU rewrites bf16 NaN
payloads) and fp8 is slow in CPU interpret mode, so every kernel moves unsigned integers of the
view width. ``bitcast_convert_type`` plus reshape are layout bitcasts in XLA: the views alias
the original buffers, which keeps donation and ``input_output_aliases`` in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

#: The unsigned JAX dtype of each element width (bytes).
UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
_UINT = UINT_OF_WIDTH


def flat_view(x: jax.Array, unit: int) -> jax.Array:
    """``x`` as a 1-D array of ``unit``-byte unsigned elements, ``[x.nbytes // unit]``."""
    itemsize = x.dtype.itemsize
    if itemsize == unit:
        y = x if x.dtype == _UINT[unit] else lax.bitcast_convert_type(x, _UINT[unit])
        return y.reshape(-1)
    if itemsize > unit:
        # One wide element becomes itemsize // unit narrow ones (a trailing axis).
        return lax.bitcast_convert_type(x, _UINT[unit]).reshape(-1)
    y = x.reshape(-1, unit // itemsize)
    return lax.bitcast_convert_type(y, _UINT[unit])


def unflat_view(y: jax.Array, like_shape: tuple[int, ...], like_dtype, unit: int) -> jax.Array:
    """Undo :func:`flat_view`: back to ``like_shape`` of ``like_dtype``."""
    itemsize = jnp.dtype(like_dtype).itemsize
    if itemsize == unit:
        y = y.reshape(like_shape)
        return y if y.dtype == like_dtype else lax.bitcast_convert_type(y, like_dtype)
    if itemsize > unit:
        y = y.reshape(*like_shape, itemsize // unit)
        return lax.bitcast_convert_type(y, like_dtype)
    y = lax.bitcast_convert_type(y, like_dtype)
    return y.reshape(like_shape)


def object_view(obj: jax.Array, unit: int) -> jax.Array:
    """A ``[num_chunks, object_nbytes]`` uint8 object as ``[num_chunks, object_nbytes // unit]``."""
    if unit == 1:
        return obj
    n, nbytes = obj.shape
    return lax.bitcast_convert_type(obj.reshape(n, nbytes // unit, unit), _UINT[unit])


def object_unview(y: jax.Array, unit: int) -> jax.Array:
    """Undo :func:`object_view`."""
    if unit == 1:
        return y
    n, elems = y.shape
    return lax.bitcast_convert_type(y, jnp.uint8).reshape(n, elems * unit)
