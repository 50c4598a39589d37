# Session 28, call 1: does a kernel's parameter size cost one-layer launches? (bare probe padded
# (.diag/probe_pad.py was benchmarks/probe_gather_ceiling.py with probe_pad.patch applied, beside it)
# to KvgParams' size) + the JAX jit step with paired timing (flat compute), twice.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for trig in "" "--trigger"; do for pad in 16 2960; do
  PAD=$pad timeout 60 python3 .diag/probe_pad.py --pools-gib 16 --moved-mib 512 --programmatic $trig >> $OUT/probe_pad.jsonl 2>> $OUT/err.log
  el "probe pad=$pad trig=$trig rc=$?"
done; done
python3 -c "
import json
for l in open('$OUT/probe_pad.jsonl'):
    r=json.loads(l)
    if r['probe']=='bare_gather_layerwise': print('pad',r['pad'],'trig',r['trigger'],'us/launch %.2f'%r['us_per_launch'],'whole %.3f'%r['frac_of_whole'])
    elif r['probe']=='bare_gather': print('pad',r['pad'],'trig',r['trigger'],r['order'],'%.3f'%r['frac_of_ceiling'])
"
S() { python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get('call')=='jit': print(r['ids'], r['chunks'], r['weights_mib'], 'step %.1f base %.1f transfer %.1f us' % (r['step_s']*1e6, r['step_without_transfer_s']*1e6, r['median_s']*1e6), round(r['frac_of_ceiling'],3), round(r['frac_of_per_call_ceiling'],3))
" "$1"; }
timeout 150 python3 benchmarks/bench_jax_engine.py --calls jit --out $OUT/jax_engine_paired.jsonl > /dev/null 2>> $OUT/err.log; el "bench rc=$?"; S $OUT/jax_engine_paired.jsonl
timeout 100 python3 benchmarks/bench_jax_engine.py --calls jit --chunks 1,4 --weights-mib 1024 --out $OUT/jax_engine_paired_w.jsonl > /dev/null 2>> $OUT/err.log; el "bench w rc=$?"; S $OUT/jax_engine_paired_w.jsonl
tail -5 $OUT/err.log
