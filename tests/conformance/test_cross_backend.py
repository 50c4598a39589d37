import numpy as np
import pytest

from kvgroups_core import get_backend
from kvgroups_core import describe
from kvgroups_core.manager import KVLayerGroupsManager
from kvgroups_core.objects import object_nbytes

from .cases import TRANSFER_FORMATS, all_blocks, make_caches
from .harnesses import make_harness, pair_params

GEOMETRY = dict(nl=2, nb=16, bs=4, nh=2, hs=16)
CHUNK = 8


def _summary(manager):
    return (
        [(g.layer_indices, g.shape_desc, g.dtype, g.engine_kv_format, g.tokens_per_block,
          g.engine_group_idx, g.sw_size_tokens) for g in manager.kernel_groups],
        [(o.kernel_group_indices, o.sw_size_chunks) for o in manager.object_groups],
        [object_nbytes(manager, o) for o in range(manager.num_object_groups)],
    )


@pytest.mark.parametrize("pair", pair_params())
@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_store_with_one_backend_load_with_the_other(pair, fmt):
    a, b = make_harness(pair[0]), make_harness(pair[1])
    rng = np.random.default_rng(hash(fmt.name) % 2**32)
    src_np, formats = make_caches(fmt, dtype="bfloat16", rng=rng, **GEOMETRY)
    dst_np, _ = make_caches(fmt, dtype="bfloat16", rng=rng, zero=True, **GEOMETRY)
    src_a, src_b = a.convert(src_np), b.convert(src_np)
    manager_a = KVLayerGroupsManager(src_a, formats, lmcache_tokens_per_chunk=CHUNK)
    manager_b = KVLayerGroupsManager(src_b, formats, lmcache_tokens_per_chunk=CHUNK)
    assert _summary(manager_a) == _summary(manager_b)

    ids_a = rng.permutation(GEOMETRY["nb"])[:6]
    ids_b = rng.permutation(GEOMETRY["nb"])[:6]
    objects_a = a.store(manager_a, src_a, ids_a)
    objects_b = b.store(manager_b, src_b, ids_a)
    for oa, ob in zip(objects_a, objects_b):  # byte-identical whichever backend wrote them
        np.testing.assert_array_equal(a.to_numpy(oa, np.zeros(0, np.uint8)),
                                      b.to_numpy(ob, np.zeros(0, np.uint8)))

    handed = [get_backend(b.backend).import_foreign(o) for o in objects_a]
    dst = b.load(manager_b, handed, b.convert(dst_np), ids_b)
    after = all_blocks(b.read(dst, dst_np), formats)
    before = all_blocks(src_np, formats)
    moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
    for (layer, kv, blk), rows in after.items():
        want = before[(layer, kv, moved[blk])] if blk in moved else np.zeros_like(rows)
        np.testing.assert_array_equal(rows, want, err_msg=f"layer {layer} kv {kv} block {blk}")


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_grouping_is_the_same_from_torch_jax_and_bare_specs(fmt):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    pytest.importorskip("kvgroups_torch")
    pytest.importorskip("kvgroups_jax")
    del torch, jax
    from .harnesses import JaxHarness, TorchHarness

    rng = np.random.default_rng(1)
    src_np, formats = make_caches(fmt, dtype="bfloat16", rng=rng, **GEOMETRY)
    t = TorchHarness("cpu").convert(src_np)
    j = JaxHarness("cpu").convert(src_np)

    def specs(structure):
        if isinstance(structure, list):
            return [specs(x) for x in structure]
        if isinstance(structure, tuple):
            return tuple(specs(x) for x in structure)
        return describe(structure).spec

    summaries = [_summary(KVLayerGroupsManager(c, formats, lmcache_tokens_per_chunk=CHUNK))
                 for c in (t, j, specs(t))]
    assert summaries[0] == summaries[1] == summaries[2]
