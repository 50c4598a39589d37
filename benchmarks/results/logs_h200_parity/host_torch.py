"""Host time of the public prepared torch calls (CUDA ids), with the GPU kept busy so the host is
what is timed: per call, and a cProfile breakdown. Also the GPU-bound per-call time."""
import cProfile, io, json, os, pstats, sys, time
import numpy as np, torch
sys.path[:0] = [os.getcwd(), os.getcwd() + "/backends"]
import kvgroups_torch  # noqa
import kvgroups_core as kc
from kvgroups_core.manager import KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS
model = MODELS["llama3-8b"].build(num_blocks=4096, layers=32, dtype="bfloat16")
caches = [torch.empty(s.shape, dtype=torch.bfloat16, device="cuda") for s in model.kv_caches]
m = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
prep = kc.prepare(m, caches)
rng = np.random.default_rng(0)
out = []
def host_us(fn, n):
    torch.cuda._sleep(int(4e7)); fn()  # GPU busy ~20 ms: launches only queue
    t = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize(); return dt
for chunks in (1, 16):
    ids = torch.from_numpy(rng.permutation(4096)[: 16 * chunks].astype(np.int32)).cuda()
    objs = [torch.empty((chunks, kc.object_nbytes(m, 0)), dtype=torch.uint8, device="cuda")]
    for name, fn in (("prepared_store", lambda: prep.store(ids, objs)),
                     ("prepared_load", lambda: prep.load(objs, ids)),
                     ("layer_store", lambda: prep.store(ids, objs, layers=[5])),
                     ("store_oneshot", lambda: kc.store(m, caches, ids, objs))):
        for _ in range(3): fn()
        torch.cuda.synchronize()
        hs = sorted(host_us(fn, 300) for _ in range(5))
        rec = dict(name=name, chunks=chunks, host_us_median=hs[2], host_us_min=hs[0])
        if chunks == 1 and name in ("prepared_store", "layer_store"):
            torch.cuda._sleep(int(4e7)); pr = cProfile.Profile(); pr.enable()
            for _ in range(300): fn()
            pr.disable(); torch.cuda.synchronize()
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
            print(s.getvalue()[-2600:])
        print(json.dumps(rec)); out.append(rec)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "host_torch.jsonl"), "w") as fh:
    fh.write("\n".join(json.dumps(r) for r in out) + "\n")
