import subprocess
import sys

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.tensors import arrays as registry
from kvgroups_core.transfer.api import load, store
from kvgroups_core.transfer.reference import NumpyBackend


class FakeArray:
    """A third-party array type: a thin wrapper around a NumPy array."""

    def __init__(self, a):
        self.a = a


class FakeBackend(kc.Backend):
    name = "fake"
    array_types = (f"{__name__}.FakeArray",)
    calls: list = []

    def __init__(self):
        self.ref = NumpyBackend()

    def describe(self, x):
        d = self.ref.describe(x.a)
        return kc.TensorDesc(d.spec, d.data_ptr, d.byte_offset, x, "fake")

    def allocate_objects(self, plan, like, placement=None):
        return [FakeArray(o) for o in self.ref.allocate_objects(plan, like, placement)]

    def execute(self, plan, caches, objects):
        FakeBackend.calls.append(plan.direction)
        inner = [kc.TensorDesc(d.spec, d.data_ptr, d.byte_offset, d.obj.a, "numpy") for d in caches]
        self.ref.execute(plan, inner, [o.a for o in objects])
        return None, list(objects)


@pytest.fixture
def fake_backend():
    registry.register_backend("fake", FakeBackend, array_types=FakeBackend.array_types)
    FakeBackend.calls.clear()
    yield
    registry.unregister_backend("fake")


def test_a_third_party_backend_plugs_in_without_editing_the_core(fake_backend):
    rng = np.random.default_rng(0)
    caches = [FakeArray(rng.standard_normal((2, 8, 4, 2, 8)).astype(np.float16)) for _ in range(2)]
    manager = KVLayerGroupsManager(caches, [F.NL_X_TWO_NB_BS_NH_HS] * 2, lmcache_tokens_per_chunk=8)
    objects = store(manager, caches, [3, 5])
    assert isinstance(objects[0], FakeArray)
    dst = [FakeArray(np.zeros_like(c.a)) for c in caches]
    load(manager, objects, dst, [6, 1])
    assert FakeBackend.calls == ["store", "load"]
    for c, d in zip(caches, dst):
        np.testing.assert_array_equal(d.a[:, [6, 1]], c.a[:, [3, 5]])


def test_two_frameworks_in_one_call_raise_type_error_naming_both(fake_backend):
    a = np.zeros((2, 8, 4, 2, 8), np.float16)
    caches = [a, FakeArray(a.copy())]
    with pytest.raises(TypeError, match=r"numpy.*fake|fake.*numpy"):
        registry.backend_for_tensors(caches)


def test_unknown_backend_name_is_a_clear_error():
    with pytest.raises(kc.BackendNotFoundError, match="nope"):
        registry.get_backend("nope")


def test_framework_detection_imports_nothing():
    code = (
        "import sys, numpy as np\n"
        "from kvgroups_core.tensors import arrays as registry\n"
        "assert registry.framework_of(np.zeros(3)) == 'numpy'\n"
        "assert registry.framework_of(object()) is None\n"
        "assert 'torch' not in sys.modules and 'jax' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
