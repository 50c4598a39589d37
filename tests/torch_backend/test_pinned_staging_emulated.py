"""Pinned host objects through the generic CUDA path (``cuda_execute.execute_checked_plan``: what
a call
with objects outside the caches' GPU takes), on CPU tensors with the emulated kernel of
test_torch_launch_emulated, for both pinned modes. "staged" device buffers come from a
stand-in of PyTorch's caching allocator, which hands a freed block to the next request of its
size at once (stream order makes that safe only for work enqueued after the free): a staging
buffer dropped before its launch is then overwritten by the next object group's staging copy.
The GPU twin is test_copy_engine_gpu's pinned loads."""

import weakref

import numpy as np
import pytest
import torch
from kvgroups_torch import backend as torch_backend
from kvgroups_torch.cuda import execute as cuda_execute

import kvgroups_core as kc
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS
from tests.torch_backend.test_torch_launch_emulated import emulated  # noqa: F401

CHUNK = 64


@pytest.fixture
def caching_allocator(monkeypatch):
    """``torch.empty(..., device="cuda:N")`` served from reused CPU blocks: a block whose
    tensor is gone is handed out again, as the CUDA caching allocator does on one stream."""
    real_empty = torch.empty
    blocks = []  # [storage, weak reference to the tensor handed out]
    served = []

    def empty(*shape, dtype=None, device=None, **kw):
        if not str(device).startswith("cuda"):
            return real_empty(*shape, dtype=dtype, device=device, **kw)
        size = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        nbytes = int(np.prod(size)) * torch.tensor([], dtype=dtype).element_size()
        for block in blocks:
            if block[0].numel() == nbytes and block[1]() is None:
                break
        else:
            block = [real_empty(nbytes, dtype=torch.uint8), None]
            blocks.append(block)
        out = block[0].view(dtype).view(size)
        block[1] = weakref.ref(out)
        served.append(out.data_ptr())
        return out

    monkeypatch.setattr(torch, "empty", empty)
    return served


def _setup(name, seed, layers=4, num_blocks=48):
    """test_copy_engine_gpu's case on CPU tensors: caches, a manager, ids per engine group."""
    model = MODELS[name].build(num_blocks=num_blocks, layers=layers, dtype="float16")
    rng = np.random.default_rng(seed)
    caches = []
    for spec in model.kv_caches:
        raw = rng.integers(0, 256, int(np.prod(spec.shape)) * 2, dtype=np.uint8)
        caches.append(torch.from_numpy(raw.view(np.float16).reshape(spec.shape)))
    manager = KVLayerGroupsManager(
        caches,
        list(model.formats),
        list(model.engine_group_infos) or None,
        lmcache_tokens_per_chunk=CHUNK,
    )
    by_group = {}
    for k, g in enumerate(manager.kernel_groups):
        n = 3 * manager.calculate_num_blocks(k, CHUNK)
        by_group.setdefault(g.engine_group_idx, rng.permutation(num_blocks)[:n])
    ids = by_group if len(by_group) > 1 else next(iter(by_group.values()))
    return manager, caches, ids


def _as_bytes(t):
    return t.numpy().view(np.uint8)


@pytest.mark.parametrize("pinned", ["staged", "direct"])
@pytest.mark.parametrize("kw", [{}, {"skip_first_n_tokens": 80}, {"layers": [0, 2]}])
def test_pinned_load_of_two_object_groups_matches_the_reference(
    emulated,  # noqa: F811
    caching_allocator,  # noqa: F811
    monkeypatch,
    pinned,
    kw,
):
    launches, _ = emulated
    manager, caches, ids = _setup("gpt-oss-20b", seed=3)
    assert manager.num_object_groups == 2  # a staging buffer per object group
    rng = np.random.default_rng(4)
    objects = [
        torch.from_numpy(rng.integers(0, 256, (3, kc.object_nbytes(manager, g)), dtype=np.uint8))
        for g in range(manager.num_object_groups)
    ]
    want = [c.numpy().copy() for c in caches]
    kc.load(manager, [o.numpy().copy() for o in objects], want, ids, backend="numpy", **kw)
    prep = kc.prepare(manager, caches, backend="torch")
    monkeypatch.setattr(prep.backend, "pinned", pinned)
    # CPU objects stand for pinned ones: not the caches' "GPU" for the prepared fast path
    # (DeviceCaches, device objects only), so the call takes the generic execute_checked_plan.
    prep._bound.device_caches = fast = cuda_execute.DeviceCaches(prep._bound.caches, 0)
    fast.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch_backend, "cache_device", lambda caches: torch.device("cuda", 0))
    ran = []
    real_enqueue = cuda_execute.execute_checked_plan
    monkeypatch.setattr(
        cuda_execute, "execute_checked_plan", lambda *a, **k: ran.append(real_enqueue(*a, **k))
    )
    before = len(launches)
    prep.load(objects, ids, **kw)
    groups = 1 if "layers" in kw else 2  # layers 0 and 2: the sliding group's alone
    assert (
        ran and len(launches) - before == groups
    )  # execute_checked_plan launched every kernel group
    assert len(caching_allocator) == (groups if pinned == "staged" else 0)
    for i, (got, ref) in enumerate(zip(caches, want)):
        np.testing.assert_array_equal(_as_bytes(got), ref.view(np.uint8), err_msg=f"cache {i}")
