"""Bad memory, types and structure (objects and caches) refused on every harness, with caches
and objects unchanged: the in-tree cases beside the kit's bad-input table."""

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_conformance.caches import make_caches
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.objects import object_nbytes

CHUNK, BS, NB = 16, 4, 12


@pytest.fixture
def setup(harness):
    rng = np.random.default_rng(9)
    caches_np, formats = make_caches(
        F.NL_X_TWO_NB_BS_NH_HS, nl=2, nb=NB, bs=BS, nh=2, hs=8, dtype="float16", rng=rng
    )
    manager = KVLayerGroupsManager(caches_np, formats, lmcache_tokens_per_chunk=CHUNK)
    objects_np = [rng.integers(0, 256, (2, object_nbytes(manager, 0)), dtype=np.uint8)]
    return manager, caches_np, objects_np


def _unchanged(harness, caches, caches_np, objects, objects_np):
    for got, want in zip(harness.read(caches, caches_np), caches_np):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(harness.to_numpy(objects[0], objects_np[0]), objects_np[0])


# --- memory, types and structure (issue 12, point 4) ---------------------------------------
# Every case: a typed error (KVGroupsError and the builtin), caches and objects unchanged.


def _framework(harness) -> str:
    return harness.id.split("-")[0]  # numpy / torch / jax


def _readonly(harness, a: np.ndarray, tmp_path):
    """``a``'s bytes in a read-only file mapping, as the harness's array; None where the
    runtime has no writable arrays to begin with (JAX: buffers are XLA's)."""
    import mmap

    kind = _framework(harness)
    if kind == "jax" or harness.id.endswith("cuda"):
        return None
    path = tmp_path / f"ro{a.nbytes}-{id(a)}"
    path.write_bytes(np.ascontiguousarray(a).tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), a.nbytes, prot=mmap.PROT_READ)
    arr = np.frombuffer(mm, a.dtype).reshape(a.shape)
    if kind == "numpy":
        return arr
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        return torch.from_numpy(arr)


def _expect(error, builtin, text, call):
    with pytest.raises(error, match=r"(?i)" + __import__("re").escape(text)) as info:
        call()
    assert isinstance(info.value, kc.KVGroupsError) and isinstance(info.value, builtin)


def _both(harness, manager, caches, objects, ids=None):
    ids = np.arange(8) if ids is None else ids
    return (
        lambda: harness.store(manager, caches, ids, objects),
        lambda: harness.load(manager, objects, caches, ids),
    )


@pytest.mark.parametrize(
    "bad",
    [None, "objects", {"a": 1}, b"\x00" * 16, 3.5],
    ids=["None", "str", "dict", "bytes", "float"],
)
def test_objects_that_are_not_arrays_are_refused(harness, setup, bad):
    manager, caches_np, objects_np = setup
    caches, objects = harness.convert(caches_np), harness.convert(objects_np)
    for call in _both(harness, manager, caches, [bad]):
        _expect(kc.KVGroupsTypeError, TypeError, "objects[0]", call)
    for call in _both(harness, manager, caches, [[bad, bad]]):
        _expect(kc.KVGroupsTypeError, TypeError, "objects[0][0]", call)
    _unchanged(harness, caches, caches_np, objects, objects_np)


def test_objects_of_another_framework_are_refused(harness, setup):
    manager, caches_np, objects_np = setup
    caches, objects = harness.convert(caches_np), harness.convert(objects_np)
    foreign = [objects_np[0].copy()]  # NumPy objects
    if _framework(harness) == "numpy":
        torch = pytest.importorskip("torch")
        foreign = [torch.from_numpy(objects_np[0].copy())]
    for call in _both(harness, manager, caches, foreign):
        _expect(kc.KVGroupsTypeError, TypeError, "objects[0]: expected a uint8 array of the", call)
    _unchanged(harness, caches, caches_np, objects, objects_np)


def test_store_into_read_only_objects_is_refused(harness, setup, tmp_path):
    manager, caches_np, objects_np = setup
    caches = harness.convert(caches_np)
    ro = _readonly(harness, objects_np[0], tmp_path)
    if ro is None:
        pytest.skip(f"{harness.id}: arrays are never read-only (immutable buffers)")
    _expect(
        kc.KVGroupsValueError,
        ValueError,
        "expected writable memory",
        lambda: harness.store(manager, caches, np.arange(8), [ro]),
    )
    np.testing.assert_array_equal(np.asarray(ro), objects_np[0])
    # Loading FROM read-only objects is fine: they are only read.
    harness.load(manager, [ro], caches, np.arange(8))


def test_load_into_read_only_caches_is_refused(harness, setup, tmp_path):
    manager, caches_np, objects_np = setup
    ro = [_readonly(harness, c, tmp_path) for c in caches_np]
    if ro[0] is None:
        pytest.skip(f"{harness.id}: arrays are never read-only (immutable buffers)")
    objects = harness.convert(objects_np)
    _expect(
        kc.KVGroupsValueError,
        ValueError,
        "kv_caches: expected writable memory",
        lambda: harness.load(manager, objects, ro, np.arange(8)),
    )
    for got, want in zip(ro, caches_np):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    stored = harness.store(manager, ro, np.arange(8))  # storing from them only reads
    assert len(stored) == 1


def _strided_objects(harness, objects_np, row_stride):
    """A ``[2, nbytes]`` object whose rows start ``row_stride`` bytes apart (overlapping)."""
    nbytes = objects_np[0].shape[1]
    kind = _framework(harness)
    if kind == "numpy":
        base = objects_np[0].copy().reshape(-1)
        return np.lib.stride_tricks.as_strided(base, (2, nbytes), (row_stride, 1), writeable=True)
    if kind == "torch":
        base = harness.convert([objects_np[0].copy().reshape(-1)])[0]
        return base.as_strided((2, nbytes), (row_stride, 1))
    return None


@pytest.mark.parametrize("row_stride", [0, 8], ids=["stride0", "overlapping"])
def test_objects_whose_rows_overlap_are_refused(harness, setup, row_stride):
    manager, caches_np, objects_np = setup
    caches = harness.convert(caches_np)
    obj = _strided_objects(harness, objects_np, row_stride)
    if obj is None:
        pytest.skip(f"{harness.id}: arrays have no strides")
    snapshot = harness.to_numpy(obj, objects_np[0]).copy()
    for call in _both(harness, manager, caches, [obj]):
        _expect(kc.KVGroupsValueError, ValueError, "expected rows of their own", call)
    np.testing.assert_array_equal(harness.to_numpy(obj, objects_np[0]), snapshot)
    _unchanged(harness, caches, caches_np, harness.convert(objects_np), objects_np)


def test_one_buffer_twice_in_a_per_chunk_list_is_refused(harness, setup):
    manager, caches_np, objects_np = setup
    caches = harness.convert(caches_np)
    buf = harness.convert([objects_np[0][0].copy()])[0]
    for call in _both(harness, manager, caches, [[buf, buf]]):
        _expect(kc.KVGroupsValueError, ValueError, "expected its own buffer", call)
    np.testing.assert_array_equal(harness.to_numpy(buf, objects_np[0][0]), objects_np[0][0])
    _unchanged(harness, caches, caches_np, harness.convert(objects_np), objects_np)


def test_objects_inside_a_cache_tensor_are_refused(harness, setup):
    manager, caches_np, objects_np = setup
    kind = _framework(harness)
    if kind == "jax":
        pytest.skip("jax: an array is never a view of another")
    caches = harness.convert(caches_np)
    nbytes = objects_np[0].shape[1]
    if kind == "numpy":
        view = caches[1].reshape(-1).view(np.uint8)[:nbytes].reshape(1, nbytes)
    else:
        import torch

        view = caches[1].reshape(-1).view(torch.uint8)[:nbytes].view(1, nbytes)
    for call in _both(harness, manager, caches, [view], np.arange(4)):
        _expect(kc.KVGroupsValueError, ValueError, "apart from the caches", call)
    _unchanged(harness, caches, caches_np, harness.convert(objects_np), objects_np)


@pytest.mark.parametrize("count", [1, 3])
def test_more_or_fewer_cache_tensors_than_layers_are_refused(harness, setup, count):
    manager, caches_np, objects_np = setup
    caches, objects = harness.convert(caches_np), harness.convert(objects_np)
    wrong = (caches * 2)[:count]
    for call in _both(harness, manager, wrong, objects):
        _expect(kc.KVGroupsValueError, ValueError, "expected 2 layers", call)
    _unchanged(harness, caches, caches_np, objects, objects_np)


def test_declared_formats_that_do_not_fit_and_empty_axes_are_refused(harness):
    flash_infer = harness.convert([np.zeros((2, 64, 4, 2, 8), np.float16)])
    _expect(
        kc.KVGroupsValueError,
        ValueError,
        "expected axis TWO of length 2",
        lambda: KVLayerGroupsManager(flash_infer, F.NL_X_NB_TWO_BS_NH_HS),
    )
    for shape, axis in (((2, 4, 0, 2, 8), "BS"), ((2, 0, 4, 2, 8), "NB"), ((2, 4, 4, 2, 0), "HS")):
        empty = harness.convert([np.zeros(shape, np.float16)])
        _expect(
            kc.KVGroupsValueError,
            ValueError,
            f"non-empty {axis} axis",
            lambda e=empty: KVLayerGroupsManager(e, F.NL_X_TWO_NB_BS_NH_HS),
        )
    spec = [kc.TensorSpec((2, 4, 0, 2, 8), "float16")]  # block_size 0, no data
    _expect(
        kc.KVGroupsValueError,
        ValueError,
        "non-empty BS axis",
        lambda: KVLayerGroupsManager(spec, F.NL_X_TWO_NB_BS_NH_HS),
    )
