"""``kvgroups demo``: one grouping, two runtimes, every byte verified.

Builds caches shaped like a catalogue model, fills them with position-encoded values, prints the
kernel and object groups, stores a request's chunks with one backend, hands the objects to a
second backend through DLPack, loads them there into zeroed caches, and checks every byte of the
objects and of the destination caches against the NumPy reference. Runtimes are reached only
through their registered backends, so this module imports no framework.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvgroups_core.errors import KVGroupsError, KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.tensors.arrays import get_backend
from kvgroups_core.tensors.descriptors import TensorSpec
from kvgroups_core.transfer.api import load, store
from kvgroups_core.transfer.backend import Backend
from kvgroups_core.transfer.objects import object_nbytes

from .catalog import CacheModel, get_model
from .cli_options import available_memory, nbytes_text


@dataclass
class StepResult:
    name: str
    backend: str
    seconds: float
    nbytes: int
    first_seconds: float  # the first call alone: compiles and first touch

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def default_backends() -> tuple[str, str]:
    """Store with torch and load with JAX when both are installed, else stay on NumPy."""
    have = [
        name
        for name, module in (("torch", "kvgroups_torch"), ("jax", "kvgroups_jax"))
        if importlib.util.find_spec(module) and importlib.util.find_spec(name)
    ]
    if len(have) == 2:
        return "torch", "jax"
    if have:
        return have[0], "numpy"
    return "numpy", "numpy"


def _numpy_dtype(spec: TensorSpec) -> np.dtype:
    return np.dtype(spec.dtype.uint_view_name)


def _map_specs(structure: Any, fn: Callable[[TensorSpec, int], Any], counter: list[int]) -> Any:
    if isinstance(structure, (list, tuple)):
        items = [_map_specs(x, fn, counter) for x in structure]
        return items if isinstance(structure, list) else tuple(items)
    counter[0] += 1
    return fn(structure, counter[0])


def position_encoded(spec: TensorSpec, salt: int) -> np.ndarray:
    """Bit patterns that differ for every element of every tensor (as unsigned integers of
    the element width: the transfer moves bytes, so any payload, NaNs included, must survive)."""
    dtype = _numpy_dtype(spec)
    bits = dtype.itemsize * 8
    index = np.arange(spec.numel, dtype=np.uint64)
    mixed = (index * np.uint64(0x9E3779B1) + np.uint64(salt * 0x85EBCA77)) >> np.uint64(7)
    return (mixed % np.uint64(2**bits)).astype(dtype).reshape(spec.shape)


def _structure_arrays(model: CacheModel, fill: bool) -> Any:
    """NumPy arrays for every distinct spec position (shared specs get their own arrays)."""

    def make(spec: TensorSpec, i: int) -> np.ndarray:
        return position_encoded(spec, i) if fill else np.zeros(spec.shape, _numpy_dtype(spec))

    return _map_specs(model.kv_caches, make, [0])


def _convert(structure: Any, backend: Backend, device: str | None, model: CacheModel) -> Any:
    """Arrays of ``backend`` with the model's real dtypes (built from the unsigned bit arrays)."""
    flat_specs: list[TensorSpec] = []
    _map_specs(model.kv_caches, lambda s, i: flat_specs.append(s), [0])
    arrays: list[np.ndarray] = []
    _map_specs(structure, lambda a, i: arrays.append(a), [0])
    converted = iter([backend.from_numpy(a, device, s.dtype) for a, s in zip(arrays, flat_specs)])
    return _map_specs(structure, lambda a, i: next(converted), [0])


def _leaves(structure: Any) -> list:
    if isinstance(structure, (list, tuple)):
        return [leaf for x in structure for leaf in _leaves(x)]
    return [structure]


def _bits(backend: Backend, x: Any) -> np.ndarray:
    a = np.ascontiguousarray(backend.to_numpy(x))
    return a.reshape(-1).view(np.uint8)


def _progress(done: int, total: int, label: str, stream: Any) -> None:
    width = 30
    filled = width * done // max(total, 1)
    stream.write(f"\r  {label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} chunks")
    if done == total:
        stream.write("\n")
    stream.flush()


def _check_positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVGroupsTypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise KVGroupsValueError(f"{name}: expected >= {minimum}, got {value}")


def _check_device(backend: Backend, device: str | None) -> str:
    """The device ``backend`` will use; an unusable one is refused before anything is built."""
    where = device or backend.default_device()
    try:
        backend.synchronize(backend.from_numpy(np.zeros(1, np.uint8), where))
    except KVGroupsError:
        raise
    except Exception as exc:  # noqa: BLE001 - the runtime's own error, reported on one line
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KVGroupsValueError(
            f"device: expected a device backend {backend.name!r} can use, got {where!r} "
            f"({type(exc).__name__}: {cause})"
        ) from None
    return where


def _default_num_blocks(entry: Any, layers: int | None, num_chunks: int) -> int:
    """Twice the request's blocks in the kernel group that needs the most per chunk (block
    sizes differ between groups), at least 64."""
    probe = entry.build(num_blocks=1, layers=layers)
    pm = KVLayerGroupsManager(probe.kv_caches, probe.formats, probe.engine_group_infos)
    chunk = pm.lmcache_tokens_per_chunk
    per_chunk = max(pm.calculate_num_blocks(k, chunk) for k in range(pm.num_kernel_groups))
    return max(64, 2 * num_chunks * per_chunk)


def _timed(step: Callable[[], None], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - start


def build_model(
    *,
    model: str = "hybrid-demo",
    spec: str | None = None,
    layers: int | None = None,
    num_chunks: int = 4,
    num_blocks: int | None = None,
) -> CacheModel:
    """The demo's caches as descriptors (nothing allocated): a catalogue model or a spec."""
    if spec is not None:
        from kvgroups_core.grouping.shape_spec import caches_from_shape_spec

        caches, formats, infos = caches_from_shape_spec(spec)
        return CacheModel("spec", caches, tuple(formats), tuple(infos))
    entry = get_model(model)
    nb = num_blocks or _default_num_blocks(entry, layers, num_chunks)
    return entry.build(num_blocks=nb, layers=layers)


def memory_needed(
    cache_model: CacheModel, manager: KVLayerGroupsManager, num_chunks: int
) -> tuple[int, str]:
    """``(bytes, breakdown)``: about what the demo allocates for ``cache_model``, most of it on
    the host (the NumPy reference): the caches seven times (the bit patterns, source and
    destination in both runtimes, the reference's three), the request's objects three times
    (stored, handed over, the reference's), and the largest tensor's 16-byte-per-element
    position encoding."""
    specs: list[TensorSpec] = []
    _map_specs(cache_model.kv_caches, lambda s, i: specs.append(s), [0])
    caches = sum(s.numel * s.dtype.itemsize for s in specs)
    biggest = max((s.numel for s in specs), default=0)
    objects = num_chunks * sum(
        object_nbytes(manager, og) for og in range(manager.num_object_groups)
    )
    need = 7 * caches + 3 * objects + 16 * biggest
    return need, f"caches of {nbytes_text(caches)} x 7, objects of {nbytes_text(objects)} x 3"


def _backend(name: str, what: str) -> Backend:
    try:
        return get_backend(name)
    except KVGroupsError as exc:
        text = str(exc)
        text = text[len("backend: ") :] if text.startswith("backend: ") else text
        raise type(exc)(f"{what}: {text}") from None


def run_demo(
    *,
    model: str = "hybrid-demo",
    spec: str | None = None,
    layers: int | None = None,
    num_chunks: int = 4,
    num_blocks: int | None = None,
    store_backend: str | None = None,
    load_backend: str | None = None,
    device: str | None = None,
    batch_chunks: int = 8,
    corrupt: bool = False,
    seed: int = 0,
    max_memory: int | None = None,
    out: Any = None,
) -> int:
    """Run the demo; returns 0 when every byte checks out, 1 otherwise.

    Every option is checked before any runtime is loaded or any array is made: a bad one
    raises a typed :class:`~kvgroups_core.errors.KVGroupsError` naming it (the CLI prints it
    on one line and exits 2). That includes the memory the run would take
    (:func:`memory_needed`), against ``max_memory`` bytes (default: the host memory
    available now)."""
    out = sys.stdout if out is None else out
    _check_positive("num_chunks", num_chunks)
    _check_positive("layers", layers)
    _check_positive("num_blocks", num_blocks)
    _check_positive("batch_chunks", batch_chunks)
    _check_positive("seed", seed, minimum=0)
    if spec is not None and (layers is not None or num_blocks is not None):
        raise KVGroupsValueError(
            "spec: expected layers and num_blocks to be left out (the shape sets both), got "
            f"layers={layers}, num_blocks={num_blocks}"
        )
    cache_model = build_model(
        model=model, spec=spec, layers=layers, num_chunks=num_chunks, num_blocks=num_blocks
    )
    manager = KVLayerGroupsManager(
        cache_model.kv_caches, cache_model.formats, cache_model.engine_group_infos
    )
    need, parts = memory_needed(cache_model, manager, num_chunks)
    limit = max_memory if max_memory is not None else available_memory()
    if limit is not None and need > limit:
        sizes = "num_chunks, num_blocks, layers" if spec is None else "num_chunks, spec"
        raise KVGroupsValueError(
            f"{sizes}: expected a demo that fits in memory, got one that needs about "
            f"{nbytes_text(need)} ({parts}), more than the {nbytes_text(limit)} "
            f"{'allowed' if max_memory is not None else 'available'}"
        )
    rng = np.random.default_rng(seed)
    engine_groups = sorted({g.engine_group_idx for g in manager.kernel_groups})
    chunk = manager.lmcache_tokens_per_chunk

    def request_ids() -> dict[int, np.ndarray]:
        ids = {}
        for g in engine_groups:
            k = next(i for i, kg in enumerate(manager.kernel_groups) if kg.engine_group_idx == g)
            need = num_chunks * manager.calculate_num_blocks(k, chunk)
            nb = manager.kernel_groups[k].shape_desc.nb
            if need > nb:
                raise KVGroupsValueError(
                    f"num_chunks: {num_chunks} chunks need {need} blocks of engine group {g}, "
                    f"which has {nb}"
                )
            ids[g] = rng.permutation(nb)[:need].astype(np.int64)
        return ids

    ids_a, ids_b = request_ids(), request_ids()

    # The runtimes last: loading one imports its framework (seconds).
    defaults = default_backends()
    store_name, load_name = store_backend or defaults[0], load_backend or defaults[1]
    a_be = _backend(store_name, "store_backend")
    b_be = _backend(load_name, "load_backend")
    dev_a, dev_b = _check_device(a_be, device), _check_device(b_be, device)

    from .cli_plan import format_plan, plan_summary

    print(
        f"kvgroups demo: {cache_model.name}, {num_chunks} chunks of "
        f"{manager.lmcache_tokens_per_chunk} tokens; store with {store_name} ({dev_a}), load "
        f"with {load_name} ({dev_b})",
        file=out,
    )
    print(format_plan(plan_summary(manager)), file=out)

    src_bits = _structure_arrays(cache_model, fill=True)
    src = _convert(src_bits, a_be, dev_a, cache_model)
    dst = _convert(_structure_arrays(cache_model, fill=False), b_be, dev_b, cache_model)
    total_bytes = sum(object_nbytes(manager, og) for og in range(manager.num_object_groups))
    print(
        f"\nmoving {num_chunks} chunks x {total_bytes:,} bytes = "
        f"{num_chunks * total_bytes / 1e6:,.1f} MB per direction",
        file=out,
    )

    steps = []
    # Store in batches of chunks (a progress bar when there is more than one batch).
    batches = [(c, min(c + batch_chunks, num_chunks)) for c in range(0, num_chunks, batch_chunks)]

    def batch_ids(ids: dict[int, np.ndarray], lo: int, hi: int) -> dict[int, np.ndarray]:
        out_ids = {}
        for g, v in ids.items():
            per = len(v) // num_chunks
            out_ids[g] = v[lo * per : hi * per]
        return out_ids

    # A first call of each direction runs alone and is reported apart: it compiles (JAX jit,
    # NVRTC) and touches memory for the first time, which is not bandwidth. The timed calls
    # then redo it (a store makes new objects; a load writes the same bytes again).
    first_lo, first_hi = batches[0]
    first_store = _timed(
        lambda: store(manager, src, batch_ids(ids_a, first_lo, first_hi), backend=store_name),
        a_be.synchronize,
    )
    stored: list[list] = []

    def store_all() -> None:
        for lo, hi in batches:
            stored.append(store(manager, src, batch_ids(ids_a, lo, hi), backend=store_name))
            if len(batches) > 1:
                _progress(hi, num_chunks, "store", out)

    steps.append(
        StepResult(
            "store",
            store_name,
            _timed(store_all, a_be.synchronize),
            2 * num_chunks * total_bytes,
            first_store,
        )
    )

    # Hand the objects to the other runtime (DLPack, zero-copy where possible).
    handed = [[b_be.import_foreign(o) for o in objs] for objs in stored]
    if corrupt:
        first = handed[0][0]
        bits = np.array(b_be.to_numpy(first), copy=True)
        bits.reshape(-1)[bits.size // 2] ^= 0x40
        handed[0][0] = b_be.from_numpy(bits, dev_b)

    def load_batch(i: int) -> None:
        nonlocal dst
        lo, hi = batches[i]
        dst = load(manager, handed[i], dst, batch_ids(ids_b, lo, hi), backend=load_name)

    first_load = _timed(lambda: load_batch(0), b_be.synchronize)

    def load_all() -> None:
        for i, (_, hi) in enumerate(batches):
            load_batch(i)
            if len(batches) > 1:
                _progress(hi, num_chunks, "load", out)

    steps.append(
        StepResult(
            "load",
            load_name,
            _timed(load_all, b_be.synchronize),
            2 * num_chunks * total_bytes,
            first_load,
        )
    )

    # The oracle: the same transfers on NumPy.
    ref = get_backend("numpy")
    ref_src = _convert(src_bits, ref, None, cache_model)
    ref_dst_bits = _structure_arrays(cache_model, fill=False)
    ref_dst = _convert(ref_dst_bits, ref, None, cache_model)
    bad = 0
    checked = 0
    object_bytes = 0
    for i, (lo, hi) in enumerate(batches):
        want = store(manager, ref_src, batch_ids(ids_a, lo, hi), backend="numpy")
        for og, w in enumerate(want):
            got = _bits(b_be, handed[i][og])
            object_bytes += got.size
            if got.size == w.size:
                bad += int(np.count_nonzero(got != w.reshape(-1)))
                checked += w.size
        load(manager, want, ref_dst, batch_ids(ids_b, lo, hi), backend="numpy")
    for got_arr, want_arr in zip(_leaves(dst), _leaves(ref_dst)):
        got = _bits(b_be, got_arr)
        want = _bits(ref, want_arr)
        bad += int(np.count_nonzero(got != want))
        checked += want.size
    del ref

    print("", file=out)
    for s in steps:
        print(
            f"  {s.name:5s} with {s.backend:6s}: {s.seconds * 1e3:9.2f} ms  "
            f"{s.gb_per_s:8.2f} GB/s (bytes read + written); first call "
            f"{s.first_seconds * 1e3:.2f} ms (compiles, first touch: not in the bandwidth)",
            file=out,
        )
    expected = num_chunks * total_bytes
    if object_bytes != expected:  # nothing (or not all) moved: there is nothing to verify
        print(
            f"\nFAILED: the transfers produced {object_bytes:,} object bytes, expected "
            f"{expected:,}",
            file=out,
        )
        return 1
    if bad:
        print(f"\nFAILED: {bad:,} of {checked:,} bytes differ from the NumPy reference", file=out)
        return 1
    print(
        f"\nverified: {checked:,} bytes (objects and every destination cache byte) match the "
        "NumPy reference",
        file=out,
    )
    return 0
