export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
timeout 120 python3 .diag/trace_chain.py > $OUT/trace_chain.txt 2>&1; echo rc=$?; grep -v "^ " $OUT/trace_chain.txt | tail -60 | cut -c1-220; rm -rf $OUT/trace
