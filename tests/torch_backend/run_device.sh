#!/usr/bin/env bash
# One batched GPU session for kvgroups_torch (used with the lent-GPU tool): versions, the GPU
# tests, the torch-cuda conformance cases, compute-sanitizer memcheck over GPU tests (bad
# inputs included), then the transfer benchmark. Logs and JSON go to ${OUT:-/tmp/kvg_out}.
# Usage: bash tests/torch_backend/run_device.sh [tests|sanitize|bench|all]...
set -u
OUT=${OUT:-/tmp/kvg_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends:${PYTHONPATH:-}"
export KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
steps=${*:-all}

python3 - <<'PY' 2>&1 | tee "$OUT/versions.log"
import torch
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
try:
    import cuda.core, cuda.bindings
    print("cuda.core", cuda.core.__version__, "cuda.bindings", cuda.bindings.__version__)
    from cuda.bindings import nvrtc
    print("nvrtc", nvrtc.nvrtcVersion())
except Exception as exc:
    print("cuda-python problem:", repr(exc))
PY
if ! python3 -c "import cuda.core as c, sys; sys.exit(int(c.__version__.split('.')[0]) < 1)"; then
  echo "installing carried cuda-core wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

if [[ $steps == *tests* || $steps == all ]]; then
  timeout 240 python3 -m pytest -q -m gpu tests/torch_backend -x -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -25
  timeout 120 python3 -m pytest -q tests/conformance -k "torch-cuda" -p no:cacheprovider 2>&1 \
    | tee "$OUT/conformance_torch_cuda.log" | tail -8
fi
if [[ $steps == *sanitize* || $steps == all ]]; then
  # No caching allocator: every tensor is its own allocation, so memcheck sees any byte
  # outside the given tensors.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck \
    --report-api-errors no --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/torch_backend/test_torch_cuda.py tests/torch_backend/test_torch_paths.py \
    -k "not torch_compile and not indexing and ((bfloat16 and (hnd or indexer or interleaved or padded)) or sliding or first_item or unaligned or per_chunk or out_of_range or short or graph or many_chunks)" \
    2>&1 | tee "$OUT/sanitizer.log" | tail -15
  echo "sanitizer exit: ${PIPESTATUS[0]}" | tee -a "$OUT/sanitizer.log"
fi
if [[ $steps == *bench* || $steps == all ]]; then
  timeout 300 python3 benchmarks/bench_torch_transfer.py ${BENCH_ARGS:-} --out "$OUT/torch_transfer_h200.jsonl" \
    2>&1 | tee "$OUT/bench.log" | tail -40
fi
