"""One 64-chunk Llama-3-8B-like store (32 KiB pages, 32 layers), repeated: torch prepared call
with CUDA ids, or JAX jitted public store with traced ids (lowering cuda / mosaic). For ncu."""
import sys
import numpy as np
from kvgroups_core import EngineKVFormat, KVLayerGroupsManager, prepare, store
which = sys.argv[1]
import os
L, NB, CH = 32, int(os.environ.get("KVG_NB", 2048)), int(os.environ.get("KVG_CH", 64))
ids = np.random.default_rng(0).permutation(NB)[:CH * 16].astype(np.int32)
if which == "torch":
    import torch
    caches = [torch.empty((2, NB, 16, 8, 128), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    m = KVLayerGroupsManager(caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * L, lmcache_tokens_per_chunk=256)
    p = prepare(m, caches)
    dids = torch.from_numpy(ids).cuda()
    objs = p.store(dids)
    for _ in range(6):
        objs = p.store(dids, objs)
    torch.cuda.synchronize()
else:
    import jax, jax.numpy as jnp
    from kvgroups_core.registry import register_backend
    from kvgroups_jax import JaxBackend
    register_backend("jx", JaxBackend(lowering=which), replace=True)
    caches = [jnp.zeros((2, NB, 16, 8, 128), jnp.bfloat16) for _ in range(L)]
    m = KVLayerGroupsManager(caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * L, lmcache_tokens_per_chunk=256)
    f = jax.jit(lambda c, i: store(m, c, i, backend="jx"))
    dids = jnp.asarray(ids)
    for _ in range(7):
        out = f(caches, dids)
    jax.block_until_ready(out)
print("done", which)
