#!/usr/bin/env bash
# The transfer benchmark on the lent GPU machine (KVG_BENCH_TOTAL_S, default 500 s): the full matrix of
# `kvgroups bench` (headline Llama-3-8B-like case, chunks 1..512, page sizes 1-128 KiB, 8-128
# layers, pinned host objects, MLA / hybrid models, manager construction up to 1,024 layers)
# for torch and JAX, then the summary (torch vs JAX ratio), a Markdown table and the PNG plot.
#
# Run from the repository root (python3 with torch and jax installed; the packages need not be
# installed). Carry .whl/ along: .whl/*.whl (cuda-core, when the machine's is older than 1.0)
# and .whl/plot/*.whl (matplotlib, when missing) are installed into /tmp when needed.
#
#   bash benchmarks/run_h200.sh            # writes under $OUT and benchmarks/results/
#
# On one GPU the whole matrix takes longer than one 10-minute device call (a JAX shape costs
# 10-30 s of compiles: three paths x two directions). Two ways to fit it:
#
# - KVG_BENCH_GPUS=2 (a two-GPU machine): two lanes run side by side, one process per GPU:
#   GPU 0 runs torch, then JAX's chunk sweep; GPU 1 runs JAX's other sweeps. Pinned-host
#   points move over PCIe, which the two GPUs may share, so JAX's pinned points run after
#   both lanes, alone (torch's run in lane 0 while lane 1 does device-only JAX work).
# - KVG_BENCH_APPEND=1: start from the committed transfer_h200.jsonl and measure only what it
#   lacks (`kvgroups bench --resume`), so running the script again finishes a cut matrix:
#
#   KVG_BENCH_GPUS=2 KVG_BENCH_TOTAL_S=570 bash benchmarks/run_h200.sh
#   KVG_BENCH_APPEND=1 bash benchmarks/run_h200.sh     # the points the first call left
#
# KVG_BENCH_LANE0_FIRST: a command lane 0 runs on GPU 0 before its steps (e.g. the GPU test
# suite, so it runs beside lane 1's work instead of before it).
# KVG_BENCH_RUNTIMES ("torch jax numpy") picks the runtimes; KVG_BENCH_STEP_SCALE multiplies
# every step's time limit (the total allowance still caps it).
#
# Each runtime runs in its own processes (a kernel fault that breaks one CUDA context spoils
# nothing else), under a hard timeout; a process that fails is recorded as an error record in
# the JSON and the run goes on.
set -u
OUT=${OUT:-/tmp/kvg_bench}
RESULTS=${KVG_BENCH_RESULTS:-benchmarks/results}
MATRIX=${KVG_BENCH_MATRIX:-full}    # "tiny": a CPU smoke test of this script
TOTAL_S=${KVG_BENCH_TOTAL_S:-500}   # the whole script's wall-clock allowance
mkdir -p "$OUT" "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends:${PYTHONPATH:-}"
export KVGROUPS_CACHE_DIR=${KVGROUPS_CACHE_DIR:-/tmp/kvg_cubins}
export XLA_PYTHON_CLIENT_PREALLOCATE=false      # JAX shares the GPU with nothing, but must
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True   # not pin 75% of it up front
RUNTIMES=${KVG_BENCH_RUNTIMES:-torch jax numpy}
GPUS=${KVG_BENCH_GPUS:-1}
JSON="$OUT/transfer_h200.jsonl"
rm -f "$JSON" "$OUT"/lane*.jsonl
RESUME=()
if [[ "${KVG_BENCH_APPEND:-0}" == 1 && -f "$RESULTS/transfer_h200.jsonl" ]]; then
  # The earlier parts of a split run, less their "cut by the time limit" records: this run
  # measures those points or records its own cut.
  grep -v -E '"reason": "(time budget|script time allowance)"' \
    "$RESULTS/transfer_h200.jsonl" > "$JSON"
  RESUME=(--resume "$RESULTS/transfer_h200.jsonl")
fi
wants() { [[ " $RUNTIMES " == *" $1 "* ]]; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1
  python3 - <<'PY'
import platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("numpy", "torch", "jax", "jaxlib", "cuda.core", "matplotlib"):
    try:
        m = __import__(name, fromlist=["x"])
        print(name, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(name, "not importable:", type(exc).__name__, exc)
PY
} > "$OUT/versions.log" 2>&1
cat "$OUT/versions.log"
if ! python3 -c "import cuda.core as c, sys; sys.exit(int(c.__version__.split('.')[0]) < 1)" \
    2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  echo "installing carried cuda-core wheels into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

# step NAME LIMIT_S ARGS...: one `kvgroups bench` process appending to ${LANE_JSON:-$JSON}.
step() {
  local name=$1 limit=$(( $2 * ${KVG_BENCH_STEP_SCALE:-1} )) left status
  shift 2
  left=$((TOTAL_S - SECONDS))
  (( limit > left )) && limit=$left
  if (( limit < 15 )); then
    echo "{\"record\": \"skipped\", \"stage\": \"process $name\", \"reason\": \"script time allowance\"}" >> "${LANE_JSON:-$JSON}"
    echo "[$SECONDS s] $name: skipped (script time allowance)"
    return
  fi
  echo "[$SECONDS s] $name (limit ${limit}s): $*"
  # The engine's own budget stops starting new cases a little before the hard limit.
  timeout -k 5 "$limit" python3 -m kvgroups_tools.cli bench --out "${LANE_JSON:-$JSON}" \
    --budget-s $((limit * 80 / 100 - 8)) ${RESUME[@]+"${RESUME[@]}"} "$@" \
    > "$OUT/$name.out" 2> "$OUT/$name.log"
  status=$?
  tail -n 4 "$OUT/$name.log"
  if (( status != 0 && status != 1 )); then   # 1: a verification failed (already recorded)
    echo "{\"record\": \"error\", \"stage\": \"process $name\", \"error_type\": \"ExitStatus\", \"error\": \"exit status $status (124: timeout)\", \"args\": \"$*\"}" >> "${LANE_JSON:-$JSON}"
  fi
}

MAIN=headline,page,layers,models,manager
torch_steps() {  # torch_steps MAIN_LIMIT_S CHUNKS_LIMIT_S
  step torch-main   "$1" --backends torch --matrix $MATRIX --sweeps $MAIN
  step torch-chunks "$2" --backends torch --matrix $MATRIX --sweeps chunks
}
if (( GPUS >= 2 )); then
  # Two lanes, one GPU each, their records in separate files (merged below).
  (
    export CUDA_VISIBLE_DEVICES=0 LANE_JSON="$OUT/lane0.jsonl"
    if [[ -n "${KVG_BENCH_LANE0_FIRST:-}" ]]; then
      echo "[$SECONDS s] lane 0 first: $KVG_BENCH_LANE0_FIRST"
      bash -c "$KVG_BENCH_LANE0_FIRST"
      echo "[$SECONDS s] lane 0 first: exit $?"
    fi
    if wants torch; then torch_steps 150 90; fi
    if wants jax; then
      step jax-chunks 200 --backends jax --matrix $MATRIX --sweeps chunks --placements device
    fi
  ) > "$OUT/lane0.txt" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1 LANE_JSON="$OUT/lane1.jsonl"
    if wants jax; then
      step jax-main 440 --backends jax --matrix $MATRIX --sweeps $MAIN --placements device
    fi
  ) > "$OUT/lane1.txt" 2>&1 &
  wait
  cat "$OUT/lane0.txt" "$OUT/lane1.txt"
  cat "$OUT"/lane*.jsonl >> "$JSON" 2>/dev/null
  export CUDA_VISIBLE_DEVICES=0
  if wants jax; then   # alone on the machine: pinned copies share the host's links
    step jax-pinned 90 --backends jax --matrix $MATRIX --sweeps headline,chunks \
      --placements pinned
  fi
else
  if wants torch; then torch_steps 85 55; fi
  if wants jax; then
    step jax-main    170 --backends jax --matrix $MATRIX --sweeps $MAIN
    step jax-chunks  100 --backends jax --matrix $MATRIX --sweeps chunks
  fi
fi
if wants numpy; then
  # The NumPy reference and plain-NumPy baseline on the host, one Llama-3-8B-like chunk.
  step numpy        25 --backends numpy --matrix tiny --models llama3-8b --layers 32 --chunks 1 \
    --placements device
fi

if [[ "$MATRIX" == full ]] && (( TOTAL_S - SECONDS >= 100 )); then
  echo "[$SECONDS s] host cost per call (torch and JAX, one chunk of a 32-layer model)"
  timeout -k 5 30 python3 benchmarks/bench_torch_transfer.py --shapes "" --host-calls 1000 \
    --out "$OUT/host_cost_h200.jsonl" > "$OUT/host_cost_torch.log" 2>&1
  timeout -k 5 45 python3 benchmarks/bench_jax_host.py --chunks 1 --calls 200 \
    --out "$OUT/host_cost_h200.jsonl" \
    > "$OUT/host_cost_jax.log" 2>&1
  grep -h "us_median" "$OUT/host_cost_h200.jsonl" | cut -c1-160
fi

if (( TOTAL_S - SECONDS >= 45 )); then
  echo "[$SECONDS s] manager construction (CPU, bench_manager.py)"
  timeout -k 5 30 python3 benchmarks/bench_manager.py --repeats 11 \
    --out "$OUT/manager_h200.jsonl" > "$OUT/bench_manager.log" 2>&1 || true
fi

echo "[$SECONDS s] summary"
python3 -m kvgroups_tools.cli bench --summarize "$JSON" --out "$OUT/summary_h200.jsonl" \
  > /dev/null 2> "$OUT/summary_h200.txt"
python3 -m kvgroups_tools.cli bench --summarize "$JSON" --markdown --quiet \
  > "$OUT/summary_h200.md" 2>/dev/null
cat "$OUT/summary_h200.txt"

if ! python3 -c "import matplotlib" 2>/dev/null && ls .whl/plot/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/plotsite \
    .whl/plot/*.whl > /dev/null 2>&1
fi
PYTHONPATH="$PYTHONPATH:/tmp/plotsite" timeout 60 python3 benchmarks/plot_transfer.py "$JSON" \
  --out "$OUT/transfer_h200.png" > "$OUT/plot.log" 2>&1 \
  || echo "plot failed (see plot.log); draw it later: python benchmarks/plot_transfer.py $JSON"

for f in transfer_h200.jsonl summary_h200.jsonl summary_h200.md transfer_h200.png \
    manager_h200.jsonl host_cost_h200.jsonl; do
  [[ -f "$OUT/$f" ]] && cp "$OUT/$f" "$RESULTS/$f"
done
echo "[$SECONDS s] done: $(grep -c '"record": "transfer"' "$JSON") transfer records, " \
  "$(grep -c '"record": "error"' "$JSON") error records; files in $OUT"
grep '"record": "error"' "$JSON" | cut -c1-300 | head -20
