"""The in-tree backends' harnesses for the conformance kit (``kvgroups_conformance``): how the
suite makes arrays of each runtime and reads them back bit-exactly, with the ids the project's
own test run uses (numpy-ref, torch-cpu, torch-cuda, jax-interpret, jax-xla, jax-gpu)."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from kvgroups_conformance import Harness, reference_harness


def _uint_view(a: np.ndarray) -> np.ndarray:
    return a.view(f"uint{a.dtype.itemsize * 8}")


class TorchHarness(Harness):
    def __init__(self, device: str) -> None:
        placements = (None, "pinned") if device == "cuda" else (None,)
        super().__init__(f"torch-{device}", "torch", placements)
        self.device = device

    def from_numpy(self, a: np.ndarray) -> Any:
        import torch

        # Torch allocates (as an engine would), then the bits are copied in.
        bits = torch.from_numpy(
            np.ascontiguousarray(_uint_view(a)).view(
                {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
            )
        )
        dtype = (
            getattr(torch, a.dtype.name)
            if a.dtype.kind in "Vf" or a.dtype.name in ("bfloat16",) or "float8" in a.dtype.name
            else bits.dtype
        )
        if a.dtype.kind in "iub":
            dtype = torch.from_numpy(a[:0].copy()).dtype
        out = torch.empty(a.shape, dtype=dtype, device=self.device)
        out.view(bits.dtype).copy_(bits)
        return out

    def to_numpy(self, x: Any, like: np.ndarray) -> np.ndarray:
        import torch

        cpu = x.detach().to("cpu").contiguous()
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[cpu.element_size()]
        raw = cpu.view(bits).numpy()
        return raw.view(like.dtype)

    def zeros_objects(self, nbytes, num_chunks, placement):
        import torch

        if placement == "pinned":
            return [torch.zeros((num_chunks, n), dtype=torch.uint8).pin_memory() for n in nbytes]
        return [torch.zeros((num_chunks, n), dtype=torch.uint8, device=self.device) for n in nbytes]


class JaxHarness(Harness):
    """JAX on CPU runs the Pallas kernels in interpret mode (a backend registered as
    "jax-interpret"); on a GPU the default backend picks the GPU lowering."""

    def __init__(self, platform: str, lowering: str | None = None) -> None:
        ident = "jax-interpret" if platform == "cpu" else "jax-gpu"
        backend = "jax"
        if lowering == "xla":  # the default backend on a CPU: plain XLA gather / scatter
            ident = "jax-xla"
        elif platform == "cpu":
            from kvgroups_core.tensors import arrays as registry

            if "jax-interpret" not in registry.registered_backends():
                from kvgroups_jax import JaxBackend

                registry.register_backend("jax-interpret", lambda: JaxBackend(lowering="interpret"))
            backend = "jax-interpret"
        super().__init__(ident, backend, (None,))
        self.platform = platform

    def from_numpy(self, a: np.ndarray) -> Any:
        from kvgroups_core import get_backend

        # The backend's own conversion makes buffers XLA owns, so donated loads stay in place.
        return get_backend("jax").from_numpy(a, "cpu" if self.platform == "cpu" else "cuda")

    def to_numpy(self, x: Any, like: np.ndarray) -> np.ndarray:
        return (
            np.asarray(x).view(like.dtype) if np.asarray(x).dtype != like.dtype else np.asarray(x)
        )

    def zeros_objects(self, nbytes, num_chunks, placement):
        import jax
        import jax.numpy as jnp

        dev = jax.devices(self.platform)[0]
        return [jax.device_put(jnp.zeros((num_chunks, n), jnp.uint8), dev) for n in nbytes]


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda_available() -> bool:
    if not _has("torch"):
        return False
    import torch

    return torch.cuda.is_available()


def _jax_gpu_available() -> bool:
    if not _has("jax"):
        return False
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def harness_params() -> list:
    """pytest params for every backend; GPU ones carry the ``gpu`` marker and skip cleanly."""
    params = [pytest.param(reference_harness(), id="numpy-ref")]

    def backend_ready(pkg: str) -> bool:
        return _has(pkg)

    params.append(
        pytest.param(
            "torch-cpu",
            id="torch-cpu",
            marks=pytest.mark.skipif(
                not (_has("torch") and backend_ready("kvgroups_torch")),
                reason="torch or kvgroups_torch not installed",
            ),
        )
    )
    params.append(
        pytest.param(
            "torch-cuda",
            id="torch-cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not _cuda_available(), reason="no CUDA GPU"),
            ],
        )
    )
    params.append(
        pytest.param(
            "jax-interpret",
            id="jax-interpret",
            marks=pytest.mark.skipif(
                not (_has("jax") and backend_ready("kvgroups_jax")),
                reason="jax or kvgroups_jax not installed",
            ),
        )
    )
    params.append(
        pytest.param(
            "jax-xla",
            id="jax-xla",
            marks=pytest.mark.skipif(
                not (_has("jax") and backend_ready("kvgroups_jax")),
                reason="jax or kvgroups_jax not installed",
            ),
        )
    )
    params.append(
        pytest.param(
            "jax-gpu",
            id="jax-gpu",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not _jax_gpu_available(), reason="no JAX GPU"),
            ],
        )
    )
    return params


def pair_params() -> list:
    """Every ordered pair of distinct backends (same-platform pairs: CPU with CPU, GPU with
    GPU), as pytest params with the marks of both."""
    singles = harness_params()
    cpu = [p for p in singles if not any(getattr(m, "name", "") == "gpu" for m in p.marks)]
    gpu = [p for p in singles if p not in cpu] + [singles[0]]
    out = []
    for group in (cpu, gpu):
        for a in group:
            for b in group:
                if a is b or (group is gpu and a is singles[0] and b is singles[0]):
                    continue
                marks = list(a.marks) + [m for m in b.marks if m not in a.marks]
                out.append(
                    pytest.param((a.values[0], b.values[0]), marks=marks, id=f"{a.id}->{b.id}")
                )
    return out


def make_harness(param: Any) -> Harness:
    if isinstance(param, Harness):
        return param
    return {
        "torch-cpu": lambda: TorchHarness("cpu"),
        "torch-cuda": lambda: TorchHarness("cuda"),
        "jax-interpret": lambda: JaxHarness("cpu"),
        "jax-xla": lambda: JaxHarness("cpu", lowering="xla"),
        "jax-gpu": lambda: JaxHarness("gpu"),
    }[param]()


__all__ = ["Harness", "harness_params", "make_harness", "pair_params"]
