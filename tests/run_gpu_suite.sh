#!/usr/bin/env bash
# Everything the GPU must show, in one call of the lent-GPU tool (about 9 minutes):
#   1. the conformance suite on torch-cuda and jax-gpu, and every GPU backend pair;
#   2. compute-sanitizer memcheck over the torch-cuda conformance run (bad input included);
#   3. the torch GPU unit tests for graph capture, torch.compile and device-side id checks;
#   4. the transfer benchmark (benchmarks/run_h200.sh).
# Logs go to $WORK; one tarball of them plus the key results land in $OUT (the tool brings
# back at most 8 files).
set -u
OUT=${OUT:-/tmp/kvg_gpu_out}
WORK=/tmp/kvg_gpu_work
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends:${PYTHONPATH:-}"
export KVGROUPS_CACHE_DIR=/tmp/kvg_cubins XLA_PYTHON_CLIENT_PREALLOCATE=false
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"

echo "== conformance on the GPU backends (and GPU pairs)"
timeout 130 $PYTEST -m gpu tests/conformance 2>&1 | tee "$WORK/conformance_gpu.log" | tail -6

echo "== compute-sanitizer memcheck over the torch-cuda conformance run"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 compute-sanitizer --tool memcheck \
  --report-api-errors no --error-exitcode 9 $PYTEST tests/conformance \
  -k "torch-cuda and not jax and (bfloat16 or bad or skip or placement or canonical or padded)" \
  2>&1 | tee "$WORK/sanitizer.log" | tail -6
echo "sanitizer exit: ${PIPESTATUS[0]}" | tee -a "$WORK/sanitizer.log"

echo "== torch GPU unit tests (graph capture, torch.compile, device ids)"
timeout 60 $PYTEST -m gpu tests/torch -k "graph or compile or out_of_range or device_ids" \
  2>&1 | tee "$WORK/torch_gpu.log" | tail -4

echo "== benchmark"
KVG_BENCH_TOTAL_S=${KVG_BENCH_TOTAL_S:-235} OUT="$WORK/bench" bash benchmarks/run_h200.sh \
  > "$WORK/bench_run.log" 2>&1
tail -30 "$WORK/bench_run.log"
cp "$WORK"/bench/transfer_h200.jsonl "$WORK"/bench/summary_h200.md "$WORK"/bench/transfer_h200.png \
  "$OUT"/ 2>/dev/null
tar -czf "$OUT/gpu_logs.tar.gz" -C "$WORK" .
ls -la "$OUT"
