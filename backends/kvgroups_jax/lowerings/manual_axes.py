"""The mesh axes a kernel's outputs vary over inside ``jax.shard_map``.

With ``check_vma=True`` (shard_map's default) every ``pallas_call`` output must declare the
manual axes it varies over. A page copy moves bytes between the shard's own arrays, so its
outputs vary over every axis any operand varies over.
"""

from __future__ import annotations

from typing import Any

import jax


def joined_manual_axes(*arrays: Any) -> Any:
    """The manual-axis type varying over every axis any of ``arrays`` varies over; None when
    none carries one (abstract shapes given for fresh outputs are skipped)."""
    types = []
    for a in arrays:
        if isinstance(a, jax.ShapeDtypeStruct):
            continue
        found = getattr(jax.typeof(a), "manual_axis_type", None)
        if found is not None:
            types.append(found)
    if not types:
        return None
    varying = frozenset().union(*(t.varying for t in types))
    return types[0].update(varying=varying)


def out_struct(shape: Any, dtype: Any, manual_axes: Any) -> jax.ShapeDtypeStruct:
    """A kernel output's shape and dtype, with the manual axes it varies over."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual_axes)
