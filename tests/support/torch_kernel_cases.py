"""The GPU test cases of one kernel family (the warp kernels), shared: a spy on the
kernels the launches pick, float16 caches of one page size, and the scenarios every family
must pass through the public prepared calls, bit-exact against the NumPy reference.

Each family's module names its page table and sizes (:class:`PageCases`) and keeps its own
tests, so a failure names the family and the parameters it is about.
"""

import kvgroups_torch
import numpy as np
import pytest
import torch
from kvgroups_cuda import params as P
from kvgroups_torch.cuda import launch as cuda_launch

import kvgroups_core as kc
from kvgroups_core.errors import KVGroupsIndexError
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from tests.support.torch_engine_cases import (
    cache_bytes,
    object_bytes,
    random_objects,
    reference_load,
    reference_store,
    reference_with_drops,
)

FORMATS = {"nhd": F.NL_X_TWO_NB_BS_NH_HS, "hnd": F.NL_X_TWO_NB_NH_BS_HS}
SKIPPED_TOKENS = (0, 16, 80, 200, 384)  # none, one block, a partial block, chunks and more


def spy_on_kernels(monkeypatch, *settings):
    """Apply ``(module, name, value)`` settings, record the name of every kernel a launch
    picks, and start from empty launch caches; yields the list of names (a fixture body)."""
    names = []
    real = P.kernel_name

    def spy(*args, **kw):
        name = real(*args, **kw)
        names.append(name)
        return name

    for module, name, value in settings:
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(P, "kernel_name", spy)
    cuda_launch.reset_caches()
    yield names
    monkeypatch.undo()
    cuda_launch.reset_caches()


def check_bytes(caches, objects, want_caches, want_objects) -> None:
    """After a sync and the device error check: the objects and / or caches hold exactly the
    wanted bytes (``None`` skips that side)."""
    torch.cuda.synchronize()
    kvgroups_torch.check_errors()
    if want_objects is not None:
        for got, want in zip(object_bytes(objects), want_objects):
            np.testing.assert_array_equal(got, want)
    if want_caches is not None:
        for got, want in zip(cache_bytes(caches), want_caches):
            np.testing.assert_array_equal(got, want)


class PageCases:
    """float16 caches of ``layers`` layers with ``pages[page] = (bs, nh, hs)`` blocks, random
    distinct block ids for ``chunk``-token chunks, and the shared scenarios."""

    def __init__(self, pages: dict, num_blocks: int, layers: int, chunk: int = 64) -> None:
        self.pages, self.num_blocks, self.layers, self.chunk = pages, num_blocks, layers, chunk
        (self.block_size,) = {bs for bs, _, _ in pages.values()}  # one block size per table

    def caches(self, page: int, layout: str = "nhd", seed: int = 0):
        bs, nh, hs = self.pages[page]
        shape = (
            (2, self.num_blocks, bs, nh, hs)
            if layout == "nhd"
            else (2, self.num_blocks, nh, bs, hs)
        )
        rng = np.random.default_rng(seed)
        caches = []
        for _ in range(self.layers):
            raw = rng.integers(0, 256, int(np.prod(shape)) * 2, dtype=np.uint8)
            caches.append(torch.from_numpy(raw).view(torch.float16).view(shape).cuda())
        manager = KVLayerGroupsManager(
            caches, [FORMATS[layout]] * self.layers, lmcache_tokens_per_chunk=self.chunk
        )
        return manager, caches

    def ids(self, chunks: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        return rng.permutation(self.num_blocks)[: chunks * (self.chunk // self.block_size)]

    def round_trip(
        self,
        page: int,
        chunks: int,
        *,
        layout: str = "nhd",
        ids_kind: str = "device",
        store_ctas: int | None = None,
        load_ctas: int | None = None,
        seed: int = 0,
    ) -> None:
        """A store of ``chunks`` chunks into random objects, then a load of other objects into
        the same blocks: each side bit-exact (``*_ctas``: the CTA cap of each call)."""
        manager, caches = self.caches(page, layout, seed=seed)
        prep = kc.prepare(manager, caches)
        host = self.ids(chunks, seed + 1)
        ids = torch.from_numpy(host.astype(np.int32)).cuda() if ids_kind == "device" else host
        objects = random_objects(manager, chunks, seed=seed + 2, device="cuda")
        want_objects = reference_store(manager, caches, host, objects=objects)
        prep.store(ids, objects, max_ctas=store_ctas)
        check_bytes(caches, objects, None, want_objects)
        loaded = random_objects(manager, chunks, seed=seed + 3, device="cuda")
        want_caches = reference_load(manager, loaded, caches, host)
        prep.load(loaded, ids, max_ctas=load_ctas)
        check_bytes(caches, loaded, want_caches, None)

    def load_skips(self, page: int, skip_kind: str, seed: int = 0) -> None:
        """Loads of 6 chunks skipping :data:`SKIPPED_TOKENS`, as a host int or a device
        scalar written in place between calls."""
        manager, caches = self.caches(page, seed=seed)
        prep = kc.prepare(manager, caches)
        host = self.ids(6, seed + 1)
        dev = torch.from_numpy(host).cuda()
        skip = torch.zeros((), dtype=torch.int64, device="cuda")
        for tokens in SKIPPED_TOKENS:
            loaded = random_objects(manager, 6, seed=seed + tokens, device="cuda")
            want = reference_load(manager, loaded, caches, host, skip=tokens)
            if skip_kind == "device":
                skip.fill_(tokens)
                prep.load(loaded, dev, skip_first_n_tokens=skip)
            else:
                prep.load(loaded, dev, skip_first_n_tokens=tokens)
            check_bytes(caches, loaded, want, None)

    def layer_subsets(self, page: int, direction: str, subsets, seed: int = 0) -> None:
        """Calls with ``layers=`` each of ``subsets``: only those layers' planes move, into or
        from their regions of the whole objects."""
        manager, caches = self.caches(page, seed=seed)
        prep = kc.prepare(manager, caches)
        host = self.ids(5, seed + 1)
        dev = torch.from_numpy(host).cuda()
        for layers in subsets:
            objects = random_objects(manager, 5, seed=seed + 2, device="cuda")
            if direction == "store":
                want = reference_store(manager, caches, host, layers=layers, objects=objects)
                prep.store(dev, objects, layers=layers)
                check_bytes(caches, objects, None, want)
            else:
                want = reference_load(manager, objects, caches, host, layers=layers)
                prep.load(objects, dev, layers=layers)
                check_bytes(caches, objects, want, None)

    def bad_device_ids(self, page: int, direction: str, seed: int = 0) -> None:
        """Eight chunks' CUDA int64 ids with three out of range (past the end, negative,
        beyond int32): their items move nothing, every other item moves, and the check
        raises one of the bad values with their count."""
        manager, caches = self.caches(page, seed=seed)
        prep = kc.prepare(manager, caches)
        bad = {0: self.num_blocks, 9: -2, 31: 2**40}
        ids = self.ids(8, seed + 1).astype(np.int64)
        ids[list(bad)] = list(bad.values())
        objects = random_objects(manager, 8, seed=seed + 2, device="cuda")
        want_caches, want_objects, met = reference_with_drops(
            manager, caches, objects, ids, direction
        )
        assert met == set(bad.values())
        device_ids = torch.from_numpy(ids).cuda()
        if direction == "store":
            prep.store(device_ids, objects)
        else:
            prep.load(objects, device_ids)
        torch.cuda.synchronize()
        # The items run in parallel: any bad value may be the first recorded; each counts once.
        values = "|".join(str(v) for v in bad.values())
        with pytest.raises(KVGroupsIndexError, match=rf"got ({values}) on .*; 3 bad id"):
            kvgroups_torch.check_errors()
        check_bytes(caches, objects, want_caches, want_objects)
