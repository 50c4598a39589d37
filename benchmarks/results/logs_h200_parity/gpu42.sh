# Session 31, call 3: where a jitted JAX program's ~90 us beyond its kernels goes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
timeout 120 python3 .diag/prog_gap.py 2>&1 | grep -v "^W\|^I0\|Warning" | head -150
timeout 60 env KVG_TAG=nocmdbuf XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 .diag/prog_gap.py 2>&1 | grep '^{'
timeout 60 env KVG_TAG=mosaic KVG_LOW=mosaic python3 .diag/prog_gap.py 2>&1 | grep '^{'
