# Call 1 of 3 (2026-12-01 session 26): the measurements. Early trigger A/B (probe, warp kernels,
# small pages), JAX chunk-order A/B (Mosaic 16/64, Triton 16).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
L=$OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 50 python3 benchmarks/probe_gather_ceiling.py --programmatic --pools-gib 16 --moved-mib 32,512 --out $L/probe_trigger_ab.jsonl > /dev/null 2> $L/probe.err; el "probe late rc=$?"; tail -2 $L/probe.err
timeout 50 python3 benchmarks/probe_gather_ceiling.py --programmatic --trigger --pools-gib 16 --moved-mib 32,512 --out $L/probe_trigger_ab.jsonl > /dev/null 2>> $L/probe.err; el "probe trigger rc=$?"; tail -2 $L/probe.err
timeout 170 python3 benchmarks/sweep_warp_kernel.py --variants warp-u16-b2,warp-u16-b2-late,warp-u16-b2,warp-u16-b2-late --out $L/warp_trigger_ab.jsonl > /dev/null 2> $L/warp.err; el "warp A/B rc=$?"; tail -2 $L/warp.err
SP() { timeout 55 python3 benchmarks/sweep_small_pages.py --runtimes torch --pages 1024,4096 --chunks 64 --planes-per-cta "" --cta-bytes "" --unroll "" --budget-s 35 "$@"; }
SP --out $L/small_trigger_ab.jsonl > /dev/null 2> $L/small.err; el "small early rc=$?"
SP --define KVG_EARLY_TRIGGER=0 --out $L/small_late.jsonl > /dev/null 2>> $L/small.err; el "small late rc=$?"; tail -2 $L/small.err
for c in 16 64; do
timeout 65 python3 benchmarks/sweep_jax_kernel.py --shapes llama3-8b --chunks $c --lowering mosaic --variants "chunk_order=0,1|chunk_order=0,1" --batches 5 --calls 10 --out $L/jax_chunk_order_ab.jsonl 2> $L/mosaic$c.err > /dev/null; el "mosaic $c rc=$?"; tail -1 $L/mosaic$c.err
done
timeout 110 python3 benchmarks/sweep_jax_kernel.py --shapes llama3-8b --chunks 16 --variants "chunk_order=0,1" --batches 5 --calls 10 --out $L/jax_chunk_order_ab.jsonl 2> $L/triton16.err > /dev/null; el "triton 16 rc=$?"; tail -1 $L/triton16.err
python3 - <<'PY'
import json, os
O = os.environ["OUT"]
def rows(f):
    p = os.path.join(O, f)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
for r in rows("probe_trigger_ab.jsonl"):
    if "frac_of_whole" in r: print("probe", r["probe"], r.get("trigger"), round(r["frac_of_whole"], 3), round(r["us_per_launch"], 2))
    elif r.get("order") == "random": print("probe", r["probe"], r.get("trigger"), r["moved_bytes"] >> 20, round(r["frac_of_ceiling"], 3))
for r in rows("warp_trigger_ab.jsonl"):
    print("warp", r.get("variant"), r.get("call"), r.get("direction"), r.get("chunks"), r.get("graph", ""), round(r.get("frac_of_ceiling", 0) or 0, 3), round(r.get("frac_of_whole", 0) or 0, 3), r.get("verified", ""))
for f in ("small_trigger_ab.jsonl", "small_late.jsonl"):
    for r in rows(f):
        if "frac_of_ceiling" in r: print(f[:11], r.get("variant"), r.get("call"), r.get("ids"), r.get("direction"), r.get("chunks"), r.get("page_bytes"), round(r["frac_of_ceiling"], 3), r.get("verified", ""))
for r in rows("jax_chunk_order_ab.jsonl"):
    if r.get("record") == "variant": print("jax", r["lowering"], r["chunks"], r["chunk_order"], round(r.get("store_of_copy", 0), 3), round(r.get("load_of_copy", 0), 3), r.get("store_matches_first_variant"), r.get("error", "")[:200])
PY
