"""The call memo on the CUDA path's host side, without a GPU: the emulated launches of
test_torch_launch_emulated (CPU tensors standing in for CUDA ones and for device ids) record
every packed parameter a launch reads, so a warm call (cuda_repeat.PlanRepeater) is compared with
the cold call of the same inputs field by field: a memo hit can never launch stale params."""

import numpy as np
import pytest
import torch
from kvgroups_cuda import params as P

from kvgroups_core.errors import KVGroupsError
from kvgroups_core.transfer import api as transfer
from tests.support.torch_engine_cases import cache_bytes, object_bytes
from tests.torch_backend import test_torch_launch_emulated as emu
from tests.torch_backend.test_torch_launch_emulated import _emulated_prepare, device_ids, emulated  # noqa: F401

_FIELDS = (
    "ids_mode",
    "obj_mode",
    "obj_base",
    "obj_chunk_stride",
    "first_item",
    "num_items",
    "items_per_cta",
    "num_tiles",
    "skip_mode",
    "num_planes",
    "block_stride",
    "num_blocks",
    "region_offset",
    "row_bytes",
    "page_obj_stride",
    "blocks_per_chunk",
    "kept_per_chunk",
    "num_runs",
    "err_engine_group",
    "err_kernel_group",
)


def _params_of(p, name, grid) -> dict:
    """What the kernel reads of one launch: every scalar, the ids (address, or the inline
    values it reads), the plane table's contents."""
    out = {f: getattr(p, f) for f in _FIELDS}
    out.update(kernel=name, grid=tuple(grid))
    chunks = -(-(p.first_item + p.num_items) // p.kept_per_chunk)
    if p.ids_mode == P.IDS_INLINE32:
        out["ids"] = list(p.inline_ids[: chunks * p.blocks_per_chunk])
    else:
        out["ids"] = p.ids
    out["planes"] = emu._read(p.plane_table, 16 * p.num_planes).tobytes()
    return out


@pytest.fixture
def recorded(device_ids, monkeypatch):  # noqa: F811 - the fixture imported above
    """Launches record their params instead of moving bytes (the bytes of warm calls are
    test_warm_calls_with_new_ids_and_objects_move_the_bytes_of_the_cpu_path's)."""
    seen = []

    def recording(p, name, grid, launches):
        seen.append(_params_of(p, name, grid))
        launches.append((name, tuple(grid), p.items_per_cta))

    monkeypatch.setattr(emu, "emulate", recording)
    return seen


def _prepared(layers=4, seed=0):
    from tests.support.torch_engine_cases import model_caches

    manager, caches = model_caches("llama3-8b", layers=layers, num_blocks=12, seed=seed, chunk=64)
    return manager, caches, _emulated_prepare(manager, caches)


def _call(prep, direction, ids, objects, kw):
    if direction == "store":
        prep.store(ids, objects, **kw)
    else:
        prep.load(objects, ids, **kw)


def test_warm_launches_write_the_params_of_cold_launches(recorded, planned, monkeypatch):
    manager, caches, prep = _prepared()
    bpc = manager.calculate_num_blocks(0, 64)
    rng = np.random.default_rng(1)
    buffers = {
        (n, w): [torch.zeros((n, b), dtype=torch.uint8) for b in prep.binding.object_nbytes]
        for n in (1, 2)
        for w in (0, 1)
    }
    calls = []
    for rnd in range(4):  # new id values every round; the rest cycles over two rounds
        odd = (rnd // 2) % 2
        for n in (1, 2):
            host = rng.permutation(12)[: n * bpc]
            for ids in (torch.from_numpy(host.astype(np.int32)), host.astype(np.int64)):
                objects = buffers[(n, rnd % 2)]
                calls += [
                    ("store", ids, objects, {}),
                    ("store", ids, objects, {"layers": [odd]}),
                    ("load", ids, objects, {"layers": [3 - odd]}),
                    ("load", ids, objects, {"skip_first_n_tokens": 16 * odd}),
                    ("store", ids, objects, {"layers": [0, 2], "max_ctas": 1 + odd}),
                ]
    warm, hits = [], 0
    for direction, ids, objects, kw in calls:
        before_launch, before_plan = len(recorded), planned[0]
        _call(prep, direction, ids, objects, kw)
        hits += planned[0] == before_plan
        warm.append(recorded[before_launch:])
    assert hits >= len(calls) // 4, "the memo was not used"
    monkeypatch.setattr(transfer, "call_key", lambda *a, **k: None)
    for i, (direction, ids, objects, kw) in enumerate(calls):
        before_launch = len(recorded)
        _call(prep, direction, ids, objects, kw)
        assert recorded[before_launch:] == warm[i], f"call {i}: {direction} {kw}"


def test_warm_calls_with_new_ids_and_objects_move_the_bytes_of_the_cpu_path(device_ids):  # noqa: F811
    from tests.support.torch_engine_cases import model_caches

    manager, caches, prep = _prepared(seed=2)
    _, twin = model_caches("llama3-8b", layers=4, num_blocks=12, seed=2, chunk=64)
    ref = transfer.prepare(manager, twin, backend="torch")
    bpc = manager.calculate_num_blocks(0, 64)
    rng = np.random.default_rng(3)
    for call in range(8):
        host = rng.permutation(12)[: 2 * bpc]
        ids = torch.from_numpy(host.astype(np.int32)) if call % 2 else host
        objects = [
            torch.from_numpy(rng.integers(0, 256, (2, b), dtype=np.uint8))
            for b in prep.binding.object_nbytes
        ]  # new buffers every call
        layer = [call % 4]
        got = [o.clone() for o in objects]
        prep.store(ids, got, layers=layer)
        want = ref.store(host, [o.clone() for o in objects], layers=layer)
        for a, b in zip(object_bytes(got), object_bytes(want)):
            np.testing.assert_array_equal(a, b, err_msg=f"store {call}")
        prep.load(objects, ids, layers=layer)
        ref.load(objects, host, layers=layer)
        for a, b in zip(cache_bytes(caches), cache_bytes(twin)):
            np.testing.assert_array_equal(a, b, err_msg=f"load {call}")


@pytest.mark.parametrize("case", ["longer", "not_whole_chunks", "float32", "int16", "two_dims"])
def test_warm_memo_refuses_device_ids_a_cold_call_refuses(recorded, planned, monkeypatch, case):
    manager, caches, prep = _prepared(seed=4)
    bpc = manager.calculate_num_blocks(0, 64)
    ids = torch.arange(bpc, dtype=torch.int32)
    objects = [torch.zeros((1, b), dtype=torch.uint8) for b in prep.binding.object_nbytes]
    for _ in range(2):
        prep.store(ids, objects, layers=[1])
    count = planned[0]
    prep.store(ids, objects, layers=[1])
    assert planned[0] == count, "not warm"
    bad = {
        "longer": torch.arange(2 * bpc, dtype=torch.int32),  # valid, but 2 chunks
        "not_whole_chunks": torch.arange(bpc + 1, dtype=torch.int32),
        "float32": ids.float(),
        "int16": ids.to(torch.int16),
        "two_dims": ids.view(1, -1),
    }[case]
    before = [b.copy() for b in object_bytes(objects) + cache_bytes(caches)]
    launches = len(recorded)

    def refusal():
        with pytest.raises(KVGroupsError) as info:
            prep.store(bad, objects, layers=[1])
        return type(info.value), str(info.value)

    warm = refusal()
    monkeypatch.setattr(transfer, "call_key", lambda *a, **k: None)
    assert refusal() == warm
    assert len(recorded) == launches
    for a, b in zip(object_bytes(objects) + cache_bytes(caches), before):
        np.testing.assert_array_equal(a, b)
