"""sglang-jax's recurrent states sharded over a mesh as its pool shards them (conv channels and
temporal heads on the model axis): per-shard transfers whose merged objects are the unsharded
store's bytes (docs/SEMANTICS.md section 9, docs/TENSOR_PARALLEL.md)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvgroups_core import EngineGroupInfo, KVLayerGroupsManager, load, merge_shards, store
from kvgroups_core import EngineKVFormat as F

SLOTS, CH, W, H, D, CHUNK = 6, 48, 3, 4, 8, 16

pytestmark = pytest.mark.skipif(
    len(jax.devices("cpu")) < 4 and jax.default_backend() == "cpu",
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count",
)


def _host(seed):
    rng = np.random.default_rng(seed)
    conv = [
        rng.integers(0, 2**16, (SLOTS, CH, W), dtype=np.uint16).view(ml_dtypes.bfloat16)
        for _ in range(2)
    ]
    temporal = [rng.standard_normal((SLOTS, H, D, D)).astype(np.float32) for _ in range(2)]
    return [conv[0], temporal[0], conv[1], temporal[1]]


def _manager(caches):
    formats = [F.NL_X_NB_CD_CW, F.NL_X_NB_SH_SS] * 2
    infos = [
        EngineGroupInfo(0, (0, 2), CHUNK, recurrent_state=True),
        EngineGroupInfo(0, (1, 3), CHUNK, recurrent_state=True),
    ]
    return KVLayerGroupsManager(caches, formats, infos, lmcache_tokens_per_chunk=CHUNK)


@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_state_slots_store_per_shard_and_merge_to_the_whole(shards):
    mesh = jax.make_mesh((shards,), ("model",), devices=jax.devices()[:shards])
    host = _host(0)

    def put(x):
        spec = P(None, "model", *([None] * (x.ndim - 2)))
        return jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))

    caches = [put(x) for x in host]
    manager = _manager(caches)
    objects = store(manager, caches, [4, 1])  # snapshots of chunks 0 and 1 in slots 4, 1
    want = store(_manager(host), host, [4, 1], backend="numpy")
    for got, ref in zip(merge_shards([manager], [objects]), want):
        assert np.array_equal(np.asarray(got), ref)
    dst_host = _host(1)
    out = load(manager, objects, [put(x) for x in dst_host], [0, 5])
    for x, src, before in zip(out, host, dst_host):
        x = np.asarray(x)
        assert x[5].tobytes() == src[1].tobytes()  # the last chunk's snapshot, into slot 5
        assert x[:5].tobytes() == before[:5].tobytes()
