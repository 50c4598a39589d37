"""The copy-engine path on a GPU (``path="copy_engine"``: one ``cuMemcpyBatchAsync`` per
call) against the kernel and the NumPy reference, bit for bit: objects in GPU and in pinned
host memory, store and load, layer subsets, prefix skips, several formats (NHD, HND, MLA,
MLA + blocked-scale indexer, sliding windows); bytes the call does not own stay as they
were; device ids are refused; stream order holds on the legacy default stream and on a side
stream; ``"auto"`` follows a table; :func:`tune_copy_paths` measures. Skipped without CUDA."""

import numpy as np
import pytest
import torch

import kvgroups_core as kc
from kvgroups_core.errors import KVGroupsValueError
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS
from tests.support.cuda_marks import needs_cuda

pytestmark = needs_cuda

if torch.cuda.is_available():
    from kvgroups_torch.copy_engine import batch as copy_engine
    from kvgroups_torch.copy_engine import paths as copy_paths

CHUNK = 64
MODELS_UNDER_TEST = [
    ("llama3-8b", None),
    ("llama3-8b", F.NL_X_TWO_NB_NH_BS_HS),  # HND: one copy per head and token
    ("deepseek-v3", None),  # MLA
    ("glm5-indexer", None),  # MLA + the indexer's blocked scales, two kernel groups
    ("gpt-oss-20b", None),  # two engine groups, one with a sliding window
]


def _setup(name, fmt, seed=0, layers=4, num_blocks=48):
    model = MODELS[name].build(num_blocks=num_blocks, layers=layers, dtype="float16", fmt=fmt)
    rng = np.random.default_rng(seed)
    caches = []
    for spec in model.kv_caches:
        dtype = np.uint8 if spec.dtype.name == "uint8" else np.float16
        raw = rng.integers(
            0, 256, int(np.prod(spec.shape)) * np.dtype(dtype).itemsize, dtype=np.uint8
        )
        caches.append(torch.from_numpy(raw.view(dtype).reshape(spec.shape)).cuda())
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


def _objects(manager, placement, seed):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(manager.num_object_groups):
        t = torch.from_numpy(
            rng.integers(0, 256, (3, kc.object_nbytes(manager, g)), dtype=np.uint8)
        )
        out.append(t.cuda() if placement == "device" else t.pin_memory())
    return out


def _host(tensors):
    return [t.detach().cpu().numpy().copy() for t in tensors]


def _bytes(arrays):
    return [np.ascontiguousarray(a).view(np.uint8) for a in arrays]


@pytest.mark.parametrize("placement", ["device", "pinned"])
@pytest.mark.parametrize("name,fmt", MODELS_UNDER_TEST)
def test_copy_engine_store_equals_kernel_and_reference(name, fmt, placement):
    manager, caches, ids = _setup(name, fmt, seed=1)
    prep = kc.prepare(manager, caches)
    for layers in (None, [1, 3]):
        # Objects start random: a layer subset must leave the other layers' rows alone.
        start = _objects(manager, placement, seed=2)
        want = kc.store(
            manager,
            _host(caches),
            ids,
            _host(start),
            backend="numpy",
            **({} if layers is None else {"layers": layers}),
        )
        by_path = {}
        for path in ("copy_engine", "kernel"):
            objects = [
                o.clone().pin_memory() if placement == "pinned" else o.clone() for o in start
            ]
            prep.store(ids, objects, layers=layers, path=path)
            torch.cuda.synchronize()
            by_path[path] = _host(objects)
        for got_ce, got_k, ref in zip(by_path["copy_engine"], by_path["kernel"], want):
            np.testing.assert_array_equal(got_ce, np.asarray(ref))
            np.testing.assert_array_equal(got_k, np.asarray(ref))


@pytest.mark.parametrize("placement", ["device", "pinned"])
@pytest.mark.parametrize("name,fmt", MODELS_UNDER_TEST)
def test_copy_engine_load_equals_kernel_and_reference(name, fmt, placement):
    manager, base, ids = _setup(name, fmt, seed=3)
    objects = _objects(manager, placement, seed=4)
    for kw in (
        {},
        {"layers": [0, 2]},
        {"skip_first_n_tokens": 80},
        {"skip_first_n_tokens": 130, "layers": [3]},
    ):
        want = _host(base)
        kc.load(manager, _host(objects), want, ids, backend="numpy", **kw)
        for path in ("copy_engine", "kernel"):
            caches = [c.clone() for c in base]  # every block not loaded must stay as it was
            kc.load(manager, objects, caches, ids, path=path, **kw)
            torch.cuda.synchronize()
            for got, ref in zip(_bytes(_host(caches)), _bytes(want)):
                np.testing.assert_array_equal(got, ref, err_msg=f"{path} {kw}")


def test_one_shot_store_with_per_chunk_pinned_buffers():
    manager, caches, ids = _setup("llama3-8b", None, seed=5)
    want = kc.store(manager, _host(caches), ids, backend="numpy")
    rows = [
        torch.zeros(kc.object_nbytes(manager, 0), dtype=torch.uint8).pin_memory() for _ in range(3)
    ]
    kc.store(manager, caches, ids, [rows], path="copy_engine")
    torch.cuda.synchronize()
    np.testing.assert_array_equal(np.stack([r.numpy() for r in rows]), np.asarray(want[0]))


def test_device_ids_with_copy_engine_are_refused_and_nothing_moves():
    manager, caches, ids = _setup("llama3-8b", None, seed=6)
    objects = _objects(manager, "device", seed=7)
    before = _host(objects)
    device_ids = torch.as_tensor(ids, device="cuda")
    with pytest.raises(KVGroupsValueError, match="path: expected host block ids"):
        kc.store(manager, caches, device_ids, objects, path="copy_engine")
    with pytest.raises(KVGroupsValueError, match="path: .*device skip_first_n_tokens"):
        kc.load(
            manager,
            objects,
            caches,
            ids,
            path="copy_engine",
            skip_first_n_tokens=torch.tensor(64, device="cuda"),
        )
    torch.cuda.synchronize()
    for got, ref in zip(_host(objects), before):
        np.testing.assert_array_equal(got, ref)
    kc.store(manager, caches, device_ids, objects)  # "auto": the kernel takes device ids


@pytest.mark.parametrize("side", [False, True])
def test_copy_engine_keeps_stream_order(side):
    """Caches rewritten by a kernel right before the store, objects read right after: on the
    legacy default stream (the batch goes to the per-thread stream, which synchronises with
    it) and on a side stream."""
    manager, caches, ids = _setup("llama3-8b", None, seed=8, num_blocks=4096)
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        objects = [torch.empty((3, kc.object_nbytes(manager, 0)), dtype=torch.uint8, device="cuda")]
        for k, c in enumerate(caches):
            c.fill_(k + 7)  # big enough that an unordered copy would read old bytes
        prep = kc.prepare(manager, caches)
        prep.store(ids, objects, path="copy_engine")
        copied = objects[0].clone()
    torch.cuda.synchronize()
    want = kc.store(manager, _host(caches), ids, backend="numpy")
    np.testing.assert_array_equal(copied.cpu().numpy(), np.asarray(want[0]))


def test_copy_engine_never_synchronises():
    manager, caches, ids = _setup("llama3-8b", None, seed=9)
    prep = kc.prepare(manager, caches)
    device, pinned = _objects(manager, "device", 1), _objects(manager, "pinned", 2)
    prep.store(ids, device, path="copy_engine")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prep.store(ids, device, path="copy_engine")
        prep.store(ids, pinned, path="copy_engine")
        prep.load(pinned, ids, path="copy_engine")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_auto_takes_the_copy_engine_where_the_table_says(monkeypatch):
    manager, caches, ids = _setup("llama3-8b", None, seed=10)
    batches = []
    real = copy_engine.enqueue
    monkeypatch.setattr(copy_engine, "enqueue", lambda *a: batches.append(real(*a)))
    points = [
        copy_paths.Point(d, p, 4096, 4, 2.0, 1.0)
        for d in ("store", "load")
        for p in ("device", "pinned")
    ]
    index = torch.cuda.current_device()
    copy_paths.set_table(index, copy_paths.PathTable(points))
    try:
        objects = _objects(manager, "pinned", 11)
        want = kc.store(manager, _host(caches), ids, backend="numpy")
        kc.store(manager, caches, ids, objects)
        torch.cuda.synchronize()
        assert batches and batches[0] > 0
        np.testing.assert_array_equal(objects[0].numpy(), np.asarray(want[0]))
        batches.clear()
        kc.store(manager, caches, ids, objects, path="kernel")
        assert not batches
    finally:
        copy_paths.forget_tables()


def test_tune_copy_paths_measures_both_paths(tmp_path, monkeypatch):
    monkeypatch.setenv(copy_paths.ENV_DIR, str(tmp_path))
    try:
        table = copy_paths.tune_copy_paths(
            page_sizes=(4096, 65536), chunk_counts=(1, 8), layers=2, iters=2
        )
        assert len(table.points) == 2 * 2 * 2 * 2
        assert all(p.kernel_ms > 0 and p.copy_engine_ms > 0 for p in table.points)
        files = list(tmp_path.glob("copy_paths-*.json"))
        assert len(files) == 1
        copy_paths.forget_tables()
        assert copy_paths.table_for(torch.cuda.current_device()).points == table.points
    finally:
        copy_paths.forget_tables()


def test_auto_keeps_the_kernel_while_a_graph_is_captured(monkeypatch):
    manager, caches, ids = _setup("llama3-8b", None, seed=12)
    prep = kc.prepare(manager, caches)
    batches = []
    real = copy_engine.enqueue
    monkeypatch.setattr(copy_engine, "enqueue", lambda *a: batches.append(real(*a)))
    points = [copy_paths.Point(d, "device", 32768, 3, 2.0, 1.0) for d in ("store", "load")]
    copy_paths.set_table(torch.cuda.current_device(), copy_paths.PathTable(points))
    try:
        objects = _objects(manager, "device", 13)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prep.store(ids, objects)  # eager: the table's choice
        torch.cuda.current_stream().wait_stream(side)
        assert len(batches) == 1
        for o in objects:
            o.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prep.store(ids, objects)  # captured: the kernel (host ids baked in)
        assert len(batches) == 1
        graph.replay()
        torch.cuda.synchronize()
        want = kc.store(manager, _host(caches), ids, backend="numpy")
        np.testing.assert_array_equal(objects[0].cpu().numpy(), np.asarray(want[0]))
    finally:
        copy_paths.forget_tables()
