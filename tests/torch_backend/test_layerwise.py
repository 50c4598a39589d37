"""kvgroups_torch.LayerwiseLoad / LayerwiseSave on CPU tensors: the bytes of the whole-model
calls, each layer's bytes appearing at its wait (not before), the same prepared calls in the
same order as on the GPU, and typed errors. The GPU side is
tests/torch_backend/test_layerwise_gpu.py."""

import numpy as np
import pytest
import torch
from kvgroups_torch import LayerwiseLoad, LayerwiseSave

import kvgroups_core as kc
from kvgroups_core.errors import (
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    UnsupportedConfigError,
)
from tests.support.torch_engine_cases import (
    cache_bytes,
    ids_for,
    model_caches,
    object_bytes,
    random_objects,
    reference_load,
    reference_store,
)
from tests.support.torch_layerwise_cases import (
    Recording,
    Step,
    check_save_many_refuses_before_any_byte_moves,
    check_start_many_refuses_before_any_byte_moves,
)

MODELS = ["llama3-8b", "gpt-oss-20b"]  # one engine group; two, one of them with a window
LAYERS = 4


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("per_launch", [1, 3])
def test_layerwise_load_gives_the_whole_model_load_bytes_each_layer_at_its_wait(name, per_launch):
    manager, caches = model_caches(name, layers=LAYERS, seed=1)
    ids = ids_for(manager, np.random.default_rng(2), 2)
    objects = random_objects(manager, 2, seed=3)
    before = cache_bytes(caches)
    want = reference_load(manager, objects, caches, ids, skip=64)
    loads = LayerwiseLoad(kc.prepare(manager, caches), layers_per_launch=per_launch)
    loads.start(objects, ids, skip_first_n_tokens=64)
    assert loads.pending
    for got, b in zip(cache_bytes(caches), before):  # nothing runs before a wait on CPU
        np.testing.assert_array_equal(got, b)
    for layer in range(LAYERS):
        loads.wait(layer)
        step = layer // per_launch
        for other, (got, w, b) in enumerate(zip(cache_bytes(caches), want, before)):
            # Layers of the steps up to this one are loaded, later ones untouched.
            np.testing.assert_array_equal(got, w if other // per_launch <= step else b)
    loads.finish()
    assert not loads.pending
    for got, w in zip(cache_bytes(caches), want):
        np.testing.assert_array_equal(got, w)


def test_a_forward_pass_that_waits_computes_on_the_loaded_bytes_and_one_that_skips_does_not():
    # A stand-in forward: layer l reads the pages its load writes. With the wait it sees the
    # loaded bytes; without, the CPU emulation shows what a GPU race would (the old bytes).
    manager, caches = model_caches("llama3-8b", layers=LAYERS, seed=4)
    host_ids = ids_for(manager, np.random.default_rng(5), 2)
    ids = torch.as_tensor(np.asarray(host_ids))
    objects = random_objects(manager, 2, seed=6)
    want = reference_load(manager, objects, caches, host_ids)

    def forward(wait: bool):
        loads = LayerwiseLoad(kc.prepare(manager, caches))
        loads.start(objects, ids)
        seen = []
        for layer in range(LAYERS):
            if wait:
                loads.wait(layer)
            seen.append(caches[layer][:, ids].contiguous().view(torch.uint8).clone())
        loads.finish()
        return seen

    saved = [c.clone() for c in caches]
    skipped = forward(wait=False)
    for c, s in zip(caches, saved):
        c.copy_(s)
    waited = forward(wait=True)
    for layer in range(LAYERS):
        expect = (
            torch.from_numpy(want[layer])
            .view(caches[layer].dtype)
            .view(caches[layer].shape)[:, ids]
            .contiguous()
            .view(torch.uint8)
        )
        assert torch.equal(waited[layer], expect)
        assert not torch.equal(skipped[layer], expect)


@pytest.mark.parametrize("name", MODELS)
def test_start_many_queues_every_transfer_layer_by_layer_in_the_gpu_order(name):
    manager, caches = model_caches(name, layers=LAYERS, seed=7)
    rng = np.random.default_rng(8)
    ids_a, ids_b = ids_for(manager, rng, 1), ids_for(manager, rng, 1)
    obj_a, obj_b = random_objects(manager, 1, seed=9), random_objects(manager, 1, seed=10)
    # The bytes: all of a, then all of b (layers are independent, so per layer a then b).
    after_a = [
        torch.from_numpy(b).view(c.dtype).view(c.shape)
        for b, c in zip(reference_load(manager, obj_a, caches, ids_a), caches)
    ]
    want = reference_load(manager, obj_b, after_a, ids_b)
    rec = Recording(kc.prepare(manager, caches))
    loads = LayerwiseLoad(rec)
    loads.start_many([(obj_a, ids_a), (obj_b, ids_b, 0)])
    assert rec.calls == []
    loads.wait(1)
    assert rec.calls == [
        ("load", (0,), id(obj_a[0])),
        ("load", (0,), id(obj_b[0])),
        ("load", (1,), id(obj_a[0])),
        ("load", (1,), id(obj_b[0])),
    ]
    loads.finish()
    order = [(layer, o) for layer in range(LAYERS) for o in (id(obj_a[0]), id(obj_b[0]))]
    assert [(c[1][0], c[2]) for c in rec.calls] == order
    for got, w in zip(cache_bytes(caches), want):
        np.testing.assert_array_equal(got, w)


def test_a_second_start_before_the_waits_is_covered_by_them_in_issue_order():
    manager, caches = model_caches("llama3-8b", layers=LAYERS, seed=11)
    rng = np.random.default_rng(12)
    ids = ids_for(manager, rng, 1)
    first, second = random_objects(manager, 1, seed=13), random_objects(manager, 1, seed=14)
    rec = Recording(kc.prepare(manager, caches))
    loads = LayerwiseLoad(rec)
    loads.start(first, ids)
    loads.start(second, ids)  # same blocks: the later load wins, as on one side stream
    loads.wait(0)
    # Waiting for layer 0 covers everything queued before its latest record: all of the
    # first start and layer 0 of the second.
    assert [(c[1][0], c[2]) for c in rec.calls] == (
        [(layer, id(first[0])) for layer in range(LAYERS)] + [(0, id(second[0]))]
    )
    loads.finish()
    want = reference_load(manager, second, caches, ids)
    for got, w in zip(cache_bytes(caches), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("name", MODELS)
def test_layerwise_saves_equal_the_whole_model_store_and_touch_only_their_layer(name):
    manager, caches = model_caches(name, layers=LAYERS, seed=15)
    ids = ids_for(manager, np.random.default_rng(16), 2)
    want = reference_store(manager, caches, ids)
    objects = random_objects(manager, 2, seed=17)
    rec = Recording(kc.prepare(manager, caches))
    saves = LayerwiseSave(rec)
    for layer in range(LAYERS):
        before = object_bytes(objects)
        saves.save(layer, ids, objects)
        only = reference_store(
            manager, caches, ids, layers=[layer], objects=[torch.from_numpy(b) for b in before]
        )
        for got, w in zip(object_bytes(objects), only):
            np.testing.assert_array_equal(got, w)  # this layer's regions, nothing else
    saves.finish()
    for got, w in zip(object_bytes(objects), want):
        np.testing.assert_array_equal(got, w)
    assert rec.calls == [("store", (layer,), id(objects[0])) for layer in range(LAYERS)]


def test_a_layer_subset_loads_only_those_layers():
    manager, caches = model_caches("llama3-8b", layers=LAYERS, seed=18)
    ids = ids_for(manager, np.random.default_rng(19), 1)
    objects = random_objects(manager, 1, seed=20)
    before = cache_bytes(caches)
    want = reference_load(manager, objects, caches, ids)
    loads = LayerwiseLoad(kc.prepare(manager, caches), layers=[2, 0])
    loads.start(objects, ids)
    loads.wait(2)  # first in this order: layer 0 (queued after it) not yet
    np.testing.assert_array_equal(cache_bytes(caches)[2], want[2])
    np.testing.assert_array_equal(cache_bytes(caches)[0], before[0])
    loads.finish()
    for layer, (got, w, b) in enumerate(zip(cache_bytes(caches), want, before)):
        np.testing.assert_array_equal(got, w if layer in (0, 2) else b)


def test_waits_and_finish_without_a_start_do_nothing():
    manager, caches = model_caches("llama3-8b", layers=LAYERS, seed=21)
    before = cache_bytes(caches)
    loads = LayerwiseLoad(kc.prepare(manager, caches))
    loads.wait(3)
    loads.finish()
    LayerwiseSave(kc.prepare(manager, caches)).finish()
    for got, b in zip(cache_bytes(caches), before):
        np.testing.assert_array_equal(got, b)


def test_bad_arguments_are_refused_with_typed_errors():
    manager, caches = model_caches("llama3-8b", layers=LAYERS, seed=22)
    prep = kc.prepare(manager, caches)
    ids = ids_for(manager, np.random.default_rng(23), 1)
    objects = random_objects(manager, 1, seed=24)
    with pytest.raises(KVGroupsValueError, match="layers_per_launch: expected a positive int"):
        LayerwiseLoad(prep, layers_per_launch=0)
    with pytest.raises(KVGroupsValueError, match="max_ctas: expected a positive int"):
        LayerwiseLoad(prep, max_ctas=0)
    with pytest.raises(KVGroupsIndexError, match=r"layers: expected indices .* got \[9\]"):
        LayerwiseLoad(prep, layers=[0, 9])
    with pytest.raises(KVGroupsValueError, match="layers: expected distinct"):
        LayerwiseLoad(prep, layers=[1, 1])
    with pytest.raises(KVGroupsValueError, match="stream: expected None for caches on cpu"):
        LayerwiseLoad(prep, stream=object())
    loads = LayerwiseLoad(prep, layers=[0, 1])
    with pytest.raises(
        KVGroupsIndexError,
        match=r"layer: expected one of the loaded layers "
        r"\[0, 1\], got 3",
    ):
        loads.wait(3)
    with pytest.raises(KVGroupsTypeError, match=r"transfers\[0\]: expected \(objects, block_ids"):
        loads.start_many([objects])
    saves = LayerwiseSave(prep)
    with pytest.raises(KVGroupsIndexError, match="layer: expected one of the manager's grouped"):
        saves.save(7, ids, objects)
    with pytest.raises(
        UnsupportedConfigError, match="mark: expected a LayerwiseSave built with graph_marks=True"
    ):
        saves.mark(0)
    with pytest.raises(
        KVGroupsTypeError, match="prepared: expected a transfer prepared on torch tensors"
    ):
        LayerwiseLoad(kc.prepare(manager, [c.numpy() for c in caches]))


def test_a_refused_load_raises_at_start_and_moves_nothing():
    manager, caches = model_caches("llama3-8b", layers=LAYERS, seed=25)
    objects = random_objects(manager, 1, seed=26)
    before = cache_bytes(caches)
    loads = LayerwiseLoad(kc.prepare(manager, caches))
    bad = np.full(manager.calculate_num_blocks(0, manager.lmcache_tokens_per_chunk), 48)
    with pytest.raises(KVGroupsIndexError, match=r"block_ids"):
        loads.start(objects, bad)  # as on the GPU: refused by start, nothing left pending
    assert not loads.pending
    loads.finish()
    for got, b in zip(cache_bytes(caches), before):
        np.testing.assert_array_equal(got, b)


def test_start_many_refuses_a_bad_transfer_before_any_transfer_moves_a_byte():
    # tests/torch_backend/test_layerwise_gpu.py runs the same check on CUDA.
    check_start_many_refuses_before_any_byte_moves("cpu")


def test_save_many_refuses_a_bad_transfer_before_any_store_moves_a_byte():
    # tests/torch_backend/test_layerwise_gpu.py runs the same check on CUDA.
    check_save_many_refuses_before_any_byte_moves("cpu")


def test_arguments_of_the_wrong_type_are_refused_with_typed_errors_naming_them():
    manager, caches = model_caches("llama3-8b", layers=LAYERS, seed=29)
    prep = kc.prepare(manager, caches)
    ids = ids_for(manager, np.random.default_rng(30), 1)
    objects = random_objects(manager, 1, seed=31)
    before = cache_bytes(caches)
    refused = [
        (
            lambda: LayerwiseLoad(prep, layers_per_launch=None),
            KVGroupsValueError,
            "layers_per_launch: expected a positive int, got None",
        ),
        (
            lambda: LayerwiseLoad(prep, layers_per_launch=True),
            KVGroupsValueError,
            "layers_per_launch",
        ),
        (lambda: LayerwiseLoad(prep, max_ctas=2.0), KVGroupsValueError, "max_ctas"),
        (lambda: LayerwiseLoad(prep, layers=0), KVGroupsTypeError, "layers: expected a sequence"),
        (
            lambda: LayerwiseLoad(prep, layers="01"),
            KVGroupsTypeError,
            "layers: expected a sequence",
        ),
        (lambda: LayerwiseLoad(prep, layers=[True]), KVGroupsTypeError, "layers: expected int"),
        (lambda: LayerwiseLoad(prep, layers=[0.0]), KVGroupsTypeError, "layers: expected int"),
        (
            lambda: LayerwiseLoad(prep, layers=[]),
            KVGroupsValueError,
            "layers: expected at least one",
        ),
        (
            lambda: LayerwiseLoad(None),
            KVGroupsTypeError,
            "prepared: expected a PreparedTransfer.*got NoneType",
        ),
        (
            lambda: LayerwiseLoad(manager),
            KVGroupsTypeError,
            "prepared: expected a PreparedTransfer.*KVLayerGroupsManager",
        ),
        (
            lambda: LayerwiseSave(manager),
            KVGroupsTypeError,
            "prepared: expected a PreparedTransfer",
        ),
        (
            lambda: LayerwiseLoad(prep).start_many(None),
            KVGroupsTypeError,
            "transfers: expected a list.*NoneType",
        ),
        (
            lambda: LayerwiseLoad(prep).start_many((objects, ids)),
            KVGroupsTypeError,
            r"transfers\[0\]",
        ),
        (
            lambda: LayerwiseSave(prep).save_many(0, None),
            KVGroupsTypeError,
            "transfers: expected a list.*NoneType",
        ),
        (
            lambda: LayerwiseLoad(prep).wait(True),
            KVGroupsTypeError,
            "layer: expected an int layer index, got True",
        ),
        (
            lambda: LayerwiseLoad(prep).wait(0.0),
            KVGroupsTypeError,
            "layer: expected an int layer index, got 0.0",
        ),
        (lambda: LayerwiseLoad(prep).wait(None), KVGroupsTypeError, "layer: expected an int"),
        (
            lambda: LayerwiseSave(prep).save(True, ids, objects),
            KVGroupsTypeError,
            "layer: expected an int",
        ),
        (
            lambda: LayerwiseSave(prep).save([0], ids, objects),
            KVGroupsTypeError,
            "layer: expected an int",
        ),
        (
            lambda: LayerwiseSave(prep, graph_marks=True).mark(1.0),
            KVGroupsTypeError,
            "layer: expected an int",
        ),
    ]
    for call, error, pattern in refused:
        with pytest.raises(error, match=pattern):
            call()
    # NumPy integers are layer indices, as for layers= of the prepared calls.
    loads = LayerwiseLoad(prep, layers=np.array([1, 0]))
    assert loads.layers == (1, 0) and all(type(x) is int for x in loads.layers)
    loads.start(objects, ids)
    loads.wait(np.int64(1))
    loads.finish()
    want = reference_load(
        manager, objects, [torch.from_numpy(b) for b in before], ids, layers=[0, 1]
    )
    for got, w in zip(cache_bytes(caches), want):  # layers 0 and 1 loaded, the rest as before
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("name", MODELS)
def test_the_gpu_tests_forward_sees_the_loaded_pages_on_cpu_only_with_its_waits(name):
    # tests/torch_backend/test_layerwise_gpu.py's step, eagerly on CPU (its content check included).
    step = Step("cpu", "device", seed=27, name=name, layers=LAYERS)
    step.new_objects(28)

    def forward(waits):
        loads = LayerwiseLoad(step.prep)
        loads.start(step.objects, step.ids)
        for layer in range(LAYERS):
            if waits:
                loads.wait(layer)
            step.compute(layer)
        loads.finish()

    forward(waits=False)
    assert step.mismatched_layers() == list(range(LAYERS))
    step.reset_caches()
    forward(waits=True)
    step.check()
