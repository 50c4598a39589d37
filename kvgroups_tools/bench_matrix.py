"""Case matrices for ``kvgroups bench``: which shapes, chunk counts and placements are measured.

A :class:`Matrix` is an ordered list of :class:`Point` s (a cache shape, a chunk count, where the
objects live) plus the manager-construction sweep. The runner (:mod:`kvgroups_tools.bench`)
measures the points in order, keeping one set of caches per shape, so each shape's points sit
together and the most important points come first (a time budget then cuts the least useful).

Presets:

``tiny``
    CPU-sized: two small shapes, a page-size point and a layer-count point; seconds in total.
``headline``
    The acceptance case: Llama-3-8B-like (32 layers, 8 KV heads x 128, block 16, bf16, NHD),
    64 chunks of 256 tokens on random blocks, objects in device and in pinned host memory.
``engine``
    The public calls (store, load, prepared, jit, graph, layer-wise; host and device ids)
    over chunks 1-256, pages 512 B-128 KiB, device and pinned objects: one GPU run.
``full``
    The headline, then chunks 1..512, page sizes 1 KiB..128 KiB (heads, head size and block
    size varied), 8..128 layers, pinned objects for a few chunk counts, MLA and hybrid models,
    and manager construction versus layers up to 1,024.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvgroups_core.errors import KVGroupsValueError
from kvgroups_core.grouping.shape_spec import group_tensor, parse_kvcache_shape_spec

from .bench_public import CALLS, IDS
from .catalog import CacheModel, get_model


@dataclass(frozen=True)
class Shape:
    """A cache geometry: a catalogue model with a layer count, or a shape spec string.

    ``label`` names it in the records; for a spec, its NB is a minimum (the runner raises it
    to what the chunk counts need).
    """

    label: str
    model: str | None = None
    layers: int | None = None
    spec: str | None = None

    def __post_init__(self) -> None:
        if (self.model is None) == (self.spec is None):
            raise KVGroupsValueError(
                f"shape {self.label!r}: expected exactly one of model= and spec=, got "
                f"model={self.model!r}, spec={self.spec!r}"
            )

    @property
    def key(self) -> tuple:
        return (self.label, self.model, self.layers, self.spec)

    def build(self, num_blocks: int) -> CacheModel:
        """The cache model with at least ``num_blocks`` blocks per cache."""
        if self.model is not None:
            return get_model(self.model).build(num_blocks=num_blocks, layers=self.layers)
        groups = parse_kvcache_shape_spec(self.spec)
        parts = []
        for g in groups:
            sd = g.shape_desc
            parts.append(
                f"({sd.kv_size},{max(sd.nb, num_blocks)},{sd.bs},{sd.nh},{sd.hs}):"
                f"{g.dtype.name}:{sd.nl}"
            )
        caches: list = []
        formats: list = []
        for i, g in enumerate(parse_kvcache_shape_spec(";".join(parts))):
            fmt, tensor = group_tensor(g, i)  # the layout manager_from_shape_spec uses
            caches += [tensor] * g.shape_desc.nl
            formats += [fmt] * g.shape_desc.nl
        return CacheModel(self.label, caches, tuple(formats), ())


@dataclass(frozen=True)
class Point:
    """One measured configuration: shape x chunk count x object placement. ``sweeps`` says
    which plots it belongs to (``"chunks"``, ``"page"``, ``"layers"``, ``"models"``)."""

    shape: Shape
    chunks: int
    placement: str
    sweeps: tuple[str, ...] = ()
    headline: bool = False
    calls: tuple[str, ...] | None = None  # public calls here (None: the matrix's)
    all_paths: bool = False  # every public path, not only the default one


@dataclass(frozen=True)
class Matrix:
    """An ordered case list plus timing settings (overridable from the command line)."""

    name: str
    points: tuple[Point, ...]
    manager_models: tuple[str, ...] = ()
    manager_layers: tuple[int, ...] = ()
    chunk_tokens: int = 256
    repeats: int = 7
    warmup: int = 2
    # Time per repeat: calls are batched up to this. A batch pays its first call's host latency
    # unhidden (a JAX call donating 32 caches dispatches for a good fraction of a millisecond),
    # so a batch must be long enough for that to be noise.
    target_s: float = 0.025
    max_calls: int = 256
    min_blocks: int = 1024  # cache pool floor, so random pages are spread past the L2 cache
    verify_bytes: int = 256 << 20  # headline points are always checked
    # Public calls measured at every point (kvgroups_tools.bench_public), with these ids.
    calls: tuple[str, ...] = CALLS
    ids: tuple[str, ...] = IDS
    internal: bool = True  # also record the internal entry points (call="internal")
    all_paths: bool = False  # every public path at every point, not only the default
    notes: dict = field(default_factory=dict)

    def shapes(self) -> list[tuple[Shape, list[Point]]]:
        """Points grouped by shape, in first-appearance order (duplicates merged)."""
        groups: dict[tuple, tuple[Shape, dict[tuple, Point]]] = {}
        for p in self.points:
            shape, points = groups.setdefault(p.shape.key, (p.shape, {}))
            old = points.get((p.chunks, p.placement))
            if old is not None:
                sweeps = old.sweeps + tuple(s for s in p.sweeps if s not in old.sweeps)
                calls = (
                    None
                    if old.calls is None or p.calls is None
                    else old.calls + tuple(c for c in p.calls if c not in old.calls)
                )
                p = replace(
                    p,
                    shape=shape,
                    sweeps=sweeps,
                    headline=old.headline or p.headline,
                    calls=calls,
                    all_paths=old.all_paths or p.all_paths,
                )
            points[(p.chunks, p.placement)] = p
        return [(shape, list(points.values())) for shape, points in groups.values()]


LLAMA = Shape("llama3-8b", model="llama3-8b", layers=32)
HEADLINE_CHUNKS = 64

#: Page sizes (bytes per block per plane, bf16) from 1 KiB to 128 KiB: (label, bs, nh, hs).
PAGE_SHAPES = (
    ("page-1KiB", 16, 1, 32),
    ("page-2KiB", 16, 1, 64),
    ("page-4KiB", 16, 2, 64),
    ("page-8KiB", 16, 4, 64),
    ("page-16KiB", 16, 8, 64),
    ("page-32KiB", 16, 8, 128),
    ("page-64KiB", 32, 8, 128),
    ("page-128KiB", 64, 8, 128),
)


def _page_shape(label: str, bs: int, nh: int, hs: int, layers: int = 32) -> Shape:
    return Shape(label, spec=f"(2,16,{bs},{nh},{hs}):bfloat16:{layers}")


def tiny() -> Matrix:
    small = Shape("small-pages", model="small-pages", layers=2)
    return Matrix(
        "tiny",
        (
            Point(small, 2, "device", ("chunks",), headline=True),
            # Public calls at the first point only: CI time (each is a few compiles in JAX).
            Point(small, 1, "device", ("chunks",), calls=()),
            Point(small, 1, "pinned", ("chunks",), calls=()),
            Point(_page_shape("page-4KiB", 16, 2, 64, layers=2), 1, "device", ("page",), calls=()),
            Point(
                Shape("small-pages", model="small-pages", layers=4),
                1,
                "device",
                ("layers",),
                calls=(),
            ),
        ),
        manager_models=("small-pages",),
        manager_layers=(4, 16),
        repeats=3,
        warmup=1,
        target_s=0.0,
        max_calls=1,
        min_blocks=0,
        verify_bytes=64 << 20,
    )


def headline() -> Matrix:
    return Matrix(
        "headline",
        (
            Point(LLAMA, HEADLINE_CHUNKS, "device", ("chunks", "page", "layers"), headline=True),
            Point(LLAMA, HEADLINE_CHUNKS, "pinned", ("chunks",), headline=True),
        ),
    )


def full() -> Matrix:
    points = list(headline().points)
    # The largest transfers last: a time budget cuts them first, and a failure that breaks
    # the device context (an out-of-bounds kernel) spoils nothing after it.
    for c in (1, 2, 4, 8, 16, 32):
        points.append(Point(LLAMA, c, "device", ("chunks",)))
    for c in (1, 8):
        points.append(Point(LLAMA, c, "pinned", ("chunks",)))
    for c in (128, 256, 512):
        points.append(Point(LLAMA, c, "device", ("chunks",)))
    for label, bs, nh, hs in PAGE_SHAPES:
        if label != "page-32KiB":  # the headline shape is that point
            points.append(
                Point(_page_shape(label, bs, nh, hs), HEADLINE_CHUNKS, "device", ("page",))
            )
    for layers in (8, 16, 64, 128):
        points.append(
            Point(
                Shape("llama3-8b", model="llama3-8b", layers=layers),
                HEADLINE_CHUNKS,
                "device",
                ("layers",),
            )
        )
    for model in ("deepseek-v3", "gpt-oss-120b", "gemma3-27b"):
        points.append(Point(Shape(model, model=model), 16, "device", ("models",)))
    return Matrix(
        "full",
        tuple(points),
        manager_models=("llama3-8b", "gemma3-27b"),
        manager_layers=(8, 32, 128, 512, 1024),
    )


#: 512 B pages, below the 1 KiB of PAGE_SHAPES.
PAGE_512B = ("page-512B", 16, 1, 16)


def engine() -> Matrix:
    """The public calls on a GPU, in a few minutes per runtime. Llama-3-8B-like caches
    (32 KiB pages) at 64 chunks: every call, ids kind and public path, device and pinned
    objects; chunks 1-16 and 256 through the one-shot, prepared, jit and graph calls
    (layer-wise at 16 and 64: a JAX layer subset is its own program, compiled once each);
    pages of 512 B-128 KiB at 64 chunks (and 4 for the smallest) through the calls engines
    make per step (prepared, jit, graph). Only public calls are recorded (the baseline is
    still timed, for ``speedup_vs_baseline``); every point up to 128 MiB is checked byte for
    byte against the baseline. The page points come before the largest one: a time budget
    cuts the 8 GiB point first (it has its own caches, built last)."""
    whole = ("store", "load", "prepared", "jit", "graph")
    step = ("prepared", "jit", "graph")
    points = [
        Point(LLAMA, HEADLINE_CHUNKS, "device", ("chunks", "page", "calls"), all_paths=True),
        Point(LLAMA, HEADLINE_CHUNKS, "pinned", ("chunks", "calls"), all_paths=True),
    ]
    for c in (1, 4, 16):
        points.append(
            Point(
                LLAMA, c, "device", ("chunks",), calls=whole + (("layerwise",) if c == 16 else ())
            )
        )
    for c in (1, 16):
        points.append(Point(LLAMA, c, "pinned", ("chunks",), calls=step))
    for label, bs, nh, hs in (PAGE_512B,) + PAGE_SHAPES:
        if label != "page-32KiB":  # the Llama shape is that page
            points.append(
                Point(
                    _page_shape(label, bs, nh, hs), HEADLINE_CHUNKS, "device", ("page",), calls=step
                )
            )
    for label, bs, nh, hs in (PAGE_512B,) + PAGE_SHAPES[:2]:
        points.append(Point(_page_shape(label, bs, nh, hs), 4, "device", ("page",), calls=step))
    big = Shape("llama3-8b-256", model="llama3-8b", layers=32)  # 8 GiB objects: last
    points.append(Point(big, 256, "device", ("chunks",), calls=whole))
    return Matrix(
        "engine",
        tuple(points),
        internal=False,
        repeats=5,
        warmup=2,
        target_s=0.01,
        max_calls=64,
        verify_bytes=128 << 20,
    )


SWEEPS = ("headline", "chunks", "page", "layers", "models", "calls", "manager")


def select(matrix: Matrix, sweeps: list[str]) -> Matrix:
    """Only the points of ``sweeps`` (see :data:`SWEEPS`): a headline point runs only when
    ``"headline"`` is named (so separate processes never measure it twice); ``"manager"``
    keeps the manager-construction sweep."""
    unknown = [s for s in sweeps if s not in SWEEPS]
    if unknown:
        raise KVGroupsValueError(f"sweeps: expected names from {SWEEPS}, got {unknown}")
    points = tuple(
        p
        for p in matrix.points
        if (("headline" in sweeps) if p.headline else set(p.sweeps) & set(sweeps))
    )
    keep = "manager" in sweeps
    return replace(
        matrix,
        points=points,
        manager_models=matrix.manager_models if keep else (),
        manager_layers=matrix.manager_layers if keep else (),
    )


PRESETS = {"tiny": tiny, "headline": headline, "full": full, "engine": engine}


def _leaves(structure: object) -> list:
    if isinstance(structure, (list, tuple)):
        return [leaf for x in structure for leaf in _leaves(x)]
    return [structure]


def memory_needed(matrix: Matrix) -> tuple[int, str]:
    """``(bytes, the shape and chunk count)`` of the matrix's largest allocation, from
    descriptors alone: a shape's caches (at the block count the runner gives them) plus, for
    its largest point, the objects of one rotation and the ceiling's and the check's copies
    of as many bytes (the runner measures one shape at a time and frees it after)."""
    from kvgroups_core.grouping.manager import KVLayerGroupsManager
    from kvgroups_core.transfer.objects import object_nbytes

    worst, label = 0, ""
    chunk = matrix.chunk_tokens
    for shape, points in matrix.shapes():
        probe = shape.build(1)
        pm = KVLayerGroupsManager(
            probe.kv_caches,
            list(probe.formats),
            probe.engine_group_infos,
            lmcache_tokens_per_chunk=chunk,
        )
        bpc = max(
            (pm.calculate_num_blocks(k, chunk) for k in range(pm.num_kernel_groups)), default=0
        )
        chunks = max(p.chunks for p in points)
        nb = max(matrix.min_blocks, -(-5 * chunks * bpc // 4))
        specs = _leaves(shape.build(nb).kv_caches)
        caches = sum(spec.numel * spec.dtype.itemsize for spec in specs)
        objects = chunks * sum(object_nbytes(pm, og) for og in range(pm.num_object_groups))
        need = caches + 4 * objects
        if need > worst:
            worst, label = need, f"{shape.label} at {chunks} chunks"
    return worst, label


def preset(name: str) -> Matrix:
    try:
        return PRESETS[name]()
    except KeyError:
        raise KVGroupsValueError(
            f"matrix: expected one of {sorted(PRESETS)}, got {name!r}"
        ) from None


def custom(
    base: Matrix,
    *,
    models: list[str] | None,
    specs: list[str] | None,
    layers: list[int] | None,
    chunks: list[int] | None,
    placements: list[str] | None,
) -> Matrix:
    """``base``'s settings with its points replaced by models x layers (plus specs) x chunks x
    placements; ``None`` keeps the headline's value for that axis."""
    shapes = [
        Shape(m, model=m, layers=n)
        for m in (models or ([] if specs else ["llama3-8b"]))
        for n in (layers or [None])
    ]
    shapes += [Shape(s, spec=s) for s in specs or []]
    for s in shapes:
        if s.model is not None:
            get_model(s.model)  # typed error for an unknown name, before any work
        else:
            parse_kvcache_shape_spec(s.spec)
    for c in chunks or []:
        if c < 1:
            raise KVGroupsValueError(f"chunks: expected counts >= 1, got {c}")
    points = tuple(
        Point(s, c, p, (), headline=(i == 0 and j == 0))
        for i, s in enumerate(shapes)
        for j, c in enumerate(chunks or [HEADLINE_CHUNKS])
        for p in placements or ["device", "pinned"]
    )
    return replace(
        base, name=f"{base.name}+custom", points=points, manager_models=(), manager_layers=()
    )
