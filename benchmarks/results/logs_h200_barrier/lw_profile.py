"""Kernel durations and gaps of 32 graphed one-layer stores (torch profiler over graph replays)."""
import json, sys, statistics
sys.path[:0] = ["benchmarks", "backends", "."]
import numpy as np, torch
import bench_torch_engine as bte
import kvgroups_core as kc
from torch.profiler import profile, ProfilerActivity

class A:
    tiny, layers, num_blocks = False, 32, 8192
s = bte.Setup(A)
rng = np.random.default_rng(0)
ids = torch.from_numpy(rng.permutation(s.num_blocks)[: 16 * s.bpc].astype(np.int32)).cuda()
objs = s.objects(16)[0]
prep = kc.prepare(s.manager, s.caches)
def captured(fn):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side): fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    return g
def per_layer():
    for layer in range(s.layers): prep.store(ids, objs, layers=[layer])
graphs = {"layerwise": captured(per_layer), "whole": captured(lambda: prep.store(ids, objs))}
for name, g in graphs.items():
    for _ in range(20): g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10): g.replay()
        torch.cuda.synchronize()
    ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                key=lambda e: e.time_range.start)
    names = sorted({e.name for e in ev})
    dur = [e.time_range.elapsed_us() for e in ev]
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(ev, ev[1:])]
    per_replay = len(ev) / 10
    print(json.dumps({"graph": name, "kernels": names, "kernels_per_replay": per_replay,
                      "dur_us_median": statistics.median(dur), "dur_us_min": min(dur), "dur_us_max": max(dur),
                      "gap_us_median": statistics.median(gaps) if gaps else None,
                      "gap_us_p10": sorted(gaps)[len(gaps)//10] if gaps else None,
                      "span_us_per_replay": (ev[-1].time_range.end - ev[0].time_range.start) / 10}))
