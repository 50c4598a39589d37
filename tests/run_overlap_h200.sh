#!/usr/bin/env bash
# Issue 41 (overlap with the forward pass) on one H200 call, about 4-5 minutes:
#   layerwise_tests   the LayerwiseLoad / LayerwiseSave GPU tests (a captured step of 32
#                     layer loads + computes equal to the eager step and content-checked, the
#                     no-wait control, captured saves, waits / marks in a graph captured apart
#                     from the transfers, no host sync), the connector's step transfers on
#                     the GPU (pinned slots, host ids), the CPU semantics tests, the guide's
#                     example on CUDA, and the engine tests' side-stream store;
#   racecheck         compute-sanitizer racecheck over the two GPU test files (all but the
#                     no-wait control, whose race is intended; no cuBLAS GEMM runs in them);
#   bench_overlap     benchmarks/bench_overlap.py: the interference curve (GEMM and
#                     attention beside device-object transfers over max_ctas and the copy
#                     engine), the 32-layer step with overlapped loads, the host-link figures,
#                     the chosen default (JSON lines in $OUT/overlap_h200.jsonl).
# Every step has a time limit (a hang is killed and reported); one JSON line per step goes to
# $OUT/steps.jsonl, logs to $OUT/logs/. Exit status: the number of failed steps.
#   OUT=/tmp/out bash tests/run_overlap_h200.sh
set -u
OUT=${OUT:-/tmp/kvg_overlap_out}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends:${PYTHONPATH:-}"
export KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
FAILED=0

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 status start=$SECONDS
  shift 2
  echo "== [$SECONDS s] $name"
  timeout -k 10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  status=$?
  tail -n 6 "$OUT/logs/$name.log"
  echo "{\"step\": \"$name\", \"exit\": $status, \"seconds\": $((SECONDS - start)), \"timed_out\": $([[ $status == 124 || $status == 137 ]] && echo true || echo false)}" \
    | tee -a "$OUT/steps.jsonl"
  (( status != 0 )) && FAILED=$((FAILED + 1))
  return 0
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader > "$OUT/logs/versions.log" 2>&1
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" \
  >> "$OUT/logs/versions.log" 2>&1
cat "$OUT/logs/versions.log"

step layerwise_tests 120 $PYTEST tests/torch_backend/test_layerwise_gpu.py tests/torch_backend/test_layerwise.py \
  tests/torch_backend/test_connector_pipeline_gpu.py tests/torch_backend/test_connector_pipeline.py \
  "tests/torch_backend/test_torch_engine_gpu.py::test_side_stream_store_overlaps_compute_and_the_engine_waits_on_its_event" \
  "tests/engines/test_integration_doc.py::test_example_runs[layerwise]"
step racecheck 200 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 \
  $PYTEST -m gpu tests/torch_backend/test_layerwise_gpu.py tests/torch_backend/test_connector_pipeline_gpu.py \
  -k "not control"
step bench_overlap 210 python3 benchmarks/bench_overlap.py --out "$OUT/overlap_h200.jsonl"
grep -h "RACECHECK SUMMARY\|ERROR SUMMARY" "$OUT/logs/racecheck.log" 2>/dev/null
python3 - "$OUT/overlap_h200.jsonl" <<'PY' 2>/dev/null
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if "failed" in r or "skipped" in r:
        print(r["call"], r.get("path"), r.get("failed") or r.get("skipped"))
    elif r.get("compute") and r.get("placement") == "device":
        print(f'{r["call"]:15} {r["path"]:11} cap={r["max_ctas"]!s:5} {r["compute"][:12]:12} '
              f'alone={r["frac_of_ceiling"]:.2f} beside={r["concurrent_frac_of_copy"]:.2f} '
              f'slowdown={r["compute_slowdown"]:.3f} '
              f'lost_us_per_GiB={r["lost_compute_us_per_gib"] or 0:.0f}')
    elif r["call"] in ("LayerwiseLoad", "overlap_default", "prepared.store+prepared.load") \
            or r.get("placement") == "pinned":
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
PY
echo "failed steps: $FAILED"
exit "$FAILED"
