"""boxnp: an example kvgroups backend. Its arrays (:class:`BoxArray`) hold NumPy arrays; its
executor moves bytes with its own index arithmetic over the plan (DESIGN.md, the page model)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvgroups_core.tensors.descriptors import TensorDesc, describe_numpy
from kvgroups_core.transfer.backend import Backend


class BoxArray:
    """The backend's array type: a NumPy array in a box (DLPack passes through)."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def __getitem__(self, index: Any) -> "BoxArray":
        return BoxArray(self.data[index])

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple:
        return self.data.__dlpack_device__()


def _all_bytes(desc: TensorDesc) -> np.ndarray:
    """Every byte the tensor addresses, as one flat uint8 array (padding included)."""
    extent = desc.spec.extent_elems() * desc.dtype.itemsize
    return np.frombuffer((ctypes.c_uint8 * extent).from_address(desc.address), np.uint8)


def _chunk_bytes(objects: Any, chunk: int) -> np.ndarray:
    row = objects[chunk] if isinstance(objects, (list, tuple)) else objects[chunk]
    return row.data.reshape(-1)


def _move_group(t: Any, store: bool, caches: list[np.ndarray], objects: Any) -> None:
    chunks, positions, ids = t.items()
    tokens = np.arange(t.block_size)
    for chunk, pos, block in zip(chunks.tolist(), positions.tolist(), ids.tolist()):
        obj = _chunk_bytes(objects, chunk)
        for plane in t.planes:
            cache = caches[plane.tensor_index]
            block_base = plane.byte_offset + block * t.block_stride_bytes
            # The plane's place in the object region (not its index in t.planes: a plan for a
            # subset of layers keeps only some planes).
            row_base = (
                t.region_offset + (plane.object_plane * t.slots + pos * t.block_size) * t.row_bytes
            )
            for run in t.runs:
                piece = np.arange(run.count)[None, :, None]
                u = np.arange(run.nbytes)[None, None, :]
                tok = tokens[:, None, None]
                at_cache = (
                    block_base
                    + run.cache_offset
                    + piece * run.cache_step
                    + tok * run.token_stride
                    + u
                )
                at_object = row_base + tok * t.row_bytes + run.obj_offset + piece * run.obj_step + u
                if store:
                    obj[at_object] = cache[at_cache]
                else:
                    cache[at_cache] = obj[at_object]


class BoxBackend(Backend):
    """Moves pages between BoxArray caches and BoxArray objects on the host."""

    name = "boxnp"
    array_types = ("boxnp_kvgroups.BoxArray",)

    def describe(self, x: Any) -> TensorDesc:
        d = describe_numpy(x.data)
        return TensorDesc(d.spec, d.data_ptr, 0, x, self.name)

    def allocate_objects(self, plan: Any, like: TensorDesc, placement: str | None = None) -> list:
        return [BoxArray(np.zeros((plan.num_chunks, n), np.uint8)) for n in plan.object_nbytes]

    def import_foreign(self, x: Any) -> BoxArray:
        return x if isinstance(x, BoxArray) else BoxArray(np.from_dlpack(x))

    def execute(self, plan: Any, caches: list, objects: list) -> tuple[None, list]:
        views = [_all_bytes(d) for d in caches]
        for t in plan.groups:
            if t.num_items:
                _move_group(t, plan.direction == "store", views, objects[t.object_group_idx])
        return None, list(objects)
