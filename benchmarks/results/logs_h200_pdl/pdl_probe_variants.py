"""Programmatic dependent launch on the bare gather: eager back-to-back launches of 1-4 chunks'
bytes and 32 layer-wise launches, with and without PDL; and a dependent chain check.

The diagnostic exactly as it ran on the H200 (from the repository root, output to stdout:
``pdl_probe_variants.jsonl``), kept beside its output as the command that made it. Kinds:
``plain`` (cuLaunchKernel, no wait), ``pdl`` (trigger at kernel start, then wait), ``pdl_end``
(wait, trigger after the stores), ``pdl_wait`` (wait only: what main's kernels do).

Its records measure no public call: the labels ``call="internal"``, ``probe``, ``runtime`` and
``path`` were added to each line of the output after the run (no measured value changed)."""
import ctypes, json, os, sys, time
sys.path[:0] = [os.getcwd(), os.getcwd() + "/backends", os.getcwd() + "/benchmarks"]
import numpy as np, torch
import bench_torch_engine as bte
from kvgroups_torch import driver
from cuda.core import ObjectCode, Program, ProgramOptions

SRC = r"""
struct alignas(16) V { unsigned long long a, b; };
struct Args { const V* src; V* dst; const int* ids; unsigned int n_units; int pad; };
template <int M> __device__ __forceinline__ void body(const Args& p) {
    if (M == 1) asm volatile("griddepcontrol.launch_dependents;");
    if (M >= 1) asm volatile("griddepcontrol.wait;" ::: "memory");
    const unsigned int u = blockIdx.x * 8u + (threadIdx.x >> 5);
    if (u >= p.n_units) { if (M == 2) asm volatile("griddepcontrol.launch_dependents;"); return; }
    const unsigned int page = u >> 2, seg = u & 3u, lane = threadIdx.x & 31u;
    const V* __restrict__ s = p.src + (unsigned long long)p.ids[page] * 2048u + seg * 512u + lane;
    V* __restrict__ d = p.dst + (unsigned long long)page * 2048u + seg * 512u + lane;
    V v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = s[k * 32];
#pragma unroll
    for (int k = 0; k < 16; ++k) d[k * 32] = v[k];
    if (M == 2) asm volatile("griddepcontrol.launch_dependents;");
}
extern "C" __global__ void __launch_bounds__(256, 2) gather(const Args p) { body<0>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) gather_pdl(const Args p) { body<1>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) gather_pdl_end(const Args p) { body<2>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) gather_pdl_wait(const Args p) { body<3>(p); }
"""
class Args(ctypes.Structure):
    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("ids", ctypes.c_uint64),
                ("n_units", ctypes.c_uint32), ("pad", ctypes.c_int32)]
class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]
class Config(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("num", ctypes.c_uint)]
lib = driver._libcuda()
lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
lib.cuLaunchKernelEx.restype = ctypes.c_int
attr = Attr(); attr.id = 6; ctypes.memmove(ctypes.addressof(attr) + 8, ctypes.byref(ctypes.c_int(1)), 4)

arch = "sm_%d%d" % torch.cuda.get_device_capability()
oc = ObjectCode.from_cubin(Program(SRC, "c++", options=ProgramOptions(arch=arch, std="c++17")).compile("cubin").code)
K = {n: int(oc.get_kernel(n).handle) for n in ("gather", "gather_pdl", "gather_pdl_end", "gather_pdl_wait")}
KIND = {"ex": "gather", "pdl": "gather_pdl", "pdl_end": "gather_pdl_end", "pdl_wait": "gather_pdl_wait"}
PAGE = 32768
keep = []
def launch(kind, src, dst, ids, n_pages, stream):
    a = Args(src, dst, ids, n_pages * 4, 0); keep.append(a)
    if len(keep) > 4096: del keep[:2048]
    params = (ctypes.c_void_p * 1)(ctypes.addressof(a)); keep.append(params)
    grid = -(-n_pages * 4 // 8)
    if kind == "plain":
        rc = lib.cuLaunchKernel(K["gather"], grid, 1, 1, 256, 1, 1, 0, stream, ctypes.addressof(params), None)
    else:
        cfg = Config(grid, 1, 1, 256, 1, 1, 0, stream, ctypes.addressof(attr), 0 if kind == "ex" else 1)
        rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), K[KIND[kind]], ctypes.addressof(params), None)
    assert rc == 0, rc

timer = bte.Timer(True, iters=15, warmup=20, batch_s=0.03)
pool = torch.empty(16 << 30, dtype=torch.uint8, device="cuda")
pool_pages = pool.numel() // PAGE
rng = np.random.default_rng(0)
out = os.environ.get("OUT", "/tmp")
for mib in (32, 128, 512):
    n = (mib << 20) // PAGE
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = [torch.empty(mib << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ceiling = timer.ms(lambda i: dst[i % 2].copy_(src))["median"]
    sets = [torch.from_numpy(rng.permutation(pool_pages)[:n].astype(np.int32)).cuda() for _ in range(4)]
    for kind in ("plain", "pdl", "pdl_end", "pdl_wait"):
        stream = torch.cuda.current_stream().cuda_stream
        t = timer.ms(lambda i: launch(kind, pool.data_ptr(), dst[i % 2].data_ptr(), sets[i % 4].data_ptr(), n, stream))["median"]
        print(json.dumps(dict(what="eager", mib=mib, kind=kind, us=t * 1e3, copy_us=ceiling * 1e3, frac=ceiling / t)), flush=True)
# layer-wise: 32 launches of 16 MiB, eager and in a graph
n_all = (512 << 20) // PAGE; per = n_all // 32
ids = torch.from_numpy(rng.permutation(pool_pages)[:n_all].astype(np.int32)).cuda()
dst_all = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
for kind in ("plain", "pdl", "pdl_end", "pdl_wait"):
    def all32(i=0, kind=kind):
        s = torch.cuda.current_stream().cuda_stream
        for k in range(32):
            launch(kind, pool.data_ptr(), dst_all.data_ptr() + k * per * PAGE, ids.data_ptr() + 4 * k * per, per, s)
    def one(i=0, kind=kind):
        launch(kind, pool.data_ptr(), dst_all.data_ptr(), ids.data_ptr(), n_all, torch.cuda.current_stream().cuda_stream)
    whole = timer.ms(one)["median"]; t = timer.ms(all32)["median"]
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side): all32()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): all32()
    tg = timer.ms(lambda i: g.replay())["median"]
    print(json.dumps(dict(what="layerwise", kind=kind, whole_us=whole * 1e3, eager_us=t * 1e3, graph_us=tg * 1e3,
                          eager_frac_of_whole=whole / t, graph_frac_of_whole=whole / tg)), flush=True)
# dependent chain: A -> B (gather random pages), B -> C (sequential), C must equal A's pages
n = 1024
A = torch.randint(0, 256, (n * PAGE,), dtype=torch.uint8, device="cuda")
idsA = torch.from_numpy(rng.permutation(n).astype(np.int32)).cuda()
seq = torch.arange(n, dtype=torch.int32, device="cuda")
bad = 0
for kind in ("pdl", "pdl_end", "pdl_wait"):
  bad = 0
  for rep in range(100):
    B = torch.empty_like(A); C = torch.empty_like(A)
    torch.cuda.synchronize()
    s = torch.cuda.current_stream().cuda_stream
    B.fill_(7); C.fill_(9)
    for k in range(3):
        launch(kind, A.data_ptr(), B.data_ptr(), idsA.data_ptr(), n, s)
        launch(kind, B.data_ptr(), C.data_ptr(), seq.data_ptr(), n, s)
    torch.cuda.synchronize()
    want = A.view(n, PAGE)[idsA.long()].reshape(-1)
    bad += int(not torch.equal(C, want))
  print(json.dumps(dict(what="chain", kind=kind, reps=100, mismatches=bad)), flush=True)
