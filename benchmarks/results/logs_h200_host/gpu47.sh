# Session 34, call 3: sanitizers and the GPU suites on the new host path (5dd7966..6519d8c),
# then the host-time A/B against main at 49ec2fd (.ab/base), alternating, and once with
# programmatic launches off (base: cuLaunchKernel, new: cuLaunchKernelEx without attributes).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
L=$OUT
export PYTHONPATH="$PWD:$PWD/backends"
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
SAN="compute-sanitizer --report-api-errors no --error-exitcode 9"
SEL="tests/core/test_suite_layout.py tests/torch/test_torch_engine_gpu.py tests/torch/test_warp_kernel_gpu.py tests/torch/test_small_pages_gpu.py tests/torch/test_call_memo_gpu.py"
timeout 110 $SAN --tool memcheck $PYTEST -m gpu $SEL -k "not compiled" > $L/memcheck.log 2>&1; el "memcheck rc=$?"; grep "ERROR SUMMARY" $L/memcheck.log; tail -2 $L/memcheck.log | head -1
timeout 60 $SAN --tool racecheck $PYTEST -m gpu tests/core/test_suite_layout.py tests/torch/test_torch_engine_gpu.py tests/torch/test_warp_kernel_gpu.py -k "not compiled and (back_to_back or bit_exact or out_of_range)" > $L/racecheck.log 2>&1; el "racecheck rc=$?"; grep "RACECHECK SUMMARY" $L/racecheck.log; tail -2 $L/racecheck.log | head -1
timeout 230 $PYTEST -m gpu tests/core/test_suite_layout.py tests/torch tests/conformance tests/tp > $L/gpu_tests.log 2>&1; el "torch gpu tests rc=$?"; tail -1 $L/gpu_tests.log; grep -E "^(FAILED|ERROR)" $L/gpu_tests.log | head
unset PYTHONPATH
for r in 1 2; do
  for t in base new; do
    root=$PWD; [ $t = base ] && root=$PWD/.ab/base
    KVG_ROOT=$root KVG_TAG=$t timeout 45 python3 benchmarks/results/logs_h200_host/host_ab.py 2>&1 | tail -1 | tee -a $L/host_ab.jsonl
  done
done
for t in base new; do
  root=$PWD; [ $t = base ] && root=$PWD/.ab/base
  KVGROUPS_PROGRAMMATIC_LAUNCH=0 KVG_ROOT=$root KVG_TAG=$t-plain timeout 45 python3 benchmarks/results/logs_h200_host/host_ab.py 2>&1 | tail -1 | tee -a $L/host_ab.jsonl
done
el "ab done"
