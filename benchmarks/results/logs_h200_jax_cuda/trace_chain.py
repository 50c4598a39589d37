"""A jax.profiler trace of 8 chained public stores in one jit (lowering cuda, 64 chunks):
every GPU op of the program with its duration and the gap before it."""
import glob, gzip, json, os
import numpy as np
import jax, jax.numpy as jnp
from kvgroups_core import EngineKVFormat, KVLayerGroupsManager, store
from kvgroups_core.registry import register_backend
from kvgroups_jax import JaxBackend
L, NB, K, CH = 32, 2048, 8, 64
caches = [jnp.zeros((2, NB, 16, 8, 128), jnp.bfloat16) for _ in range(L)]
m = KVLayerGroupsManager(caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * L, lmcache_tokens_per_chunk=256)
import sys
LOW = sys.argv[1] if len(sys.argv) > 1 else "cuda"
CH = int(sys.argv[2]) if len(sys.argv) > 2 else CH
register_backend("jx", JaxBackend(lowering=LOW), replace=True)
idss = jnp.asarray(np.stack([np.random.default_rng(k).permutation(NB)[:CH * 16] for k in range(K)]).astype(np.int32))
def chain(caches, idss):
    objs = store(m, caches, idss[0], backend="jx")
    for k in range(1, K):
        objs = store(m, caches, idss[k], objs, backend="jx")
    return objs
f = jax.jit(chain)
jax.block_until_ready(f(caches, idss))
d = os.path.join(os.environ["OUT"], "trace")
with jax.profiler.trace(d, create_perfetto_trace=True):
    jax.block_until_ready(f(caches, idss))
hlo = f.lower(caches, idss).compile().as_text()
open(os.path.join(os.environ["OUT"], "chain_hlo.txt"), "w").write(hlo)
path = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
ev = json.load(gzip.open(path))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
pids = {}
for e in ev:
    if e.get("ph") == "M" and e.get("name") == "process_name":
        pids[e["pid"]] = e["args"]["name"]
gpu = [e for e in ev if e.get("ph") == "X" and "GPU" in pids.get(e.get("pid"), "") or (e.get("ph") == "X" and "/device:GPU" in pids.get(e.get("pid"), ""))]
gpu.sort(key=lambda e: e["ts"])
prev = None
for e in gpu:
    gap = e["ts"] - prev if prev is not None else 0
    print(f"{e['name'][:60]:60s} dur {e.get('dur', 0):9.1f} us  gap {gap:8.1f} us  tid {e.get('tid')}")
    prev = e["ts"] + e.get("dur", 0)
print("ops in HLO:", [l.strip()[:120] for l in hlo.splitlines() if "custom-call" in l or " copy(" in l or "copy-start" in l][:20])
