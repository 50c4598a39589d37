"""Where a prepared one-chunk torch store's host time goes on this host (GPU kept busy, so
only enqueueing is timed): the public calls, the backend runner, and raw driver launches of
the very kernel and parameters the runner launches (ctypes cuLaunchKernelEx / cuLaunchKernel,
legacy and side stream), against torch's own launches and a one-kernel graph replay. As run on main at 49ec2fd (call 1):
it finds the PlanRunner in the memo runner's closure, which 6519d8c removed."""
import ctypes, json, os, sys, time
import numpy as np, torch
sys.path[:0] = [os.getcwd(), os.getcwd() + "/backends"]
import kvgroups_torch  # noqa
from kvgroups_torch import cuda_path, driver
import kvgroups_core as kc
from kvgroups_core.call_memo import call_key
from kvgroups_core.manager import KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS

model = MODELS["llama3-8b"].build(num_blocks=4096, layers=32, dtype="bfloat16")
caches = [torch.empty(s.shape, dtype=torch.bfloat16, device="cuda") for s in model.kv_caches]
m = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
prep = kc.prepare(m, caches)
ids = torch.randperm(4096, device="cuda")[:16].to(torch.int32)
objs = [torch.empty((1, kc.object_nbytes(m, 0)), dtype=torch.uint8, device="cuda")]
side = torch.cuda.Stream()


def host_us(fn, n=200, stream=None):
    out = []
    ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream())
    with ctx:
        for _ in range(7):
            torch.cuda._sleep(int(2e8)); fn()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - t) / n * 1e6)
            torch.cuda.synchronize()
    return round(sorted(out)[3], 2)


res = {}
for name, layers in (("whole", None), ("layer", [5])):
    call = lambda: prep.store(ids, objs, layers=layers)
    call(); call()
    res[name + "_call"] = host_us(call)
    res[name + "_call_side"] = host_us(call, stream=side)
    key = call_key(prep._ids_key, "store", ids, layers, None, 0, None)
    entry = prep._memo._plans[key]
    res[name + "_runner"] = host_us(lambda: entry.run(ids, objs))
    runner = next(c.cell_contents for c in entry.run.__closure__
                  if isinstance(c.cell_contents, cuda_path.PlanRunner))
    steps = next(iter(runner._steps.values()))
    launch, p, launcher, function, grid = steps[0][:5]
    lib = driver._libcuda()
    args = launcher._args_address
    for sname, s in (("legacy", 0), ("side", side.cuda_stream)):
        res[f"{name}_raw_ex_{sname}"] = host_us(
            lambda s=s: launcher._launch(launcher._config_address, function, args, None)
            if (setattr(launcher._config, "stream", s) or True) else None,
            stream=None if s == 0 else side)
        res[f"{name}_raw_plain_{sname}"] = host_us(
            lambda s=s: lib.cuLaunchKernel(function, grid[0], 1, 1, 256, 1, 1, 0, s, args, None),
            stream=None if s == 0 else side)
    launcher._config.stream = 0
cur = ctypes.c_void_p()
res["cuCtxGetCurrent"] = host_us(lambda: lib.cuCtxGetCurrent(ctypes.byref(cur)))
libc = ctypes.CDLL(None); labs = libc.labs
res["ctypes_noop"] = host_us(lambda: labs(0))
res["raw_stream_query"] = host_us(lambda: torch._C._cuda_getCurrentRawStream(0))
x = torch.zeros(16, device="cuda")
res["torch_add_legacy"] = host_us(lambda: x.add_(0))
res["torch_add_side"] = host_us(lambda: x.add_(0), stream=side)
g = torch.cuda.CUDAGraph()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    prep.store(ids, objs)
torch.cuda.current_stream().wait_stream(side)
with torch.cuda.graph(g):
    prep.store(ids, objs)
res["graph_replay"] = host_us(g.replay)
res["programmatic"] = driver.programmatic_launch(0)
print(json.dumps(res))
open(os.path.join(os.environ.get("OUT", "/tmp"), "launch_probe.json"), "w").write(json.dumps(res))
