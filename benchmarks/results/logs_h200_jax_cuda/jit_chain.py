"""K public stores chained inside one jax.jit (traced device ids, objects threaded through), the
engine's compiled path with no host work between them: time per store -> GB/s (read + written),
for lowering cuda and mosaic, against a jitted x+1 copy of the same bytes."""
import json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from kvgroups_core import EngineKVFormat, KVLayerGroupsManager, store
from kvgroups_core.registry import register_backend
from kvgroups_jax import JaxBackend
L, NB, K = int(os.environ.get("KVG_L", 32)), int(os.environ.get("KVG_NB", 2048)), 8
out = []
caches = [jnp.asarray(np.random.default_rng(l).integers(0, 2**16, (2, NB, 16, 8, 128), np.uint16)).view(jnp.bfloat16) for l in range(L)]
m = KVLayerGroupsManager(caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * L, lmcache_tokens_per_chunk=256)
def timed(f, *a, reps=7):
    r = f(*a); jax.block_until_ready(r); ts = []
    for _ in range(reps):
        t = time.perf_counter(); r = f(*a); jax.block_until_ready(r); ts.append(time.perf_counter() - t)
    return float(np.median(ts))
for CH in [int(c) for c in os.environ.get("KVG_CH", "16,64").split(",")]:
    idss = jnp.asarray(np.stack([np.random.default_rng(k).permutation(NB)[:CH * 16] for k in range(K)]).astype(np.int32))
    nbytes = CH * 16 * L * 2 * 16 * 8 * 128 * 2
    x = jnp.zeros((nbytes,), jnp.uint8)
    copy = jax.jit(lambda x: jax.lax.fori_loop(0, K, lambda i, y: y + jnp.uint8(1), x), donate_argnums=0)
    t_copy = timed(lambda: copy(jnp.zeros((nbytes,), jnp.uint8))) / K
    for lo in sys.argv[1:]:
        register_backend("jx-" + lo, JaxBackend(lowering=lo), replace=True)
        def chain(caches, idss, lo=lo):
            objs = store(m, caches, idss[0], backend="jx-" + lo)
            for k in range(1, K):
                objs = store(m, caches, idss[k], objs, backend="jx-" + lo)
            return objs
        f = jax.jit(chain, donate_argnums=())
        t = timed(f, caches, idss) / K
        ref = store(m, [np.asarray(c) for c in caches], np.asarray(idss[K - 1]), backend="numpy")
        got = f(caches, idss)
        ok = all(np.array_equal(np.asarray(g).view(np.uint8).reshape(-1), np.asarray(r).view(np.uint8).reshape(-1)) for g, r in zip(got, ref))
        rec = dict(record="transfer", runtime="jax", call="jit-chain", ids="device", path=lo, direction="store", chunks=CH, page_bytes=32768, calls_per_program=K, median_s=t, gbps=2 * nbytes / t / 1e9, ceiling="device_copy", ceiling_gbps=2 * nbytes / t_copy / 1e9, frac_of_ceiling=t_copy / t, verified=ok)
        print(json.dumps(rec)); out.append(rec)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "jax_jit_chain.jsonl"), "a") as fh:
    for r in out:
        fh.write(json.dumps(r) + "\n")
# The same stores from torch in the same process: K prepared calls back to back, CUDA ids.
import torch
from kvgroups_core import prepare
tcaches = [torch.from_dlpack(c).clone() for c in caches]
tm = KVLayerGroupsManager(tcaches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * L, lmcache_tokens_per_chunk=256)
tp = prepare(tm, tcaches)
for CH in [int(c) for c in os.environ.get("KVG_CH", "16,64").split(",")]:
    tids = [torch.from_numpy(np.random.default_rng(k).permutation(NB)[:CH * 16].astype(np.int32)).cuda() for k in range(K)]
    nbytes = CH * 16 * L * 2 * 16 * 8 * 128 * 2
    objs = tp.store(tids[0])
    x = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    def run_t():
        for k in range(K):
            tp.store(tids[k], objs)
    def run_c():
        for k in range(K):
            x.add_(1)
    res = {}
    for name, fn in (("store", run_t), ("copy", run_c)):
        fn(); torch.cuda.synchronize(); ts = []
        for _ in range(7):
            t = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t) / K)
        res[name] = float(np.median(ts))
    rec = dict(record="transfer", runtime="torch", call="prepared", ids="device", path="cuda", direction="store", chunks=CH, page_bytes=32768, calls_per_batch=K, median_s=res["store"], gbps=2 * nbytes / res["store"] / 1e9, ceiling="device_copy", ceiling_gbps=2 * nbytes / res["copy"] / 1e9, frac_of_ceiling=res["copy"] / res["store"])
    print(json.dumps(rec))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "jax_jit_chain.jsonl"), "a") as fh:
        fh.write(json.dumps(rec) + "\n")
