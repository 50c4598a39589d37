"""Host cost of a torch engine's prepared calls, launches stubbed (no GPU needed).

Run by hand (not a test):
``PYTHONPATH=$PWD:$PWD/backends python tests/torch_backend/host_cost_layerwise.py``
(``--case`` picks some cases; ``--profile CASE`` prints cProfile's top entries for one).
Llama-3-8B-like caches (32 layers, 1024 blocks). Cases:

- ``layer-store`` / ``layer-load``: 16-chunk transfers, ``layers=[l]`` for every layer in
  turn, as an engine's layer-wise save / load does (per call);
- ``chunk-store-dev`` / ``chunk-load-dev``: whole-model one-chunk transfers, device ids;
- ``chunk-store-host`` / ``chunk-load-host``: the same with host NumPy ids.

CPU tensors play the GPU's and stand for device ids (the CUDA path's ``DeviceCaches`` runs;
only the driver is stubbed), so a number here is the GPU call's host time minus
``cuLaunchKernel``, plus a little CPU-only work (the pinned-memory query and the host-mapping
check of CPU objects). Per-thread CPU time, the best of several rounds: robust to other
processes on a shared machine.
"""

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch
from kvgroups_torch.cuda import device_tables
from kvgroups_torch.cuda import execute as cuda_execute
from kvgroups_torch.cuda import launch as cuda_launch
from kvgroups_torch.cuda import objects as cuda_objects
from kvgroups_torch.cuda import repeat as cuda_repeat

from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.api import prepare
from kvgroups_tools.catalog import MODELS

CASES = (
    "layer-store",
    "layer-load",
    "chunk-store-dev",
    "chunk-load-dev",
    "chunk-store-host",
    "chunk-load-host",
)


def stub_driver() -> type:
    class Kernels:
        def handle(self, name):
            return 0

    class Device:
        index, arch, num_sms = 0, "sm_90", 132
        err_table = device_tables.HostTable(np.zeros(8, dtype=np.int64))
        err_record = err_table.tensor
        kernels = Kernels()

    class Launcher:
        launches = 0  # counted only while ``counting`` (the timed loops skip it)
        counting = False

        def __init__(self, device_index, params_address, *, programmatic=False):
            pass

        def launch(self, function, grid, threads, stream):
            if Launcher.counting:
                Launcher.launches += 1

    device = Device()
    cuda_execute.device_state = lambda index: device
    cuda_launch.Launcher = Launcher
    cuda_execute.current_stream = lambda index: 0
    cuda_repeat.current_stream = lambda index: 0
    cuda_launch.on_device = lambda t, index: True
    cuda_repeat.on_device = lambda t, index: True
    cuda_launch.to_device = lambda a, index: torch.from_numpy(np.ascontiguousarray(a).copy())
    cuda_objects.to_table = lambda a, index: device_tables.HostTable(a)
    cuda_launch.to_table = lambda a, index: device_tables.HostTable(a)
    return Launcher


def stubbed_prepared(manager, caches):
    """A prepared torch transfer whose per-call path is the CUDA one, on CPU tensors (CPU id
    tensors taken as device ids)."""
    prepared = prepare(manager, caches, backend="torch")
    fast = cuda_execute.DeviceCaches(prepared._bound.caches, 0)
    fast.device = torch.device("cpu")  # "objects on the caches' GPU" are CPU tensors here
    prepared._bound.device_caches = fast
    prepared._ids_spec = lambda x: (
        (str(x.dtype).rpartition(".")[2], tuple(x.shape)) if isinstance(x, torch.Tensor) else None
    )
    prepared._ids_key = lambda x: (x.dtype, x.shape) if type(x) is torch.Tensor else None
    return prepared, fast


def case_step(name, manager, prepared, rng):
    """``(step, calls per step)`` of one case."""
    chunks = 16 if name.startswith("layer") else 1
    n = chunks * manager.calculate_num_blocks(0, 256)
    host = rng.permutation(1024)[:n].astype(np.int32)
    ids = host if name.endswith("-host") else torch.from_numpy(host)
    objects = [torch.empty((chunks, b), dtype=torch.uint8) for b in prepared.binding.object_nbytes]
    store = "store" in name
    if name.startswith("layer"):
        layers = [[layer] for layer in range(32)]
        if store:

            def step():
                for one in layers:
                    prepared.store(ids, objects, layers=one)
        else:

            def step():
                for one in layers:
                    prepared.load(objects, ids, layers=one)

        return step, 32
    if store:

        def step():
            prepared.store(ids, objects)
    else:

        def step():
            prepared.load(objects, ids)

    return step, 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", action="append", choices=CASES, help="default: every case")
    p.add_argument("--calls", type=int, default=6400, help="calls per round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--profile", choices=CASES, help="cProfile one case instead")
    args = p.parse_args()
    launcher = stub_driver()
    model = MODELS["llama3-8b"].build(num_blocks=1024, layers=32)
    caches = [torch.empty(s.shape, dtype=getattr(torch, s.dtype.name)) for s in model.kv_caches]
    manager = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
    prepared, _ = stubbed_prepared(manager, caches)
    rng = np.random.default_rng(2)
    if args.profile:
        step, per = case_step(args.profile, manager, prepared, rng)
        step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(max(1, args.calls // per)):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    for name in args.case or CASES:
        step, per = case_step(name, manager, prepared, rng)
        launcher.counting, launcher.launches = True, 0
        step()
        launcher.counting = False
        assert launcher.launches == per, f"{name}: not the CUDA path"
        steps = max(1, args.calls // per)
        rounds = []
        for _ in range(args.rounds):
            t = time.thread_time()
            for _ in range(steps):
                step()
            rounds.append((time.thread_time() - t) / steps / per * 1e6)
        print(f"{name:18s} {min(rounds):7.2f} us per call (best of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
