"""Helpers of the LayerwiseLoad / LayerwiseSave tests (CPU and GPU)."""

import numpy as np
import pytest
import torch
from kvgroups_torch import LayerwiseLoad, LayerwiseSave, check_errors

import kvgroups_core as kc
from kvgroups_core.errors import KVGroupsIndexError, KVGroupsTypeError, KVGroupsValueError
from tests.support.torch_engine_cases import (
    cache_bytes,
    ids_for,
    map_ids,
    model_caches,
    reference_load,
)

LAYERS = 32
NUM_BLOCKS = 64
CHUNKS = 4


class Recording(kc.PreparedTransfer):
    """A prepared transfer (on ``prep``'s manager and caches) that records every transfer
    LayerwiseLoad / LayerwiseSave make on it: ``(direction, layers, id of the first object
    tensor)``, in call order (checks that move nothing are not recorded)."""

    def __init__(self, prep):
        super().__init__(prep.manager, prep.kv_caches, backend=prep.backend)
        self.calls = []

    def load(self, objects, block_ids, **kw):
        self.calls.append(("load", tuple(kw["layers"]), id(objects[0])))
        return super().load(objects, block_ids, **kw)

    def store(self, block_ids, objects=None, **kw):
        self.calls.append(("store", tuple(kw["layers"]), id(objects[0])))
        return super().store(block_ids, objects, **kw)


def expected_load_order(layers, objects_list, per_launch=1):
    """The calls LayerwiseLoad.start_many makes: per layer step, every transfer in turn."""
    steps = [tuple(layers[i : i + per_launch]) for i in range(0, len(layers), per_launch)]
    return [("load", step, id(objects[0])) for step in steps for objects in objects_list]


def delay(stream, cycles: int) -> None:
    """Hold ``stream`` (CUDA) back by ``cycles`` GPU cycles after what the current stream
    queued so far; nothing on CPU (no stream)."""
    if stream is None:
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


class Step:
    """A forward pass's view of a load: model-shaped caches (32 Llama-3-8B-like layers by
    default) on ``device``, ids of 4 chunks there, objects holding the bytes to load (on the
    device or pinned), and ``seen[l]``: what layer l's compute read of its loaded pages."""

    def __init__(
        self, device: str, placement: str, seed: int, name: str = "llama3-8b", layers: int = LAYERS
    ) -> None:
        self.device = device
        self.manager, self.caches = model_caches(
            name, layers=layers, num_blocks=NUM_BLOCKS, device=device, seed=seed
        )
        self.old = [c.clone() for c in self.caches]  # what the caches hold before each load
        rng = np.random.default_rng(seed + 1)
        self.host_ids = ids_for(self.manager, rng, CHUNKS, num_blocks=NUM_BLOCKS)
        self.ids = map_ids(
            self.host_ids, lambda v: torch.as_tensor(np.asarray(v)).to(device, torch.int32)
        )
        # The ids each layer's pages are at (its engine group's).
        group_of = {
            layer: g.engine_group_idx
            for g in self.manager.kernel_groups
            for layer in g.layer_indices
        }
        self.layer_ids = [
            self.ids[group_of[layer]] if isinstance(self.ids, dict) else self.ids
            for layer in range(len(self.caches))
        ]
        self.pinned = placement == "pinned"
        self.objects = [
            torch.empty(
                (CHUNKS, kc.object_nbytes(self.manager, g)),
                dtype=torch.uint8,
                device="cpu" if self.pinned else device,
                pin_memory=self.pinned,
            )
            for g in range(self.manager.num_object_groups)
        ]
        self.seen = [torch.empty_like(self.pages(layer)) for layer in range(len(self.caches))]
        self.prep = kc.prepare(self.manager, self.caches)

    def new_objects(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for o in self.objects:
            o.copy_(torch.randint(0, 256, o.shape, dtype=torch.uint8, generator=gen))

    def reset_caches(self) -> None:
        for c, o in zip(self.caches, self.old):
            c.copy_(o)

    def pages(self, layer: int, caches=None) -> torch.Tensor:
        """Layer ``layer``'s pages at the step's ids (of ``caches``, default the caches)."""
        caches = self.caches if caches is None else caches
        return caches[layer].index_select(1, self.layer_ids[layer].to(caches[layer].device))

    def compute(self, layer: int) -> None:
        """Layer ``layer``'s stand-in attention: reads the pages its load writes."""
        self.seen[layer].copy_(self.pages(layer))

    def expected(self) -> tuple[list, list]:
        """The caches' bytes after the load and each layer's loaded pages."""
        want = reference_load(
            self.manager, [o.cpu() for o in self.objects], self.old, self.host_ids
        )
        loaded = [
            torch.from_numpy(w).view(c.dtype).view(c.shape) for w, c in zip(want, self.caches)
        ]
        return want, [self.pages(layer, loaded) for layer in range(len(loaded))]

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            check_errors()

    def check(self) -> None:
        self.sync()
        want, pages = self.expected()
        for layer, (s, p) in enumerate(zip(self.seen, pages)):
            assert torch.equal(s.cpu().view(torch.uint8), p.view(torch.uint8)), (
                f"layer {layer}: its compute did not see the loaded pages"
            )
        for got, w in zip(cache_bytes(self.caches), want):
            np.testing.assert_array_equal(got, w)

    def mismatched_layers(self) -> list[int]:
        self.sync()
        _, pages = self.expected()
        return [
            layer
            for layer, (s, p) in enumerate(zip(self.seen, pages))
            if not torch.equal(s.cpu().view(torch.uint8), p.view(torch.uint8))
        ]


def refused_transfers(step: "Step") -> list:
    """``(label, bad transfer, error class, pattern)``: loads of ``step`` (one engine group)
    that the prepared call refuses on its host checks, on any device: an id out of range
    (host ids), a chunk short in the objects, a bool skip, NumPy objects."""
    host = np.asarray(step.host_ids).copy()
    host[-1] = NUM_BLOCKS + 35
    return [
        ("id out of range", (step.objects, host), KVGroupsIndexError, r"block_ids\[\d+\]"),
        (
            "short objects",
            ([o[:-1] for o in step.objects], step.ids),
            KVGroupsValueError,
            "objects",
        ),
        ("bool skip", (step.objects, step.ids, True), KVGroupsTypeError, "skip_first_n_tokens"),
        (
            "numpy objects",
            ([o.cpu().numpy() for o in step.objects], step.ids),
            KVGroupsTypeError,
            "objects",
        ),
    ]


def check_start_many_refuses_before_any_byte_moves(device: str) -> None:
    """``start_many([good, bad])`` (and ``[bad, good]``) raises the bad transfer's typed refusal
    from the call itself, having queued no load (no call on the prepared transfer, nothing
    pending, every cache byte as before, also after finish()); the next good start loads."""
    step = Step(device, "device", seed=41, layers=4)
    step.new_objects(42)
    for label, bad, error, pattern in refused_transfers(step):
        for transfers in ([(step.objects, step.ids), bad], [bad, (step.objects, step.ids)]):
            rec = Recording(step.prep)
            loads = LayerwiseLoad(rec)
            with pytest.raises(error, match=pattern):
                loads.start_many(transfers)
            assert not loads.pending, label
            loads.finish()
            step.sync()
            assert rec.calls == [], label
            for layer, (got, old) in enumerate(zip(cache_bytes(step.caches), step.old)):
                np.testing.assert_array_equal(got, cache_bytes([old])[0], f"{label}: {layer}")
    rec = Recording(step.prep)
    loads = LayerwiseLoad(rec)
    loads.start(step.objects, step.ids)
    for layer in range(len(step.caches)):
        loads.wait(layer)
        step.compute(layer)
    loads.finish()
    step.check()


def check_save_many_refuses_before_any_byte_moves(device: str) -> None:
    """``save_many(layer, [good, bad])`` (and ``[bad, good]``) raises the bad store's typed
    refusal having issued no store: the good transfer's objects keep every byte."""
    step = Step(device, "device", seed=43, layers=4)
    step.new_objects(44)
    fresh = [torch.zeros_like(o) for o in step.objects]
    host = np.asarray(step.host_ids).copy()
    host[-1] = NUM_BLOCKS + 35
    refused = [
        ("id out of range", (host, fresh), KVGroupsIndexError, r"block_ids\[\d+\]"),
        ("short objects", (step.ids, [o[:-1] for o in fresh]), KVGroupsValueError, "objects"),
        (
            "numpy objects",
            (step.ids, [o.cpu().numpy() for o in fresh]),
            KVGroupsTypeError,
            "objects",
        ),
    ]
    for label, bad, error, pattern in refused:
        for transfers in ([(step.ids, step.objects), bad], [bad, (step.ids, step.objects)]):
            before = [o.clone() for o in step.objects]
            rec = Recording(step.prep)
            saves = LayerwiseSave(rec)
            with pytest.raises(error, match=pattern):
                saves.save_many(0, transfers)
            saves.finish()
            step.sync()
            assert rec.calls == [], label
            for got, old in zip(step.objects, before):
                assert torch.equal(got, old), label
