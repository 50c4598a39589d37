"""The adversarial suite, torch tensors as arguments (issue 35, causes 6 and 7).

Engines hand kvgroups torch tensors for block ids and skips, of whatever dtype and layout their
code produced: bf16 or fp8 from a cast, meta from a deferred init, sparse, quantized, nested,
floats that require grad, 0-d and one-element tensors. Each example draws one such tensor and
uses it as the ids or the skip of a call on a CPU backend. Only a dense CPU tensor of integers
(ids: 1-D; skip: 0-d) in range is valid: it must move exactly what the NumPy reference moves.
Anything else must raise a typed error (``KVGroupsError`` and a builtin) naming the argument,
and leave caches and objects as they were. Also ``layers=`` as 0-d arrays and tensors, and a
structure with a non-tensor where a layer's tensor belongs. Few examples, derandomized.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
pytest.importorskip("kvgroups_torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvgroups_core as kc  # noqa: E402
from kvgroups_core.formats.catalogue import EngineKVFormat as F  # noqa: E402

NL, NB, BS, CHUNK = 2, 8, 2, 4
SHAPE = (2, NB, BS, 1, 4)
BUILTINS = (ValueError, TypeError, IndexError, NotImplementedError)
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

INT_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
OTHER_DTYPES = [
    torch.bool,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
FORMS = [
    "dense",
    "0-d",
    "one-element",
    "2-D",
    "non-contiguous",
    "meta",
    "sparse",
    "nested",
    "quantized",
    "requires-grad",
]


def _tensor(values: list[int], dtype, form: str):
    """``values`` as a torch tensor of ``dtype`` in ``form``; ``(tensor, dense ints?)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        base = torch.tensor(values, dtype=torch.int64)
        if form == "quantized":
            return torch.quantize_per_tensor(base.float(), 1.0, 0, torch.qint32), False
        t = base.to(dtype)
        if form == "0-d":
            return t[0].clone(), True
        if form == "one-element":
            return t[:1].clone(), True
        if form == "2-D":
            return t.reshape(1, -1).clone(), True
        if form == "non-contiguous":
            return torch.stack([t, t], 1)[:, 0], True
        if form == "meta":
            return torch.empty(t.shape, dtype=dtype, device="meta"), False
        if form == "sparse":
            return base.to_sparse().to(dtype), False
        if form == "nested":
            return torch.nested.nested_tensor([t, t]), False
        if form == "requires-grad":
            return t.float().requires_grad_(), False
        return t, True


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b)
    )


def _backend_arrays(backend: str):
    if backend == "numpy":
        return lambda a: a.copy(), lambda x: np.asarray(x).view(np.uint8).copy()
    if backend == "torch":
        return (
            lambda a: torch.from_numpy(a.view(np.int16).copy()).view(torch.float16),
            lambda x: x.contiguous().view(torch.uint8).numpy().copy(),
        )
    pytest.importorskip("kvgroups_jax")
    jb = kc.get_backend("jax")
    return jb.from_numpy, lambda x: np.asarray(x).view(np.uint8).copy()


def _setup(backend: str):
    src = [
        np.random.default_rng(i).integers(0, 2**16, SHAPE, dtype=np.uint16).view(np.float16)
        for i in range(NL)
    ]
    manager = kc.KVLayerGroupsManager(src, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK)
    return src, manager


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_torch_ids_of_every_dtype_and_layout_move_exactly_or_are_refused(backend):
    to_rt, to_bytes = _backend_arrays(backend)
    src, manager = _setup(backend)
    counts = {True: 0, False: 0}

    @SETTINGS
    @given(st.data())
    def run(data):
        draw = data.draw
        direction = draw(st.sampled_from(["store", "load"]))
        values = draw(st.lists(st.integers(0, NB - 1), min_size=CHUNK // BS, max_size=CHUNK // BS))
        if draw(st.booleans()):  # half the draws a form engines use for ids
            dtype = draw(st.sampled_from(INT_DTYPES))
            form = draw(st.sampled_from(["dense", "non-contiguous"]))
        else:
            dtype = draw(st.sampled_from(INT_DTYPES + OTHER_DTYPES))
            form = draw(st.sampled_from(FORMS))
        try:
            ids, dense = _tensor(values, dtype, form)
        except (RuntimeError, TypeError, NotImplementedError):
            return  # torch cannot make this combination at all
        valid = dense and dtype in INT_DTYPES and form in ("dense", "non-contiguous")
        caches = [to_rt(a) for a in src]
        objects = kc.store(manager, [to_rt(a) for a in src], np.array(values))
        before = ([to_bytes(c) for c in caches], [to_bytes(o) for o in objects])

        def call():
            if direction == "store":
                return kc.store(manager, caches, ids, backend=backend)
            return kc.load(manager, objects, caches, ids, backend=backend)

        counts[valid] += 1
        if not valid:
            with pytest.raises(kc.KVGroupsError) as info:
                call()
            assert isinstance(info.value, BUILTINS), repr(info.value)
            assert "block_ids" in str(info.value)
            if backend != "jax" or direction == "store":  # a refused JAX load consumed nothing
                assert _same([to_bytes(c) for c in caches], before[0])
            return
        ref = [a.copy() for a in src]
        if direction == "store":
            got = call()
            want = kc.store(manager, ref, np.array(values), backend="numpy")
            assert _same([to_bytes(g) for g in got], [w.view(np.uint8) for w in want])
        else:
            out = call()
            kc.load(
                manager, [np.asarray(o) for o in before[1]], ref, np.array(values), backend="numpy"
            )
            assert _same([to_bytes(c) for c in out], [r.view(np.uint8) for r in ref])

    run()
    assert min(counts.values()) >= 3, counts


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_torch_skips_of_every_dtype_and_layout_are_scalars_or_refused(backend):
    to_rt, to_bytes = _backend_arrays(backend)
    src, manager = _setup(backend)
    ids = np.arange(CHUNK // BS)
    counts = {True: 0, False: 0}

    @SETTINGS
    @given(st.data())
    def run(data):
        draw = data.draw
        skip_value = draw(st.integers(0, CHUNK))
        if draw(st.booleans()):  # half the draws a 0-d integer tensor
            dtype, form = draw(st.sampled_from(INT_DTYPES)), "0-d"
        else:
            dtype = draw(st.sampled_from(INT_DTYPES + OTHER_DTYPES))
            form = draw(st.sampled_from(FORMS))
        try:
            skip, dense = _tensor([skip_value], dtype, form)
        except (RuntimeError, TypeError, NotImplementedError):
            return
        valid = dense and dtype in INT_DTYPES and form == "0-d"
        caches = [to_rt(a) for a in src]
        objects = kc.store(manager, [to_rt(np.zeros_like(a)) for a in src], ids)
        before = [to_bytes(c) for c in caches]
        counts[valid] += 1
        if not valid:
            with pytest.raises(kc.KVGroupsError) as info:
                kc.load(manager, objects, caches, ids, skip_first_n_tokens=skip, backend=backend)
            assert isinstance(info.value, BUILTINS), repr(info.value)
            assert "skip_first_n_tokens" in str(info.value)
            assert _same([to_bytes(c) for c in caches], before)
            return
        out = kc.load(manager, objects, caches, ids, skip_first_n_tokens=skip, backend=backend)
        ref = [a.copy() for a in src]
        kc.load(
            manager,
            [np.zeros((1, kc.object_nbytes(manager, 0)), np.uint8)],
            ref,
            ids,
            skip_first_n_tokens=skip_value,
            backend="numpy",
        )
        assert _same([to_bytes(c) for c in out], [r.view(np.uint8) for r in ref])

    run()
    assert min(counts.values()) >= 3, counts


@pytest.mark.parametrize(
    "layers",
    [np.array(0), torch.tensor(0), np.array(0.0), "0", {0: 0}, 3.0, [True], [0.0]],
    ids=repr,
)
def test_bad_layers_are_typed_errors_naming_layers(layers):
    src, manager = _setup("numpy")
    with pytest.raises(kc.KVGroupsError, match="layers") as info:
        kc.store(manager, [a.copy() for a in src], np.arange(CHUNK // BS), layers=layers)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("bad", [None, [1, 2], "cache", 3, {"k": 1}], ids=repr)
@pytest.mark.parametrize("where", ["manager", "store"])
def test_a_non_tensor_where_a_layer_belongs_is_named(bad, where):
    src, manager = _setup("numpy")
    caches = [a.copy() for a in src]
    caches[1] = bad
    with pytest.raises(kc.KVGroupsTypeError) as info:
        if where == "manager":
            kc.KVLayerGroupsManager(caches, F.NL_X_TWO_NB_BS_NH_HS)
        else:
            kc.store(manager, caches, np.arange(CHUNK // BS))
    assert str(info.value).startswith("kv_caches[1]"), str(info.value)
