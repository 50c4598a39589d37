"""Host cost of a prepared one-layer store with device ids, launches stubbed (no GPU needed).

Run by hand (not a test): ``PYTHONPATH=$PWD:$PWD/backends python tests/torch/host_cost_layerwise.py``.
Llama-3-8B-like caches (32 layers, 1024 blocks), 16-chunk stores, ``layers=[l]`` for every
layer in turn, as an engine's layer-wise save does. CPU tensors play the GPU's and stand for
device ids (the CUDA path's ``DeviceCaches`` runs; only the driver is stubbed), so a number
here is the GPU call's host time minus ``cuLaunchKernel``, plus a little CPU-only work (the
pinned-memory query and the host-mapping check of CPU objects). Per-thread CPU time, the
best of several rounds: robust to other processes on a shared machine.
"""

import argparse
import time

import numpy as np
import torch
from kvgroups_torch import cuda_path

from kvgroups_core.manager import KVLayerGroupsManager
from kvgroups_core.transfer import prepare
from kvgroups_tools.catalog import MODELS


def stub_driver() -> None:
    class Kernels:
        def handle(self, name):
            return 0

    class Device:
        index, arch, num_sms = 0, "sm_90", 132
        err_record = torch.zeros(8, dtype=torch.int64)
        kernels = Kernels()

    class Launcher:
        def __init__(self, device_index, params_address):
            pass

        def launch(self, function, grid, threads, stream):
            pass

    device = Device()
    cuda_path.device_state = lambda index: device
    cuda_path.Launcher = Launcher
    cuda_path.current_stream = lambda index: 0
    cuda_path._on_device = lambda t, index: True
    cuda_path._to_device = lambda a, index: torch.from_numpy(np.ascontiguousarray(a).copy())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--steps", type=int, default=200, help="32-call steps per round")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    stub_driver()
    model = MODELS["llama3-8b"].build(num_blocks=1024, layers=32)
    caches = [torch.empty(s.shape, dtype=getattr(torch, s.dtype.name)) for s in model.kv_caches]
    manager = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
    prepared = prepare(manager, caches, backend="torch")
    fast = cuda_path.DeviceCaches(prepared._bound.caches, 0)
    fast.device = torch.device("cpu")  # "objects on the caches' GPU" are CPU tensors here
    prepared._bound.device_caches = fast
    prepared._ids_spec = lambda x: (str(x.dtype).rpartition(".")[2], tuple(x.shape)) \
        if isinstance(x, torch.Tensor) else None  # CPU tensors taken as device ids
    n = args.chunks * manager.calculate_num_blocks(0, 256)
    ids = torch.from_numpy(np.random.default_rng(2).permutation(1024)[:n].astype(np.int32))
    objects = [torch.empty((args.chunks, b), dtype=torch.uint8)
               for b in prepared.binding.object_nbytes]
    layers = [[layer] for layer in range(32)]

    def step():
        for one in layers:
            prepared.store(ids, objects, layers=one)

    step()
    assert len(fast._launches) >= 32, "not the CUDA path"
    rounds = []
    for _ in range(args.rounds):
        t = time.thread_time()
        for _ in range(args.steps):
            step()
        rounds.append((time.thread_time() - t) / args.steps / 32 * 1e6)
    print(f"one-layer prepared store, device ids, {args.chunks} chunks: "
          f"{min(rounds):.2f} us per call (best of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
