# Session 31, call 2: the parity benchmark (JAX jitted programs vs torch prepared calls, same
# work), then torch's GPU tests, memcheck and racecheck (pending since 5700dd0).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 200 python3 benchmarks/bench_parity.py --out $OUT/parity_h200.jsonl > $OUT/parity.txt 2>&1; el "parity rc=$?"
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "parity_h200.jsonl")
for r in (json.loads(l) for l in open(p)) if os.path.exists(p) else []:
    print(r["runtime"], r["path"], r["direction"], r["chunks"], r.get("verified", ""), "ms", round(r["median"], 4), "frac", round(r["frac_of_ceiling"], 3), "vs_torch", round(r.get("frac_of_torch", 0), 3), "kern", round(r.get("kernel_ms", 0), 4), "dev", round(r.get("device_ms", 0), 4))
PY
tail -3 $OUT/parity.txt | cut -c1-300
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
SAN="compute-sanitizer --report-api-errors no --error-exitcode 9"
timeout 60 $SAN --tool racecheck $PYTEST -m gpu tests/core/test_suite_layout.py tests/torch/test_torch_engine_gpu.py tests/torch/test_warp_kernel_gpu.py -k "not compiled and (back_to_back or bit_exact or out_of_range)" > $OUT/racecheck.log 2>&1; el "racecheck rc=$?"; grep "RACECHECK SUMMARY" $OUT/racecheck.log; tail -2 $OUT/racecheck.log | head -1
SEL="tests/core/test_suite_layout.py tests/torch/test_torch_engine_gpu.py tests/torch/test_warp_kernel_gpu.py tests/torch/test_small_pages_gpu.py"
timeout 90 $SAN --tool memcheck $PYTEST -m gpu $SEL -k "not compiled" > $OUT/memcheck.log 2>&1; el "memcheck rc=$?"; grep "ERROR SUMMARY" $OUT/memcheck.log; tail -2 $OUT/memcheck.log | head -1
left=$(( 585 - ($(date +%s) - T0) )); el "tests get $left s"
timeout $left $PYTEST -m gpu tests/core/test_suite_layout.py tests/torch tests/conformance tests/tp > $OUT/gpu_tests.log 2>&1; el "torch gpu tests rc=$?"; tail -1 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head
