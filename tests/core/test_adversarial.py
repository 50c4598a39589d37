"""The adversarial suite (issue 12, point 7): random ids, objects and skips on every CPU backend.

Each example draws, independently, block ids, objects and (for a load) a skip, each either
valid or broken in one of the ways users and engines get wrong. A call with every input valid
must succeed and move exactly what the NumPy reference moves; a call with any input broken
must raise a typed error (``KVGroupsError`` and a builtin) and leave caches and objects byte
for byte as they were. Cases that crashed a process before (read-only mappings written by
torch) run in a subprocess. Kept cheap for CI: few examples, no deadline.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvgroups_core as kc  # noqa: E402
from kvgroups_core.formats.catalogue import EngineKVFormat as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NL, NB, BS, NH, HS, CHUNK = 2, 8, 2, 1, 4, 4
BPC = CHUNK // BS
SHAPE = (2, NB, BS, NH, HS)
BUILTINS = (ValueError, TypeError, IndexError, NotImplementedError)
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# --- runtimes ------------------------------------------------------------------------------


class Runtime:
    """How one backend makes arrays and reads them back (bit-exact, as uint8)."""

    def __init__(self, name: str, backend: str) -> None:
        self.name, self.backend = name, backend

    def array(self, a: np.ndarray):
        return a.copy()

    def bytes_of(self, x) -> np.ndarray:
        return np.asarray(x).view(np.uint8).copy()

    @property
    def strided(self) -> bool:  # can make overlapping / read-only objects
        return self.name in ("numpy", "torch-cpu")


class TorchRuntime(Runtime):
    def array(self, a: np.ndarray):
        import torch

        if a.dtype == np.float16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.float16)
        return torch.from_numpy(a.copy())

    def bytes_of(self, x) -> np.ndarray:
        import torch

        return x.contiguous().view(torch.uint8).numpy().copy()


class JaxRuntime(Runtime):
    def array(self, a: np.ndarray):
        return kc.get_backend("jax").from_numpy(a)

    def bytes_of(self, x) -> np.ndarray:
        return np.asarray(x).view(np.uint8).copy()


def _runtime(name: str) -> Runtime:
    if name == "numpy":
        return Runtime(name, "numpy")
    if name == "torch-cpu":
        pytest.importorskip("torch")
        pytest.importorskip("kvgroups_torch")
        return TorchRuntime(name, "torch")
    pytest.importorskip("jax")
    pytest.importorskip("kvgroups_jax")
    if name == "jax-interpret":
        from kvgroups_core.tensors import arrays as registry

        if "jax-interpret" not in registry.registered_backends():
            from kvgroups_jax import JaxBackend

            registry.register_backend("jax-interpret", lambda: JaxBackend(lowering="interpret"))
        return JaxRuntime(name, "jax-interpret")
    return JaxRuntime(name, "jax")


RUNTIMES = ["numpy", "torch-cpu", "jax-xla", "jax-interpret"]


# --- inputs: (value, valid?) ---------------------------------------------------------------


def _ids(draw) -> tuple[object, bool, int]:
    """``(block_ids, valid, num_chunks)``."""
    chunks = draw(st.integers(1, 2))
    good = draw(st.lists(st.integers(0, NB - 1), min_size=chunks * BPC, max_size=chunks * BPC))
    kind = draw(
        st.sampled_from(
            [
                "list",
                "int64",
                "int32",
                "dict",
                "nb",
                "negative",
                "huge",
                "bool",
                "float",
                "none",
                "str",
                "partial",
                "uint64",
                "unknown-key",
                "two-lists",
            ]
        )
    )
    if kind == "list":
        return good, True, chunks
    if kind in ("int64", "int32"):
        return np.array(good, dtype=kind), True, chunks
    if kind == "dict":
        return {0: good}, True, chunks
    bad = list(good)
    at = draw(st.integers(0, len(bad) - 1))
    if kind == "nb":
        bad[at] = NB
    elif kind == "negative":
        bad[at] = -1
    elif kind == "huge":
        bad[at] = draw(st.sampled_from([2**31, 2**63, -(2**63) - 1, 2**70]))
    elif kind == "bool":
        bad[at] = True
    elif kind == "float":
        bad[at] = 1.0
    elif kind == "none":
        bad[at] = None
    elif kind == "str":
        bad[at] = "1"
    elif kind == "partial":
        bad = bad[:-1]
    elif kind == "uint64":
        arr = np.array(good, dtype=np.uint64)
        arr[at] = 2**63 + 1
        return arr, False, chunks
    elif kind == "unknown-key":
        return {0: good, 5: good}, False, chunks
    elif kind == "two-lists":
        return [good, good], False, chunks
    return bad, False, chunks


def _objects(draw, rt: Runtime, nbytes: int, chunks: int, direction: str, rng) -> tuple:
    """``(objects, valid, numpy copies to compare)``."""
    base = rng.integers(0, 256, (chunks, nbytes), dtype=np.uint8)
    kinds = [
        "good",
        "good-list",
        "none",
        "str",
        "dict",
        "bytes",
        "short",
        "chunks",
        "dtype",
        "foreign",
        "entries",
    ]
    if rt.strided:
        kinds += ["stride0", "overlap", "twice", "readonly"]
    kind = draw(st.sampled_from(kinds))
    if kind == "good":
        return [rt.array(base)], True
    if kind == "good-list":
        return [[rt.array(base[c]) for c in range(chunks)]], True
    if kind in ("none", "str", "dict", "bytes"):
        return [{"none": None, "str": "obj", "dict": {}, "bytes": base.tobytes()}[kind]], False
    if kind == "short":
        return [rt.array(base[:, :-1])], False
    if kind == "chunks":
        return [rt.array(np.concatenate([base, base]))], False
    if kind == "dtype":
        return [rt.array(base.view(np.float16))], False
    if kind == "foreign":
        if rt.name == "numpy":
            return [{"x": base}], False  # no second framework needed: a mapping
        return [base.copy()], False  # NumPy objects for a torch / JAX call
    if kind == "entries":
        return [rt.array(base), rt.array(base)], False
    flat = rt.array(base.reshape(-1))
    if kind == "twice":
        if chunks < 2:
            return [rt.array(base)], True
        row = rt.array(base[0])
        return [[row, row]], False
    if kind == "readonly":
        if direction == "load":
            return [
                np.frombuffer(base.tobytes(), np.uint8).reshape(base.shape)
                if rt.name == "numpy"
                else rt.array(base)
            ], True
        arr = base.copy()
        arr.flags.writeable = False
        return [arr if rt.name == "numpy" else _torch_readonly(arr)], rt.name != "numpy"
    stride = 0 if kind == "stride0" else max(1, nbytes // 2)
    if chunks < 2:
        return [rt.array(base)], True
    if rt.name == "numpy":
        return [
            np.lib.stride_tricks.as_strided(flat, (chunks, nbytes), (stride, 1), writeable=True)
        ], False
    return [flat.as_strided((chunks, nbytes), (stride, 1))], False


def _torch_readonly(arr: np.ndarray):
    """A torch tensor over a non-writable NumPy array (torch cannot tell: it is heap
    memory, so the call is valid and writes it; see the subprocess test for mappings)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.from_numpy(arr)


def _skip(draw, chunks: int) -> tuple[object, bool]:
    covered = chunks * CHUNK
    kind = draw(st.sampled_from(["zero", "good", "negative", "past", "bool", "float", "str"]))
    if kind == "zero":
        return 0, True
    if kind == "good":
        return draw(st.integers(0, covered)), True
    return {"negative": -1, "past": covered + 1, "bool": True, "float": 1.5, "str": "2"}[
        kind
    ], False


# --- the property ----------------------------------------------------------------------------


def _snapshot(rt: Runtime, structure) -> list[np.ndarray]:
    out = []
    for x in structure if isinstance(structure, (list, tuple)) else [structure]:
        if isinstance(x, (list, tuple)):
            out.extend(_snapshot(rt, x))
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            out.append(
                rt.bytes_of(x)
                if not isinstance(x, np.ndarray)
                else np.asarray(x).view(np.uint8).copy()
            )
    return out


@pytest.mark.parametrize("name", RUNTIMES)
def test_random_inputs_are_moved_exactly_or_refused_untouched(name):
    rt = _runtime(name)
    src_np = [
        np.random.default_rng(i).integers(0, 2**16, SHAPE, dtype=np.uint16).view(np.float16)
        for i in range(NL)
    ]
    manager = kc.KVLayerGroupsManager(
        src_np, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK
    )
    nbytes = kc.object_nbytes(manager, 0)
    counts = {True: 0, False: 0}

    @SETTINGS
    @given(st.data())
    def run(data):
        draw = data.draw
        rng = np.random.default_rng(draw(st.integers(0, 2**16)))
        direction = draw(st.sampled_from(["store", "load"]))
        ids, ids_ok, chunks = _ids(draw)
        objects, objects_ok = _objects(draw, rt, nbytes, chunks, direction, rng)
        skip, skip_ok = _skip(draw, chunks) if direction == "load" else (0, True)
        caches_np = [c.copy() for c in src_np]
        caches = [rt.array(c) for c in caches_np]
        before = (_snapshot(rt, caches), _snapshot(rt, objects))
        valid = ids_ok and objects_ok and skip_ok

        # The reference's inputs, read before the call (a JAX store donates its objects).
        ref_caches = [c.copy() for c in caches_np]
        ref_objects = None
        if valid:
            ref_objects = [
                np.concatenate([rt.bytes_of(o)[None] for o in objects[0]])
                if isinstance(objects[0], (list, tuple))
                else rt.bytes_of(objects[0])
            ]

        def call():
            if direction == "store":
                return kc.store(manager, caches, ids, objects, backend=rt.backend)
            return kc.load(
                manager, objects, caches, ids, skip_first_n_tokens=skip, backend=rt.backend
            )

        counts[valid] += 1
        if not valid:
            with pytest.raises(kc.KVGroupsError) as info:
                call()
            assert isinstance(info.value, BUILTINS), repr(info.value)
            assert _same(_snapshot(rt, caches), before[0]), "caches changed"
            assert _same(_snapshot(rt, objects), before[1]), "objects changed"
            return
        out = call()
        ref_ids = np.asarray(ids if not isinstance(ids, dict) else ids[0], dtype=np.int64)
        if direction == "store":
            got = kc.store(manager, ref_caches, ref_ids, ref_objects, backend="numpy")
            assert _same(_snapshot(rt, out), _snapshot(Runtime("numpy", "numpy"), got))
        else:
            kc.load(
                manager, ref_objects, ref_caches, ref_ids, skip_first_n_tokens=skip, backend="numpy"
            )
            assert _same(_snapshot(rt, out), [c.view(np.uint8) for c in ref_caches])

    run()
    assert min(counts.values()) >= 3, f"too few valid or broken examples: {counts}"


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Same bytes in the same order (a per-chunk list and its stacked array compare equal)."""
    flat = [
        np.concatenate([x.reshape(-1) for x in xs]) if xs else np.zeros(0, np.uint8)
        for xs in (a, b)
    ]
    return np.array_equal(flat[0], flat[1])


def test_read_only_mappings_are_refused_without_a_crash():
    """Stores into objects, and loads into caches, in a read-only file mapping: before the
    fix torch wrote into them and the process died. Run in a subprocess."""
    pytest.importorskip("torch")
    pytest.importorskip("kvgroups_torch")
    code = textwrap.dedent("""
        import mmap, tempfile, warnings
        import numpy as np, torch, kvgroups_core as kc
        from kvgroups_core.formats.catalogue import EngineKVFormat as F
        warnings.simplefilter("ignore")
        def mapped(nbytes, dtype, shape):
            f = tempfile.TemporaryFile()
            f.write(bytes(range(256)) * (nbytes // 256 + 1))
            f.flush()
            mm = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
            return np.frombuffer(mm, dtype).reshape(shape)
        shape = (2, 8, 2, 1, 4)
        caches = [torch.zeros(shape, dtype=torch.float16) for _ in range(2)]
        m = kc.KVLayerGroupsManager(caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=4)
        n = kc.object_nbytes(m, 0)
        for wrap, backend in ((lambda a: a, "numpy"), (torch.from_numpy, "torch")):
            cs = caches if backend == "torch" else [c.numpy() for c in caches]
            obj = wrap(mapped(2 * n, np.uint8, (2, n)))
            try:
                kc.store(m, cs, np.arange(4), [obj], backend=backend)
                raise SystemExit("store into a read-only mapping was not refused")
            except kc.KVGroupsValueError:
                pass
            ro = [wrap(mapped(c.nbytes, np.float16, shape)) for c in caches]
            before = [np.array(r).view(np.uint16).copy() for r in ro]
            try:
                kc.load(m, [wrap(np.zeros((2, n), np.uint8))], ro, np.arange(4),
                        backend=backend)
                raise SystemExit("load into read-only caches was not refused")
            except kc.KVGroupsValueError:
                pass
            assert all(np.array_equal(np.array(r).view(np.uint16), b) for r, b in zip(ro, before))
        print("refused")
    """)
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'backends'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-2000:])
    assert "refused" in result.stdout
