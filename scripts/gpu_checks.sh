#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one command (about 5 minutes on an H200):
#
#   bash scripts/gpu_checks.sh                      # all check steps
#   KVG_GPU_STEPS="gpu_tests memcheck_torch" bash scripts/gpu_checks.sh
#   KVG_GPU_STEPS=bench bash scripts/gpu_checks.sh  # the H200 records of benchmarks/results
#
# Steps (KVG_GPU_STEPS, default: every step but bench, in this order):
#   gpu_tests          every test marked `gpu` (the conformance suite on torch-cuda and jax-gpu,
#                      graph capture, torch.compile, device-side id checks, every Pallas
#                      lowering, donation, in-place loads into torch memory)
#   memcheck_torch     compute-sanitizer memcheck over the torch-cuda conformance run (bad
#                      input and cross-runtime pairs included), caching allocator off
#   memcheck_jax       memcheck over the jax-gpu conformance run (XLA allocating each buffer)
#   memcheck_kernels   memcheck over the engine-native, warp-kernel, call-memo and pinned-mode
#                      torch tests (our kvg_* kernels only) and the jitted JAX tests (small pages)
#   racecheck          racecheck (shared-memory hazards) over the engine and kernel tests, and
#                      over the per-layer readiness tests (a captured step of 32 layer loads
#                      on a side stream, each layer's compute waiting for its own load)
#   mosaic_smoke       the Mosaic GPU kernel bit-exact and in place per layout
#   nixl_probe         which NIXL plugins load and whether device memory registers (P/D)
#   bench              the benchmark commands of benchmarks/results/README.md (JSON lines)
#
# NIXL (the P/D tests and bench_pd) is used where importable: on a machine that cannot
# download, carry `.whl/nixl_cu13_min.zip` made by `python scripts/nixl_subset.py`.
#
# Run from the repository root with torch, jax and the cuda extra installed (or the checkout
# on PYTHONPATH, which this sets). Logs go to $WORK, records and a tarball of the logs to $OUT.
# The exit status is the number of failed steps. Test files are found by name anywhere under
# tests/, so the script does not depend on the folders' layout.
set -u
OUT=${OUT:-/tmp/kvg_gpu_out}
WORK=${WORK:-/tmp/kvg_gpu_work}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends:${PYTHONPATH:-}"
export KVGROUPS_CACHE_DIR=${KVGROUPS_CACHE_DIR:-/tmp/kvg_cubins} XLA_PYTHON_CLIENT_PREALLOCATE=false
if [[ -f .whl/nixl_cu13_min.zip ]]; then  # a carried NIXL (see above)
  rm -rf /tmp/kvg_nixl_site && python3 -m zipfile -e .whl/nixl_cu13_min.zip /tmp/kvg_nixl_site
  export PYTHONPATH="/tmp/kvg_nixl_site:$PYTHONPATH"
fi
PY=${PYTHON:-python3}
PYTEST="$PY -m pytest -q -p no:cacheprovider -o addopts=-ra"
MEMCHECK="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9"
RACECHECK="compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9"
# Only our page-copy kernels (kvg_<direction>_...) are instrumented: cuBLAS's GEMMs beside them
# in the overlap tests are not ours to judge, and the filter keeps the steps fast.
OURS="--kernel-name kns=kvg_"
FAILED=0

tests_named() {  # the test files with these base names, wherever they live under tests/
  local name found
  for name in "$@"; do
    found=$(find tests -name "$name" -print | head -n 1)
    [ -n "$found" ] && echo "$found"
  done
}

step() {  # step NAME LIMIT_S COMMAND...: run, log to $WORK/NAME.log, show the tail
  local name=$1 limit=$2 status
  shift 2
  echo "== [$SECONDS s] $name"
  timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  status=$?
  grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|Error" "$WORK/$name.log" | tail -n 4
  echo "$name: exit $status" | tee -a "$WORK/$name.log"
  (( status != 0 )) && FAILED=$((FAILED + 1))
  return 0
}

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)"
} > "$WORK/versions.log" 2>&1
cat "$WORK/versions.log"

STEPS=${KVG_GPU_STEPS:-gpu_tests memcheck_torch memcheck_jax memcheck_kernels racecheck mosaic_smoke nixl_probe}
wants() { [[ " $STEPS " == *" $1 "* ]]; }
TORCH_KERNEL_TESTS=$(tests_named test_torch_engine_gpu.py test_call_memo_gpu.py \
  test_pinned_modes_gpu.py test_warp_kernel_gpu.py)
JAX_KERNEL_TESTS=$(tests_named test_gpu_engine.py test_jax_small_pages_gpu.py)

wants gpu_tests && step gpu_tests 240 $PYTEST -m gpu tests
wants memcheck_torch && step memcheck_torch 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  $MEMCHECK $PYTEST tests/conformance -k "torch-cuda"
wants memcheck_jax && step memcheck_jax 150 env XLA_PYTHON_CLIENT_ALLOCATOR=platform \
  $MEMCHECK $PYTEST tests/conformance -k "jax-gpu"
if wants memcheck_kernels; then
  step memcheck_kernels 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 $MEMCHECK $OURS \
    $PYTEST -m gpu $TORCH_KERNEL_TESTS -k "not graph and not compiled"
  step memcheck_jax_kernels 150 env XLA_PYTHON_CLIENT_ALLOCATOR=platform $MEMCHECK \
    $PYTEST -m gpu $JAX_KERNEL_TESTS
  step memcheck_mosaic 120 env XLA_PYTHON_CLIENT_ALLOCATOR=platform $MEMCHECK \
    $PYTEST -m gpu "$(tests_named test_gpu.py)" -k "mosaic or auto"
fi
# Racecheck runs unfiltered (with the kernel filter it once failed to handle a hardware
# exception beside an uninstrumented GEMM) over every test that launches no GEMM.
wants racecheck && step racecheck 150 $RACECHECK $PYTEST -m gpu $TORCH_KERNEL_TESTS \
  -k "not compiled and not side_stream and not tunables"
# The no-wait controls race on purpose (they prove the content checks can fail).
wants racecheck && step racecheck_layerwise 150 $RACECHECK $PYTEST -m gpu \
  $(tests_named test_layerwise_gpu.py test_connector_pipeline_gpu.py) -k "not control"
if wants nixl_probe; then
  step nixl_probe 60 $PY -c "
import json, torch
from kvgroups_transport import get_transport
t = get_transport('nixl', name='probe')
x = torch.empty((4, 1 << 20), dtype=torch.uint8, device='cuda')
t.register_pool('probe', [x], [1 << 20])
print(json.dumps({'vram_registered': True, 'torch': torch.__version__}))
t.close()"
fi
if wants mosaic_smoke; then
  step mosaic_smoke 120 $PY "$(tests_named mosaic_smoke.py)"
  grep '^{' "$WORK/mosaic_smoke.log" > "$OUT/mosaic_smoke.jsonl"
fi
if wants bench; then  # the commands of benchmarks/results/README.md
  step bench_torch_engine 200 $PY benchmarks/bench_torch_engine.py --out "$OUT/torch_engine_h200.jsonl"
  step bench_parity 150 $PY benchmarks/bench_parity.py --chunks 1,4,16,64 --out "$OUT/parity_h200.jsonl"
  step bench_jax_engine 150 $PY benchmarks/bench_jax_engine.py --calls jit,store --out "$OUT/jax_engine_h200.jsonl"
  step bench_host_cost 60 $PY benchmarks/bench_host_cost.py --device cuda --runtimes torch,jax \
    --out "$OUT/host_cost_h200.jsonl"
  step bench_state 120 $PY benchmarks/bench_torch_engine.py --only state --out "$OUT/state_h200.jsonl"
  step bench_overlap 210 $PY benchmarks/bench_overlap.py --out "$OUT/overlap_h200.jsonl"
  step bench_pd 150 $PY benchmarks/bench_pd.py --out "$OUT/pd_h200.jsonl"
fi
grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$WORK"/*check*.log 2>/dev/null
grep -h "^FAILED\|^ERROR " "$WORK"/*.log 2>/dev/null | head -n 30
tar -czf "$OUT/gpu_logs.tar.gz" -C "$WORK" .
echo "failed steps: $FAILED"
exit "$FAILED"
