#!/usr/bin/env bash
# Disaggregated prefill/decode over NIXL on one GPU, in one device call (at most about 6 minutes):
#   probe   which NIXL plugins load, UCX's memory kinds, and whether device memory registers
#           (nixl_probe.json);
#   tests   the GPU-marked tests of tests/pd: a writer and a reader process on the one GPU,
#           caches, pools and staging in device memory, bit-exact for every object group kind,
#           partial and layer-streamed pulls, the failure cases, a 2 -> 1 TP pair;
#   bench   benchmarks/bench_pd.py: descriptors per request beside NixlConnector's count,
#           bandwidth against the same run's device copy, time to the first layer
#           (pd_h200.jsonl).
#
# NIXL is not installed there and nothing can be downloaded: carry the UCX part of the
# nixl-cu13 wheel. Here, once, in the repository root:
#   echo /.whl/ >> .git/info/exclude && python3 benchmarks/nixl_subset.py   # .whl/nixl_cu13_min.zip
# then run with carry [".whl"]:
#   bash benchmarks/run_pd_h200.sh
set -u
export OUT=${OUT:-/tmp/kvg_pd}
mkdir -p "$OUT"
SITE=/tmp/kvg_nixl_site
if [[ -f .whl/nixl_cu13_min.zip ]]; then
  rm -rf "$SITE" && python3 -m zipfile -e .whl/nixl_cu13_min.zip "$SITE"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$PWD:$PWD/backends:$PWD/tests/tp:${PYTHONPATH:-}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

python3 - <<'EOF' 2>&1 | tee "$OUT/nixl_probe.log"
import json, os, torch
from kvgroups_transport import get_transport
from kvgroups_transport.nixl import import_nixl
agent_cls, _ = import_nixl()
t = get_transport("nixl", name="probe")
x = torch.empty((4, 1 << 20), dtype=torch.uint8, device="cuda")
report = {"module": agent_cls.__module__, "plugins": sorted(t._agent.get_plugin_list()),
          "ucx_mem_types": t._agent.get_backend_mem_types("UCX"),
          "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
          "ucx_tls": os.environ.get("UCX_TLS", "default")}
try:
    t.register_pool("probe", [x], [1 << 20])
    report["vram_registered"] = True
except Exception as exc:  # noqa: BLE001 - reported
    report["vram_registered"] = f"{type(exc).__name__}: {exc}"
t.close()
print(json.dumps(report))
open(os.environ["OUT"] + "/nixl_probe.json", "w").write(json.dumps(report))
EOF

timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/pd -rA 2>&1 \
  | tail -n 40 | tee "$OUT/pd_gpu_tests.log"
timeout 150 python3 benchmarks/bench_pd.py --out "$OUT/pd_h200.jsonl" > "$OUT/bench_pd.log" 2>&1
echo "bench_pd exit $?"; tail -n 5 "$OUT/bench_pd.log"
