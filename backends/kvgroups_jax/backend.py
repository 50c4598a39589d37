"""The ``"jax"`` backend of the core registry."""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvgroups_core.descriptors import TensorDesc
from kvgroups_core.errors import KVGroupsValueError
from kvgroups_core.registry import Backend

from .describe import describe_array, memory_kind_of
from .executor import LOWERINGS, execute_plan
from .foreign import check_in_place

_PINNED = ("pinned", "pinned_host", "cuda_host")


class JaxBackend(Backend):
    """Moves pages of JAX arrays with Pallas kernels (plain XLA where no kernel applies).

    Parameters
    ----------
    lowering : "auto" (Mosaic GPU on Hopper+ where the layout allows, else Triton, else XLA;
        XLA on CPU), or one of "triton", "mosaic", "xla", "interpret" to force a path
        (register such an instance under its own name: there is no global switch).
    num_warps : warps per Triton program.
    """

    name: ClassVar[str] = "jax"
    array_types: ClassVar[tuple[str, ...]] = ("jax.Array",)

    def __init__(self, lowering: str = "auto", num_warps: int = 4):
        if lowering not in LOWERINGS:
            raise KVGroupsValueError(f"lowering: expected one of {LOWERINGS}, got {lowering!r}")
        self.lowering = lowering
        self.num_warps = num_warps

    def describe(self, x: Any) -> TensorDesc:
        return describe_array(x)

    def execute(self, plan, caches: Sequence[TensorDesc], objects: Sequence[Any]):
        arrays = [c.obj if isinstance(c, TensorDesc) else c for c in caches]
        objs = [o.obj if isinstance(o, TensorDesc) else o for o in objects]
        # Objects in pinned host memory are staged through device memory: kernels address
        # device memory only.
        kinds = [memory_kind_of(o) for o in objs]
        staged = [_to_device(o) if k == "pinned_host" else o for o, k in zip(objs, kinds)]
        before = [_pointer(x) for x in arrays] if plan.direction == "load" else []
        new_caches, new_objs = execute_plan(plan, arrays, staged, lowering=self.lowering,
                                            num_warps=self.num_warps)
        new_objs = [
            jax.device_put(n, o.sharding) if k == "pinned_host" and plan.direction == "store"
            else (o if k == "pinned_host" else n)
            for n, o, k in zip(new_objs, objs, kinds)
        ]
        if plan.direction == "store":
            return None, list(new_objs)
        check_in_place(plan, before, arrays, list(new_caches))
        return list(new_caches), list(new_objs)

    def allocate_objects(self, plan, like: TensorDesc, placement: str | None = None) -> list:
        x = like.obj if isinstance(like, TensorDesc) else like
        device = next(iter(x.devices())) if isinstance(x, jax.Array) and not isinstance(
            x, jax.core.Tracer) else jax.devices()[0]
        kind = "pinned_host" if placement in _PINNED else None
        if placement is not None and placement not in _PINNED + ("device",):
            raise KVGroupsValueError(
                f"placement: expected None, 'device' or 'pinned_host', got {placement!r}"
            )
        sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
        return [
            jax.jit(lambda n=n: jnp.zeros((plan.num_chunks, n), jnp.uint8),
                    out_shardings=sharding)()
            for n in plan.object_nbytes
        ]

    def to_host_ids(self, ids: Any) -> Any:
        return np.asarray(ids)


def _pointer(x: Any) -> int:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.size \
            and len(x.devices()) == 1 and not x.is_deleted():
        return int(x.unsafe_buffer_pointer())
    return 0


def _to_device(x: jax.Array) -> jax.Array:
    device = next(iter(x.devices()))
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind="device"))
