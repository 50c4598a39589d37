# Session 28, call 4: the load's barrier: JAX GPU tests, memcheck over the jitted cases, the engine bench.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
SAN="compute-sanitizer --report-api-errors no --error-exitcode 9"
timeout 160 $PYTEST -m gpu tests/core/test_suite_layout.py tests/jax > $OUT/jax_gpu_tests.log 2>&1; el "jax gpu tests rc=$?"; tail -1 $OUT/jax_gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/jax_gpu_tests.log | head
timeout 90 env XLA_PYTHON_CLIENT_ALLOCATOR=platform $SAN --tool memcheck $PYTEST -m gpu tests/core/test_suite_layout.py tests/jax/test_gpu_engine.py > $OUT/memcheck_jax.log 2>&1; el "memcheck jax rc=$?"; grep "ERROR SUMMARY" $OUT/memcheck_jax.log; tail -2 $OUT/memcheck_jax.log | head -1
S() { python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get('call')=='jit': print(r['ids'], r['chunks'], r['weights_mib'], 'wall %.3f' % r['frac_of_ceiling'], 'kern %.1f us' % (r.get('transfer_kernels_device_s',0)*1e6), 'dev %.3f' % r.get('frac_of_ceiling_device',0), 'stepdev %.3f' % r.get('frac_of_ceiling_step_device',0), r.get('device_growth_us'))
    elif r.get('call') in ('store','prepared'): print(r['call'], r['path'], r['chunks'], '%.3f' % r['frac_of_ceiling'])
" "$1"; }
timeout 200 python3 benchmarks/bench_jax_engine.py --calls jit,store --out $OUT/jax_engine_barrier.jsonl > /dev/null 2>> $OUT/err.log; el "bench rc=$?"; S $OUT/jax_engine_barrier.jsonl
timeout 90 python3 benchmarks/bench_jax_engine.py --calls jit --chunks 1,4 --weights-mib 1024 --out $OUT/jax_engine_barrier_w.jsonl > /dev/null 2>> $OUT/err.log; el "bench w rc=$?"; S $OUT/jax_engine_barrier_w.jsonl
tail -3 $OUT/err.log
