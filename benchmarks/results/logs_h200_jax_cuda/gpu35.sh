# Session 10, call B: lowering "cuda" with capped (persistent) grids: tests, memcheck, and the
# parity bench (torch once, then JAX cuda at resident_waves None / 1 / 2 / 4 / 8, mosaic).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
L=$OUT
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
timeout 120 $PYTEST -m gpu tests/jax/test_gpu.py tests/jax/test_gpu_engine.py -k cuda > $L/jax_cuda_tests.log 2>&1; el "jax cuda tests rc=$?"; tail -1 $L/jax_cuda_tests.log; grep -E "^(FAILED|ERROR)" $L/jax_cuda_tests.log | head
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 compute-sanitizer --report-api-errors no --error-exitcode 9 --tool memcheck $PYTEST -m gpu tests/jax/test_gpu_engine.py tests/jax/test_gpu.py -k "cuda and (capped or traced or without or nhd-bfloat16)" > $L/memcheck_jax_cuda.log 2>&1; el "memcheck rc=$?"; grep "ERROR SUMMARY" $L/memcheck_jax_cuda.log | sort | uniq -c; tail -1 $L/memcheck_jax_cuda.log
B="--matrix headline --chunks 4,16,64 --placements device --quiet"
timeout 100 python3 benchmarks/bench_transfer.py $B --backends torch --paths cuda --budget-s 80 --out $L/parity_cta.jsonl > /dev/null 2>> $L/parity.err; el "torch rc=$?"
for W in 0 1 2 4 8; do
  KVG_W=$W timeout 80 python3 - $B --backends jax --paths cuda --budget-s 60 --out $L/parity_cta.jsonl > /dev/null 2>> $L/parity.err <<'PY2'
import os, runpy, sys
sys.path[:0] = ["backends", "."]
from kvgroups_jax import cuda_copy
w = int(os.environ["KVG_W"]); cuda_copy.TUNING["resident_waves"] = w or None
sys.argv = ["benchmarks/bench_transfer.py"] + sys.argv[1:]
runpy.run_path("benchmarks/bench_transfer.py", run_name="__main__")
PY2
  el "jax cuda waves=$W rc=$?"; echo "{\"record\": \"marker\", \"resident_waves\": $W}" >> $L/parity_cta.jsonl
done
timeout 60 python3 benchmarks/bench_transfer.py $B --backends jax --paths pallas-mosaic --budget-s 45 --out $L/parity_cta.jsonl > /dev/null 2>> $L/parity.err; el "mosaic rc=$?"
python3 - <<'PY2'
import json, os
p = os.path.join(os.environ["OUT"], "parity_cta.jsonl")
recs = [json.loads(l) for l in open(p)] if os.path.exists(p) else []
tag = "torch"
for r in recs:
    if r.get("record") == "marker":
        tag = f"waves={r['resident_waves']} (above)"; print("----", tag); continue
    if r.get("record") in ("transfer", "error"):
        print(r.get("backend"), r.get("path"), r.get("call"), r.get("ids"), r.get("direction"), r.get("chunks"), round(r.get("gbps", 0)), round(r.get("frac_of_ceiling", 0), 3), r.get("error", "")[:100] if r.get("record") == "error" else "")
PY2
tail -3 $L/parity.err
