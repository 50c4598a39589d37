# Session 28, call 3: where the one-chunk JAX step's device time grows.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
timeout 120 python3 benchmarks/bench_jax_engine.py --calls jit --chunks 1,4 --out $OUT/jax_growth.jsonl > /dev/null 2>> $OUT/err.log; echo "rc=$?"
python3 -c "
import json
for l in open('$OUT/jax_growth.jsonl'):
    r=json.loads(l)
    if r.get('call')=='jit': print(r['ids'], r['chunks'], 'dev %.3f stepdev %.3f' % (r['frac_of_ceiling_device'], r['frac_of_ceiling_step_device']), r['device_growth_us'])
"
tail -3 $OUT/err.log
