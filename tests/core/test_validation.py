"""The memory checks of ``kvgroups_core.transfer.checks`` and the framework-specific refusals (issue
12, point 4): torch meta and autograd tensors, JAX arrays deleted, donated or on another
device (several CPU devices in a subprocess), objects sharing memory across object groups,
``format_kvcache_shape_spec`` given anything but groups."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.engine_groups import EngineGroupInfo
from kvgroups_core.transfer.checks import Memory, host_range_writable

ROOT = Path(__file__).resolve().parents[2]
CHUNK, BS, NB = 8, 4, 16
SHAPE = (2, NB, BS, 2, 8)


def _caches(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**16, SHAPE, dtype=np.uint16).view(np.float16) for _ in range(2)]


def _typed(exc: BaseException, builtin: type) -> bool:
    return isinstance(exc, kc.KVGroupsError) and isinstance(exc, builtin)


def test_host_range_writable_reads_the_mapping_not_the_flag(tmp_path):
    path = tmp_path / "page"
    path.write_bytes(bytes(8192))
    with open(path, "rb") as f:
        ro = mmap.mmap(f.fileno(), 8192, prot=mmap.PROT_READ)
    arr = np.frombuffer(ro, np.uint8)
    address = arr.__array_interface__["data"][0]
    assert not host_range_writable(Memory(address, 8192, True))
    heap = np.zeros(8192, np.uint8)
    assert host_range_writable(Memory(heap.__array_interface__["data"][0], 8192, True))


def test_objects_of_two_object_groups_sharing_bytes_are_refused():
    caches = _caches()
    infos = (
        EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1,), sw_size_tokens=4),
    )
    manager = kc.KVLayerGroupsManager(
        caches, F.NL_X_TWO_NB_BS_NH_HS, infos, lmcache_tokens_per_chunk=CHUNK
    )
    n0, n1 = kc.object_nbytes(manager, 0), kc.object_nbytes(manager, 1)
    backing = np.zeros(n0 + n1, np.uint8)
    shared = [backing[:n0].reshape(1, n0), backing[n0 - 8 : n0 - 8 + n1].reshape(1, n1)]
    before = [c.copy() for c in caches]
    ids = {0: np.arange(2), 1: np.arange(2, 4)}
    with pytest.raises(kc.KVGroupsValueError, match=r"objects\[1\]: expected memory of its own"):
        kc.store(manager, caches, ids, shared)
    with pytest.raises(kc.KVGroupsValueError, match="memory of its own"):
        kc.load(manager, shared, caches, ids)
    assert not backing.any()
    for c, b in zip(caches, before):
        np.testing.assert_array_equal(c.view(np.uint16), b.view(np.uint16))
    apart = [backing[:n0].reshape(1, n0), np.zeros((1, n1), np.uint8)]
    kc.store(manager, caches, ids, apart)  # the same call with memory apart works


def test_objects_of_another_framework_or_dtype_are_refused_naming_them():
    torch = pytest.importorskip("torch")
    pytest.importorskip("kvgroups_torch")
    caches = _caches()
    manager = kc.KVLayerGroupsManager(
        caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK
    )
    nbytes = kc.object_nbytes(manager, 0)
    good = np.full((2, nbytes), 7, np.uint8)
    as_torch = torch.from_numpy(good.copy())
    boxed = np.empty(1, dtype=object)  # a NumPy array holding the object, not the object
    boxed[0] = good.copy()
    before = [c.copy() for c in caches]
    ids = np.arange(4)
    other = r"^objects\[0\]: expected a numpy array .*kv_caches is numpy.*got torch \(Tensor\)"
    for call, match in (
        (lambda: kc.load(manager, [as_torch], caches, ids), other),
        (lambda: kc.store(manager, caches, ids, [as_torch]), other),
        (
            lambda: kc.load(manager, boxed, caches, ids),
            rf"^objects\[0\]: expected uint8 \[2, {nbytes}\], got object \[1\]",
        ),
        (
            lambda: kc.store(manager, caches, ids, boxed),
            r"^objects\[0\]: expected uint8 .*got object",
        ),
    ):
        with pytest.raises(kc.KVGroupsError, match=match) as info:
            call()
        assert isinstance(info.value, (TypeError, ValueError))
    kc.store(manager, caches, ids)  # a binding kept for the next one-shot call: named there too
    with pytest.raises(kc.KVGroupsTypeError, match=other):
        kc.load(manager, [as_torch], caches, ids)
    # Per-chunk buffers: the one of the other framework is named.
    chunks = [[good[0].copy(), torch.from_numpy(good[1].copy())]]
    with pytest.raises(kc.KVGroupsTypeError, match=r"^objects\[0\]\[1\]: expected a numpy"):
        kc.store(manager, caches, ids, chunks)
    assert (as_torch.numpy() == 7).all() and (boxed[0] == 7).all() and (chunks[0][0] == 7).all()
    for c, b in zip(caches, before):
        np.testing.assert_array_equal(c.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("bad", ["(2,4,4,2,8):float16:1", None, {}, [1], [None], 3])
def test_format_shape_spec_takes_only_a_list_of_groups(bad):
    with pytest.raises(kc.KVGroupsTypeError, match="groups"):
        kc.format_kvcache_shape_spec(bad)
    with pytest.raises(kc.KVGroupsValueError, match="empty"):
        kc.format_kvcache_shape_spec([])
    groups = kc.parse_kvcache_shape_spec("(2,4,4,2,8):float16:2")
    assert kc.format_kvcache_shape_spec(tuple(groups)) == "(2,4,4,2,8):float16:2"


# --- torch ---------------------------------------------------------------------------------


def _torch_setup():
    torch = pytest.importorskip("torch")
    pytest.importorskip("kvgroups_torch")
    caches = [torch.from_numpy(c.view(np.int16).copy()).view(torch.float16) for c in _caches()]
    manager = kc.KVLayerGroupsManager(
        caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK
    )
    objects = [torch.randint(0, 256, (1, kc.object_nbytes(manager, 0)), dtype=torch.uint8)]
    return torch, manager, caches, objects


def _torch_bytes(ts) -> list[np.ndarray]:
    import torch

    return [t.detach().contiguous().view(-1).view(torch.uint8).numpy().copy() for t in ts]


def test_torch_meta_tensors_plan_but_never_transfer():
    torch, manager, caches, objects = _torch_setup()
    meta = [c.to("meta") for c in caches]
    planned = kc.KVLayerGroupsManager(meta, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK)
    assert kc.object_nbytes(planned, 0) == kc.object_nbytes(manager, 0)
    before = _torch_bytes(objects)
    for call in (
        lambda: kc.store(manager, meta, np.arange(2), objects),
        lambda: kc.load(manager, objects, meta, np.arange(2)),
    ):
        with pytest.raises(kc.KVGroupsValueError, match="meta tensor") as info:
            call()
        assert _typed(info.value, ValueError)
    meta_obj = [objects[0].to("meta")]
    cache_bytes = _torch_bytes(caches)
    for call in (
        lambda: kc.store(manager, caches, np.arange(2), meta_obj),
        lambda: kc.load(manager, meta_obj, caches, np.arange(2)),
    ):
        with pytest.raises(kc.KVGroupsValueError, match=r"objects\[0\]: .*meta tensor"):
            call()
    assert all(np.array_equal(a, b) for a, b in zip(_torch_bytes(objects), before))
    assert all(np.array_equal(a, b) for a, b in zip(_torch_bytes(caches), cache_bytes))


def test_torch_autograd_tensors_are_refused():
    torch, manager, caches, objects = _torch_setup()
    grad_caches = [c.float().half().requires_grad_(True) for c in caches]
    grad_objects = [objects[0].float().requires_grad_(True)]  # any float tensor can need grad
    cache_bytes, object_bytes = _torch_bytes(grad_caches), _torch_bytes(objects)
    for call in (
        lambda: kc.load(manager, objects, grad_caches, np.arange(2)),
        lambda: kc.store(manager, grad_caches, np.arange(2), objects),
        lambda: kc.store(manager, caches, np.arange(2), grad_objects),
        lambda: kc.load(manager, grad_objects, caches, np.arange(2)),
    ):
        with pytest.raises(kc.KVGroupsValueError, match="requires grad") as info:
            call()
        assert _typed(info.value, ValueError)
    assert all(np.array_equal(a, b) for a, b in zip(_torch_bytes(grad_caches), cache_bytes))
    assert all(np.array_equal(a, b) for a, b in zip(_torch_bytes(objects), object_bytes))


# --- JAX: several CPU devices, deleted and donated arrays ----------------------------------


def test_jax_arrays_on_another_device_or_deleted_are_refused():
    pytest.importorskip("jax")
    pytest.importorskip("kvgroups_jax")
    code = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp, kvgroups_core as kc
        from kvgroups_core.tensors import arrays as registry
        from kvgroups_core.formats.catalogue import EngineKVFormat as F
        from kvgroups_jax import JaxBackend
        registry.register_backend("jax-interpret", lambda: JaxBackend(lowering="interpret"))
        devs = jax.devices("cpu")
        assert len(devs) == 8, devs
        rng = np.random.default_rng(0)
        host = [rng.integers(0, 2**16, (2, 16, 4, 2, 8), dtype=np.uint16) for _ in range(2)]
        def check(call, text, backend):
            try:
                call()
            except kc.KVGroupsValueError as exc:
                assert isinstance(exc, ValueError) and text in str(exc), exc
                return
            raise SystemExit(f"{backend}: not refused: {text}")
        for backend in ("jax", "jax-interpret"):
            caches = [jax.device_put(jnp.asarray(h).view(jnp.float16), devs[0]) for h in host]
            m = kc.KVLayerGroupsManager(caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=8)
            n = kc.object_nbytes(m, 0)
            other = [jax.device_put(jnp.full((1, n), 7, jnp.uint8), devs[3])]
            check(lambda: kc.store(m, caches, np.arange(2), other, backend=backend),
                  "expected an array on", backend)
            check(lambda: kc.load(m, other, caches, np.arange(2), backend=backend),
                  "expected an array on", backend)
            split = [caches[0], jax.device_put(caches[1], devs[5])]
            check(lambda: kc.store(m, split, np.arange(2), backend=backend),
                  "expected arrays on one device", backend)
            gone = [jnp.zeros((1, n), jnp.uint8)]
            gone[0].delete()
            check(lambda: kc.load(m, gone, caches, np.arange(2), backend=backend),
                  "deleted or donated", backend)
            # Nothing was consumed or changed by the refused calls.
            for c, h in zip(caches, host):
                assert not c.is_deleted()
                assert np.array_equal(np.asarray(c).view(np.uint16), h)
            assert np.asarray(other[0]).tolist() == [[7] * n]
            objects = kc.store(m, caches, np.arange(2), backend=backend)
            new = kc.load(m, objects, caches, np.arange(2, 4), backend=backend)
            check(lambda: kc.store(m, caches, np.arange(2), backend=backend),
                  "deleted or donated", backend)  # the caches a load consumed
            assert np.array_equal(np.asarray(new[0]).view(np.uint16)[:, 2:4], host[0][:, 0:2])
        print("refused")
    """)
    # Eight CPU devices: the flag tests/conftest.py sets, handed to the clean environment.
    env = {
        "PYTHONPATH": f"{ROOT}:{ROOT / 'backends'}",
        "PATH": "/usr/bin:/bin",
        "XLA_FLAGS": os.environ["XLA_FLAGS"],
    }
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert "refused" in result.stdout


@pytest.mark.parametrize("manager", [None, "manager", object()])
@pytest.mark.parametrize("call", ["store", "load", "prepare"])
def test_a_public_call_without_a_manager_is_refused_naming_it(call, manager):
    caches = [np.arange(2 * 4 * 4 * 4, dtype=np.float32).reshape(2, 4, 4, 1, 4)]
    before = caches[0].copy()
    objects = [np.zeros((1, 128), np.uint8)]
    run = {
        "store": lambda: kc.store(manager, caches, [0, 1], objects),
        "load": lambda: kc.load(manager, objects, caches, [0, 1]),
        "prepare": lambda: kc.prepare(manager, caches),
    }[call]
    with pytest.raises(kc.KVGroupsTypeError, match="manager: expected a KVLayerGroupsManager"):
        run()
    np.testing.assert_array_equal(caches[0], before)
    assert not objects[0].any()


@pytest.mark.parametrize("kv_caches", [None, [], 5])
def test_caches_without_a_framework_are_refused_naming_kv_caches(kv_caches):
    caches = [np.zeros((2, 8, 2, 1, 4), np.float32)]
    manager = kc.KVLayerGroupsManager(caches, [F.NL_X_TWO_NB_BS_NH_HS], lmcache_tokens_per_chunk=4)
    for call in (
        lambda: kc.prepare(manager, kv_caches),
        lambda: kc.store(manager, kv_caches, [0, 1]),
    ):
        with pytest.raises(kc.BackendNotFoundError, match="^kv_caches: expected arrays of a"):
            call()
