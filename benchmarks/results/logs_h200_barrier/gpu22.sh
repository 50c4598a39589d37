# Session 28, call 2: whole-segment warp path A/B (sweep), JAX jit step with profiler device time.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" XLA_PYTHON_CLIENT_PREALLOCATE=false KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
cd benchmarks && timeout 60 python3 -c "
import bench_jax_engine as b, jax, glob, tempfile
fn, sync = b.copy_program(32<<20)
fn(0); sync()
with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
        for i in range(3): fn(i)
        sync()
    data = jax.profiler.ProfileData.from_file(glob.glob(f'{d}/**/*.xplane.pb', recursive=True)[0])
for p in data.planes:
    if p.name.startswith('/device:'):
        for l in p.lines: print(p.name, '|', l.name, [(e.name[:40], round(e.duration_ns/1e3,1)) for e in list(l.events)[:4]])
print(b.device_kernels(fn, sync, calls=5))
" 2>&1 | tail -12; cd ..
el "lines"
timeout 200 python3 benchmarks/sweep_warp_kernel.py --variants warp-u16-b2-pred,warp-u16-b2,warp-u16-b2-late,warp-u16-b2-pred,warp-u16-b2,warp-u16-b2-late,warp-u8-b4 --out $OUT/warp_whole_ab.jsonl > /dev/null 2>> $OUT/err.log; el "sweep rc=$?"
python3 -c "
import json
for l in open('$OUT/warp_whole_ab.jsonl'):
    r=json.loads(l)
    k=r['call']+('-g' if r.get('graph') else '')
    print(r['variant'], r['verified'], k, r['direction'], r['chunks'], '%.3f'%r['frac_of_ceiling'], ('whole %.3f'%r['frac_of_whole']) if 'frac_of_whole' in r else '')
" | awk '{print}' > $OUT/warp_summary.txt; cat $OUT/warp_summary.txt | grep -v "prepared.*1 \|graph" 
S() { python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get('call')=='jit': print(r['ids'], r['chunks'], r['weights_mib'], 'wall %.3f' % r['frac_of_ceiling'], 'kern %.1f us' % (r.get('transfer_kernels_device_s',0)*1e6), 'dev %.3f' % r.get('frac_of_ceiling_device',0), 'stepdev %.3f' % r.get('frac_of_ceiling_step_device',0), 'ceil %.1f us' % (r.get('ceiling_device_s',0)*1e6), 'step %.1f base %.1f' % (r.get('step_device_s',0)*1e6, r.get('step_without_transfer_device_s',0)*1e6))
" "$1"; }
timeout 150 python3 benchmarks/bench_jax_engine.py --calls jit --chunks 1,4,16 --out $OUT/jax_engine_device.jsonl > /dev/null 2>> $OUT/err.log; el "bench rc=$?"; S $OUT/jax_engine_device.jsonl
timeout 100 python3 benchmarks/bench_jax_engine.py --calls jit --chunks 1,4 --weights-mib 1024 --out $OUT/jax_engine_device_w.jsonl > /dev/null 2>> $OUT/err.log; el "bench w rc=$?"; S $OUT/jax_engine_device_w.jsonl
tail -5 $OUT/err.log
