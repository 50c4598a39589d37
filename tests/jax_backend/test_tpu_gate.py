"""The TPU lowering gate (no TPU needed): for every transfer format and dtype, an engine step
calling the public store, load and layer-subset store with ``backend="jax-tpu"`` inside
``jax.jit`` lowers for a TPU (``.trace(...).lower(lowering_platforms=("tpu",))``) and exports
(``jax.export(..., platforms=["tpu"])``, serialized). Every transfer is one Mosaic TPU custom
call, and every load's custom call aliases the caches it writes to its outputs (in place on
the TPU). What this cannot check is Mosaic's own compilation (layouts, tiling of the DMA
windows, SMEM use), which needs a TPU: docs/HARDWARE.md."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvgroups_jax import JaxBackend

from kvgroups_conformance.caches import TRANSFER_FORMATS, make_caches
from kvgroups_core import KVLayerGroupsManager, load, store
from kvgroups_core.tensors.arrays import register_backend, registered_backends, unregister_backend
from kvgroups_core.transfer.objects import object_nbytes

DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn"]
GEOMETRY = dict(nl=2, nb=16, bs=4, nh=2, hs=16)
CHUNK, CHUNKS = 8, 2
TPU = "jax-tpu"

needs_flatbuffers = pytest.mark.skipif(
    importlib.util.find_spec("flatbuffers") is None,
    reason="jax.export serializes with flatbuffers: pip install 'kvgroups[test]'",
)


@pytest.fixture(scope="module", autouse=True)
def tpu_backend():
    added = TPU not in registered_backends()  # an install whose metadata predates it
    if added:
        register_backend(TPU, JaxBackend(lowering="tpu"))
    yield
    if added:
        unregister_backend(TPU)


def _spec(x):
    return jax.ShapeDtypeStruct(x.shape, jnp.dtype(x.dtype.name))


def _step(fmt, dtype):
    """An engine step (store, layer-subset store, load) and its abstract arguments."""
    caches, formats = make_caches(fmt, dtype=dtype, rng=np.random.default_rng(0), **GEOMETRY)
    manager = KVLayerGroupsManager(caches, formats, lmcache_tokens_per_chunk=CHUNK)
    nbytes = [object_nbytes(manager, og) for og in range(manager.num_object_groups)]

    def step(kv, objects, ids):
        stored = store(manager, kv, ids, backend=TPU)
        subset = store(manager, kv, ids, objects, layers=[1], backend=TPU)
        loaded = load(manager, stored, kv, ids, backend=TPU)
        return stored, subset, loaded

    spec = jax.tree_util.tree_map(_spec, caches)
    objects = [jax.ShapeDtypeStruct((CHUNKS, n), jnp.uint8) for n in nbytes]
    ids = jax.ShapeDtypeStruct((CHUNKS * CHUNK // GEOMETRY["bs"],), jnp.int32)
    return step, (spec, objects, ids), manager


def _custom_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


@needs_flatbuffers
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_public_calls_lower_and_export_for_tpu(fmt, dtype):
    step, args, manager = _step(fmt, dtype)
    text = (
        jax.jit(step, donate_argnums=(0,)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    )
    calls = _custom_calls(text)
    assert calls and all("@tpu_custom_call" in c for c in calls), calls
    kinds = [re.search(r"kvgroups_(store|load)_pages_tpu", c) for c in calls]
    names = [k.group(1) for k in kinds if k]
    # One launch per kernel group and call: two stores (whole, subset) and one load; the
    # subset store launches only the groups holding layer 1.
    groups = manager.num_kernel_groups
    with_layer = sum(1 in g.layer_indices for g in manager.kernel_groups)
    assert names.count("store") == groups + with_layer and names.count("load") == groups
    for call, kind in zip(calls, names):
        if kind == "load":  # the caches come back in their own buffers
            assert "output_operand_aliases = [#stablehlo.output_operand_alias" in call
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "tf.aliasing_output" in main  # the donated caches are the load's results
    exported = jax.export.export(jax.jit(step), platforms=["tpu"])(*args)
    assert exported.platforms == ("tpu",)
    assert len(exported.serialize()) > 0
    assert "tpu_custom_call" in exported.mlir_module()


@needs_flatbuffers
def test_an_exported_tpu_step_refuses_to_run_on_the_cpu():
    step, args, _ = _step(TRANSFER_FORMATS[0], "bfloat16")
    exported = jax.export.deserialize(
        jax.export.export(jax.jit(step), platforms=["tpu"])(*args).serialize()
    )
    concrete = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), args)
    with pytest.raises(ValueError, match="tpu"):
        exported.call(*concrete)
