"""LayerwiseLoad / LayerwiseSave on a GPU: a whole step -- every layer's load queued at once on
a side stream, each of 32 layers' compute waiting on the GPU for its own load -- captured in
one CUDA graph gives the bytes of the eager step, and each layer's compute sees its loaded
pages (checked by content: the compute copies out the pages the load overwrites, and the loads
are held back by a sleep on the side stream, so a compute that ran before its load would copy
the old bytes). The same for layer-wise saves, for waits captured in a graph replayed after
eager loads (graph_waits, vLLM's FULL graphs) and for saves after a replay (graph_marks).
The negative controls (the same step without waits) show the content check sees a race.

compute-sanitizer (scripts/gpu_checks.sh, step racecheck): racecheck over every test but the
controls."""

import numpy as np
import pytest
import torch
from kvgroups_torch import LayerwiseLoad, LayerwiseSave

from kvgroups_core.errors import UnsupportedConfigError
from tests.support.cuda_marks import needs_cuda
from tests.support.torch_engine_cases import reference_store
from tests.support.torch_layerwise_cases import (
    LAYERS,
    Recording,
    Step,
    check_save_many_refuses_before_any_byte_moves,
    check_start_many_refuses_before_any_byte_moves,
    delay,
    expected_load_order,
)

pytestmark = needs_cuda

DELAY = 4_000_000  # GPU cycles (about 2 ms) the delayed stream sleeps


def _forward(step: Step, loads: LayerwiseLoad, waits: bool = True) -> None:
    delay(loads.stream, DELAY)
    loads.start(step.objects, step.ids)
    for layer in range(LAYERS):
        if waits:
            loads.wait(layer)
        step.compute(layer)
    loads.finish()


@pytest.mark.parametrize("placement", ["device", "pinned"])
def test_a_captured_step_of_32_layer_loads_and_computes_equals_the_eager_step(placement):
    step = Step("cuda", placement, seed=1)
    rec = Recording(step.prep)
    loads = LayerwiseLoad(rec)
    step.new_objects(2)
    _forward(step, loads)  # eager, and the warm-up of the capture (kernels, tables)
    step.check()
    assert rec.calls == expected_load_order(list(range(LAYERS)), [step.objects])
    eager_seen = [x.clone() for x in step.seen]
    eager_caches = [c.clone() for c in step.caches]
    graph = torch.cuda.CUDAGraph()
    step.reset_caches()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        _forward(step, loads)
    for seed in (2, 3, 4):  # the eager step's bytes, then new ones; the caches reset each time
        step.new_objects(seed)
        step.reset_caches()
        for s in step.seen:
            s.zero_()
        graph.replay()
        step.check()
        if seed == 2:  # the same bytes as the eager step, bit for bit
            for a, b in zip(step.seen + step.caches, eager_seen + eager_caches):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_an_eager_step_with_loads_and_saves_never_syncs_the_host():
    step = Step("cuda", "device", seed=5)
    loads, saves = LayerwiseLoad(step.prep), LayerwiseSave(step.prep)
    out = [torch.empty_like(o) for o in step.objects]
    step.new_objects(6)
    for _ in range(2):  # the first round warms up kernels and tables
        step.reset_caches()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            delay(loads.stream, DELAY)
            loads.start(step.objects, step.ids)
            for layer in range(LAYERS):
                loads.wait(layer)
                step.compute(layer)
                saves.save(layer, step.ids, out)
            loads.finish()
            saves.finish()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    step.check()
    want = reference_store(step.manager, step.caches, step.host_ids)
    for got, w in zip(out, want):
        np.testing.assert_array_equal(got.cpu().numpy(), w)


def test_the_control_a_step_without_waits_reads_pages_before_their_load():
    # Shows the content check above can fail: same step, no waits.
    step = Step("cuda", "device", seed=7)
    loads = LayerwiseLoad(step.prep)
    step.new_objects(8)
    _forward(step, loads)
    step.check()
    step.reset_caches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _forward(step, loads, waits=False)
    step.new_objects(9)
    step.reset_caches()
    graph.replay()
    assert step.mismatched_layers(), "without waits every layer still saw its loaded pages"


@pytest.mark.parametrize("name", ["llama3-8b", "gpt-oss-20b"])
def test_captured_layerwise_saves_store_what_each_layer_wrote(name):
    step = Step("cuda", "device", seed=10, name=name)
    saves = LayerwiseSave(step.prep, max_ctas=8)
    out = [torch.zeros_like(o) for o in step.objects]
    src = [torch.empty_like(c) for c in step.caches]

    def forward():
        torch.cuda._sleep(DELAY)  # the first write comes late: a save before it would miss it
        for layer in range(len(step.caches)):
            step.caches[layer].copy_(src[layer])  # the layer writes its KV
            saves.save(layer, step.ids, out)
        saves.finish()

    def new_src(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for s in src:
            s.view(torch.int16).random_(generator=gen)

    new_src(11)
    forward()  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for seed in (12, 13):
        new_src(seed)
        for o in out:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want = reference_store(step.manager, src, step.host_ids)
        for got, w in zip(out, want):
            np.testing.assert_array_equal(got.cpu().numpy(), w)


def test_waits_captured_apart_from_the_loads_bind_to_each_replays_eager_start():
    # vLLM's FULL graphs: the forward is captured once; every step loads eagerly, then replays.
    step = Step("cuda", "pinned", seed=14)
    loads = LayerwiseLoad(step.prep, graph_waits=True)

    def forward():
        for layer in range(LAYERS):
            loads.wait(layer)
            step.compute(layer)
        loads.finish()

    def eager_start():
        delay(loads.stream, DELAY)
        loads.start(step.objects, step.ids)

    step.new_objects(15)
    eager_start()
    forward()
    step.check()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        forward()
    for seed in (16, 17):
        step.new_objects(seed)
        step.reset_caches()
        for s in step.seen:
            s.zero_()
        eager_start()
        graph.replay()
        step.check()
    # A step without loads: the waits find their last loads done and the replay goes on.
    step.reset_caches()
    graph.replay()
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(
            step.seen[layer].view(torch.int16), step.pages(layer, step.old).view(torch.int16)
        )


def test_saves_after_a_replay_wait_for_the_marks_recorded_in_the_graph():
    step = Step("cuda", "pinned", seed=18)
    saves = LayerwiseSave(step.prep, graph_marks=True)
    src = [torch.empty_like(c) for c in step.caches]

    def forward():
        torch.cuda._sleep(DELAY)
        for layer in range(LAYERS):
            step.caches[layer].copy_(src[layer])
            saves.mark(layer)

    def eager_saves():
        for layer in range(LAYERS):
            saves.save(layer, step.ids, step.objects)
        saves.finish()

    def new_src(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for s in src:
            s.view(torch.int16).random_(generator=gen)

    new_src(19)
    forward()
    eager_saves()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for seed in (20, 21):
        new_src(seed)
        graph.replay()
        eager_saves()  # queued while the replay still sleeps: each waits for its layer's mark
        torch.cuda.synchronize()
        want = reference_store(step.manager, src, step.host_ids)
        for got, w in zip(step.objects, want):
            np.testing.assert_array_equal(got.numpy(), w)


def test_mixing_an_eager_start_with_captured_waits_is_refused_with_the_fix():
    step = Step("cuda", "device", seed=22)
    loads = LayerwiseLoad(step.prep)
    step.new_objects(23)
    loads.start(step.objects, step.ids)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(UnsupportedConfigError, match="graph_waits=True"):
        with torch.cuda.graph(graph):
            step.compute(0)  # (a graph that is not empty when the capture ends)
            loads.wait(0)
    loads.finish()
    torch.cuda.synchronize()
    waits = LayerwiseLoad(step.prep, graph_waits=True)
    with pytest.raises(
        UnsupportedConfigError, match="start: expected to run outside any CUDA graph"
    ):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step.compute(0)
            waits.start(step.objects, step.ids)


def test_start_many_refuses_a_bad_transfer_before_any_transfer_moves_a_byte_on_the_gpu():
    # The CPU test's check (tests/torch_backend/test_layerwise.py) on CUDA caches and device
    # ids: the refusal is start_many's own, before it queues anything on the side stream.
    check_start_many_refuses_before_any_byte_moves("cuda")


def test_save_many_refuses_a_bad_transfer_before_any_store_moves_a_byte_on_the_gpu():
    check_save_many_refuses_before_any_byte_moves("cuda")
