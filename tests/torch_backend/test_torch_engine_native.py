import numpy as np
import pytest
import torch

import kvgroups_core as kc
from kvgroups_core.errors import KVGroupsIndexError
from kvgroups_core.transfer.objects import region_view
from tests.support.torch_engine_cases import (
    cache_bytes,
    ids_for,
    map_ids,
    model_caches,
    object_bytes,
    random_objects,
    reference_load,
    reference_store,
)

MODELS = ["llama3-8b", "gpt-oss-20b"]


def _tensor_ids(ids):
    return map_ids(ids, lambda v: torch.as_tensor(np.asarray(v), dtype=torch.int64))


def _layer_rows(manager, layer):
    """``(kernel group, position)`` of every kernel group holding ``layer``."""
    return [
        (k, list(g.layer_indices).index(layer))
        for k, g in enumerate(manager.kernel_groups)
        if layer in g.layer_indices
    ]


def _with_layer_from(manager, base, source, layer):
    """``base`` objects with ``layer``'s rows (every region holding it) taken from
    ``source``: what a store of that one layer into ``base`` must give."""
    out = [b.copy() for b in base]
    for k, pos in _layer_rows(manager, layer):
        og = next(
            i
            for i in range(manager.num_object_groups)
            if k in manager.object_groups[i].kernel_group_indices
        )
        want = region_view(manager, out[og], k)
        got = region_view(manager, source[og], k)
        want[:, :, pos] = got[:, :, pos]
    return out


@pytest.mark.parametrize("name", MODELS)
def test_layer_wise_stores_fill_only_their_layers_and_add_up_to_the_whole_model(name):
    manager, caches = model_caches(name, seed=1)
    prep = kc.prepare(manager, caches)
    ids = ids_for(manager, np.random.default_rng(2), 2)
    whole = reference_store(manager, caches, ids)
    objects = random_objects(manager, 2, seed=3)
    expected = object_bytes(objects)
    for layer in range(len(manager.engine_kv_formats)):
        prep.store(ids, objects, layers=[layer])
        expected = _with_layer_from(manager, expected, whole, layer)
        for got, want in zip(object_bytes(objects), expected):
            np.testing.assert_array_equal(got, want, err_msg=f"after layer {layer}")
    for got, want in zip(object_bytes(objects), whole):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", MODELS)
def test_layer_wise_loads_write_only_their_layers_caches(name):
    manager, caches = model_caches(name, seed=4)
    prep = kc.prepare(manager, caches)
    ids = ids_for(manager, np.random.default_rng(5), 2)
    objects = random_objects(manager, 2, seed=6)
    full = reference_load(manager, objects, caches, ids, skip=64)
    before = cache_bytes(caches)
    num_layers = len(manager.engine_kv_formats)
    for layer in range(num_layers):
        prep.load(objects, ids, skip_first_n_tokens=64, layers=[layer])
        now = cache_bytes(caches)
        for other in range(num_layers):  # one tensor per layer in these models
            want = full[other] if other <= layer else before[other]
            np.testing.assert_array_equal(now[other], want, err_msg=f"{layer}, {other}")


def test_layers_outside_the_manager_are_refused_before_any_byte_moves():
    manager, caches = model_caches("llama3-8b", seed=7)
    objects = random_objects(manager, 1, seed=8)
    before = object_bytes(objects)
    with pytest.raises(KVGroupsIndexError, match=r"layers: .*got \[9\]"):
        kc.store(manager, caches, np.arange(4), objects, layers=[9])
    for got, want in zip(object_bytes(objects), before):
        np.testing.assert_array_equal(got, want)


def _counting(backend, compiles):
    def compile_fn(gm, example_inputs):
        compiles.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(backend)(gm, example_inputs)

    return compile_fn


def _step(manager):
    def step(prepared, caches, ids, objects, loaded, skip):
        prepared.store(ids, objects)
        kc.load(manager, loaded, caches, ids, skip_first_n_tokens=skip, layers=[1])
        whole = kc.store(manager, caches, ids)
        prepared.load(loaded, ids, layers=[0])
        return whole

    return step


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_public_calls_equal_eager_and_reuse_the_graph_for_new_ids(backend):
    torch._dynamo.reset()
    manager, caches = model_caches("gpt-oss-20b", seed=9)
    twin = [c.clone() for c in caches]
    prep, twin_prep = kc.prepare(manager, caches), kc.prepare(manager, twin)
    compiles = []
    step = _step(manager)
    compiled = torch.compile(step, fullgraph=True, backend=_counting(backend, compiles))
    rng = np.random.default_rng(10)
    for call, chunks in enumerate((2, 2, 2, 1, 1)):
        ids = _tensor_ids(ids_for(manager, rng, chunks))
        loaded = random_objects(manager, chunks, seed=11 + call)
        skip = 32 * call % (64 * chunks)
        got_objects = random_objects(manager, chunks, seed=30 + call)
        want_objects = [o.clone() for o in got_objects]
        got = compiled(prep, caches, ids, got_objects, loaded, torch.tensor(skip))
        want = step(twin_prep, twin, ids, want_objects, [o.clone() for o in loaded], skip)
        for a, b in zip(
            object_bytes(got) + object_bytes(got_objects),
            object_bytes(want) + object_bytes(want_objects),
        ):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(cache_bytes(caches), cache_bytes(twin)):
            np.testing.assert_array_equal(a, b)
        # New ids (and skips) of the same chunk count reuse the graph; a new count retraces.
        assert len(compiles) == (1 if chunks == 2 else 2), (call, len(compiles))


def test_compiled_calls_with_out_of_range_cpu_ids_raise_typed_before_any_byte_moves():
    torch._dynamo.reset()
    manager, caches = model_caches("llama3-8b", seed=12)
    prep = kc.prepare(manager, caches)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def save(ids, objects):
        prep.store(ids, objects)
        return objects[0]

    objects = random_objects(manager, 2, seed=13)
    save(torch.arange(8), objects)
    before = object_bytes(objects)
    bad = torch.tensor([0, 1, 2, 48, 4, 5, 6, 7])
    with pytest.raises(KVGroupsIndexError, match=r"block_ids\[0\].*got 48"):
        save(bad, objects)
    for got, want in zip(object_bytes(objects), before):
        np.testing.assert_array_equal(got, want)


def _chain(exc):
    """``exc`` and every exception it was raised from or during."""
    seen = []
    while exc is not None and len(seen) < 16:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("case", ["float ids", "2-D ids", "unknown path"])
def test_compiled_calls_refused_at_trace_time_keep_the_typed_error(case, fullgraph):
    # A typed error raised while Dynamo traces: without fullgraph Dynamo runs the call eagerly
    # and the error is the caller's; with fullgraph=True Dynamo reports every error of its
    # trace as its own ``Unsupported``, raised from ours. Either way nothing moves.
    torch._dynamo.reset()
    manager, caches = model_caches("llama3-8b", seed=14)
    prep = kc.prepare(manager, caches)
    ids, kw, error = {
        "float ids": (torch.arange(8.0), {}, kc.KVGroupsTypeError),
        "2-D ids": (torch.arange(8).reshape(2, 4), {}, kc.KVGroupsTypeError),
        "unknown path": (torch.arange(8), {"path": "bogus"}, kc.KVGroupsValueError),
    }[case]
    objects = random_objects(manager, 2, seed=15)
    before = object_bytes(objects)

    @torch.compile(fullgraph=fullgraph, backend="aot_eager")
    def save(ids, objects):
        prep.store(ids, objects, **kw)
        return objects[0]

    with pytest.raises(Exception) as info:
        save(ids, objects)
    typed = [e for e in _chain(info.value) if isinstance(e, kc.KVGroupsError)]
    assert typed and isinstance(typed[0], error), _chain(info.value)
    if not fullgraph:
        assert info.value is typed[0]
    for got, want in zip(object_bytes(objects), before):
        np.testing.assert_array_equal(got, want)


def test_compile_plans_at_trace_time_without_reading_data():
    # A trace never reads a FakeTensor's data: the planner works from abstract descriptors.
    from kvgroups_torch.describe import describe_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2, 48, 16, 8, 128, dtype=torch.float16)
        desc = describe_tensor(fake)
    assert desc.is_abstract and desc.shape == (2, 48, 16, 8, 128)
    assert desc.strides == tuple(fake.stride()) and desc.data_ptr == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_nonstrict_traced_calls_on_fakes_record_ops_without_the_compiling_flag(monkeypatch, device):
    # Dynamo runs the nonstrict-traced public calls on fake tensors with
    # torch.compiler.is_compiling() unset (torch 2.11): fakes must still be recognised as
    # such (no .numpy(), no launch) and recorded as one custom op per call. Fake CUDA tensors
    # need no GPU.
    from kvgroups_torch.compile import dynamo as compiled
    from kvgroups_torch.compile import ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    manager, caches = model_caches("llama3-8b", seed=30)
    nbytes = kc.prepare(manager, caches).binding.object_nbytes
    recorded = []
    monkeypatch.setattr(ops, "store_pages", lambda *a: recorded.append(("store", a)))
    monkeypatch.setattr(ops, "load_pages", lambda *a: recorded.append(("load", a)))
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert not torch.compiler.is_compiling()
        fakes = [torch.empty(c.shape, dtype=c.dtype, device=device) for c in caches]
        ids = torch.empty(8, dtype=torch.int64, device=device)
        objects = [torch.empty((2, n), dtype=torch.uint8, device=device) for n in nbytes]
        skip = torch.empty((), dtype=torch.int64, device=device)
        assert compiled._traced_store(manager, fakes, ids, {"objects": objects}) == []
        made = compiled._traced_store(manager, fakes, ids, {"layers": [1]})
        assert (
            compiled._traced_load(manager, objects, fakes, ids, {"skip_first_n_tokens": skip}) == []
        )
    assert type(made) is list and [tuple(t.shape) for t in made] == [(2, n) for n in nbytes]
    assert [kind for kind, _ in recorded] == ["store", "store", "load"]
    store_ids, load_args = recorded[0][1][3], recorded[2][1]
    assert len(store_ids) == 1 and store_ids[0] is ids  # the fake ids travel, unread
    assert load_args[4] is skip


def test_cpu_tensor_ids_keep_host_semantics_in_eager_calls():
    manager, caches = model_caches("llama3-8b", seed=14)
    objects = random_objects(manager, 2, seed=15)
    before_objects, before_caches = object_bytes(objects), cache_bytes(caches)
    bad = torch.tensor([0, 1, 2, 3, 4, -1, 6, 7], dtype=torch.int32)
    with pytest.raises(KVGroupsIndexError, match=r"block_ids\[0\].*got -1"):
        kc.store(manager, caches, bad, objects)
    with pytest.raises(KVGroupsIndexError, match=r"block_ids\[0\].*got -1"):
        kc.prepare(manager, caches).load(objects, bad)
    for got, want in zip(object_bytes(objects), before_objects):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(cache_bytes(caches), before_caches):
        np.testing.assert_array_equal(got, want)
    good = bad.clone()
    good[5] = 5
    got = kc.store(manager, caches, good, objects)
    for a, b in zip(object_bytes(got), reference_store(manager, caches, good.numpy())):
        np.testing.assert_array_equal(a, b)


def test_check_errors_without_a_gpu_is_a_no_op():
    import kvgroups_torch

    assert kvgroups_torch.check_errors() is None
