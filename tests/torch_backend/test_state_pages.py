"""Recurrent state in vLLM's own page layout on the torch backend: conv and temporal states as
views of one padded int8 page per layer (Qwen3-Next-like GDN: conv (3, 512) bf16 + temporal
(4, 64, 64) f32 = 68,608 B in a 131,072-B page), attention beside; bytes against the NumPy
reference on the same memory, the padding and every other slot untouched. CPU here, CUDA (host
and device ids, a captured CUDA graph) under the ``gpu`` marker."""

import numpy as np
import pytest

from kvgroups_core import EngineGroupInfo, KVLayerGroupsManager, prepare, store
from kvgroups_core import EngineKVFormat as F
from tests.support.cuda_marks import needs_cuda

torch = pytest.importorskip("torch")

NB, PAGE, CONV, TEMPORAL = 8, 131072, (3, 512), (4, 64, 64)
CONV_BYTES, STATE_BYTES = 3 * 512 * 2, 3 * 512 * 2 + 4 * 64 * 64 * 4
CHUNK, TPB = 512, 256  # two blocks per chunk: a chunk keeps its second state id
PAD = 0xA5
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_cuda)]


def _model(device, seed):
    gen = torch.Generator().manual_seed(seed)
    caches, raws = [], []
    for layer in range(4):
        if layer % 2 == 0:  # a GDN layer: one int8 page, conv then temporal, then padding
            raw = torch.full((NB, PAGE), PAD, dtype=torch.uint8)
            raw[:, :STATE_BYTES] = torch.randint(
                0, 256, (NB, STATE_BYTES), dtype=torch.uint8, generator=gen
            )
            raw = raw.to(device)
            caches += [
                raw[:, :CONV_BYTES].view(torch.bfloat16).view(NB, *CONV),
                raw[:, CONV_BYTES:STATE_BYTES].view(torch.float32).view(NB, *TEMPORAL),
            ]
            raws.append(raw)
        else:  # attention, vLLM's [blocks, heads, tokens, K|V]
            bits = torch.randint(
                -(2**15), 2**15, (NB, 2, TPB, 128), dtype=torch.int16, generator=gen
            )
            caches.append(bits.view(torch.bfloat16).to(device))
    formats = [F.NL_X_NB_CW_CD, F.NL_X_NB_SH_SS, F.NL_X_NB_NH_BS_CS] * 2
    return (
        KVLayerGroupsManager(caches, formats, _infos(), lmcache_tokens_per_chunk=CHUNK),
        caches,
        raws,
    )


def _infos():
    return [
        EngineGroupInfo(0, (0, 3), TPB, recurrent_state=True),
        EngineGroupInfo(0, (1, 4), TPB, recurrent_state=True),
        EngineGroupInfo(1, (2, 5), TPB),
    ]


def _numpy_views(caches):
    # The same bytes as NumPy arrays of the same dtypes: the reference on identical memory.
    import ml_dtypes

    out = []
    for t in caches:
        t = t.cpu()
        if t.dtype == torch.bfloat16:
            out.append(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        else:
            out.append(t.numpy())
    return out


STORE_IDS = {0: [0, 3, 0, 6], 1: [1, 2, 4, 5]}
LOAD_IDS = {0: [0, 0, 0, 7], 1: [3, 6, 7, 0]}


@pytest.mark.parametrize("device", DEVICES)
def test_state_pages_round_trip_against_the_reference(device):
    m, src, src_raws = _model(device, 1)
    objs = prepare(m, src).store(STORE_IDS)
    attn_bytes = 2 * 2 * (2 * TPB * 128 * 2)  # 2 layers x 2 blocks of [2 heads, TPB, K|V]
    assert [tuple(o.shape) for o in objs] == [(2, 2 * STATE_BYTES), (2, attn_bytes)]
    views = _numpy_views(src)
    ref_m = KVLayerGroupsManager(
        views, list(m.engine_kv_formats), _infos(), lmcache_tokens_per_chunk=CHUNK
    )
    ref = store(ref_m, views, STORE_IDS, backend="numpy")
    for got, want in zip(objs, ref):
        assert np.array_equal(got.cpu().numpy(), want)

    dst_m, dst, dst_raws = _model(device, 2)
    before = [r.cpu().clone() for r in dst_raws]
    before_attn = [dst[i].cpu().clone() for i in (2, 5)]
    prepare(dst_m, dst).load(objs, LOAD_IDS)
    for raw, old, src_raw in zip(dst_raws, before, src_raws):
        raw = raw.cpu()
        changed = torch.nonzero((raw != old).any(dim=1)).flatten().tolist()
        assert changed == [7]  # only the request's slot
        assert torch.equal(raw[7, :STATE_BYTES], src_raw.cpu()[6, :STATE_BYTES])
        assert bool((raw[7, STATE_BYTES:] == PAD).all())  # the padding kept
    for j, layer in enumerate((2, 5)):
        got = dst[layer].cpu()
        for s, d in zip(STORE_IDS[1], LOAD_IDS[1]):
            assert torch.equal(got[d].view(torch.int16), src[layer].cpu()[s].view(torch.int16))
        untouched = [b for b in range(NB) if b not in LOAD_IDS[1]]
        assert torch.equal(
            got[untouched].view(torch.int16), before_attn[j][untouched].view(torch.int16)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_state_pages_move_with_device_ids_inside_a_cuda_graph():
    m, src, _ = _model("cuda", 3)
    dst_m, dst, dst_raws = _model("cuda", 4)
    prep_src, prep_dst = prepare(m, src), prepare(dst_m, dst)
    store_ids = {g: torch.tensor(v, device="cuda") for g, v in STORE_IDS.items()}
    load_ids = {g: torch.tensor(v, device="cuda") for g, v in LOAD_IDS.items()}
    objs = [torch.zeros_like(o) for o in prep_src.store(STORE_IDS)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
        prep_src.store(store_ids, objs)
        prep_dst.load(objs, load_ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prep_src.store(store_ids, objs)
        prep_dst.load(objs, load_ids)
    for raw in dst_raws:
        raw[7, :STATE_BYTES] = 0
    graph.replay()
    torch.cuda.synchronize()
    want = prepare(*_model("cuda", 3)[:2]).store(STORE_IDS)
    for got, ref in zip(objs, want):
        assert torch.equal(got, ref)
    src_state = [r for r in _model("cuda", 3)[2]]
    for raw, ref in zip(dst_raws, src_state):
        assert torch.equal(raw[7, :STATE_BYTES], ref[6, :STATE_BYTES])
        assert bool((raw[7, STATE_BYTES:] == PAD).all())


def _real_size_round_trip(device, path):
    """Whole-model GDN states (48 KiB conv + 2 MiB delta memory per slot) beside attention,
    through ``path`` against the reference on the same bytes."""
    from kvgroups_tools.catalog import MODELS

    model = MODELS["qwen3-next-like"].build(num_blocks=64, layers=4)
    gen = torch.Generator().manual_seed(11)
    host = []
    for spec in model.kv_caches:
        t = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype.name))
        t.view(torch.uint8).copy_(
            torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen)
        )
        host.append(t)
    caches = [t.to(device) for t in host]
    m = KVLayerGroupsManager(caches, list(model.formats), model.engine_group_infos)
    ids = {0: list(range(31, -1, -1)), 1: [3, 1]}
    views = _numpy_views(host)
    ref_m = KVLayerGroupsManager(views, list(model.formats), model.engine_group_infos)
    want = store(ref_m, views, ids, backend="numpy")
    prep = prepare(m, caches)
    got = prep.store(ids, path=path)
    for g, w in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), w)
    before = [t.cpu().clone() for t in caches]
    prep.load(got, {0: list(range(32, 64)), 1: [0, 4]}, path=path)
    state = {i for g in m.kernel_groups if g.recurrent_state for i in g.layer_indices}
    assert len(state) == 6
    for layer in state:  # slot 4 got the last chunk's snapshot (slot 1); nothing else moved
        t, old = caches[layer].cpu(), before[layer]
        rows = (
            t.view(torch.uint8).reshape(t.shape[0], -1)
            != old.view(torch.uint8).reshape(t.shape[0], -1)
        ).any(1)
        assert torch.nonzero(rows).flatten().tolist() == [4]
        assert torch.equal(t[4].view(torch.uint8), host[layer][1].view(torch.uint8))


def test_qwen3_next_size_states_on_the_cpu():
    _real_size_round_trip("cpu", "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("path", ["auto", "kernel", "copy_engine"])
def test_qwen3_next_size_states_on_every_cuda_path(path):
    _real_size_round_trip("cuda", path)
