#!/usr/bin/env bash
# The GPU checks of the host-path work (H200, 2026-12-01: two device calls, this script's
# first six steps (jaxpinned then cut short: wrong options), then the rest; logs in benchmarks/results/logs_h200_hostpath). Every
# GPU-marked torch / core / jitted-JAX test, memcheck over the torch-cuda and jax-gpu
# conformance runs, the engine-native torch tests, the jitted JAX tests and the small-page and
# copy-engine tests, racecheck over the torch engine and small-page tests, the JAX
# pinned-object benchmark. Run from the repo root with OUT set.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/backends KVGROUPS_CACHE_DIR=/tmp/kvgc XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/kvg_gpu_out}; W=/tmp/kvg_hostpath; mkdir -p $W $OUT
P="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
S="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9"
st(){ n=$1; l=$2; shift 2; echo "== [$SECONDS s] $n"; timeout -k 5 $l "$@" > $W/$n.log 2>&1; echo "$n exit $?"; grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY" $W/$n.log | tail -3; }
st gpu 175 $P -m gpu tests/torch_backend tests/core tests/jax_backend/test_gpu_engine.py tests/jax_backend/test_jax_small_pages_gpu.py
st pinnedjax 40 $P tests/jax_backend/test_pinned_objects.py
st memtorch 110 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 $S $P tests/conformance -k torch-cuda
st memengine 110 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 $S --kernel-name kns=kvg_ $P -m gpu tests/torch_backend/test_torch_engine_gpu.py tests/torch_backend/test_call_memo_gpu.py tests/torch_backend/test_pinned_modes_gpu.py -k "not graph and not compiled"
st memjax 100 env XLA_PYTHON_CLIENT_ALLOCATOR=platform $S $P -m gpu tests/jax_backend/test_gpu_engine.py
st jaxpinned 70 python3 -m kvgroups_tools.cli bench --backends jax-cuda --paths pallas-triton --placements pinned --directions store,load --chunks 16,64 --models llama3-8b --budget-s 60 --quiet --out $OUT/jax_pinned_h200.jsonl
st memjaxconf 130 env XLA_PYTHON_CLIENT_ALLOCATOR=platform $S $P tests/conformance -k jax-gpu
st memjaxsmall 80 env XLA_PYTHON_CLIENT_ALLOCATOR=platform $S $P -m gpu tests/jax_backend/test_jax_small_pages_gpu.py
st memsmall 110 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 $S --kernel-name kns=kvg_ $P -m gpu tests/torch_backend/test_small_pages_gpu.py tests/torch_backend/test_copy_engine_gpu.py -k "not graph"
st race 110 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 $P -m gpu tests/torch_backend/test_torch_engine_gpu.py tests/torch_backend/test_call_memo_gpu.py tests/torch_backend/test_small_pages_gpu.py -k "not compiled and not side_stream"
grep -h "^FAILED\|^ERROR " $W/*.log | head -30
tar czf $OUT/logs.tgz -C $W .
