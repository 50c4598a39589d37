"""A transfer whose first call in the process is traced inside ``jax.jit`` leaves nothing of
that trace behind: later calls of the same plan shape (eager, retraced, another manager, a
prepared transfer) run and move the right bytes.

Each ordering runs in a fresh interpreter, because the state at stake is process-wide (the
executor's caches of per-call arrays): a test that ran an eager call of the shape first would
hide the leak.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kvgroups_core as kc
    from kvgroups_core import EngineKVFormat as F

    NL, NB, BS, NH, HS, CHUNK = 2, 16, 4, 2, 8, 8
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 2**31, (2, NB, BS, NH, HS), dtype=np.uint32) for _ in range(NL)]

    def caches():
        return [jnp.asarray(h) for h in host]

    def manager(cs):
        return kc.KVLayerGroupsManager(cs, [F.NL_X_TWO_NB_BS_NH_HS] * NL,
                                       lmcache_tokens_per_chunk=CHUNK)

    ids = np.array([3, 7, 1, 12], np.int32)  # two chunks of two blocks
    ref_objs = kc.store(manager(host), host, ids, backend="numpy")

    def expect_store_objects(objs, what):
        for got, want in zip(objs, ref_objs):
            if not np.array_equal(np.asarray(got), want):
                sys.exit(f"{what}: objects differ from the reference")

    def check_load(new, what):
        want = [h.copy() for h in host]
        want = kc.load(manager(want), ref_objs, want, np.array([9, 10, 11, 13]),
                       backend="numpy")
        for got, w in zip(new, want):
            if not np.array_equal(np.asarray(got), w):
                sys.exit(f"{what}: caches differ from the reference")

    def jit_store_closed_caches():
        cs = caches()
        m = manager(cs)
        expect_store_objects(jax.jit(lambda i: kc.store(m, cs, i))(jnp.asarray(ids)), "jit store")

    def jit_store_traced_caches():
        cs = caches()
        m = manager(cs)
        expect_store_objects(jax.jit(lambda c, i: kc.store(m, c, i))(cs, jnp.asarray(ids)),
                      "jit store (traced caches)")

    def jit_load():
        cs = caches()
        m = manager(cs)
        objs = [jnp.asarray(o) for o in ref_objs]
        f = jax.jit(lambda c, o, i: kc.load(m, o, c, i), donate_argnums=(0,))
        check_load(f(cs, objs, jnp.asarray([9, 10, 11, 13], jnp.int32)), "jit load")

    def jit_load_traced_skip():
        cs = caches()
        m = manager(cs)
        objs = [jnp.asarray(o) for o in ref_objs]
        f = jax.jit(lambda c, o, i, s: kc.load(m, o, c, i, skip_first_n_tokens=s))
        check_load(f(cs, objs, jnp.asarray([9, 10, 11, 13], jnp.int32), jnp.int32(0)),
                   "jit load, traced skip")

    def eager_store():
        cs = caches()
        expect_store_objects(kc.store(manager(cs), cs, ids), "eager store")

    def eager_load():
        cs = caches()
        new = kc.load(manager(cs), [jnp.asarray(o) for o in ref_objs], cs,
                      np.array([9, 10, 11, 13]))
        check_load(new, "eager load")

    def prepared_store():
        cs = caches()
        expect_store_objects(kc.prepare(manager(cs), cs).store(ids), "prepared store")

    def prepared_load():
        cs = caches()
        new = kc.prepare(manager(cs), cs).load([jnp.asarray(o) for o in ref_objs],
                                               np.array([9, 10, 11, 13]))
        check_load(new, "prepared load")

    def jit_layer_subset():
        cs = caches()
        m = manager(cs)
        objs = jax.jit(lambda i: kc.store(m, cs, i, layers=[1]))(jnp.asarray(ids))
        mine = kc.store(manager(host), host, ids, layers=[1], backend="numpy")
        for got, want in zip(objs, mine):
            if not np.array_equal(np.asarray(got), want):
                sys.exit("jit store, layers=[1]: objects differ")

    steps = {name: fn for name, fn in globals().items() if callable(fn) and
             name.startswith(("jit_", "eager_", "prepared_"))}
    for name in sys.argv[1].split(","):
        steps[name]()
    print("ok")
    """
)

ORDERS = {
    "jit-store-then-everything": "jit_store_closed_caches,jit_store_traced_caches,eager_store,"
    "prepared_store,jit_store_closed_caches,eager_load,jit_load,prepared_load",
    "jit-load-first": "jit_load,jit_load_traced_skip,eager_load,prepared_load,jit_load,eager_store",
    "traced-caches-first": "jit_store_traced_caches,jit_store_closed_caches,prepared_store,"
    "eager_store",
    "traced-skip-first": "jit_load_traced_skip,jit_load,eager_load",
    "layer-subset-first": "jit_layer_subset,eager_store,jit_layer_subset,prepared_store",
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_first_call_traced_in_jit_leaves_the_process_usable(order):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, ORDERS[order]], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )
