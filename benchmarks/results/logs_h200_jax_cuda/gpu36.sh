# Session 10, call C: kernel time of the same 64-chunk store under torch and under XLA (ncu),
# then the torch GPU subset on the moved package.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
L=$OUT
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
NCU="ncu --clock-control none --launch-skip 3 --launch-count 2 --section SpeedOfLight --section LaunchStats --section Occupancy"
for w in torch cuda; do
  K=regex:kvg_store; [ $w = mosaic ] && K=regex:.
  [ $w = mosaic ] && NCUW="ncu --clock-control none --launch-skip 40 --launch-count 1 --section SpeedOfLight" || NCUW="$NCU -k $K"
  timeout 90 $NCUW python3 .diag/one_store.py $w > $L/ncu_$w.txt 2>&1; el "ncu $w rc=$?"
  grep -E "kvg_|Duration|DRAM Throughput|Memory Throughput|Registers Per|Grid Size|Achieved Occupancy|Block Size|==PROF==|rror" $L/ncu_$w.txt | head -24
done
timeout 100 $PYTEST -m gpu tests/core/test_suite_layout.py tests/torch/test_torch_nvrtc.py tests/torch/test_warp_kernel_gpu.py tests/torch/test_torch_engine_gpu.py > $L/gpu_subset.log 2>&1; el "torch gpu subset rc=$?"; tail -1 $L/gpu_subset.log; grep -E "^(FAILED|ERROR)" $L/gpu_subset.log | head
