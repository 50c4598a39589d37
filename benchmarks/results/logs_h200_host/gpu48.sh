# Session 34, call 4: the engine benchmark of the new host path (every section; run 6 of
# torch_engine_h200.jsonl), then one-chunk and layer-wise calls of main at 49ec2fd (.ab/base)
# and of the new tree, alternating.
set -u
export PYTHONUNBUFFERED=1 KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PYTHONPATH="$PWD:$PWD/backends" timeout 330 python3 benchmarks/bench_torch_engine.py --out $OUT/torch_engine.jsonl > /dev/null 2> $OUT/engine_err.log; el "engine rc=$?"; tail -2 $OUT/engine_err.log
for r in 1 2; do
  for t in new base; do
    root=$PWD; [ $t = base ] && root=$PWD/.ab/base
    (cd $root && PYTHONPATH="$root:$root/backends" timeout 60 python3 benchmarks/bench_torch_engine.py --only prepared layerwise --chunks 1 --out $OUT/ab_$t.jsonl > /dev/null 2>&1); el "ab $t rc=$?"
  done
done
python3 - <<'PY'
import json, os
for name in ("torch_engine", "ab_new", "ab_base"):
    p = os.path.join(os.environ["OUT"], name + ".jsonl")
    for r in (json.loads(l) for l in open(p)) if os.path.exists(p) else []:
        print(name, r.get("call"), r.get("ids"), r.get("direction"), r.get("chunks"), "graph" if r.get("graph") else "", r.get("max_ctas", ""), "us", round(r.get("median", 0) * 1e3, 2), "frac", round(r.get("frac_of_ceiling", 0) or 0, 3), "whole", round(r.get("frac_of_whole", 0) or 0, 3), round(r.get("gemm_slowdown", 0) or 0, 3))
PY
