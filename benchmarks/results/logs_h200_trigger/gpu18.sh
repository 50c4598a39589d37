# Call 2: checks of the early trigger and JAX chunk order (tests, memcheck), at most 8 files in $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
L=$OUT
timeout 250 $PYTEST -m gpu tests/core/test_suite_layout.py tests/torch tests/conformance tests/tp > $L/gpu_tests.log 2>&1; el "torch gpu tests rc=$?"; tail -1 $L/gpu_tests.log; grep -E "^(FAILED|ERROR)" $L/gpu_tests.log | head
timeout 160 $PYTEST -m gpu tests/core/test_suite_layout.py tests/jax > $L/jax_gpu_tests.log 2>&1; el "jax gpu tests rc=$?"; tail -1 $L/jax_gpu_tests.log; grep -E "^(FAILED|ERROR)" $L/jax_gpu_tests.log | head
SAN="compute-sanitizer --report-api-errors no --error-exitcode 9"
SEL="tests/core/test_suite_layout.py tests/torch/test_torch_engine_gpu.py tests/torch/test_warp_kernel_gpu.py tests/torch/test_small_pages_gpu.py"
timeout 170 $SAN --tool memcheck $PYTEST -m gpu $SEL -k "not compiled" > $L/memcheck.log 2>&1; el "memcheck rc=$?"; grep "ERROR SUMMARY" $L/memcheck.log; tail -2 $L/memcheck.log | head -1
