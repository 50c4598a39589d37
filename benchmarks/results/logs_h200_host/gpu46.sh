# Session 34, call 2: host time A/B (main at 49ec2fd in .ab/base against the working tree),
# GPU tests of the touched code, the engine benchmark of both trees.
set -u
export PYTHONUNBUFFERED=1 KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
for r in 1 2 3; do
  for t in base new; do
    root=$PWD; [ $t = base ] && root=$PWD/.ab/base
    KVG_ROOT=$root KVG_TAG=$t timeout 60 python3 benchmarks/results/logs_h200_host/host_ab.py 2>&1 | tail -1 | tee -a $OUT/host_ab.jsonl
  done
done
el "ab done"
export PYTHONPATH="$PWD:$PWD/backends"
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
timeout 200 $PYTEST -m gpu tests/torch/test_buffer_keys.py tests/torch/test_call_memo_gpu.py tests/torch/test_torch_engine_gpu.py tests/core/test_one_shot_reuse.py tests/torch/test_cross_stream_gpu.py tests/torch/test_torch_cuda.py tests/torch/test_warp_kernel_gpu.py > $OUT/gpu_tests.log 2>&1; el "gpu tests rc=$?"; tail -1 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head
for t in new base; do
  root=$PWD; [ $t = base ] && root=$PWD/.ab/base
  (cd $root && PYTHONPATH="$root:$root/backends" timeout 120 python3 benchmarks/bench_torch_engine.py --only prepared layerwise --chunks 1 4 --out $OUT/engine_$t.jsonl > /dev/null 2>&1); el "bench $t rc=$?"
done
python3 - <<'PY'
import json, os
for t in ("new", "base"):
    for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], f"engine_{t}.jsonl"))):
        print(t, r["call"], r["ids"], r["direction"], r["chunks"], "us", round(r["median"] * 1e3, 2), "frac", round(r["frac_of_ceiling"], 3), "whole", round(r.get("frac_of_whole", 0), 3), "graph" if r.get("graph") else "")
PY
