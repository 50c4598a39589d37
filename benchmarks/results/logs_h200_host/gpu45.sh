# Session 34, call 1: launch costs on this host, and main's engine benchmark (prepared, layer-wise) as the baseline.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print(torch.__version__)"
nproc; grep -m1 "model name" /proc/cpuinfo
timeout 120 python3 benchmarks/results/logs_h200_host/launch_probe.py 2>&1 | tail -3
timeout 240 python3 benchmarks/bench_torch_engine.py --only prepared layerwise --chunks 1 4 --out $OUT/engine_base.jsonl > $OUT/engine_base.txt 2>&1; echo "bench rc=$?"
python3 - <<'PY'
import json, os
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "engine_base.jsonl"))):
    print(r["call"], r["ids"], r["direction"], r["chunks"], "ms", round(r["median"], 4), "frac", round(r["frac_of_ceiling"], 3), "whole", round(r.get("frac_of_whole", 0), 3), "graph" if r.get("graph") else "")
PY
