set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 .diag/jax_reduce_diag.py $OUT 2>&1 | grep -v Warning | tail -40
