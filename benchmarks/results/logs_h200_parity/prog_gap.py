"""The ~90 us a jitted JAX program of K public stores takes beyond its kernels, even with
programs in flight: per-call wall time for K = 8 and 32, and a trace of 3 pipelined programs
(GPU ops with the gap before each, host events of 20 us or more)."""
import glob, gzip, json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from kvgroups_core import EngineKVFormat, KVLayerGroupsManager, store
from kvgroups_core.registry import register_backend
from kvgroups_jax import JaxBackend
L, NB, CH = 32, 2048, 16
register_backend("jx", JaxBackend(lowering=os.environ.get("KVG_LOW", "cuda")), replace=True)
caches = [jnp.zeros((2, NB, 16, 8, 128), jnp.bfloat16) + l for l in range(L)]
m = KVLayerGroupsManager(caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * L, lmcache_tokens_per_chunk=256)
TAG = os.environ.get("KVG_TAG", "default")
for K in (8, 32):
    ids = jnp.asarray(np.stack([np.random.default_rng(k).permutation(NB)[:CH * 16] for k in range(K)]).astype(np.int32))
    def chain(objs, caches, ids):
        for k in range(K):
            objs = store(m, caches, ids[k], objs, backend="jx")
        return objs
    f = jax.jit(chain, donate_argnums=0)
    objs = store(m, caches, ids[0], backend="jx")
    objs = f(objs, caches, ids); jax.block_until_ready(objs)
    P = max(2, 48 // K); ts, ds = [], []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(P):
            objs = f(objs, caches, ids)
        ds.append(time.perf_counter() - t)
        jax.block_until_ready(objs); ts.append(time.perf_counter() - t)
    print(json.dumps(dict(tag=TAG, K=K, programs=P, per_call_us=1e6 * float(np.median(ts)) / (P * K),
                          dispatch_us_per_program=1e6 * float(np.median(ds)) / P)), flush=True)
    if K == 8 and TAG == "default":
        d = "/tmp/trace_gap"
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(3):
                objs = f(objs, caches, ids)
            jax.block_until_ready(objs)
        p = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
        ev = json.load(gzip.open(p)); ev = ev["traceEvents"] if isinstance(ev, dict) else ev
        names = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
        tnames = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
        xs = sorted((e for e in ev if e.get("ph") == "X"), key=lambda e: e["ts"])
        t0 = xs[0]["ts"]; prev_gpu = None
        for e in xs:
            gpu = "GPU" in names.get(e["pid"], "") or "/device:" in names.get(e["pid"], "")
            if gpu:
                gap = e["ts"] - prev_gpu if prev_gpu is not None else 0
                prev_gpu = e["ts"] + e.get("dur", 0)
                if "kvg" in e["name"] and gap < 3:
                    continue  # back-to-back transfer kernels: only the boundaries are printed
                print(f"GPU  {e['ts'] - t0:10.1f} dur {e.get('dur', 0):8.1f} gap {gap:8.1f} {tnames.get((e['pid'], e['tid']), e['tid'])!s:.20} {e['name'][:60]}")
            elif e.get("dur", 0) >= 20:
                print(f"HOST {e['ts'] - t0:10.1f} dur {e.get('dur', 0):8.1f} {tnames.get((e['pid'], e['tid']), e['tid'])!s:.20} {e['name'][:70]}")
