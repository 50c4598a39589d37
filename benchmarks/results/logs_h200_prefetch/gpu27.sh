# Call 1: A/B of the L2 prefetch before the wait (warp kernels), then the warp and engine GPU tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
L=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader
timeout 200 python3 benchmarks/sweep_warp_kernel.py --variants warp-u16-b2-nopf,warp-u16-b2,warp-u16-b2-pfload,warp-u16-b2-nopf,warp-u16-b2,warp-u16-b2-pfload --out $L/pf_ab.jsonl > /dev/null 2> $L/err.log; el "sweep rc=$?"
tail -3 $L/err.log
python3 - <<'PY'
import json, os
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "pf_ab.jsonl"))):
    print(r["variant"], r["call"], r["direction"], r["chunks"], r.get("graph", ""), r["verified"], round(r["frac_of_ceiling"], 3), round(r.get("frac_of_whole", 0), 3), round(r["median"] * 1e3, 1))
PY
timeout 220 $PYTEST -m gpu tests/core/test_suite_layout.py tests/torch/test_warp_kernel_gpu.py tests/torch/test_torch_engine_gpu.py > $L/gpu_subset.log 2>&1; el "gpu subset rc=$?"; tail -1 $L/gpu_subset.log; grep -E "^(FAILED|ERROR)" $L/gpu_subset.log | head
