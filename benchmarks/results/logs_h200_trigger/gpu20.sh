# Call 9: the reworked engine step (in-place page write, 1 GiB weight stream by default, paired timing).
# (As run, the bench's defaults were then the in-place page write and a 1 GiB weight stream: today's
# equivalent is --compute inplace --weights-mib 1024 on both scripts below.)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
S() { python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get('call')=='jit': print(r.get('run',''), r['ids'], r['chunks'], r['weights_mib'], 'step %.1f base %.1f transfer %.1f us' % (r['step_s']*1e6, r['step_without_transfer_s']*1e6, r['median_s']*1e6), round(r['frac_of_ceiling'],3), round(r['frac_of_per_call_ceiling'],3))
" "$1"; }
timeout 130 python3 benchmarks/bench_jax_engine.py --calls jit --out $OUT/jax_engine_step.jsonl > /dev/null 2> $OUT/err.log; el "bench rc=$?"; S $OUT/jax_engine_step.jsonl
timeout 50 python3 benchmarks/profile_jax_step.py --chunks 1 > $OUT/profile_1chunk.jsonl 2>> $OUT/err.log; el "profile rc=$?"; cut -c1-700 $OUT/profile_1chunk.jsonl
timeout 60 python3 benchmarks/bench_jax_engine.py --calls jit --chunks 1,4 --out $OUT/jax_engine_step_run2.jsonl > /dev/null 2>> $OUT/err.log; el "bench 2 rc=$?"; S $OUT/jax_engine_step_run2.jsonl
tail -3 $OUT/err.log
