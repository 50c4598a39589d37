# The cases live in the conformance kit; this module runs them over the in-tree harness pairs,
# plus a check only the in-tree backends can make (torch and JAX side by side).
import numpy as np
import pytest

from kvgroups_conformance.caches import TRANSFER_FORMATS, make_caches
from kvgroups_conformance.suite.test_cross_backend import *  # noqa: F401,F403
from kvgroups_conformance.suite.test_cross_backend import CHUNK, GEOMETRY, _summary
from kvgroups_core import describe
from kvgroups_core.grouping.manager import KVLayerGroupsManager


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_grouping_is_the_same_from_torch_jax_and_bare_specs(fmt):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    pytest.importorskip("kvgroups_torch")
    pytest.importorskip("kvgroups_jax")
    del torch, jax
    from .harnesses import JaxHarness, TorchHarness

    rng = np.random.default_rng(1)
    src_np, formats = make_caches(fmt, dtype="bfloat16", rng=rng, **GEOMETRY)
    t = TorchHarness("cpu").convert(src_np)
    j = JaxHarness("cpu").convert(src_np)

    def specs(structure):
        if isinstance(structure, list):
            return [specs(x) for x in structure]
        if isinstance(structure, tuple):
            return tuple(specs(x) for x in structure)
        return describe(structure).spec

    summaries = [
        _summary(KVLayerGroupsManager(c, formats, lmcache_tokens_per_chunk=CHUNK))
        for c in (t, j, specs(t))
    ]
    assert summaries[0] == summaries[1] == summaries[2]
