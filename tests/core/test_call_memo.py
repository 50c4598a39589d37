"""The memo of validated call signatures (kvgroups_core/transfer/fast/call_memo.py) on the CPU
backends.

A prepared transfer remembers the signatures of calls that passed every check; these tests
show that a warm memo moves the same bytes as a cold call, that it never lets through a call
a cold transfer refuses (same typed error, same message, nothing written), and that a
layer-subset call is judged by the tensors it touches. The prepared transfer's check calls
(``check_load`` / ``check_store``) refuse what the calls refuse, moving nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.transfer import api as transfer

CHUNK, BS, NB, LAYERS = 16, 4, 32, 8
SHAPE = (2, NB, BS, 2, 8)
BPC = CHUNK // BS  # block ids per chunk


class Arrays:
    """Caches and objects of one CPU runtime, and their bytes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "torch":
            self.torch = pytest.importorskip("torch")
            pytest.importorskip("kvgroups_torch")

    def cache(self, seed: int):
        raw = np.random.default_rng(seed).integers(0, 2**16, SHAPE, dtype=np.uint16)
        if self.kind == "numpy":
            return raw.view(np.float16).copy()  # owns its memory (resizable)
        return self.torch.from_numpy(raw.view(np.int16)).view(self.torch.float16)

    def objects(self, num_chunks: int, nbytes: int, seed: int = 0):
        raw = np.random.default_rng(seed).integers(0, 256, (num_chunks, nbytes), dtype=np.uint8)
        return [raw if self.kind == "numpy" else self.torch.from_numpy(raw)]

    def bytes(self, x) -> np.ndarray:
        if self.kind == "numpy":
            return np.asarray(x).view(np.uint8).copy()
        t = x.detach().contiguous()
        return t.view(self.torch.uint8).numpy().copy()


def _setup(kind: str, seed: int = 1):
    arrays = Arrays(kind)
    caches = [arrays.cache(seed * 100 + layer) for layer in range(LAYERS)]
    manager = kc.KVLayerGroupsManager(
        caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK
    )
    return arrays, manager, caches, kc.prepare(manager, caches)


def _ids(num_chunks: int, seed: int, dtype=np.int64) -> np.ndarray:
    return np.random.default_rng(seed).permutation(NB)[: num_chunks * BPC].astype(dtype)


def _cold(monkeypatch) -> None:
    """Every later call takes the full path (no signature is memoised or looked up)."""
    monkeypatch.setattr(transfer, "call_key", lambda *args, **kw: None)


def _calls():
    """An engine's calls, four rounds of the same signatures with new id values: layer-wise
    and whole-model, store and load, two chunk counts and id dtypes, two object sets, a load
    skip and a CTA cap."""
    out = []
    for rnd in range(4):
        for n in (1, 2):
            ids = _ids(n, seed=10 * rnd + n, dtype=np.int32 if n == 2 else np.int64)
            which, odd = rnd % 2, (rnd // 2) % 2
            out.append(("store", n, ids, which, {}))
            out.append(("store", n, ids, which, {"layers": [odd]}))
            out.append(("store", n, ids, which, {"layers": [1, 4], "max_ctas": 2}))
            out.append(("load", n, ids, which, {"layers": [2 + odd]}))
            out.append(("load", n, ids, which, {"skip_first_n_tokens": 4 * odd}))
    return out


def _replay(kind: str, calls):
    arrays, manager, caches, prepared = _setup(kind)
    nbytes = prepared.binding.object_nbytes[0]
    buffers = {(n, w): arrays.objects(n, nbytes, seed=n + 2 * w) for n in (1, 2) for w in (0, 1)}
    seen = []
    for direction, n, ids, which, kw in calls:
        objects = buffers[(n, which)]
        if direction == "store":
            prepared.store(ids, objects, **kw)
        else:
            prepared.load(objects, ids, **kw)
        seen.append([arrays.bytes(o) for o in objects] + [arrays.bytes(c) for c in caches])
    return seen


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_warm_calls_move_the_bytes_of_cold_calls(kind, planned, monkeypatch):
    calls = _calls()
    warm = _replay(kind, calls)
    assert len(calls) - planned[0] >= 10, "the memo was not used"
    _cold(monkeypatch)
    before = planned[0]
    cold = _replay(kind, calls)
    assert planned[0] - before == len(calls)
    for i, (a, b) in enumerate(zip(warm, cold)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y, err_msg=f"call {i}: {calls[i][0]}")


def _refusal(call):
    with pytest.raises(kc.KVGroupsError) as info:
        call()
    return type(info.value), str(info.value)


def _bad_cases(kind: str):
    """``name -> (mutate(state) -> bad call)``: each after a passing call of the same
    signature, so the memo is warm for it."""

    def ids_length(s):
        return lambda: s.prepared.store(np.arange(BPC + 1), s.objects, layers=[3])

    def ids_dtype(s):
        return lambda: s.prepared.store(np.arange(BPC, dtype=np.float64), s.objects, layers=[3])

    def ids_out_of_range(s):
        bad = s.ids.copy()
        bad[2] = NB
        return lambda: s.prepared.store(bad, s.objects, layers=[3])

    def ids_negative(s):
        bad = s.ids.copy()
        bad[-1] = -1
        return lambda: s.prepared.load(s.objects, bad)

    def object_replaced(s):
        other = s.arrays.objects(2, s.nbytes)
        return lambda: s.prepared.store(s.ids, other, layers=[3])

    def object_resized(s):
        if kind == "numpy":
            s.objects[0].resize((1, s.nbytes - 8), refcheck=False)
        else:
            s.objects[0].resize_(1, s.nbytes - 8)
        return lambda: s.prepared.store(s.ids, s.objects, layers=[3])

    def object_over_a_cache(s):
        if kind == "numpy":
            view = s.caches[6].reshape(-1).view(np.uint8)[: s.nbytes].reshape(1, s.nbytes)
            return lambda: s.prepared.store(s.ids, [view], layers=[3])
        storage = s.caches[6].untyped_storage()
        s.objects[0].set_(storage, 0, (1, s.nbytes), (s.nbytes, 1))
        return lambda: s.prepared.store(s.ids, s.objects, layers=[3])

    def object_twice(s):
        return lambda: s.prepared.store(s.ids, [s.objects[0], s.objects[0]], layers=[3])

    def cache_reallocated(s):
        if kind == "numpy":
            s.caches[3].resize((2, 4, BS, 2, 8), refcheck=False)
        else:
            fresh = s.arrays.cache(99)[:, :4].contiguous()
            s.caches[3].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
        return lambda: s.prepared.store(s.ids, s.objects, layers=[3])

    def cache_replaced(s):
        s.caches[3] = s.arrays.cache(98)[:, :4]
        return lambda: s.prepared.store(s.ids, s.objects, layers=[3])

    def other_cache_replaced_whole_call(s):
        s.caches[0] = s.arrays.cache(98)[:, :4]
        return lambda: s.prepared.load(s.objects, s.ids)

    def layers_unknown(s):
        return lambda: s.prepared.store(s.ids, s.objects, layers=[LAYERS])

    def layers_bool(s):
        return lambda: s.prepared.store(s.ids, s.objects, layers=[True])

    def layers_repeated(s):
        return lambda: s.prepared.store(s.ids, s.objects, layers=[3, 3])

    def max_ctas_bool(s):
        return lambda: s.prepared.store(s.ids, s.objects, layers=[3], max_ctas=True)

    def skip_past_the_ids(s):
        return lambda: s.prepared.load(s.objects, s.ids, skip_first_n_tokens=CHUNK + 1)

    cases = dict(
        ids_length=ids_length,
        ids_dtype=ids_dtype,
        ids_out_of_range=ids_out_of_range,
        ids_negative=ids_negative,
        object_replaced=object_replaced,
        object_resized=object_resized,
        object_over_a_cache=object_over_a_cache,
        object_twice=object_twice,
        cache_reallocated=cache_reallocated,
        cache_replaced=cache_replaced,
        other_cache_replaced_whole_call=other_cache_replaced_whole_call,
        layers_unknown=layers_unknown,
        layers_bool=layers_bool,
        layers_repeated=layers_repeated,
        max_ctas_bool=max_ctas_bool,
        skip_past_the_ids=skip_past_the_ids,
    )
    if kind == "numpy":

        def object_read_only(s):
            s.objects[0].flags.writeable = False
            return lambda: s.prepared.store(s.ids, s.objects, layers=[3])

        cases["object_read_only"] = object_read_only
    return cases


class _State:
    def __init__(self, kind: str) -> None:
        self.arrays, self.manager, self.caches, self.prepared = _setup(kind, seed=3)
        self.nbytes = self.prepared.binding.object_nbytes[0]
        self.objects = self.arrays.objects(1, self.nbytes, seed=4)
        self.ids = _ids(1, seed=5)

    def snapshot(self):
        return [self.arrays.bytes(x) for x in list(self.caches) + list(self.objects)]


@pytest.mark.parametrize(
    "kind,case", [(kind, case) for kind in ("numpy", "torch") for case in sorted(_bad_cases(kind))]
)
def test_a_warm_memo_refuses_what_a_cold_call_refuses(kind, case, planned, monkeypatch):
    cases = _bad_cases(kind)
    s = _State(kind)
    for _ in range(2):  # the second call of each signature is a memo hit: the memo is warm
        s.prepared.store(s.ids, s.objects, layers=[3])
        s.prepared.load(s.objects, s.ids)
    hits_from = planned[0]
    s.prepared.store(s.ids, s.objects, layers=[3])
    s.prepared.load(s.objects, s.ids)
    assert planned[0] == hits_from, "not warm"
    bad = cases[case](s)
    before = s.snapshot()
    warm = _refusal(bad)
    for a, b in zip(s.snapshot(), before):
        np.testing.assert_array_equal(a, b)
    _cold(monkeypatch)
    cold = _refusal(bad)
    assert warm == cold
    for a, b in zip(s.snapshot(), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "kind,case", [(kind, case) for kind in ("numpy", "torch") for case in sorted(_bad_cases(kind))]
)
def test_check_calls_refuse_what_the_calls_refuse_and_move_nothing(kind, case):
    # check_load / check_store: a caller issuing several transfers (kvgroups_torch's
    # LayerwiseLoad) refuses a bad one with them before any of the transfers moves a byte.
    s = _State(kind)
    s.prepared.store(s.ids, s.objects, layers=[3])  # warm, as the engine's calls are
    s.prepared.load(s.objects, s.ids)
    bad = _bad_cases(kind)[case](s)
    before = s.snapshot()
    s.prepared.store, s.prepared.load = s.prepared.check_store, s.prepared.check_load
    checked = _refusal(bad)
    for a, b in zip(s.snapshot(), before):
        np.testing.assert_array_equal(a, b)
    del s.prepared.store, s.prepared.load  # the calls themselves again
    assert _refusal(bad) == checked


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_check_calls_pass_good_calls_and_move_nothing(kind):
    s = _State(kind)
    before = s.snapshot()
    assert s.prepared.check_load(s.objects, s.ids, skip_first_n_tokens=4, layers=[2, 5]) is None
    assert s.prepared.check_store(s.ids, s.objects, layers=[3], max_ctas=2) is None
    assert s.prepared.check_store(s.ids) is None  # objects the call would allocate
    for a, b in zip(s.snapshot(), before):
        np.testing.assert_array_equal(a, b)


def test_a_layer_call_is_judged_by_the_tensors_it_touches(planned):
    s = _State("torch")
    a, torch = s.arrays, s.arrays.torch
    for layer in (3, 5):
        s.prepared.store(s.ids, s.objects, layers=[layer])
    memo = s.prepared._memo
    old5 = a.bytes(s.caches[5])
    fresh = a.cache(77)
    keep_old = s.caches[5].untyped_storage()
    s.caches[5].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())  # new memory
    host = [a.bytes(c).view(np.float16).reshape(SHAPE) for c in s.caches]
    # Layer 3's call reads nothing of layer 5: it runs on the warm memo, no rebinding.
    count = planned[0]
    s.objects[0].copy_(torch.from_numpy(a.bytes(a.objects(1, s.nbytes, seed=6)[0])))
    prior = a.bytes(s.objects[0])
    s.prepared.store(s.ids, s.objects, layers=[3])
    assert planned[0] == count and s.prepared._memo is memo
    want3 = kc.store(s.manager, host, s.ids, [prior.copy()], layers=[3])
    np.testing.assert_array_equal(a.bytes(s.objects[0]), want3[0])
    prior = want3[0]
    # Layer 5's call notices that its tensor moved: it binds again and reads the new bytes.
    count = planned[0]
    s.prepared.store(s.ids, s.objects, layers=[5])
    assert planned[0] == count + 1 and s.prepared._memo is not memo
    want5 = kc.store(s.manager, host, s.ids, [prior.copy()], layers=[5])
    np.testing.assert_array_equal(a.bytes(s.objects[0]), want5[0])
    # A load of layer 5 writes the new tensor; the old memory stays as it was.
    loaded = a.objects(1, s.nbytes, seed=8)
    s.prepared.load(loaded, s.ids, layers=[5])
    kc.load(s.manager, [a.bytes(o) for o in loaded], host, s.ids, layers=[5])
    for got, want in zip(s.caches, host):
        np.testing.assert_array_equal(a.bytes(got), want.view(np.uint8))
    old_now = torch.empty(0, dtype=torch.float16).set_(keep_old, 0, SHAPE)
    np.testing.assert_array_equal(a.bytes(old_now), old5)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_layer_of_the_wrong_shape_refuses_only_the_calls_that_touch_it(kind, planned):
    s = _State(kind)
    for layer in (3, 5):
        s.prepared.store(s.ids, s.objects, layers=[layer])
    if kind == "numpy":
        s.caches[5].resize((2, 4, BS, 2, 8), refcheck=False)  # reallocated, another shape
    else:
        fresh = s.arrays.cache(77)[:, :4].contiguous()
        s.caches[5].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
    count = planned[0]
    prior = s.arrays.bytes(s.objects[0])
    s.prepared.store(s.ids, s.objects, layers=[3])
    assert planned[0] == count
    host = [
        s.arrays.bytes(c).view(np.float16).reshape(SHAPE) if i != 5 else np.zeros(SHAPE, np.float16)
        for i, c in enumerate(s.caches)
    ]
    want = kc.store(s.manager, host, s.ids, [prior.reshape(1, -1).copy()], layers=[3])
    np.testing.assert_array_equal(s.arrays.bytes(s.objects[0]).reshape(1, -1), want[0])
    snapshot = [s.arrays.bytes(x) for x in s.caches[:5] + s.caches[6:] + s.objects]
    with pytest.raises(
        kc.KVGroupsValueError,
        match="kv_caches changed since the transfer was prepared.*index 5.*binding them again",
    ):
        s.prepared.store(s.ids, s.objects, layers=[5])
    for x, b in zip(s.caches[:5] + s.caches[6:] + s.objects, snapshot):
        np.testing.assert_array_equal(s.arrays.bytes(x), b)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_replaced_entry_refuses_only_the_calls_that_touch_it(kind, planned):
    s = _State(kind)
    for layer in (3, 5):
        s.prepared.store(s.ids, s.objects, layers=[layer])
    memo = s.prepared._memo
    s.caches[5] = s.arrays.cache(77)[:, :4]  # another tensor of another shape
    count = planned[0]
    prior = s.arrays.bytes(s.objects[0])
    host = [
        s.arrays.bytes(c).view(np.float16).reshape(SHAPE) if i != 5 else np.zeros(SHAPE, np.float16)
        for i, c in enumerate(s.caches)
    ]
    # Layer 3's call reads nothing of entry 5: it runs on the warm memo and moves its bytes.
    s.prepared.store(s.ids, s.objects, layers=[3])
    assert planned[0] == count and s.prepared._memo is memo
    want = kc.store(s.manager, host, s.ids, [prior.reshape(1, -1).copy()], layers=[3])
    np.testing.assert_array_equal(s.arrays.bytes(s.objects[0]).reshape(1, -1), want[0])
    # Every call that touches entry 5 names it, and moves nothing.
    snapshot = [s.arrays.bytes(x) for x in s.caches + s.objects]
    for call in (
        lambda: s.prepared.store(s.ids, s.objects, layers=[5]),
        lambda: s.prepared.store(s.ids, s.objects),
        lambda: s.prepared.load(s.objects, s.ids),
    ):
        with pytest.raises(
            kc.KVGroupsValueError,
            match=r"kv_caches changed since the transfer "
            r"was prepared \(kv_caches\[5\] was replaced",
        ):
            call()
        for x, b in zip(s.caches + s.objects, snapshot):
            np.testing.assert_array_equal(s.arrays.bytes(x), b)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_threads_on_a_warm_memo_move_their_own_bytes(kind):
    import threading

    s = _State(kind)
    host = [s.arrays.bytes(c).view(np.float16).reshape(SHAPE) for c in s.caches]
    ids = [_ids(1, seed=20 + t) for t in range(4)]
    outs = [s.arrays.objects(1, s.nbytes, seed=30 + t) for t in range(4)]
    errors = []
    barrier = threading.Barrier(4)

    def worker(t):
        try:
            barrier.wait()
            for _ in range(5):  # repeated signatures: hits after each thread's first call
                for layer in range(LAYERS):
                    s.prepared.store(ids[t], outs[t], layers=[layer])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for t in range(4):
        want = kc.store(s.manager, host, ids[t])
        np.testing.assert_array_equal(s.arrays.bytes(outs[t][0]).reshape(1, -1), want[0])
