"""Caches of more than 2**31 elements: every CPU path moves the right block or refuses.

One uint8 MLA-like cache ``[NB, 16, 3]`` of a bit over 2**31 bytes (odd rows: the copy unit is
one byte, so element offsets are byte offsets). Block ``NB - 1`` starts past 2**31; an int32
offset wraps to a block near ``(NB - 1) * 48 - 2**32``. Runs once per backend on the same
memory where the framework allows (NumPy, torch through ``from_numpy``); JAX builds its own.
Skipped when the machine has less than 8 GiB available (it needs about 2.2 GiB at a time).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_core.formats.catalogue import EngineKVFormat as F

BS, HS = 16, 3
PAGE = BS * HS
NB = (2**31 + 2**22) // PAGE + 1  # a bit over 2**31 bytes
HIGH = NB - 1  # starts at HIGH * 48 > 2**31
LOW = 7


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _page(block: int) -> np.ndarray:
    """The bytes the test writes into ``block`` (distinct per block)."""
    return ((np.arange(PAGE, dtype=np.int64) * 31 + block * 7) % 251).astype(np.uint8)


def _manager(cache) -> kc.KVLayerGroupsManager:
    return kc.KVLayerGroupsManager([cache], F.NL_X_NB_BS_HS, lmcache_tokens_per_chunk=BS)


def _host_round_trip(cache: np.ndarray, backend: str, wrap) -> None:
    """Store blocks HIGH and LOW, load them swapped, through ``backend`` on ``cache``'s
    memory (``wrap`` makes the backend's array over it, zero-copy)."""
    cache[HIGH] = _page(HIGH).reshape(BS, HS)
    cache[LOW] = _page(LOW).reshape(BS, HS)
    arr = wrap(cache)
    manager = _manager(arr)
    objects = kc.store(manager, [arr], np.array([HIGH, LOW]), backend=backend)
    got = np.asarray(objects[0]).reshape(2, PAGE)
    np.testing.assert_array_equal(got[0], _page(HIGH))
    np.testing.assert_array_equal(got[1], _page(LOW))
    kc.load(manager, objects, [arr], np.array([LOW, HIGH]), backend=backend)
    np.testing.assert_array_equal(cache[LOW].ravel(), _page(HIGH))
    np.testing.assert_array_equal(cache[HIGH].ravel(), _page(LOW))


@pytest.mark.slow
@pytest.mark.skipif(_available_bytes() < 8 * 2**30, reason="needs 8 GiB of available memory")
def test_numpy_torch_and_xla_move_blocks_past_2_31_elements():
    cache = np.zeros((NB, BS, HS), np.uint8)
    assert cache.size > 2**31
    _host_round_trip(cache, "numpy", lambda a: a)
    if importlib.util.find_spec("torch") and importlib.util.find_spec("kvgroups_torch"):
        import torch

        _host_round_trip(cache, "torch", torch.from_numpy)
    del cache
    if not (importlib.util.find_spec("jax") and importlib.util.find_spec("kvgroups_jax")):
        return
    import jax
    import jax.numpy as jnp

    dev = jax.devices("cpu")[0]
    high, low = jnp.asarray(_page(HIGH).reshape(BS, HS)), jnp.asarray(_page(LOW).reshape(BS, HS))

    @jax.jit
    def build():
        c = jnp.zeros((NB, BS, HS), jnp.uint8)
        return c.at[HIGH].set(high).at[LOW].set(low)

    arr = jax.device_put(build(), dev)
    manager = _manager(arr)
    objects = kc.store(manager, [arr], np.array([HIGH, LOW]), backend="jax")
    got = np.asarray(objects[0]).reshape(2, PAGE)
    np.testing.assert_array_equal(got[0], _page(HIGH))
    np.testing.assert_array_equal(got[1], _page(LOW))
    (arr,) = kc.load(manager, objects, [arr], np.array([LOW, HIGH]), backend="jax")
    np.testing.assert_array_equal(np.asarray(arr[LOW]).ravel(), _page(HIGH))
    np.testing.assert_array_equal(np.asarray(arr[HIGH]).ravel(), _page(LOW))


def test_xla_index_range_check_refuses_past_int32():
    """The XLA path's guard (run at trace time, before anything is donated): rows of a span
    up to 2**31 - 1, elements up to 2**31 - 1 on the element path."""
    xla_copy = pytest.importorskip("kvgroups_jax.lowerings.xla")
    from types import SimpleNamespace

    big = SimpleNamespace(span=48, unit=1, operand_sizes=(NB * PAGE,))
    xla_copy.check_index_range(big, 2, PAGE, rows=True)  # NB rows: fine
    with pytest.raises(kc.UnsupportedConfigError, match="elements of 1 bytes"):
        xla_copy.check_index_range(big, 2, PAGE, rows=False)
    huge = SimpleNamespace(span=1, unit=1, operand_sizes=(2**31,))
    with pytest.raises(NotImplementedError, match="XLA path"):
        xla_copy.check_index_range(huge, 1, 16, rows=True)


def _cuda() -> bool:
    if not importlib.util.find_spec("torch"):
        return False
    import torch

    return torch.cuda.is_available()


def _jax_gpu() -> bool:
    if not importlib.util.find_spec("jax"):
        return False
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="no CUDA GPU")
def test_torch_cuda_moves_blocks_past_2_31_elements():
    """The CUDA kernel's cache addressing is 64-bit (base + id * block_stride in int64)."""
    import torch

    pytest.importorskip("kvgroups_torch")
    cache = torch.zeros((NB, BS, HS), dtype=torch.uint8, device="cuda")
    cache[HIGH] = torch.from_numpy(_page(HIGH).reshape(BS, HS)).cuda()
    cache[LOW] = torch.from_numpy(_page(LOW).reshape(BS, HS)).cuda()
    manager = _manager(cache)
    objects = kc.store(manager, [cache], np.array([HIGH, LOW]))
    got = objects[0].cpu().numpy().reshape(2, PAGE)
    np.testing.assert_array_equal(got[0], _page(HIGH))
    np.testing.assert_array_equal(got[1], _page(LOW))
    kc.load(manager, objects, [cache], np.array([LOW, HIGH]))
    np.testing.assert_array_equal(cache[LOW].cpu().numpy().ravel(), _page(HIGH))
    np.testing.assert_array_equal(cache[HIGH].cpu().numpy().ravel(), _page(LOW))


@pytest.mark.gpu
@pytest.mark.skipif(not _jax_gpu(), reason="no JAX GPU")
@pytest.mark.parametrize("lowering", ["auto", "xla", "triton"])
def test_jax_gpu_moves_blocks_past_2_31_elements_or_refuses(lowering):
    """``auto`` leaves the Pallas kernels (int32 indexing) for XLA's row path past 2**31
    units; an explicit Triton request is refused before anything is donated."""
    import jax
    import jax.numpy as jnp

    from kvgroups_core.tensors import arrays as registry

    name = f"jax-{lowering}-big"
    if name not in registry.registered_backends():
        from kvgroups_jax import JaxBackend

        registry.register_backend(name, lambda: JaxBackend(lowering=lowering))
    high, low = jnp.asarray(_page(HIGH).reshape(BS, HS)), jnp.asarray(_page(LOW).reshape(BS, HS))

    @jax.jit
    def build():
        return jnp.zeros((NB, BS, HS), jnp.uint8).at[HIGH].set(high).at[LOW].set(low)

    arr = build()
    manager = _manager(arr)
    if lowering == "triton":
        with pytest.raises(kc.UnsupportedConfigError, match="int32"):
            kc.store(manager, [arr], np.array([HIGH, LOW]), backend=name)
        assert not arr.is_deleted()
        return
    objects = kc.store(manager, [arr], np.array([HIGH, LOW]), backend=name)
    got = np.asarray(objects[0]).reshape(2, PAGE)
    np.testing.assert_array_equal(got[0], _page(HIGH))
    np.testing.assert_array_equal(got[1], _page(LOW))
    (arr,) = kc.load(manager, objects, [arr], np.array([LOW, HIGH]), backend=name)
    np.testing.assert_array_equal(np.asarray(arr[LOW]).ravel(), _page(HIGH))
    np.testing.assert_array_equal(np.asarray(arr[HIGH]).ravel(), _page(LOW))
