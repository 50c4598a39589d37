"""Bound torch caches changed in place (issue 35, cause 5): noticed by the next call.

A binding depends on each cache tensor's address, shape, strides, dtype and requires-grad
flag. Changed in place with the address kept (``resize_`` smaller, ``.data = x.view(...)``,
``as_strided_``, ``requires_grad_``), a cache was taken for the one bound before: a one-shot
call taking its parked binding back wrote block 5 of a tensor resized to 3 blocks at the old
geometry, and prepared calls wrote into tensors that now require grad. Each change must now be
met exactly as a fresh call meets it: refused with the fresh call's typed error (nothing
moved), or bound again and moved right. CPU tensors; the same fingerprints serve CUDA ones.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kvgroups_torch")

from kvgroups_torch import fingerprints as fp  # noqa: E402

import kvgroups_core as kc  # noqa: E402
from kvgroups_core.formats.catalogue import EngineKVFormat as F  # noqa: E402

CHUNK, BS, NB, LAYERS = 8, 4, 8, 2
SHAPE = (2, NB, BS, 2, 4)
IDS = np.array([4, 5])  # one chunk: blocks 4 and 5 (past a cache resized to 3 blocks)


def _caches(seed: int = 0, device: str = "cpu") -> list:
    rng = np.random.default_rng(seed)
    return [
        torch.from_numpy(rng.integers(-(2**15), 2**15, SHAPE, dtype=np.int16))
        .view(torch.float16)
        .to(device)
        .clone()
        for _ in range(LAYERS)
    ]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(name: str) -> str:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return name


def _manager() -> kc.KVLayerGroupsManager:
    return kc.KVLayerGroupsManager(
        _caches(), F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK
    )


def _storage_bytes(t) -> bytes:
    """Every byte of the tensor's storage (what a stale geometry would write into)."""
    return bytes(t.untyped_storage().cpu())


def _shrink(t):
    t.resize_(2, 3, BS, 2, 4)  # smaller: same storage, same address


def _retype(t):
    t.data = t.view(torch.int16)  # same bytes and address, another dtype


def _reshape(t):
    t.data = t.view(2, NB // 2, 2 * BS, 2, 4)  # same bytes, dtype and address


def _restride(t):
    t.as_strided_(SHAPE, (NB * BS * 8, BS * 8, 1, 2, 2))  # rows overlapping: refused fresh


def _requires_grad(t):
    t.requires_grad_(True)


CHANGES = {
    "resize_": _shrink,
    "data=view(dtype)": _retype,
    "data=view(shape)": _reshape,
    "as_strided_": _restride,
    "requires_grad_": _requires_grad,
}


def _fresh_error(manager, caches, direction, objects):
    """The error a fresh call (a new manager state: prepare) raises for these caches."""
    with pytest.raises(kc.KVGroupsError) as info:
        fresh = kc.prepare(manager, caches)
        if direction == "store":
            fresh.store(IDS, objects)
        else:
            fresh.load(objects, IDS)
    return info.value


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("how", ["one-shot", "prepared", "prepared-memo"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_cache_changed_in_place_is_refused_as_a_fresh_call_is(change, direction, how, device):
    device = _device(device)
    manager = _manager()
    caches = _caches(1, device)
    objects = [
        torch.from_numpy(
            np.random.default_rng(2).integers(
                0, 256, (1, kc.object_nbytes(manager, 0)), dtype=np.uint8
            )
        ).to(device)
    ]
    prepared = kc.prepare(manager, caches) if how != "one-shot" else None

    def call():
        obj = [objects[0]]
        if how == "one-shot":
            if direction == "store":
                return kc.store(manager, caches, IDS, obj)
            return kc.load(manager, obj, caches, IDS)
        if direction == "store":
            return prepared.store(IDS, obj)
        return prepared.load(obj, IDS)

    call()
    if how == "prepared-memo":
        call()  # a second call of the signature: the memo's hit path from now on
    CHANGES[change](caches[0])
    if device == "cuda":
        torch.cuda.synchronize()
    before = ([_storage_bytes(c) for c in caches], objects[0].clone())
    want = _fresh_error(manager, caches, direction, [objects[0].clone()])
    with pytest.raises(type(want)) as info:
        call()
    assert isinstance(info.value, (ValueError, TypeError))
    assert str(want) in str(info.value)  # the fresh call's own words (after what changed)
    if device == "cuda":
        torch.cuda.synchronize()
    assert [_storage_bytes(c) for c in caches] == before[0], "a cache was written"
    assert torch.equal(objects[0], before[1]), "an object was written"


def test_a_cache_set_to_new_memory_with_the_same_layout_is_bound_again():
    manager = _manager()
    caches = _caches(3)
    prepared = kc.prepare(manager, caches)
    objects = prepared.store(IDS)
    prepared.store(IDS, objects)
    fresh = _caches(4)[0]
    caches[0].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
    got = prepared.store(IDS, [torch.zeros_like(objects[0])])
    want = kc.prepare(manager, [fresh, caches[1]]).store(IDS)
    assert torch.equal(got[0], want[0])


def test_the_fast_check_follows_inference_mode_and_still_sees_changes():
    """The fast check depends on thread-local state (inference mode); a call in another mode
    compares in full, takes the tensors as unchanged, and checks fast again from then on."""
    xs = _caches(5)
    keys = fp.fingerprints(xs)
    assert fp.same_fingerprints(xs, keys) and keys.guard  # made by the first comparison
    outside = keys.guard
    with torch.inference_mode():
        assert fp.same_fingerprints(xs, keys)
        inside = keys.guard
        assert inside and inside is not outside
        assert fp.same_fingerprints(xs, keys) and keys.guard is inside  # fast from now on
        xs[1].data = xs[1].view(torch.int16)
        assert not fp.same_fingerprints(xs, keys)


def test_prepared_calls_inside_inference_mode_keep_the_memo():
    manager = _manager()
    caches = _caches(6)
    prepared = kc.prepare(manager, caches)
    objects = prepared.store(IDS)
    with torch.inference_mode():
        for _ in range(3):
            prepared.store(IDS, objects)
        _requires_grad_or_retype = CHANGES["data=view(dtype)"]
        _requires_grad_or_retype(caches[1])
        with pytest.raises(kc.KVGroupsValueError, match="kv_caches changed since"):
            prepared.store(IDS, objects)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_alters_the_fingerprint(change):
    x = _caches(7)[0]
    keys = fp.fingerprints([x])
    assert fp.same_fingerprints([x], keys)
    CHANGES[change](x)
    assert not fp.same_fingerprints([x], keys)
    assert fp.fingerprints([x]) != keys


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("api", ["one-shot", "prepared"])
def test_storage_shrunk_in_place_is_refused_before_any_byte_moves(direction, api):
    # Two dtypes: two kernel groups, the second layer's in the second. Its storage shrunk in
    # place (the data pointer kept on the CPU) must be refused before the first group moves.
    caches = [_caches(1)[0], _caches(2)[1].view(torch.int16)]
    m = kc.KVLayerGroupsManager(
        caches, [F.NL_X_TWO_NB_BS_NH_HS] * LAYERS, lmcache_tokens_per_chunk=CHUNK
    )
    assert m.num_kernel_groups == 2
    objects = kc.store(m, caches, IDS)
    prepared = kc.prepare(m, caches)
    call = {
        ("one-shot", "store"): lambda: kc.store(m, caches, IDS, objects),
        ("one-shot", "load"): lambda: kc.load(m, objects, caches, IDS),
        ("prepared", "store"): lambda: prepared.store(IDS, objects),
        ("prepared", "load"): lambda: prepared.load(objects, IDS),
    }[api, direction]
    call()  # warm: the binding is made (and parked for the one-shot call)
    for c in caches:
        c.view(torch.int16).add_(1)
    objects[0].add_(3)
    before = [c.clone() for c in caches] + [o.clone() for o in objects]
    storage = caches[1].untyped_storage()
    storage.resize_(storage.nbytes() // 2)
    with pytest.raises(
        kc.KVGroupsValueError,
        match=r"caches\[1\]: expected a storage of at "
        r"least \d+ bytes .*got \d+ bytes",
    ):
        call()
    assert torch.equal(caches[0].view(torch.int16), before[0].view(torch.int16))  # NaN bits
    assert torch.equal(objects[0], before[2])
