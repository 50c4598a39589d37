"""Recurrent state at real sizes through the JAX lowerings (GPU ones under the ``gpu``
marker): Qwen3-Next-80B's whole-model GDN states, a (3, 8192) bf16 conv state (48 KiB) and a
(32, 128, 128) fp32 delta memory (2 MiB) per slot, beside attention; every byte of objects
and caches against the NumPy reference (untouched slots included)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvgroups_core import load, store
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS


def _arrays(model, seed):
    rng = np.random.default_rng(seed)
    out = []
    for spec in model.kv_caches:
        bits = rng.integers(
            0, 256, size=int(np.prod(spec.shape)) * spec.dtype.itemsize, dtype=np.uint8
        )
        dt = jnp.bfloat16 if spec.dtype.name == "bfloat16" else np.dtype(spec.dtype.name)
        out.append(bits.view(np.dtype(dt)).reshape(spec.shape))
    return out


def _round_trip(lowering, platform):
    from kvgroups_jax import JaxBackend

    from kvgroups_core import register_backend
    from kvgroups_core.tensors.arrays import registered_backends

    name = f"jax-state-{lowering}"
    if name not in registered_backends():
        register_backend(name, lambda: JaxBackend(lowering=lowering))
    model = MODELS["qwen3-next-like"].build(num_blocks=64, layers=4)
    src_np, dst_np = _arrays(model, 1), _arrays(model, 2)
    manager = KVLayerGroupsManager(src_np, model.formats, model.engine_group_infos)
    rng = np.random.default_rng(3)
    ids = {0: rng.permutation(64)[:32], 1: np.array([3, 1])}  # two chunks
    load_ids = {0: rng.permutation(64)[:32], 1: np.array([0, 4])}
    want = store(manager, src_np, ids, backend="numpy")
    device = jax.devices(platform)[0]
    put = lambda x: jax.device_put(jnp.asarray(x), device)  # noqa: E731
    got = store(manager, [put(x) for x in src_np], ids, backend=name)
    for g, w in zip(got, want):
        assert np.array_equal(np.asarray(g), w)
    dst_ref = [x.copy() for x in dst_np]
    load(manager, want, dst_ref, load_ids, backend="numpy")
    dst = load(manager, [put(o) for o in want], [put(x) for x in dst_np], load_ids, backend=name)
    for a, b in zip(dst, dst_ref):
        assert np.asarray(a).tobytes() == b.tobytes()


def test_gdn_states_at_real_size_store_and_load_with_xla_on_the_cpu():
    _round_trip("xla", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("lowering", ["auto", "triton", "mosaic", "cuda", "xla"])
def test_gdn_states_at_real_size_store_and_load_on_the_gpu(lowering):
    _round_trip(lowering, "gpu")
