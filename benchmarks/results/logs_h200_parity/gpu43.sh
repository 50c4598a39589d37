# Session 31, call 4: the parity benchmark with steady-state per-call figures; the host split.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
timeout 60 python3 .diag/host_split.py 2>&1 | tail -1
timeout 300 python3 benchmarks/bench_parity.py --chunks 1,4,16,64 --out $OUT/parity_h200.jsonl > $OUT/parity.txt 2>&1; echo "parity rc=$?"
python3 - <<'PY'
import json, os
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "parity_h200.jsonl"))):
    print(r["runtime"], r["path"], r["direction"], r["chunks"], r.get("verified", ""), "ms", round(r["median"], 4), "wall", round(r["wall_ms"], 4), "frac", round(r["frac_of_ceiling"], 3), "vs_torch", round(r.get("frac_of_torch", 0), 3), round(r.get("frac_of_torch_wall", 0), 3), "kern", round(r.get("kernel_ms", 0), 4))
PY
tail -2 $OUT/parity.txt | cut -c1-200
