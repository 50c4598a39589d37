export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
for a in "mosaic 64" "cuda 16" "mosaic 16"; do timeout 60 python3 .diag/trace_chain.py $a > $OUT/trace_${a// /_}.txt 2>&1; echo "== $a rc=$?"; grep -v "^ " $OUT/trace_${a// /_}.txt | grep -v "ops in HLO" | tail -12 | cut -c1-120; rm -rf $OUT/trace; done
