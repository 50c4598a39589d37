"""Pinned host objects on a GPU in both pinned modes ("staged": device staging buffers,
"direct": the kernel through UVA) with two object groups (gpt-oss-20b: a sliding-window
engine group and a full one), kernel path, against the NumPy reference bit for bit. The
registered torch backend's mode is set per test (``DEFAULT_PINNED_MODE`` is read when the
backend is made, so changing it later does nothing); a spy on the staging says which mode
ran. The CPU twin is test_pinned_staging_emulated. Skipped without CUDA."""

import numpy as np
import pytest
import torch

import kvgroups_core as kc
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.tensors.arrays import get_backend
from kvgroups_tools.catalog import MODELS
from tests.support.cuda_marks import needs_cuda

pytestmark = needs_cuda

if torch.cuda.is_available():
    from kvgroups_torch.cuda import execute as cuda_execute
    from kvgroups_torch.cuda import objects as cuda_objects

CHUNK = 64


def _setup(seed, layers=4, num_blocks=48):
    model = MODELS["gpt-oss-20b"].build(num_blocks=num_blocks, layers=layers, dtype="float16")
    rng = np.random.default_rng(seed)
    caches = []
    for spec in model.kv_caches:
        raw = rng.integers(0, 256, int(np.prod(spec.shape)) * 2, dtype=np.uint8)
        caches.append(torch.from_numpy(raw.view(np.float16).reshape(spec.shape)).cuda())
    manager = KVLayerGroupsManager(
        caches, list(model.formats), list(model.engine_group_infos), lmcache_tokens_per_chunk=CHUNK
    )
    ids = {}
    for k, g in enumerate(manager.kernel_groups):
        n = 3 * manager.calculate_num_blocks(k, CHUNK)
        ids.setdefault(g.engine_group_idx, rng.permutation(num_blocks)[:n])
    return manager, caches, ids


def _host(tensors):
    return [t.cpu().numpy().copy() for t in tensors]


@pytest.fixture(params=["staged", "direct"])
def mode(request, monkeypatch):
    monkeypatch.setattr(get_backend("torch"), "pinned", request.param)
    staged = []
    real = cuda_objects.stage
    monkeypatch.setattr(cuda_execute, "stage", lambda *a: staged.append(1) or real(*a))
    monkeypatch.setattr(cuda_objects, "stage", lambda *a: staged.append(1) or real(*a))
    return request.param, staged


@pytest.mark.parametrize("kw", [{}, {"skip_first_n_tokens": 80}, {"layers": [0, 2]}])
def test_pinned_load_in_both_modes_matches_the_reference(mode, kw):
    name, staged = mode
    manager, base, ids = _setup(seed=3)
    assert manager.num_object_groups == 2
    rng = np.random.default_rng(4)
    objects = [
        torch.from_numpy(
            rng.integers(0, 256, (3, kc.object_nbytes(manager, g)), dtype=np.uint8)
        ).pin_memory()
        for g in range(manager.num_object_groups)
    ]
    want = _host(base)
    kc.load(manager, _host(objects), want, ids, backend="numpy", **kw)
    for _ in range(2):  # a second call reuses the parked binding and the launch state
        caches = [c.clone() for c in base]
        kc.load(manager, objects, caches, ids, path="kernel", **kw)
        torch.cuda.synchronize()
        for i, (got, ref) in enumerate(zip(_host(caches), want)):
            np.testing.assert_array_equal(
                got.view(np.uint8), ref.view(np.uint8), err_msg=f"{name} {kw} cache {i}"
            )
    assert bool(staged) == (name == "staged")


def test_pinned_store_in_both_modes_matches_the_reference(mode):
    name, staged = mode
    manager, caches, ids = _setup(seed=5)
    rng = np.random.default_rng(6)
    start = [
        torch.from_numpy(
            rng.integers(0, 256, (3, kc.object_nbytes(manager, g)), dtype=np.uint8)
        ).pin_memory()
        for g in range(manager.num_object_groups)
    ]
    for layers in (None, [1, 3]):
        objects = [o.clone().pin_memory() for o in start]
        want = kc.store(manager, _host(caches), ids, _host(start), backend="numpy", layers=layers)
        kc.store(manager, caches, ids, objects, path="kernel", layers=layers)
        torch.cuda.synchronize()
        for g, (got, ref) in enumerate(zip(_host(objects), want)):
            np.testing.assert_array_equal(got, np.asarray(ref), err_msg=f"{name} {layers} {g}")
    assert bool(staged) == (name == "staged")
