"""The ``"torch"`` backend of the core registry (``kvgroups_core.registry``)."""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from kvgroups_core.descriptors import TensorDesc
from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, UnsupportedConfig
from kvgroups_core.registry import Backend

from . import cuda_path, torch_path
from .describe import describe_tensor
from .objects import allocate_objects

#: How pinned host objects are reached by default; chosen by measurement (see
#: ``benchmarks/results/torch_*``): "direct" (kernel through UVA) or "staged".
DEFAULT_PINNED_MODE = "direct"


def tensor_of(x: Any, what: str) -> torch.Tensor:
    """The torch tensor behind a TensorDesc (or the tensor itself)."""
    t = x.obj if isinstance(x, TensorDesc) else x
    if not isinstance(t, torch.Tensor):
        raise KVGroupsTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def cache_device(caches: Sequence[Any]) -> torch.device:
    """The one device of the backing tensors."""
    if not caches:
        raise KVGroupsValueError("caches: expected at least one backing tensor, got none")
    first = tensor_of(caches[0], "caches[0]").device
    return first


class TorchBackend(Backend):
    """PyTorch: CUDA kernels (NVRTC) for GPU caches, indexing ops for CPU caches.

    Parameters
    ----------
    pinned : {"direct", "staged"}
        How the kernels reach objects in pinned host memory (see :func:`cuda_path.run_plan`).
    """

    name: ClassVar[str] = "torch"
    array_types: ClassVar[tuple[str, ...]] = ("torch.Tensor",)

    def __init__(self, pinned: str = DEFAULT_PINNED_MODE) -> None:
        if pinned not in ("direct", "staged"):
            raise KVGroupsValueError(f"pinned: expected 'direct' or 'staged', got {pinned!r}")
        self.pinned = pinned

    def describe(self, x: Any) -> TensorDesc:
        return describe_tensor(x)

    def execute(self, plan: Any, caches: Sequence[TensorDesc], objects: Sequence[Any]
                ) -> tuple[list | None, list]:
        """Move the bytes of ``plan``; caches (load) or objects (store) are written in place."""
        device = cache_device(caches)
        if device.type == "cuda":
            cuda_path.run_plan(plan, caches, objects, device.index, pinned=self.pinned)
        elif device.type == "cpu":
            tensors = [tensor_of(c, f"caches[{i}]") for i, c in enumerate(caches)]
            torch_path.run_plan(plan, tensors, objects)
        else:
            raise UnsupportedConfig(f"caches: expected CPU or CUDA tensors, got {device}")
        return None, list(objects)

    def validate(self, plan: Any, caches: Sequence[TensorDesc], objects: Sequence[Any]) -> None:
        """Devices and memory kinds, before any byte moves: GPU caches take objects on the
        same GPU or in pinned host memory; CPU caches take CPU objects."""
        device = cache_device(caches)
        for i, c in enumerate(caches):
            if tensor_of(c, f"caches[{i}]").device != device:
                raise KVGroupsValueError(
                    f"caches[{i}]: expected a tensor on {device}, got {tensor_of(c, '').device}"
                )
        for g, entry in enumerate(objects):
            for c, t in enumerate(entry if isinstance(entry, (list, tuple)) else [entry]):
                what = f"objects[{g}][{c}]" if isinstance(entry, (list, tuple)) else f"objects[{g}]"
                t = tensor_of(t, what)
                if device.type == "cuda":
                    cuda_path.check_object_tensor(t, device.index, what)
                elif t.device.type != "cpu":
                    raise KVGroupsValueError(
                        f"{what}: expected a CPU tensor for CPU caches, got {t.device}"
                    )

    def allocate_objects(self, plan: Any, like: TensorDesc, placement: str | None = None) -> list:
        device = tensor_of(like, "like").device
        return allocate_objects(plan.object_nbytes, plan.num_chunks, device, placement)

    def to_host_ids(self, ids: Any) -> Any:
        if isinstance(ids, torch.Tensor):
            return ids.detach().cpu().numpy()  # synchronises for device ids
        return ids
