# Call 3: racecheck, memcheck over the jitted JAX GPU cases, the engine benchmarks, Triton A/B.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
L=$OUT
SAN="compute-sanitizer --report-api-errors no --error-exitcode 9"
timeout 100 $SAN --tool racecheck $PYTEST -m gpu tests/core/test_suite_layout.py tests/torch/test_torch_engine_gpu.py tests/torch/test_warp_kernel_gpu.py -k "not compiled and (back_to_back or bit_exact or out_of_range)" > $L/racecheck.log 2>&1; el "racecheck rc=$?"; grep "RACECHECK SUMMARY" $L/racecheck.log; tail -2 $L/racecheck.log | head -1
timeout 90 env XLA_PYTHON_CLIENT_ALLOCATOR=platform $SAN --tool memcheck $PYTEST -m gpu tests/core/test_suite_layout.py tests/jax/test_gpu_engine.py > $L/memcheck_jax.log 2>&1; el "memcheck jax rc=$?"; grep "ERROR SUMMARY" $L/memcheck_jax.log; tail -2 $L/memcheck_jax.log | head -1
timeout 130 python3 benchmarks/bench_torch_engine.py --only prepared graph layerwise sm_cap --out $L/torch_engine.jsonl > /dev/null 2> $L/err.log; el "torch engine rc=$?"
timeout 140 python3 benchmarks/bench_jax_engine.py --calls jit,store --out $L/jax_engine.jsonl > /dev/null 2>> $L/err.log; el "jax engine rc=$?"
timeout 125 python3 benchmarks/sweep_jax_kernel.py --shapes llama3-8b --chunks 16 --variants "chunk_order=1,0" --batches 5 --calls 10 --out $L/triton_ab.jsonl 2>> $L/err.log > /dev/null; el "triton 16 rc=$?"
tail -3 $L/err.log
python3 - <<'PY'
import json, os
O = os.environ["OUT"]
def rows(f):
    p = os.path.join(O, f)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
for r in rows("torch_engine.jsonl"):
    print("torch", r.get("call"), r.get("ids"), r.get("direction"), r.get("chunks"), r.get("graph", ""), round(r.get("frac_of_ceiling", 0) or 0, 3), round(r.get("frac_of_whole", 0) or 0, 3), r.get("max_ctas", ""), {k: r[k] for k in r if "gemm" in k or "slowdown" in k})
for r in rows("jax_engine.jsonl"):
    print("jax", r.get("call"), r.get("ids"), r.get("path"), r.get("direction"), r.get("chunks"), round(r.get("frac_of_ceiling", 0) or 0, 3), round(r.get("frac_of_per_call_ceiling", 0) or 0, 3))
for r in rows("triton_ab.jsonl"):
    if r.get("record") == "variant": print("triton", r["chunks"], r["chunk_order"], r.get("first_call_s"), round(r.get("store_of_copy", 0), 3), round(r.get("load_of_copy", 0), 3), r.get("store_matches_first_variant"), r.get("error", "")[:200])
PY
