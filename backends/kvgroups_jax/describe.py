"""Describe JAX arrays for the core: concrete arrays with pointers, traced values without.

Planning must work under ``jax.jit``, where arrays are tracers with a shape and a dtype but no
buffer: those become :class:`~kvgroups_core.tensors.descriptors.TensorDesc` s with ``data_ptr == 0``
(abstract), which is all planning needs.
"""

from __future__ import annotations

from typing import Any

import jax

from kvgroups_core.errors import KVGroupsTypeError
from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec
from kvgroups_core.tensors.dtypes import as_dtype


def device_string(device: Any, memory_kind: str | None = None) -> str:
    """Our device spelling (``"cpu"``, ``"cuda:0"``, ``"cuda_host"``) of a JAX device."""
    platform = getattr(device, "platform", "cpu")
    if memory_kind in ("pinned_host", "unpinned_host"):
        return (
            "cuda_host" if platform in ("gpu", "cuda") and memory_kind == "pinned_host" else "cpu"
        )
    if platform in ("gpu", "cuda"):
        hw = getattr(device, "local_hardware_id", None)
        return f"cuda:{device.id if hw is None else hw}"
    return "cpu" if platform == "cpu" else f"{platform}:{device.id}"


def memory_kind_of(x: Any) -> str | None:
    sharding = getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None)


def _abstract_device(x: Any) -> str:
    sharding = getattr(x, "sharding", None)
    devices = getattr(sharding, "device_set", None) if sharding is not None else None
    if devices:
        return device_string(next(iter(devices)), memory_kind_of(x))
    return "cpu" if jax.default_backend() == "cpu" else "cuda:0"


def describe_array(x: Any) -> TensorDesc:
    """Describe a ``jax.Array``, a tracer or a ``jax.ShapeDtypeStruct``.

    Parameters
    ----------
    x : a single-device concrete array (described with its buffer pointer), or any value with
        ``shape`` and ``dtype`` (described abstractly, ``data_ptr == 0``).

    Returns
    -------
    TensorDesc with ``framework == "jax"``; strides are row-major (JAX arrays are logically
    dense) and ``obj`` is ``x``.
    """
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise KVGroupsTypeError(
            f"tensor: expected a jax.Array, a tracer or a ShapeDtypeStruct, got {type(x).__name__}"
        )
    spec_dtype = as_dtype(x.dtype)
    if spec_dtype.name == "bool":
        # Every lowering moves same-width unsigned views (views.py) and XLA has no bitcast of
        # bool. A convert to uint8 is bit-exact but not a view: the kernels would read a
        # converted copy of the whole cache, and a load would no longer update the donated
        # buffer in place.
        raise KVGroupsTypeError(
            "tensor: expected a JAX array of a dtype with a bitcast to uint8 (XLA has none for "
            "bool), got bool; hold such data as uint8 (0 / 1) instead"
        )
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    if concrete and not x.is_deleted() and len(x.devices()) == 1:  # deleted: shape only
        device = next(iter(x.devices()))
        spec = TensorSpec(
            tuple(x.shape), spec_dtype, None, device_string(device, memory_kind_of(x))
        )
        ptr = x.unsafe_buffer_pointer() if x.size else 0
        return TensorDesc(spec, int(ptr), 0, x, "jax")
    # Tracers, ShapeDtypeStructs and sharded arrays: no single buffer to point at. A concrete
    # array spread over devices leaves its sharding with the descriptor: a manager built from
    # it can then vouch for the sharding of the tracers that stand for it inside jax.jit.
    spec = TensorSpec(tuple(x.shape), spec_dtype, None, _abstract_device(x))
    placement = x.sharding if concrete and len(x.sharding.device_set) > 1 else None
    return TensorDesc(spec, 0, 0, x, "jax", abstract=True, placement=placement)
