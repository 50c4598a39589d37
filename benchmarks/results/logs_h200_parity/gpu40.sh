# Session 31, call 1: host cost of torch prepared calls; JAX program wall time vs kernels;
# pending checks since 5700dd0 (JAX GPU tests incl. Triton, the warp-kernel sweep).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; nproc; python3 -c "import torch, jax; print(torch.__version__, jax.__version__)"
timeout 90 python3 .diag/host_torch.py > $OUT/host_torch.txt 2>&1; el "host_torch rc=$?"; grep '^{' $OUT/host_torch.txt
timeout 100 python3 .diag/jax_program.py > $OUT/jax_program.txt 2>&1; el "jax_program rc=$?"; grep '^{' $OUT/jax_program.txt | cut -c1-260
timeout 60 env KVG_TAG=nocmdbuf KVG_CH=64 XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 .diag/jax_program.py > $OUT/jax_program_nocmdbuf.txt 2>&1; el "nocmdbuf rc=$?"; grep '^{' $OUT/jax_program_nocmdbuf.txt | cut -c1-260
timeout 60 env KVG_TAG=mosaic KVG_LOW=mosaic KVG_CH=64 python3 .diag/jax_program.py > $OUT/jax_program_mosaic.txt 2>&1; el "mosaic rc=$?"; grep '^{' $OUT/jax_program_mosaic.txt | cut -c1-260
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts=-ra"
timeout 170 $PYTEST -m gpu tests/core/test_suite_layout.py tests/jax > $OUT/jax_gpu_tests.log 2>&1; el "jax gpu tests rc=$?"; tail -1 $OUT/jax_gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/jax_gpu_tests.log | head
left=$(( 580 - ($(date +%s) - T0) )); el "sweep gets $left s"
timeout $left python3 benchmarks/sweep_warp_kernel.py --variants warp-u16-b2,warp-u16-b2-nopf --out $OUT/sweep.jsonl > /dev/null 2> $OUT/sweep_err.log; el "sweep rc=$?"; tail -2 $OUT/sweep_err.log
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "sweep.jsonl")
for r in (json.loads(l) for l in open(p)) if os.path.exists(p) else []:
    print(r.get("variant"), r.get("call"), r.get("direction"), r.get("chunks"), r.get("graph", ""), r.get("verified"), round(r.get("frac_of_ceiling", 0), 3), round(r.get("frac_of_whole", 0) or 0, 3))
PY
