"""Why the jitted step's 32 reduce fusions run 12 us slower after a load: HLO and a barrier A/B."""
import functools, json, sys, re
sys.path[:0] = ["benchmarks"]
import bench_jax_engine as bje, jax, jax.numpy as jnp
from kvgroups_core import load, store
args = bje.parse_args([])
b = bje.Bench(args)
m = b.manager
sets = b.ids(1)
dev = [jnp.asarray(s) for s in sets]
objs = store(m, b.caches, sets[0])
compute = functools.partial(bje.step_compute, layout=args.layout, mode="flat",
                            plane_elems=args.page_size * args.heads * args.head_dim)
def make(kind):
    def step(c, o, li, si):
        if kind != "without":
            c = load(m, o, c, li)
            if kind == "barrier":
                c = list(jax.lax.optimization_barrier(tuple(c)))
        c = compute(c, None)
        return c, (store(m, c, si) if kind != "without" else [])
    return step
held = {"c": b.caches}
res = {}
for kind in ("without", "plain", "barrier"):
    jitted = jax.jit(make(kind), donate_argnums=(0,))
    if kind != "barrier":
        txt = jitted.lower(held["c"], objs, dev[0], dev[1]).compile().as_text()
        fus = [blk for blk in txt.split("\n\n") if "reduce(" in blk][:2]
        with open(sys.argv[1] + f"/hlo_{kind}.txt", "w") as f:
            f.write(txt)
        print(kind, "reduce fusion:", "\n".join(x[:300] for x in fus[0].splitlines()[:14]) if fus else None)
    def fn(i, jitted=jitted):
        held["c"], held["o"] = jitted(held["c"], objs, dev[i % 8], dev[(i + 3) % 8])
    res[kind] = bje.device_kernels(fn, lambda: jax.block_until_ready(held["c"]))
for kind in ("plain", "barrier"):
    g = {k: round((res[kind].get(k, 0) - res["without"].get(k, 0)) * 1e6, 2) for k in set(res[kind]) | set(res["without"])}
    print(kind, "total growth us %.1f" % (sum(res[kind].values()) * 1e6 - sum(res["without"].values()) * 1e6), sorted(g.items(), key=lambda kv: -abs(kv[1]))[:6])
