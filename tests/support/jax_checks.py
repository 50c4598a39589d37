"""Run one hand-built plan through the JAX executor and the NumPy oracle, compare bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from kvgroups_jax.executor import execute_plan
from kvgroups_jax.lowerings.tuning import DEFAULT_TUNING

from kvgroups_core.transfer.reference import execute_group
from tests.support.jax_layouts import make_plan


def reference_transfer(direction, group, caches, objects, object_nbytes) -> None:
    """The NumPy oracle (kvgroups_core.transfer.reference) on flat uint8 buffers: ``caches`` one per
    tensor, ``objects`` ``[num_chunks * object_nbytes]`` of the group's object group."""
    if group.num_items:
        execute_group(group, direction == "store", caches, objects.reshape(-1, object_nbytes))


def as_bytes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8).reshape(-1)


def run_and_check(
    direction,
    groups,
    arrays,
    object_nbytes,
    *,
    lowering,
    device=None,
    seed=7,
    tuning=DEFAULT_TUNING,
):
    """Execute and compare with the oracle; returns (new caches, new objects, input ptrs)."""
    plan = make_plan(direction, groups, arrays, object_nbytes)
    rng = np.random.default_rng(seed)
    objs = [rng.integers(0, 256, (plan.num_chunks, nb), dtype=np.uint8) for nb in object_nbytes]
    exp_c = [a.copy().view(np.uint8).reshape(-1) for a in arrays]
    exp_o = [o.copy().reshape(-1) for o in objs]
    for g in groups:
        reference_transfer(
            direction, g, exp_c, exp_o[g.object_group_idx], object_nbytes[g.object_group_idx]
        )
    put = (lambda a: jax.device_put(a, device)) if device is not None else jnp.asarray
    caches = [put(a) for a in arrays]
    jobjs = [put(o) for o in objs]
    ptrs = [c.unsafe_buffer_pointer() for c in caches]
    optrs = [o.unsafe_buffer_pointer() for o in jobjs]
    new_c, new_o = execute_plan(plan, caches, jobjs, lowering=lowering, tuning=tuning)
    for k, (c, e) in enumerate(zip(new_c, exp_c)):
        np.testing.assert_array_equal(as_bytes(c), e, err_msg=f"cache tensor {k}")
    for k, (o, e) in enumerate(zip(new_o, exp_o)):
        np.testing.assert_array_equal(as_bytes(o), e, err_msg=f"object group {k}")
    return caches, jobjs, new_c, new_o, ptrs, optrs
