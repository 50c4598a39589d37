"""Whole-model caches, their tensor-parallel shards, and the TP=1 references the tests compare.

A shard is cut from the whole model's NumPy caches the way vLLM and SGLang shard KV heads:
rank ``r`` of ``t`` holds heads ``[r * H / t, (r + 1) * H / t)`` of each layer with a head
axis, or head ``r // (t / H)`` when ``H < t``; caches without a head axis are copied whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvgroups_core import EngineGroupInfo, KVLayerGroupsManager, load, store
from kvgroups_core.formats.catalogue import CROSS_LAYER, KV_LIST
from kvgroups_core.formats.catalogue import EngineKVFormat as F

DTYPES = {"float16": np.float16, "float32": np.float32, "uint8": np.uint8}


@dataclass(frozen=True)
class Layer:
    fmt: F
    heads: int = 8
    head_size: int = 16
    dtype: str = "float16"
    engine_group: int = 0
    sliding_window: int = -1


@dataclass(frozen=True)
class Model:
    """A model as a list of per-layer caches (or one structure of a single format)."""

    name: str
    layers: tuple[Layer, ...]
    num_blocks: int = 24
    block_size: int = 16
    chunk: int = 64
    structure_format: F | None = None  # a KV-list or cross-layer format for every layer
    extra: dict = field(default_factory=dict)

    @property
    def formats(self) -> list[F]:
        return [lay.fmt for lay in self.layers]

    @property
    def total_heads(self) -> list[int]:
        return [lay.heads for lay in self.layers]


def _shape(fmt: F, lay: Layer, nb: int, bs: int, nl: int) -> tuple[int, ...]:
    sizes = {
        "NB": nb,
        "BS": bs,
        "NH": lay.heads,
        "HS": lay.head_size,
        "CS": lay.head_size,
        "NL": nl,
        "TWO": 2,
        "ONE": 1,
        "BSV_BSS": 132,
    }
    return tuple(sizes[a] for a in fmt.facts.axes)


def _random(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    np_dtype = np.dtype(DTYPES[dtype])
    bits = rng.integers(0, 256, size=int(np.prod(shape)) * np_dtype.itemsize, dtype=np.uint8)
    return bits.view(np_dtype).reshape(shape)


def make_model_caches(model: Model, rng: np.random.Generator):
    """The whole model's caches (NumPy, random bits)."""
    nb, bs = model.num_blocks, model.block_size
    fmt = model.structure_format
    if fmt is not None and fmt.facts.structure == CROSS_LAYER:
        return _random(
            _shape(fmt, model.layers[0], nb, bs, len(model.layers)), model.layers[0].dtype, rng
        )
    if fmt is not None and fmt.facts.structure == KV_LIST:
        return [
            [_random(_shape(fmt, lay, nb, bs, 1), lay.dtype, rng) for lay in model.layers]
            for _ in range(2)
        ]
    return [_random(_shape(lay.fmt, lay, nb, bs, 1), lay.dtype, rng) for lay in model.layers]


def _head_slice(total: int, rank: int, size: int) -> slice:
    if total >= size:
        h = total // size
        return slice(rank * h, (rank + 1) * h)
    head = rank // (size // total)
    return slice(head, head + 1)


def _shard_tensor(arr: np.ndarray, fmt: F, rank: int, size: int) -> np.ndarray:
    axes = fmt.facts.axes
    if "NH" not in axes:
        return arr.copy()
    axis = axes.index("NH")
    index = [slice(None)] * arr.ndim
    index[axis] = _head_slice(arr.shape[axis], rank, size)
    return np.ascontiguousarray(arr[tuple(index)])


def shard_caches(model: Model, caches, rank: int, size: int):
    """Rank ``rank``'s shard of the whole model's caches (contiguous copies)."""
    fmt = model.structure_format
    if fmt is not None and fmt.facts.structure == CROSS_LAYER:
        return _shard_tensor(caches, fmt, rank, size)
    if fmt is not None and fmt.facts.structure == KV_LIST:
        return [[_shard_tensor(x, fmt, rank, size) for x in plane] for plane in caches]
    return [_shard_tensor(x, lay.fmt, rank, size) for x, lay in zip(caches, model.layers)]


def engine_group_infos(model: Model) -> list[EngineGroupInfo]:
    """One info per kernel group, in kernel-group order (groups of equal layer specs)."""
    if all(lay.engine_group == 0 and lay.sliding_window == -1 for lay in model.layers):
        return []
    groups: dict[Layer, list[int]] = {}
    for i, lay in enumerate(model.layers):
        groups.setdefault(lay, []).append(i)
    return [
        EngineGroupInfo(
            engine_group_id=lay.engine_group,
            layer_indices=tuple(layers),
            sw_size_tokens=lay.sliding_window,
        )
        for lay, layers in groups.items()
    ]


def manager(model: Model, caches, rank: int = 0, size: int = 1, **kw) -> KVLayerGroupsManager:
    formats = model.structure_format or model.formats
    chunk = kw.pop("lmcache_tokens_per_chunk", model.chunk)
    return KVLayerGroupsManager(
        caches,
        formats,
        engine_group_infos(model),
        lmcache_tokens_per_chunk=chunk,
        tp_rank=rank,
        tp_size=size,
        total_num_kv_heads=model.total_heads,
        **kw,
    )


def engine_groups(model: Model) -> list[int]:
    return sorted({lay.engine_group for lay in model.layers})


def block_ids(model: Model, num_chunks: int, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Distinct random block ids per engine group covering ``num_chunks`` chunks."""
    per_chunk = model.chunk // model.block_size
    return {
        g: rng.permutation(model.num_blocks)[: num_chunks * per_chunk].astype(np.int64)
        for g in engine_groups(model)
    }


def reference_store(model: Model, caches, ids) -> list[np.ndarray]:
    """The canonical objects: a TP=1 store of the whole model (NumPy reference backend)."""
    return store(manager(model, caches), caches, ids, backend="numpy")


def reference_load(model: Model, objects, caches, ids, skip: int = 0):
    """A TP=1 load of the whole model into a copy of ``caches`` (NumPy reference backend)."""
    fresh = copy_structure(caches)
    return load(
        manager(model, fresh), objects, fresh, ids, skip_first_n_tokens=skip, backend="numpy"
    )


def copy_structure(structure):
    if isinstance(structure, list):
        return [copy_structure(x) for x in structure]
    return structure.copy()


def to_backend(structure, backend: str):
    """A copy of a NumPy structure as ``backend``'s arrays ("numpy" or "torch", CPU)."""
    if isinstance(structure, list):
        return [to_backend(x, backend) for x in structure]
    if backend == "torch":
        import torch

        return torch.from_numpy(structure.copy())
    return structure.copy()


def to_numpy(x) -> np.ndarray:
    return x.numpy() if type(x).__module__.startswith("torch") else np.asarray(x)


def assert_same_bytes(got_list, want_list) -> None:
    assert len(got_list) == len(want_list)
    for got, want in zip(got_list, want_list):
        got = to_numpy(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def leaves(structure) -> list:
    if isinstance(structure, (list, tuple)):
        return [y for x in structure for y in leaves(x)]
    return [structure]


# --- the models the tests run -----------------------------------------------------------

NHD = F.NL_X_TWO_NB_BS_NH_HS
MODELS = {
    "mha-nhd": Model("mha-nhd", (Layer(NHD),) * 3),
    "mha-hnd-flashinfer": Model(
        "mha-hnd-flashinfer", (Layer(F.NL_X_NB_TWO_NH_BS_HS, dtype="float32"),) * 2
    ),
    "sglang-kv-list": Model(
        "sglang-kv-list",
        (Layer(F.TWO_X_NL_X_NB_BS_NH_HS),) * 2,
        structure_format=F.TWO_X_NL_X_NB_BS_NH_HS,
    ),
    "cross-layer-trtllm": Model(
        "cross-layer-trtllm",
        (Layer(F.NB_NL_TWO_NH_BS_HS),) * 2,
        structure_format=F.NB_NL_TWO_NH_BS_HS,
    ),
    "packed-cs-hnd": Model("packed-cs-hnd", (Layer(F.NL_X_NB_NH_BS_CS, head_size=32),) * 2),
    "jax-interleaved": Model("jax-interleaved", (Layer(F.NL_X_NB_BS_NH_TWO_HS),) * 2),
    # MLA latents and the indexer cache: no head axis, replicated on every rank.
    "mla-indexer": Model(
        "mla-indexer",
        (Layer(F.NL_X_NB_BS_HS, heads=1, head_size=72),) * 2
        + (Layer(F.NL_X_NB_BSV_BSS, heads=1, dtype="uint8"),),
    ),
    # Hybrid: full attention, a sub-chunk sliding window in its own engine group, and a
    # layer with only two KV heads (replicated over the ranks of TP 4 and 8).
    "hybrid-full-sw-gqa2": Model(
        "hybrid-full-sw-gqa2",
        (
            Layer(NHD),
            Layer(NHD, engine_group=1, sliding_window=32),
            Layer(NHD),
            Layer(NHD, engine_group=1, sliding_window=32),
            Layer(NHD, heads=2, head_size=32, dtype="float32"),
        ),
    ),
}
