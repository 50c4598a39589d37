"""No stale layouts (issue 12, point 3) and concurrent calls (point 6).

A manager never changes once a transfer used it; a prepared transfer notices caches that were
replaced, resized or reallocated since its last call and binds them again (or raises a typed
error naming the change). Cases that crashed before run in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.engine_groups import EngineGroupInfo

ROOT = Path(__file__).resolve().parents[2]
CHUNK, BS, NB = 16, 4, 32
SHAPE = (2, NB, BS, 2, 8)


def _caches(fill: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(fill)
    return [rng.integers(0, 2**16, SHAPE, dtype=np.uint16).view(np.float16) for _ in range(2)]


def _windowed_manager(caches, **kw) -> kc.KVLayerGroupsManager:
    infos = (
        EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1,), sw_size_tokens=8),
    )
    return kc.KVLayerGroupsManager(
        caches, F.NL_X_TWO_NB_BS_NH_HS, infos, lmcache_tokens_per_chunk=CHUNK, **kw
    )


def _run(code: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'backends'}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )


# --- the manager ----------------------------------------------------------------------------


def test_full_sw_mode_is_chosen_at_construction_or_by_a_new_manager():
    caches = _caches()
    plain = _windowed_manager(caches)
    full = _windowed_manager(caches, full_sw_kv=True)
    copy = plain.with_full_sw_kv()
    assert copy is not plain and plain.full_sw_kv is False and copy.full_sw_kv is True
    for m in (full, copy):
        assert m.get_attn_desc().num_chunks_in_sw == [-1, -1]
        assert m.get_slots_per_chunk_in_sw(1) == CHUNK
    assert plain.get_slots_per_chunk_in_sw(1) == 8
    assert kc.object_nbytes(copy, 1) == kc.object_nbytes(full, 1) == 2 * kc.object_nbytes(plain, 1)
    with pytest.raises(kc.KVGroupsTypeError, match="full_sw_kv"):
        _windowed_manager(caches, full_sw_kv=1)


def test_enable_full_sw_kv_works_before_use_and_refuses_after():
    caches = _caches()
    lmcache_order = _windowed_manager(caches)
    lmcache_order.enable_full_sw_kv()  # LMCache calls it right after construction
    assert lmcache_order.full_sw_kv and kc.object_nbytes(lmcache_order, 1) == 2 * 16 * 32

    manager = _windowed_manager(caches)
    prepared = kc.prepare(manager, caches)
    objects = prepared.store({0: np.arange(4), 1: np.arange(4, 8)})
    with pytest.raises(kc.KVGroupsValueError, match="with_full_sw_kv") as info:
        manager.enable_full_sw_kv()
    assert isinstance(info.value, ValueError)
    assert manager.full_sw_kv is False
    # The prepared transfer still moves objects of the size its manager reports.
    again = prepared.store({0: np.arange(4), 1: np.arange(4, 8)})
    assert [o.shape for o in again] == [o.shape for o in objects]
    assert again[1].shape[1] == kc.object_nbytes(manager, 1)


# --- caches replaced, resized, reallocated ----------------------------------------------------


def _backend_arrays(kind: str):
    """(to_backend, to_numpy) for a CPU runtime."""
    if kind == "numpy":
        return (lambda a: a.copy()), np.asarray
    if kind == "torch":
        torch = pytest.importorskip("torch")
        pytest.importorskip("kvgroups_torch")
        return (
            lambda a: torch.from_numpy(a.view(np.int16).copy()).view(torch.float16),
            lambda t: t.view(torch.int16).numpy().view(np.float16),
        )
    if kind == "torch-cuda":
        torch = pytest.importorskip("torch")
        pytest.importorskip("kvgroups_torch")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU")
        return (
            lambda a: torch.from_numpy(a.view(np.int16).copy()).view(torch.float16).cuda(),
            lambda t: t.cpu().view(torch.int16).numpy().view(np.float16),
        )
    pytest.importorskip("kvgroups_jax")
    backend = kc.get_backend("jax")
    return (lambda a: backend.from_numpy(a)), (lambda x: np.asarray(x))


@pytest.mark.parametrize("kind", ["numpy", "torch", "jax"])
def test_a_replaced_cache_is_the_one_written(kind):
    to_backend, to_numpy = _backend_arrays(kind)
    src_np, dst_np = _caches(1), [np.zeros(SHAPE, np.float16) for _ in range(2)]
    src = [to_backend(a) for a in src_np]
    dst = [to_backend(a) for a in dst_np]
    manager = kc.KVLayerGroupsManager(src, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK)
    objects = kc.store(manager, src, np.arange(4))
    prepared = kc.prepare(manager, dst)
    old = dst[0]
    replacement = to_backend(np.zeros(SHAPE, np.float16))
    dst[0] = replacement
    out = prepared.load(objects, np.arange(4))
    written = to_numpy(out[0])
    np.testing.assert_array_equal(written[:, :4].view(np.uint16), src_np[0][:, :4].view(np.uint16))
    if kind != "jax":  # JAX consumed only the arrays it was given; the old one is untouched
        assert out[0] is replacement
        assert not to_numpy(old).view(np.uint16).any()


def test_numpy_resize_after_prepare_is_a_typed_error_not_a_crash():
    result = _run("""
        import numpy as np, kvgroups_core as kc
        from kvgroups_core.formats.catalogue import EngineKVFormat as F
        caches = [np.zeros((2, 32, 4, 2, 8), np.float16) for _ in range(2)]
        m = kc.KVLayerGroupsManager(caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=16)
        p = kc.prepare(m, caches)
        objects = p.store(np.arange(4))
        caches[1].resize((2, 4, 4, 2, 8), refcheck=False)  # reallocates: old pointer freed
        try:
            p.load(objects, np.arange(4))
        except kc.KVGroupsValueError as exc:
            print("refused:", exc)
        caches[1].resize((2, 32, 4, 2, 8), refcheck=False)  # same shape, new memory
        p.load(objects, np.arange(4))
        np.testing.assert_array_equal(caches[1][:, :4], np.zeros((2, 4, 4, 2, 8)))
        print("rebound")
    """)
    assert result.returncode == 0, result.stderr
    assert "refused: kv_caches changed since the transfer was prepared" in result.stdout
    assert "resized or reallocated" in result.stdout and "rebound" in result.stdout


def test_torch_resize_and_set_after_prepare_rebind_or_refuse():
    pytest.importorskip("torch")
    pytest.importorskip("kvgroups_torch")
    result = _run("""
        import numpy as np, torch, kvgroups_core as kc
        from kvgroups_core.formats.catalogue import EngineKVFormat as F
        caches = [torch.ones((2, 32, 4, 2, 8), dtype=torch.float16) for _ in range(2)]
        m = kc.KVLayerGroupsManager(caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=16)
        p = kc.prepare(m, caches)
        objects = p.store(np.arange(4))
        zeros = [torch.zeros_like(c) for c in caches]
        p2 = kc.prepare(m, zeros)
        caches[0].resize_(4 * 2 * 32 * 4 * 2 * 8)  # grows past its storage: reallocated
        try:
            p.store(np.arange(4))
        except kc.KVGroupsValueError as exc:
            print("refused:", exc)
        fresh = torch.zeros((2, 32, 4, 2, 8), dtype=torch.float16)
        zeros[1].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
        p2.load(objects, np.arange(4))
        assert bool((fresh[:, :4] == 1).all()), "set_: the new storage is the one written"
        print("rebound")
    """)
    assert result.returncode == 0, result.stderr
    assert "refused: kv_caches changed since the transfer was prepared" in result.stdout
    assert "rebound" in result.stdout


def test_jax_deleted_bound_cache_is_a_typed_error():
    pytest.importorskip("kvgroups_jax")
    backend = kc.get_backend("jax")
    caches = [backend.from_numpy(a) for a in _caches(2)]
    manager = kc.KVLayerGroupsManager(
        caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK
    )
    prepared = kc.prepare(manager, caches)
    objects = prepared.store(np.arange(4))
    caches[1].delete()
    with pytest.raises(kc.KVGroupsValueError, match="deleted or donated"):
        prepared.load(objects, np.arange(4))
    # A one-shot call given donated arrays is refused the same way (nothing dispatched).
    live = [backend.from_numpy(a) for a in _caches(3)]
    kc.load(manager, objects, live, np.arange(4))
    with pytest.raises(kc.KVGroupsValueError, match="deleted or donated"):
        kc.store(manager, live, np.arange(4))


# --- threads ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["numpy", "torch", "jax", pytest.param("torch-cuda", marks=pytest.mark.gpu)]
)
def test_four_threads_on_one_prepared_transfer_lose_no_block(kind):
    to_backend, to_numpy = _backend_arrays(kind)
    src_np = _caches(4)
    src = [to_backend(a) for a in src_np]
    manager = kc.KVLayerGroupsManager(src, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK)
    objects = [kc.store(manager, src, np.arange(4 * t, 4 * t + 4)) for t in range(8)]
    prepared = kc.prepare(manager, [to_backend(np.zeros(SHAPE, np.float16)) for _ in range(2)])
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for rep in range(2):
                c = 2 * t + rep
                prepared.load(objects[c], np.arange(4 * c, 4 * c + 4))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for got, want in zip(prepared.kv_caches, src_np):
        np.testing.assert_array_equal(to_numpy(got).view(np.uint16), want.view(np.uint16))
