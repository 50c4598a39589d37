"""Where a jitted JAX program of K chained public stores spends its wall time beyond its kernels:
blocking vs pipelined (several programs in flight), objects allocated by the program vs donated,
against a jitted K-step x+1 of the same bytes and torch's K prepared stores in the same process."""
import glob, gzip, json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from kvgroups_core import EngineKVFormat, KVLayerGroupsManager, store
from kvgroups_core.registry import register_backend
from kvgroups_jax import JaxBackend
L, NB, K = int(os.environ.get("KVG_L", 32)), int(os.environ.get("KVG_NB", 2048)), 8
LOW = os.environ.get("KVG_LOW", "cuda")
TAG = os.environ.get("KVG_TAG", "default")
register_backend("jx", JaxBackend(lowering=LOW), replace=True)
caches = [jnp.zeros((2, NB, 16, 8, 128), jnp.bfloat16) + l for l in range(L)]
m = KVLayerGroupsManager(caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * L, lmcache_tokens_per_chunk=256)
res = []
def measure(name, f, make_args, ch, nbytes, reps=7, inflight=6):
    a = make_args(); r = f(*a); jax.block_until_ready(r); del r
    blk, disp = [], []
    for _ in range(reps):
        a = make_args(); jax.block_until_ready(a)
        t = time.perf_counter(); r = f(*a); t1 = time.perf_counter(); jax.block_until_ready(r)
        blk.append(time.perf_counter() - t); disp.append(t1 - t); del r
    pipe = []
    for _ in range(3):
        argss = [make_args() for _ in range(inflight)]; jax.block_until_ready(argss)
        t = time.perf_counter(); rs = [f(*a) for a in argss]; jax.block_until_ready(rs)
        pipe.append((time.perf_counter() - t) / inflight); del rs, argss
    rec = dict(tag=TAG, lowering=LOW, name=name, chunks=ch, K=K, blocking_ms=1e3 * float(np.median(blk)),
               dispatch_ms=1e3 * float(np.median(disp)), pipelined_ms=1e3 * float(np.median(pipe)),
               gbps_pipelined=2 * nbytes * K / float(np.median(pipe)) / 1e9,
               gbps_blocking=2 * nbytes * K / float(np.median(blk)) / 1e9)
    print(json.dumps(rec), flush=True); res.append(rec)
for CH in [int(c) for c in os.environ.get("KVG_CH", "16,64").split(",")]:
    nbytes = CH * 16 * L * 2 * 16 * 8 * 128 * 2
    idss = jnp.asarray(np.stack([np.random.default_rng(k).permutation(NB)[:CH * 16] for k in range(K)]).astype(np.int32))
    def alloc_chain(caches, idss):
        objs = store(m, caches, idss[0], backend="jx")
        for k in range(1, K):
            objs = store(m, caches, idss[k], objs, backend="jx")
        return objs
    def donated_chain(objs, caches, idss):
        for k in range(K):
            objs = store(m, caches, idss[k], objs, backend="jx")
        return objs
    fa = jax.jit(alloc_chain)
    fd = jax.jit(donated_chain, donate_argnums=0)
    fc = jax.jit(lambda x: jax.lax.fori_loop(0, K, lambda i, y: y + jnp.uint8(1), x), donate_argnums=0)
    fz = jax.jit(lambda: jnp.zeros((CH, nbytes // CH), jnp.uint8))
    measure("alloc_chain", fa, lambda: (caches, idss), CH, nbytes)
    measure("donated_chain", fd, lambda: ([fz()], caches, idss), CH, nbytes)
    measure("copy_x_plus_1", fc, lambda: (fz(),), CH, nbytes)
    if CH == 64 and TAG == "default":
        d = os.path.join(os.environ["OUT"], "trace_prog")
        a = ([fz()], caches, idss); jax.block_until_ready(a)
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(3):
                r = fd(*a); a = (r, caches, idss)
            jax.block_until_ready(r)
        p = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
        ev = json.load(gzip.open(p)); ev = ev["traceEvents"] if isinstance(ev, dict) else ev
        names = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
        xs = sorted((e for e in ev if e.get("ph") == "X"), key=lambda e: e["ts"])
        t0 = xs[0]["ts"]
        with open(os.path.join(os.environ["OUT"], "trace_prog.txt"), "w") as fh:
            for e in xs:
                if e.get("dur", 0) >= 5 or "GPU" in names.get(e["pid"], ""):
                    fh.write(f"{e['ts'] - t0:10.1f} {e.get('dur', 0):9.1f} {names.get(e['pid'], '')[:24]:24s} {e.get('tid')} {e['name'][:70]}\n")
        import shutil; shutil.rmtree(d, ignore_errors=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "jax_program.jsonl"), "a") as fh:
    for r in res:
        fh.write(json.dumps(r) + "\n")
if os.environ.get("KVG_TORCH", "1") == "1" and TAG == "default":
    import torch
    from kvgroups_core import prepare
    tcaches = [torch.from_dlpack(c).clone() for c in caches]
    tm = KVLayerGroupsManager(tcaches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * L, lmcache_tokens_per_chunk=256)
    tp = prepare(tm, tcaches)
    for CH in [int(c) for c in os.environ.get("KVG_CH", "16,64").split(",")]:
        nbytes = CH * 16 * L * 2 * 16 * 8 * 128 * 2
        tids = [torch.from_numpy(np.random.default_rng(k).permutation(NB)[:CH * 16].astype(np.int32)).cuda() for k in range(K)]
        objs = tp.store(tids[0])
        def batch():
            for k in range(K):
                tp.store(tids[k], objs)
        batch(); torch.cuda.synchronize(); blk, pipe = [], []
        for _ in range(7):
            t = time.perf_counter(); batch(); torch.cuda.synchronize(); blk.append(time.perf_counter() - t)
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(6): batch()
            torch.cuda.synchronize(); pipe.append((time.perf_counter() - t) / 6)
        rec = dict(tag=TAG, lowering="torch", name="prepared_x8", chunks=CH, K=K,
                   blocking_ms=1e3 * float(np.median(blk)), pipelined_ms=1e3 * float(np.median(pipe)),
                   gbps_pipelined=2 * nbytes * K / float(np.median(pipe)) / 1e9,
                   gbps_blocking=2 * nbytes * K / float(np.median(blk)) / 1e9)
        print(json.dumps(rec), flush=True)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "jax_program.jsonl"), "a") as fh:
            fh.write(json.dumps(rec) + "\n")
