import numpy as np
import pytest

from kvgroups_conformance.caches import all_blocks, make_caches
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.api import load, store

from .harnesses import JaxHarness, TorchHarness, _cuda_available, _jax_gpu_available

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
kvgroups_jax = pytest.importorskip("kvgroups_jax")
pytest.importorskip("kvgroups_torch")

GEOMETRY = dict(nl=2, nb=16, bs=4, nh=2, hs=16)
CHUNK = 8
PLATFORMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "gpu",
        id="gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not (_cuda_available() and _jax_gpu_available()),
                reason="needs a CUDA GPU visible to torch and JAX",
            ),
        ],
    ),
]


def _setup(rng):
    src_np, formats = make_caches(F.NL_X_TWO_NB_BS_NH_HS, dtype="bfloat16", rng=rng, **GEOMETRY)
    dst_np, _ = make_caches(
        F.NL_X_TWO_NB_BS_NH_HS, dtype="bfloat16", rng=rng, zero=True, **GEOMETRY
    )
    ids_a = rng.permutation(GEOMETRY["nb"])[:6]
    ids_b = rng.permutation(GEOMETRY["nb"])[:6]
    return src_np, dst_np, formats, ids_a, ids_b


def _check_moved(after, src_np, formats, ids_a, ids_b):
    before = all_blocks(src_np, formats)
    moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
    for (layer, kv, blk), rows in all_blocks(after, formats).items():
        want = before[(layer, kv, moved[blk])] if blk in moved else np.zeros_like(rows)
        np.testing.assert_array_equal(rows, want, err_msg=f"layer {layer} kv {kv} block {blk}")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_torch_owned_cache_moved_by_the_jax_backend(platform):
    th = TorchHarness("cuda" if platform == "gpu" else "cpu")
    src_np, dst_np, formats, ids_a, ids_b = _setup(np.random.default_rng(0))
    src, dst = th.convert(src_np), th.convert(dst_np)
    manager = KVLayerGroupsManager(src, formats, lmcache_tokens_per_chunk=CHUNK)
    # DLPack import shares torch's memory: same address, no copy of the cache.
    for t in src:
        assert kvgroups_jax.import_dlpack(t).unsafe_buffer_pointer() == t.data_ptr()
    pointers = [t.data_ptr() for t in dst]

    objects = store(manager, src, ids_a, backend="jax")
    assert all(isinstance(o, jax.Array) for o in objects)
    out = load(manager, objects, dst, ids_b, backend="jax")
    if platform == "gpu":
        # The donated, aliased scatter wrote into torch's own buffers.
        assert [a.unsafe_buffer_pointer() for a in out] == pointers
        torch.cuda.synchronize()
    assert [t.data_ptr() for t in dst] == pointers
    # Whatever the platform, torch sees the loaded bytes: nothing was silently lost.
    _check_moved(th.read(dst, dst_np), src_np, formats, ids_a, ids_b)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_jax_owned_cache_moved_by_the_torch_backend(platform):
    jh = JaxHarness(platform)
    src_np, dst_np, formats, ids_a, ids_b = _setup(np.random.default_rng(1))
    src, dst = jh.convert(src_np), jh.convert(dst_np)
    manager = KVLayerGroupsManager(src, formats, lmcache_tokens_per_chunk=CHUNK)
    pointers = [a.unsafe_buffer_pointer() for a in dst]
    for a in src:  # torch adopts JAX's buffers through DLPack without copying them
        assert torch.from_dlpack(a).data_ptr() == a.unsafe_buffer_pointer()

    objects = store(manager, src, ids_a, backend="torch")
    assert all(isinstance(o, torch.Tensor) for o in objects)
    out = load(manager, objects, dst, ids_b, backend="torch")
    assert out is dst  # written in place: the same arrays, the same buffers
    assert [a.unsafe_buffer_pointer() for a in dst] == pointers
    if platform == "gpu":
        torch.cuda.synchronize()
    _check_moved(jh.read(dst, dst_np), src_np, formats, ids_a, ids_b)
