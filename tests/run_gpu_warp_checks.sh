#!/usr/bin/env bash
# The GPU checks and benchmarks of the warp kernels (kvg_*_v16_warp), H200, two device calls:
#   KVG_STEPS="gpu conf memconf memwarp race" bash tests/run_gpu_warp_checks.sh   # tests
#   KVG_STEPS="engine warp gather small headline" bash tests/run_gpu_warp_checks.sh  # benchmarks
# Every GPU-marked torch / core test; memcheck over the torch-cuda conformance run and over the
# warp-kernel, engine-native, call-memo and pinned-mode tests; racecheck over the warp-kernel
# and engine tests; then the torch engine benchmark, the kernel variants, the bare-gather
# ceiling, the torch small-page sweep for 2-32 KiB pages and the torch headline. Run from the
# repo root with OUT set; logs in $OUT/logs.tgz, results as $OUT/*.jsonl.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/backends KVGROUPS_CACHE_DIR=/tmp/kvgc
OUT=${OUT:-/tmp/kvg_gpu_out}; W=/tmp/kvg_warp; mkdir -p $W $OUT
P="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
S="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9"
R="compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9"
ENGINE="tests/torch_backend/test_torch_engine_gpu.py tests/torch_backend/test_call_memo_gpu.py tests/torch_backend/test_pinned_modes_gpu.py"
st(){ n=$1; l=$2; shift 2; echo "== [$SECONDS s] $n"; timeout -k 5 $l "$@" > $W/$n.log 2>&1; echo "$n exit $?"; grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY" $W/$n.log | tail -3; }
for step in ${KVG_STEPS:-gpu conf memconf memwarp race}; do case $step in
gpu) st gpu 150 $P -m gpu tests/torch_backend tests/core ;;
conf) st conf 60 $P tests/conformance -k torch-cuda ;;
memconf) st memconf 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 $S $P tests/conformance -k torch-cuda ;;
memwarp) st memwarp 130 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 $S --kernel-name kns=kvg_ $P -m gpu tests/torch_backend/test_warp_kernel_gpu.py $ENGINE -k "not graph and not compiled" ;;
race) st race 120 $R $P -m gpu tests/torch_backend/test_warp_kernel_gpu.py tests/torch_backend/test_torch_engine_gpu.py -k "not compiled and not side_stream and not tunables" ;;
engine) st engine 170 python3 benchmarks/bench_torch_engine.py --out $OUT/torch_engine_h200.jsonl ;;
warp) st warp 120 python3 benchmarks/sweep_warp_kernel.py --out $OUT/torch_warp_h200.jsonl ;;
gather) st gather 60 python3 benchmarks/probe_gather_ceiling.py --out $OUT/gather_ceiling_h200.jsonl ;;
small) st small 100 python3 benchmarks/sweep_small_pages.py --pages 2048,4096 --chunks 64,256 --planes-per-cta 8 --cta-bytes 65536 --unroll 8 --budget-s 80 --out $OUT/small_pages_warp_h200.jsonl ;;
headline) st headline 130 python3 -m kvgroups_tools.cli bench --backends torch --matrix headline --budget-s 110 --quiet --out $OUT/headline_warp_h200.jsonl ;;
esac; done
grep -h "^FAILED\|^ERROR " $W/*.log | head -30
tar czf $OUT/logs.tgz -C $W .
