# Session 10, call A: can XLA launch our CUDA kernel (jaxlib's kernel call)? Then lowering
# "cuda": its GPU tests, and the public-call parity bench against torch.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
L=$OUT
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
python3 -c "import cuda.core, jax, jaxlib; print(cuda.core.__version__, jax.__version__, jaxlib.__version__)"; pip list 2>/dev/null | grep -i -E "nvrtc|nvcc|cuda-bindings|jax"
timeout 100 python3 .diag/probe_xla.py > $L/probe.log 2>&1; el "probe rc=$?"; grep -v "^ " $L/probe.log | head -30
if ! grep -q "equal True" $L/probe.log; then
  for v in 9.0 8.8; do PTXV=$v timeout 60 python3 .diag/probe_xla.py > $L/probe_$v.log 2>&1; el "probe $v rc=$?"; grep -E "equal|GB/s|rror" $L/probe_$v.log | head -8; done
fi
python3 -c "import sys; sys.path[:0]=['backends']; from kvgroups_jax import cuda_copy as c; print('xla cuda', c._xla_cuda_version(), c.runtime_unavailable(), [l for l in c._ptx('sm_90', 8).splitlines() if l.startswith('.version')])" 2>&1 | tail -2
timeout 150 $PYTEST -m gpu tests/jax/test_gpu.py tests/jax/test_gpu_engine.py -k cuda -x > $L/jax_cuda_tests.log 2>&1; el "jax cuda tests rc=$?"; tail -1 $L/jax_cuda_tests.log; grep -E "^(FAILED|ERROR)|Error" $L/jax_cuda_tests.log | head -12
timeout 170 python3 benchmarks/bench_transfer.py --matrix headline --backends torch,jax --paths cuda,pallas-mosaic --chunks 16,64 --placements device --budget-s 140 --out $L/parity.jsonl > /dev/null 2> $L/parity.err; el "parity rc=$?"; tail -3 $L/parity.err
python3 - <<'PY2'
import json, os
p = os.path.join(os.environ["OUT"], "parity.jsonl")
for r in (json.loads(l) for l in open(p)) if os.path.exists(p) else []:
    if r.get("record") in ("transfer", "error", "summary", "ceiling"):
        print({k: r[k] for k in ("record", "backend", "path", "call", "ids", "direction", "chunks", "page_bytes", "gbps", "frac_of_ceiling", "ceiling", "median_s", "error", "reason") if k in r})
PY2
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 100 compute-sanitizer --report-api-errors no --error-exitcode 9 --tool memcheck $PYTEST -m gpu tests/jax/test_gpu_engine.py -k cuda > $L/memcheck_jax_cuda.log 2>&1; el "memcheck rc=$?"; grep "ERROR SUMMARY" $L/memcheck_jax_cuda.log; tail -1 $L/memcheck_jax_cuda.log
