# Session 10, call D: K=8 public stores chained in one jax.jit (lowering cuda, mosaic) and the
# same 8 prepared torch stores, in one process, 16 and 64 chunks.
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
timeout 200 python3 .diag/jit_chain.py cuda mosaic 2>&1 | grep -E "record|rror" | cut -c1-400
