#!/usr/bin/env bash
# The public calls on one GPU, in one device call of under 9 minutes (KVG_ENGINE_TOTAL_S,
# default 510 s): `kvgroups bench --matrix engine` for torch, then JAX (store, load, prepared,
# jit, graph, layer-wise; host and device ids; chunks 1-256; pages 512 B-128 KiB; device and
# pinned objects), then the Markdown table of the records (call / ids / page / chunks, the
# fraction of the same run's copy, host-bound flags).
#
# Run from the repository root (python3 with torch and jax installed; the packages need not be
# installed):
#
#   bash benchmarks/run_engine_h200.sh                 # writes $OUT/engine_h200.jsonl, .md
#   KVG_ENGINE_RESUME=engine_h200.jsonl bash benchmarks/run_engine_h200.sh
#       # a second call: measures only the cases that file lacks (the points a budget cut)
#
# KVG_ENGINE_TORCH_S / KVG_ENGINE_JAX_S: each runtime's time limit (default 170 / 310 s: JAX compiles each call); its
# engine stops starting new cases at 85% of it (later cases become "time budget" records,
# which a resumed run measures). KVG_ENGINE_MATRIX=tiny (with KVG_ENGINE_TORCH=torch-cpu,
# KVG_ENGINE_JAX=jax-cpu, KVG_ENGINE_ARGS="--sweeps headline"): a CPU smoke test of this script.
set -u
OUT=${OUT:-/tmp/kvg_engine}
MATRIX=${KVG_ENGINE_MATRIX:-engine}
TOTAL_S=${KVG_ENGINE_TOTAL_S:-510}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends:${PYTHONPATH:-}"
export KVGROUPS_CACHE_DIR=${KVGROUPS_CACHE_DIR:-/tmp/kvg_cubins}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
JSON="$OUT/engine_h200.jsonl"
RESUME=()
if [[ -n "${KVG_ENGINE_RESUME:-}" && -f "${KVG_ENGINE_RESUME}" ]]; then
  grep -v -E '"reason": "(time budget|script time allowance)"' "$KVG_ENGINE_RESUME" > "$JSON"
  RESUME=(--resume "$KVG_ENGINE_RESUME")
else
  rm -f "$JSON"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/versions.log" 2>&1
python3 -c "import torch, jax; print('torch', torch.__version__, 'jax', jax.__version__)" \
  >> "$OUT/versions.log" 2>&1
cat "$OUT/versions.log"

run() {  # run NAME LIMIT_S BACKEND
  local name=$1 limit=$2 left status
  left=$((TOTAL_S - SECONDS - 15))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then
    echo "{\"record\": \"skipped\", \"backend\": \"$3\", \"stage\": \"process $name\", \"reason\": \"script time allowance\"}" >> "$JSON"
    return
  fi
  echo "[$SECONDS s] $name (limit ${limit}s)"
  timeout -k 5 "$limit" python3 -m kvgroups_tools.cli bench --matrix "$MATRIX" \
    --backends "$3" --out "$JSON" --budget-s $((limit * 85 / 100)) \
    ${RESUME[@]+"${RESUME[@]}"} ${KVG_ENGINE_ARGS:-} > "$OUT/$name.out" 2> "$OUT/$name.log"
  status=$?
  tail -n 3 "$OUT/$name.log"
  if (( status != 0 && status != 1 )); then   # 1: a verification failed (recorded)
    echo "{\"record\": \"error\", \"backend\": \"$3\", \"stage\": \"process $name\", \"error_type\": \"ExitStatus\", \"error\": \"exit status $status (124: timeout)\"}" >> "$JSON"
  fi
}

run torch "${KVG_ENGINE_TORCH_S:-170}" "${KVG_ENGINE_TORCH:-torch}"
run jax "${KVG_ENGINE_JAX_S:-310}" "${KVG_ENGINE_JAX:-jax}"

python3 -m kvgroups_tools.cli bench --summarize "$JSON" --markdown --quiet \
  > "$OUT/engine_h200.md" 2> "$OUT/summary.log"
echo "[$SECONDS s] done: $(grep -c '"record": "transfer"' "$JSON") transfer records," \
  "$(grep -c '"reason": "time budget"' "$JSON") cut by the budget," \
  "$(grep -c '"record": "error"' "$JSON") error records; files in $OUT"
grep '"record": "error"' "$JSON" | cut -c1-300 | head -20
