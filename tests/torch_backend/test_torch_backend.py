import numpy as np
import pytest
import torch
from kvgroups_torch import BoundPlan, TorchBackend, allocate_objects, describe_tensor

import kvgroups_core as kc
from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.tensors.arrays import get_backend
from tests.support.cuda_marks import HAS_CUDA
from tests.support.torch_page_cases import as_bytes, as_tensor, make_case, oracle


def test_registry_finds_this_backend_for_torch_tensors():
    backend = get_backend("torch")
    assert isinstance(backend, TorchBackend)
    desc = kc.describe(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert desc.framework == "torch" and desc.dtype == kc.DTYPE_MAP["bfloat16"]


@pytest.mark.parametrize(
    "dtype,name",
    [
        (torch.float8_e4m3fn, "float8_e4m3fn"),
        (torch.float8_e5m2, "float8_e5m2"),
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
        (torch.float32, "float32"),
        (torch.uint8, "uint8"),
    ],
)
def test_describe_keeps_the_dtype_fp8_included(dtype, name):
    base = torch.zeros(5, 2, 3, 4, dtype=torch.float32).to(dtype)
    x = base.permute(1, 0, 3, 2)[:, 1:]  # a strided view with a storage offset
    desc = describe_tensor(x)
    assert desc.dtype.name == name
    assert desc.shape == tuple(x.shape) and desc.strides == tuple(x.stride())
    assert desc.address == x.data_ptr()
    assert desc.obj is x and desc.device == "cpu"


def test_describe_accepts_tensors_that_require_grad():
    x = torch.zeros(4, 8, requires_grad=True)
    assert describe_tensor(x).shape == (4, 8)


def test_describe_rejects_non_tensors():
    with pytest.raises(KVGroupsTypeError, match="torch.Tensor"):
        describe_tensor(np.zeros(3))


def test_allocate_objects_placements_on_cpu():
    objs = allocate_objects((100, 36), 3, torch.device("cpu"))
    assert [tuple(o.shape) for o in objs] == [(3, 100), (3, 36)]
    assert all(o.dtype == torch.uint8 and o.device.type == "cpu" for o in objs)
    with pytest.raises(KVGroupsValueError, match="placement"):
        allocate_objects((8,), 1, torch.device("cpu"), "nowhere")
    with pytest.raises(KVGroupsValueError, match="GPU"):
        allocate_objects((8,), 1, torch.device("cpu"), "device")


def test_bad_pinned_mode_is_rejected():
    with pytest.raises(KVGroupsValueError, match="pinned"):
        TorchBackend(pinned="sometimes")


def test_validate_rejects_cpu_caches_with_objects_elsewhere():
    backend = TorchBackend()
    caches = [kc.describe(torch.zeros(16))]
    backend.validate(None, caches, [torch.zeros(1, 8, dtype=torch.uint8)])
    if HAS_CUDA:
        with pytest.raises(KVGroupsValueError, match="CPU tensor"):
            backend.validate(None, caches, [torch.zeros(1, 8, dtype=torch.uint8, device="cuda")])


def _bound(case, device, objects_device=None):
    caches = [as_tensor(c, case.dtype, device) for c in case.caches]
    objects = torch.from_numpy(case.objects.copy()).to(objects_device or device)
    return caches, objects, BoundPlan(case.plan, caches, [objects])


@pytest.mark.parametrize("direction", ["store", "load"])
def test_bound_plan_runs_through_the_custom_op_on_cpu(direction):
    case = make_case("hnd", "bfloat16", direction, np.random.default_rng(1))
    caches, objects, bound = _bound(case, "cpu")
    bound.run()
    want_caches, want_objects = oracle(case)
    np.testing.assert_array_equal(objects.numpy(), want_objects)
    for got, want in zip(caches, want_caches):
        np.testing.assert_array_equal(as_bytes(got), want)


def test_bound_plan_takes_new_ids_per_run_on_cpu():
    case = make_case("nhd", "float16", "store", np.random.default_rng(2))
    caches, objects, bound = _bound(case, "cpu")
    ids = np.random.default_rng(3).permutation(40)[:12]
    bound.run(torch.from_numpy(ids))
    _, want_objects = oracle(case, ids=ids)
    np.testing.assert_array_equal(objects.numpy(), want_objects)


def test_bound_plan_works_under_torch_compile_on_cpu():
    case = make_case("interleaved", "float32", "store", np.random.default_rng(4))
    caches, objects, bound = _bound(case, "cpu")
    ids = torch.from_numpy(np.random.default_rng(5).permutation(40)[:12])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(ids):
        torch.ops.kvgroups.store_pages(bound.handle, bound.caches, bound.objects, [ids])

    step(ids)
    _, want_objects = oracle(case, ids=ids.numpy())
    np.testing.assert_array_equal(objects.numpy(), want_objects)


def test_ops_have_fake_implementations():
    case = make_case("nhd", "float16", "load", np.random.default_rng(6))
    caches, objects, bound = _bound(case, "cpu")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_caches = [mode.from_tensor(c) for c in caches]
        fake_objects = [mode.from_tensor(objects)]
        torch.ops.kvgroups.load_pages(bound.handle, fake_caches, fake_objects, [])


def test_validate_takes_raw_tensors_as_well_as_descriptors():
    # Backends are handed either the caller's tensors or their TensorDescs.
    case = make_case("nhd", "float16", "store", np.random.default_rng(8))
    caches = [as_tensor(c, case.dtype, "cpu") for c in case.caches]
    objects = torch.from_numpy(case.objects.copy())
    TorchBackend().validate(case.plan, caches, [objects])
    TorchBackend().validate(case.plan, [describe_tensor(c) for c in caches], [objects])
    caches[0].requires_grad_(True)  # float16: autograd can track it; a transfer must not
    with pytest.raises(KVGroupsValueError, match="requires grad"):
        TorchBackend().validate(case.plan, caches, [objects])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_pageable_host_objects_are_rejected_before_any_byte_moves():
    case = make_case("nhd", "float16", "store", np.random.default_rng(7))
    caches = [as_tensor(c, case.dtype, "cuda") for c in case.caches]
    objects = torch.from_numpy(case.objects.copy())  # pageable: not reachable by the kernel
    with pytest.raises(KVGroupsValueError, match="pinned"):
        TorchBackend().validate(case.plan, caches, [objects])
    with pytest.raises(KVGroupsValueError, match="pinned"):
        TorchBackend().execute(case.plan, caches, [objects])
    np.testing.assert_array_equal(objects.numpy(), case.objects)


# --- tensors whose memory is not their values ------------------------------------------------

_SHAPE = (2, 16, 4, 2, 4)
_IDS = [0, 1, 2, 3]
_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")]


def _plain_setup(device="cpu"):
    base = torch.arange(np.prod(_SHAPE), dtype=torch.float32, device=device).reshape(_SHAPE) + 1
    fmts = [kc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * 2
    caches = [base.clone(), base.clone() * 2]
    manager = kc.KVLayerGroupsManager(caches, fmts, lmcache_tokens_per_chunk=8)
    return manager, caches


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_sparse_and_nested_caches_are_refused_naming_the_cache():
    manager, caches = _plain_setup()
    fmts = [kc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * 2
    rows = [torch.zeros(_SHAPE[1:]) for _ in range(2)]
    for bad in (
        torch.zeros(_SHAPE).to_sparse(),
        torch.nested.nested_tensor(rows),
        torch.nested.nested_tensor(rows, layout=torch.jagged),
    ):
        with pytest.raises(KVGroupsTypeError, match=r"^kv_caches\[1\]: expected a dense"):
            kc.KVLayerGroupsManager([caches[0], bad], fmts, lmcache_tokens_per_chunk=8)
        with pytest.raises(KVGroupsTypeError, match=r"^kv_caches: expected a dense"):
            kc.detect_format(bad)
        with pytest.raises(KVGroupsTypeError, match=r"^kv_caches\[1\].*expected a dense"):
            kc.store(manager, [caches[0], bad], _IDS)


def test_negative_bit_view_caches_are_refused_not_moved_as_raw_storage():
    # A negative-bit view's storage holds the unnegated values: moving its bytes would store
    # (or load) numbers of the wrong sign without an error.
    manager, caches = _plain_setup()
    neg = caches[1]._neg_view()
    fmts = [kc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * 2
    stored = kc.store(manager, caches, _IDS)
    kept = caches[1].clone()
    calls = {
        "manager": lambda: kc.KVLayerGroupsManager(
            [caches[0], neg], fmts, lmcache_tokens_per_chunk=8
        ),
        "store": lambda: kc.store(manager, [caches[0], neg], _IDS),
        "load": lambda: kc.load(manager, stored, [caches[0], neg], [4, 5, 6, 7]),
        "prepare": lambda: kc.prepare(manager, [caches[0], neg]),
    }
    for name, call in calls.items():
        with pytest.raises(KVGroupsTypeError, match=r"^kv_caches\[1\].*negative-bit view") as e:
            call()
        assert "resolve_neg()" in str(e.value), name
    assert torch.equal(caches[1], kept)  # the refused load wrote nothing
    # Resolved, the same values move.
    resolved = kc.store(manager, [caches[0], neg.resolve_neg()], _IDS)
    assert not torch.equal(resolved[0], stored[0])
    kc.load(manager, resolved, [caches[0], caches[1]], [8, 9, 10, 11])
    assert torch.equal(caches[1][:, 8:12], -kept[:, 0:4])


def _not_plain_objects(nbytes, device):
    """uint8 [2, nbytes] objects torch cannot hand over as plain strided memory."""
    rows = torch.full((2, nbytes), 7, dtype=torch.uint8, device=device)
    return {
        "sparse": lambda: rows.to_sparse(),
        "sparse_csr": lambda: rows.to_sparse_csr(),
        "nested": lambda: torch.nested.nested_tensor(list(rows), layout=torch.jagged),
        "neg_view": lambda: rows.clone()._neg_view(),
    }


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("kind", ["sparse", "sparse_csr", "nested", "neg_view"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_GPU)])
def test_objects_without_plain_strided_memory_are_refused_naming_them(kind, device):
    manager, caches = _plain_setup(device)
    before = [c.clone() for c in caches]
    prepared = kc.prepare(manager, caches)
    make = _not_plain_objects(kc.object_nbytes(manager, 0), device)[kind]
    calls = {
        "load": lambda o: kc.load(manager, [o], caches, _IDS),
        "store": lambda o: kc.store(manager, caches, _IDS, [o]),
        "prepared.load": lambda o: prepared.load([o], _IDS),
        "prepared.store": lambda o: prepared.store(_IDS, [o]),
    }
    for name, call in calls.items():
        obj = make()
        with pytest.raises(KVGroupsTypeError, match=r"^objects\[0\]: expected a") as err:
            call(obj)
        if kind == "neg_view":
            assert "resolve_neg()" in str(err.value), name
            assert torch.equal(obj._neg_view(), torch.full_like(obj, 7)), name  # storage kept
        else:
            assert "layout" in str(err.value), name
        for got, want in zip(caches, before):  # a refused load wrote nothing
            assert torch.equal(got, want), name


@pytest.mark.parametrize("kind", ["sparse", "neg_view"])
def test_bound_plan_refuses_objects_without_plain_memory_naming_them(kind):
    case = make_case("nhd", "float16", "store", np.random.default_rng(9))
    caches = [as_tensor(c, case.dtype, "cpu") for c in case.caches]
    obj = torch.from_numpy(case.objects.copy())
    obj = obj.to_sparse() if kind == "sparse" else obj._neg_view()
    with pytest.raises(KVGroupsTypeError, match=r"^objects\[0\]: expected a"):
        BoundPlan(case.plan, caches, [obj])
