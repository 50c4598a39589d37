"""Bad input to the tensor-parallel calls (issue 35, cause 6): typed errors naming the
argument, before any conversion runs. ``merge_shards`` / ``split_canonical`` passed the
frameworks' own errors through (deleted JAX arrays, tensors on two devices) and took
``shards=True`` for 1; ``total_num_kv_heads`` was checked after the caches (or never, for a
manager without layers), where docs/TENSOR_PARALLEL.md says before."""

from __future__ import annotations

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_core.formats.catalogue import EngineKVFormat as F

SHAPE = (2, 8, 16, 2, 32)


def _specs(n: int = 2) -> list:
    return [kc.TensorSpec(SHAPE, "float16") for _ in range(n)]


def _rank_managers(size: int = 2) -> list:
    return [
        kc.KVLayerGroupsManager(_specs(), F.NL_X_TWO_NB_BS_NH_HS, tp_rank=r, tp_size=size)
        for r in range(size)
    ]


@pytest.mark.parametrize("shards", [True, False, 2.0, "2", None])
def test_split_shards_must_be_an_int(shards):
    m = kc.KVLayerGroupsManager(_specs(), F.NL_X_TWO_NB_BS_NH_HS)
    objects = [np.zeros((1, kc.object_nbytes(m, 0)), np.uint8)]
    with pytest.raises(kc.KVGroupsTypeError, match="shards"):
        kc.split_canonical(m, objects, shards=shards)


def test_deleted_jax_arrays_are_refused_by_name():
    jnp = pytest.importorskip("jax.numpy")
    managers = _rank_managers()
    n = kc.object_nbytes(managers[0], 0)
    live, gone = jnp.zeros((1, n), jnp.uint8), jnp.zeros((1, n), jnp.uint8)
    gone.delete()
    with pytest.raises(kc.KVGroupsValueError, match=r"objects_per_rank\[1\]\[0\]: .*deleted"):
        kc.merge_shards(managers, [[live], [gone]])
    whole = jnp.zeros((1, 2 * n), jnp.uint8)
    whole.delete()
    with pytest.raises(kc.KVGroupsValueError, match=r"objects\[0\]: .*deleted"):
        kc.split_canonical(managers[0], [whole])


def test_torch_tensors_without_memory_or_on_two_devices_are_refused_by_name():
    torch = pytest.importorskip("torch")
    managers = _rank_managers()
    n = kc.object_nbytes(managers[0], 0)
    cpu = torch.zeros((1, n), dtype=torch.uint8)
    meta = torch.empty((1, n), dtype=torch.uint8, device="meta")
    with pytest.raises(kc.KVGroupsValueError, match=r"objects_per_rank\[1\]\[0\]: .*meta"):
        kc.merge_shards(managers, [[cpu], [meta]])
    if torch.cuda.is_available():
        with pytest.raises(kc.KVGroupsValueError, match="one device"):
            kc.merge_shards(managers, [[cpu], [cpu.cuda()]])


@pytest.mark.parametrize(
    "heads, match",
    [
        (0, "total_num_kv_heads: expected >= 1"),
        (-3, "total_num_kv_heads"),
        ("x", "total_num_kv_heads: expected an int"),
        (2.0, "total_num_kv_heads"),
        ([4, 0], r"total_num_kv_heads\[1\]"),
        ([True], r"total_num_kv_heads\[0\]"),
    ],
)
@pytest.mark.parametrize("caches", ["none", "bad", "no-layers"])
def test_total_num_kv_heads_is_checked_before_the_caches(heads, match, caches):
    structure = {"none": [None, None], "bad": [np.zeros(3), "x"], "no-layers": []}[caches]
    formats = [] if caches == "no-layers" else F.NL_X_TWO_NB_BS_NH_HS
    with pytest.raises(kc.KVGroupsError, match=match) as info:
        kc.KVLayerGroupsManager(structure, formats, tp_size=2, total_num_kv_heads=heads)
    assert isinstance(info.value, (TypeError, ValueError))


def test_helpers_refuse_what_is_not_a_manager_by_name():
    managers = _rank_managers()
    m = kc.KVLayerGroupsManager(_specs(), F.NL_X_TWO_NB_BS_NH_HS)
    per_rank = [[np.zeros((1, kc.object_nbytes(r, 0)), np.uint8)] for r in managers]
    canonical = [np.zeros((1, kc.object_nbytes(m, 0)), np.uint8)]
    for call, name in [
        (lambda: kc.merge_shards([1, 2], per_rank), "managers[0]"),
        (lambda: kc.merge_shards([managers[0], None], per_rank), "managers[1]"),
        (lambda: kc.merge_shards([None], [canonical]), "managers[0]"),
        (lambda: kc.split_canonical(None, canonical), "manager"),
        (lambda: kc.canonical_nbytes("m", 0), "manager"),
        (lambda: kc.rank_byte_ranges(None, 0), "manager"),
    ]:
        with pytest.raises(kc.KVGroupsTypeError) as info:
            call()
        assert str(info.value).startswith(f"{name}: expected a KVLayerGroupsManager")


@pytest.mark.parametrize("flag", ["yes", 1, np.True_, None])
def test_check_replicas_must_be_a_bool(flag):
    managers = _rank_managers()
    per_rank = [[np.zeros((1, kc.object_nbytes(r, 0)), np.uint8)] for r in managers]
    with pytest.raises(kc.KVGroupsTypeError, match="^check_replicas: expected a bool"):
        kc.merge_shards(managers, per_rank, check_replicas=flag)
