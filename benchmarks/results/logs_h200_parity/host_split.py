"""Where a prepared one-layer torch store's host time goes (CUDA ids, GPU kept busy): the
whole call, the core's memo hit without the launch, and the backend runner (launch) alone."""
import json, os, sys, time
import numpy as np, torch
sys.path[:0] = [os.getcwd(), os.getcwd() + "/backends"]
import kvgroups_torch  # noqa
import kvgroups_core as kc
from kvgroups_core.call_memo import call_key
from kvgroups_core.manager import KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS
model = MODELS["llama3-8b"].build(num_blocks=4096, layers=32, dtype="bfloat16")
caches = [torch.empty(s.shape, dtype=torch.bfloat16, device="cuda") for s in model.kv_caches]
m = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
prep = kc.prepare(m, caches)
ids = torch.arange(256, dtype=torch.int32, device="cuda")
objs = [torch.empty((16, kc.object_nbytes(m, 0)), dtype=torch.uint8, device="cuda")]
def host_us(fn, n=300):
    out = []
    for _ in range(5):
        torch.cuda._sleep(int(4e7)); fn()
        t = time.perf_counter()
        for _ in range(n): fn()
        out.append((time.perf_counter() - t) / n * 1e6); torch.cuda.synchronize()
    return sorted(out)[2]
res = {}
for name, layers in (("whole", None), ("layer", [5])):
    call = lambda: prep.store(ids, objs, layers=layers)
    call(); call()
    key = call_key(prep._ids_key, "store", ids, layers, None, 0, None)
    entry = prep._memo._plans[key]
    run = entry.run
    res[name + "_call"] = host_us(call)
    res[name + "_call_key"] = host_us(lambda: call_key(prep._ids_key, "store", ids, layers, None, 0, None))
    res[name + "_runner"] = host_us(lambda: run(ids, objs))
    entry.run = lambda i, o: (None, list(o))
    res[name + "_memo_no_launch"] = host_us(lambda: prep.store(ids, objs, layers=layers))
    entry.run = run
res["empty_torch_add"] = host_us(lambda: ids.add_(0))
print(json.dumps(res))
open(os.path.join(os.environ.get("OUT", "/tmp"), "host_split.json"), "w").write(json.dumps(res))
