# Call 4: evict-last prefetch and the trigger at the start, against main.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
L=$OUT
timeout 200 python3 benchmarks/sweep_warp_kernel.py --variants warp-u16-b2,warp-u16-b2-pflast,warp-u16-b2-trigstart,warp-u16-b2,warp-u16-b2-pflast,warp-u16-b2-trigstart --out $L/pf_more.jsonl > /dev/null 2> $L/err.log; el "sweep rc=$?"
tail -3 $L/err.log
python3 - <<'PY'
import json, os
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "pf_more.jsonl"))):
    print(r["variant"], r["call"], r["direction"], r["chunks"], r.get("graph", ""), r["verified"], round(r["frac_of_ceiling"], 3), round(r.get("frac_of_whole", 0), 3), round(r["median"] * 1e3, 1), round(r.get("whole_ms", 0) * 1e3, 1))
PY
