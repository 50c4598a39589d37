"""Host time of the public prepared calls (CUDA ids, GPU kept busy so only enqueueing is
timed), for the code under KVG_ROOT: whole-model and one-layer stores and loads, on
PyTorch's current (legacy) stream and on a side stream, plus the pieces they are made of.
Run once per tree, alternating, and compare medians (this host's speed drifts)."""
import ctypes, json, os, sys, time
import numpy as np, torch
root = os.environ.get("KVG_ROOT", os.getcwd())
sys.path[:0] = [root, root + "/backends"]
import kvgroups_torch  # noqa
from kvgroups_torch import backend as tb, driver
import kvgroups_core as kc
from kvgroups_core.manager import KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS

assert kc.__file__.startswith(root), (kc.__file__, root)
model = MODELS["llama3-8b"].build(num_blocks=4096, layers=32, dtype="bfloat16")
caches = [torch.empty(s.shape, dtype=torch.bfloat16, device="cuda") for s in model.kv_caches]
m = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
prep = kc.prepare(m, caches)
ids = torch.randperm(4096, device="cuda")[:16].to(torch.int32)
objs = [torch.empty((1, kc.object_nbytes(m, 0)), dtype=torch.uint8, device="cuda")]
side = torch.cuda.Stream()


def host_us(fn, n=200, stream=None):
    out = []
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        for _ in range(9):
            torch.cuda._sleep(int(2e8)); fn()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - t) / n * 1e6)
            torch.cuda.synchronize()
    return round(sorted(out)[4], 2)


res = {"tree": os.environ.get("KVG_TAG", root), "call": "prepared", "ids": "device",
       "measure": "host_us_per_call", "chunks": 1}
for name, layers in (("whole", None), ("layer", [5])):
    st = lambda: prep.store(ids, objs, layers=layers)
    ld = lambda: prep.load(objs, ids, layers=layers)
    st(); st(); ld(); ld()
    res[name + "_store"] = host_us(st)
    res[name + "_load"] = host_us(ld)
    res[name + "_store_side"] = host_us(st, stream=side)
dp = torch.Tensor.data_ptr
keys = [c.data_ptr() for c in caches]
res["ptrs_python_32"] = host_us(lambda: list(map(dp, caches)) == keys)
native = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
if native is not None:
    idx = list(range(32))
    res["ptrs_native_32"] = host_us(lambda: native(caches, keys, idx))
x = torch.zeros(16, device="cuda")
res["torch_add"] = host_us(lambda: x.add_(0))
print(json.dumps(res))
