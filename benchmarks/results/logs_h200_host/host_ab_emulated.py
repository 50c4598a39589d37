"""Host time of the public prepared calls on the CUDA path, without a GPU, for the code under
KVG_ROOT: CPU tensors stand in for CUDA ones (as in tests/torch/test_torch_launch_emulated.py)
and libcuda is a stub library compiled here with gcc, so every ctypes call of a launch still
happens (cuCtxGetCurrent, cuLaunchKernelEx) but the driver does nothing. What remains is our
own Python, which this machine times far more steadily than the H200's host.

    KVG_ROOT=<tree> KVG_TAG=<name> python3 host_ab_emulated.py
"""
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

root = os.environ["KVG_ROOT"]
sys.path[:0] = [root, root + "/backends"]
from kvgroups_cuda import params as P  # noqa: E402
from kvgroups_torch import cuda_path, device_tables, driver  # noqa: E402
from kvgroups_torch.backend import TorchBackend  # noqa: E402

import kvgroups_core as kc  # noqa: E402
from kvgroups_core.manager import KVLayerGroupsManager  # noqa: E402
from kvgroups_core.transfer import prepare  # noqa: E402
from kvgroups_tools.catalog import MODELS  # noqa: E402

assert kc.__file__.startswith(root), (kc.__file__, root)
STUB = r"""
static void* cur = (void*)0x1000;
int cuCtxGetCurrent(void** p) { *p = cur; return 0; }
int cuCtxSetCurrent(void* c) { cur = c; return 0; }
int cuLaunchKernelEx(void* cfg, void* f, void* args, void* extra) { return 0; }
int cuLaunchKernel(void* f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e,
                   unsigned g, unsigned h, void* s, void* p, void* x) { return 0; }
int cuDriverGetVersion(int* v) { *v = 13000; return 0; }
int cuDeviceGet(int* d, int i) { *d = i; return 0; }
int cuDeviceGetAttribute(int* v, int a, int d) { *v = 9; return 0; }
int cuDevicePrimaryCtxRetain(void** p, int d) { *p = (void*)0x1000; return 0; }
int cuGetErrorName(int c, const char** s) { return 0; }
int cuGetErrorString(int c, const char** s) { return 0; }
int cuStreamIsCapturing(void* s, int* st) { *st = 0; return 0; }
int cuStreamWaitEvent(void* s, void* e, unsigned f) { return 0; }
"""
build = tempfile.mkdtemp()
with open(os.path.join(build, "stub.c"), "w") as f:
    f.write(STUB)
subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", os.path.join(build, "libstub.so"),
                os.path.join(build, "stub.c")], check=True)
stub = ctypes.CDLL(os.path.join(build, "libstub.so"))
real_cdll = ctypes.CDLL
driver.ctypes.CDLL = lambda name, *a, **k: stub if name == "libcuda.so.1" else real_cdll(name)
driver._libcuda.cache_clear()


class FakeKernels:
    def handle(self, name):
        return 1


class FakeDevice:
    index, arch, num_sms = 0, "sm_90", 132
    err_table = device_tables.HostTable(np.zeros(P.ERR_WORDS, dtype=np.int64))
    err_record = err_table.tensor
    kernels = FakeKernels()


cuda_path.device_state = lambda index: FakeDevice()
cuda_path.current_stream = lambda index: 0
cuda_path.check_object_tensor = lambda t, i, w: None
cuda_path._to_table = lambda a, i: device_tables.HostTable(a)
cuda_path._on_device = lambda t, index: True
TorchBackend.device_ids_spec = lambda self, x: (
    (str(x.dtype).rpartition(".")[2], tuple(x.shape)) if isinstance(x, torch.Tensor) else None)
TorchBackend.device_ids_key = lambda self, x: (
    (x.dtype, x.shape, x.is_contiguous()) if type(x) is torch.Tensor else None)
assert driver.programmatic_launch(0) == (os.environ.get("KVGROUPS_PROGRAMMATIC_LAUNCH", "1") != "0")

model = MODELS["llama3-8b"].build(num_blocks=64, layers=32, dtype="bfloat16")
caches = [torch.empty(s.shape, dtype=torch.bfloat16) for s in model.kv_caches]
manager = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
prep = prepare(manager, caches, backend="torch")
fast = cuda_path.DeviceCaches(prep._bound.caches, 0)
fast.device = torch.device("cpu")
prep._bound.device_caches = fast
ids = torch.arange(16, dtype=torch.int32)
objs = [torch.empty((1, kc.object_nbytes(manager, 0)), dtype=torch.uint8)]


def us(fn, n=20000):
    for _ in range(200):
        fn()
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return round(sorted(runs)[3], 3)


res = {"tree": os.environ.get("KVG_TAG", root), "call": "prepared", "ids": "device-emulated",
       "measure": "host_us_per_call", "chunks": 1, "layers": 32}
for name, layers in (("whole", None), ("layer", [5])):
    res[name + "_store"] = us(lambda: prep.store(ids, objs, layers=layers))
    res[name + "_load"] = us(lambda: prep.load(objs, ids, layers=layers))
res["torch_add_"] = us(lambda: ids.add_(0))
print(json.dumps(res))
