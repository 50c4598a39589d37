# Session 31, call 6: JAX kernels after pallas_copy's signature change: memcheck over the JAX
# GPU engine tests (Triton, Mosaic, cuda lowerings), the Triton path's benchmark, parity again.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
SAN="compute-sanitizer --report-api-errors no --error-exitcode 9"
timeout 150 env XLA_PYTHON_CLIENT_ALLOCATOR=platform $SAN --tool memcheck $PYTEST -m gpu tests/core/test_suite_layout.py tests/jax/test_gpu_engine.py > $OUT/memcheck_jax.log 2>&1; el "memcheck jax rc=$?"; grep "ERROR SUMMARY" $OUT/memcheck_jax.log | sort | uniq -c; tail -2 $OUT/memcheck_jax.log | head -1
timeout 120 python3 -m kvgroups_tools.cli bench --matrix headline --backends jax --paths pallas-triton --chunks 16,64 --placements device --budget-s 100 --out $OUT/triton_h200.jsonl > /dev/null 2> $OUT/triton.err; el "triton bench rc=$?"; tail -2 $OUT/triton.err
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "triton_h200.jsonl")
for r in (json.loads(l) for l in open(p)) if os.path.exists(p) else []:
    if "frac_of_ceiling" in r: print(r.get("call"), r.get("ids"), r.get("path"), r.get("direction"), r.get("chunks"), round(r["frac_of_ceiling"], 3))
PY
left=$(( 330 - ($(date +%s) - T0) )); el "parity gets $left s"
timeout $left python3 benchmarks/bench_parity.py --chunks 4,16,64 --lowerings auto --out $OUT/parity_h200.jsonl > $OUT/parity.txt 2>&1; el "parity rc=$?"
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "parity_h200.jsonl")
for r in (json.loads(l) for l in open(p)) if os.path.exists(p) else []:
    print(r["runtime"], r["path"], r["direction"], r["chunks"], r.get("verified", ""), r["steady_state"], "frac", round(r["frac_of_ceiling"], 3), "vs_torch", round(r.get("frac_of_torch", 0), 3))
PY
