"""The model catalogue (kvgroups_tools/catalog.py), shrunk: every real KV pattern against the
NumPy oracle."""

import numpy as np
import pytest

from kvgroups_conformance.caches import DTYPES, all_blocks, random_bits
from kvgroups_conformance.compare import assert_blocks_match, assert_objects_match
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.tensors.descriptors import TensorSpec
from kvgroups_core.transfer.api import load, store
from kvgroups_tools.catalog import MODELS

# Real model shapes, shrunk in layers and blocks; every pattern kept: GQA, MLA,
# the blocked-scale indexer beside MLA, sliding/full hybrids, the compressed DeepSeek-V4 mix.
SHRUNK = {
    "llama3-8b": 3,
    "deepseek-v3": 2,
    "glm5-indexer": 2,
    "gemma3-27b": 7,
    "gpt-oss-20b": 4,
    "deepseek-v4-like": None,
    "hybrid-demo": 4,
}
CHUNKS = 3


def small_case(name: str, params: dict) -> bool:
    """The small case set: the mixes without the two largest (the 7-layer Gemma-3 hybrid; the
    MLA + indexer pair, whose indexer rows round-trip alone in test_roundtrip)."""
    return params.get("name") not in ("gemma3-27b", "glm5-indexer")


def _np_dtype(spec: TensorSpec) -> np.dtype:
    return DTYPES[spec.dtype.name] if spec.dtype.name in DTYPES else np.dtype(spec.dtype.name)


def _arrays(structure, rng, zero):
    if isinstance(structure, (list, tuple)):
        return [_arrays(s, rng, zero) for s in structure]
    dtype = _np_dtype(structure)
    return np.zeros(structure.shape, dtype) if zero else random_bits(structure.shape, dtype, rng)


def _request_ids(manager, rng):
    chunk = manager.lmcache_tokens_per_chunk
    ids = {}
    for k, g in enumerate(manager.kernel_groups):
        if g.engine_group_idx not in ids:
            need = CHUNKS * manager.calculate_num_blocks(k, chunk)
            ids[g.engine_group_idx] = rng.permutation(g.shape_desc.nb)[:need]
    return ids


@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_catalogue_models_match_the_numpy_oracle(harness, name):
    model = MODELS[name].build(num_blocks=256, layers=SHRUNK[name])
    rng = np.random.default_rng(len(name))
    src_np = _arrays(model.kv_caches, rng, zero=False)
    manager = KVLayerGroupsManager(src_np, model.formats, model.engine_group_infos)
    ids_a, ids_b = _request_ids(manager, rng), _request_ids(manager, rng)

    want_objects = store(manager, src_np, ids_a, backend="numpy")
    want_caches = _arrays(model.kv_caches, rng, zero=True)
    load(manager, want_objects, want_caches, ids_b, backend="numpy", skip_first_n_tokens=100)

    src = harness.convert(src_np)
    objects = harness.store(manager, src, ids_a)
    for og, (got, want) in enumerate(zip(objects, want_objects)):
        assert_objects_match(
            harness.to_numpy(got, want),
            want,
            manager,
            og,
            what=f"{name}: store (expected: the NumPy oracle's objects)",
            ids=ids_a,
            source_caches=src_np,
            formats=model.formats,
        )
    dst = harness.convert(_arrays(model.kv_caches, rng, zero=True))
    dst = harness.load(manager, objects, dst, ids_b, skip=100)
    assert_blocks_match(
        harness.read(dst, want_caches),
        model.formats,
        all_blocks(want_caches, model.formats),
        what=f"{name}: load with skip_first_n_tokens=100 (expected: the NumPy oracle's caches)",
        source=all_blocks(src_np, model.formats),
    )
