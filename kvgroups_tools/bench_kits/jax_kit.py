"""Bench kit for JAX (``kvgroups bench --backends jax``), driven by :mod:`kvgroups_tools.bench`.

Paths (lowerings of :func:`kvgroups_jax.execute_plan`): ``pallas-triton``, ``pallas-mosaic``
(GPU kernels), ``cuda`` (the torch backend's CUDA kernel launched by XLA, where jaxlib can),
``xla`` (the plain baseline: ``take`` / ``.at[].set``), ``interpret`` (Pallas interpret mode;
only when named). Loads donate the caches and stores the objects, so every
call's results replace the workload's arrays. Objects in pinned host memory
(``memory_kind="pinned_host"``) go through :class:`~kvgroups_jax.JaxBackend` with the lowering
forced, which stages them through device memory.

Timed with the wall clock around batches of back-to-back calls, then ``block_until_ready`` on
every array of the workload (dispatch runs ahead of the device). Ceilings: ``device_copy``
(a jitted ``x + 1`` over the same byte count into a donated buffer: one read and one write of
every byte),
``pinned_h2d`` / ``pinned_d2h`` (``jax.device_put`` between device and pinned host memory).
"""

from __future__ import annotations

import gc
import os
import platform
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from kvgroups_jax.backend import JaxBackend
from kvgroups_jax.executor import execute_plan
from kvgroups_jax.lowerings import cuda as cuda_copy

import kvgroups_core as kc
from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_core.tensors.arrays import register_backend
from kvgroups_tools.bench import SCRATCH_FILL, Timing, Workload, map_specs, wall_timer
from kvgroups_tools.bench_public import Refused

LOWERING = {
    "xla": "xla",
    "pallas-triton": "triton",
    "pallas-mosaic": "mosaic",
    "cuda": "cuda",
    "interpret": "interpret",
}


def _pattern(shape: tuple[int, int], value: int | None, seed: Any) -> jax.Array:
    """uint8 ``shape``: pseudo-random bytes (one random row, shifted per chunk) or the constant
    ``value``; elementwise, so sizes past 2**31 elements are fine."""
    if value is not None:
        return jnp.full(shape, value, jnp.uint8)
    row = jax.random.bits(jax.random.PRNGKey(seed), (1, shape[1]), jnp.uint8)
    shift = (jnp.arange(shape[0], dtype=jnp.uint32) * 97 + seed).astype(jnp.uint8)[:, None]
    return row + shift


class JaxKit:
    """The JAX runtime for the benchmark runner, on one GPU or the CPU."""

    backend = "jax"
    baseline = "xla"

    def __init__(self, device: str | None) -> None:
        gpu = jax.default_backend() == "gpu"
        name, _, index = (device or ("cuda" if gpu else "cpu")).partition(":")
        if name in ("cuda", "gpu"):
            if not gpu:
                raise UnsupportedConfigError(
                    f"device: expected a JAX GPU for {device!r}, got "
                    f"platform {jax.default_backend()!r}"
                )
            self.dev, self.device = jax.devices("gpu")[int(index or 0)], "cuda"
        elif name == "cpu":
            self.dev, self.device = jax.devices("cpu")[int(index or 0)], "cpu"
        else:
            raise UnsupportedConfigError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
        self.sharding = jax.sharding.SingleDeviceSharding(self.dev)
        self._fill = jax.jit(_pattern, static_argnums=(0, 1), out_shardings=self.sharding)
        # What JaxBackend(lowering="auto") runs for the usual layouts.
        self.default_path = "pallas-triton" if self.device == "cuda" else "xla"
        self._backends = {p: JaxBackend(lowering=lo) for p, lo in LOWERING.items()}

    def info(self) -> dict:
        return {
            "jax": jax.__version__,
            "device_name": getattr(self.dev, "device_kind", ""),
            "platform": self.dev.platform,
            "compute_capability": getattr(self.dev, "compute_capability", None),
            "host": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        }

    def paths(self) -> tuple[str, ...]:
        gpu = ("pallas-triton", "pallas-mosaic") if self.device == "cuda" else ()
        if gpu and cuda_copy.runtime_unavailable() is None:
            gpu += ("cuda",)
        return ("xla",) + gpu + ("interpret",)

    def default_paths(self) -> tuple[str, ...]:
        return tuple(p for p in self.paths() if p != "interpret")  # interpret: minutes on GBs

    def path_kind(self, path: str) -> str:
        return {"xla": "baseline", "interpret": "reference"}.get(path, "kernel")

    def placements(self) -> tuple[str, ...]:
        return ("device", "pinned") if self.device == "cuda" else ("device",)

    def check(self, path: str, placement: str) -> str | None:
        if path not in self.paths():
            return f"path: expected one of {self.paths()} on {self.device}, got {path!r}"
        if placement not in self.placements():
            return f"placement: expected one of {self.placements()}, got {placement!r}"
        return None

    def l2_bytes(self) -> int:
        return 50 << 20 if self.device == "cuda" else 32 << 20  # Hopper's L2; a host LLC

    # --- arrays ----------------------------------------------------------------------------
    def make_caches(self, specs: Any, seed: int, fill: bool = True) -> Any:
        key = jax.random.PRNGKey(seed)

        @partial(jax.jit, static_argnums=(1, 2, 3), out_shardings=self.sharding)
        def make_one(k: Any, shape: tuple, uint: str, target: str) -> jax.Array:
            bits = (
                jax.random.bits(k, shape, jnp.dtype(uint))
                if fill
                else jnp.zeros(shape, jnp.dtype(uint))
            )
            return bits if uint == target else jax.lax.bitcast_convert_type(bits, target)

        def make(spec: Any, i: int) -> jax.Array:
            return make_one(
                jax.random.fold_in(key, i),
                tuple(spec.shape),
                spec.dtype.uint_view_name,
                spec.dtype.name,
            )

        return map_specs(specs, make)

    def _place(self, x: jax.Array, placement: str) -> jax.Array:
        if placement != "pinned":
            return x
        return jax.device_put(
            x, jax.sharding.SingleDeviceSharding(self.dev, memory_kind="pinned_host")
        )

    def alloc_objects(
        self, wl: Workload, object_nbytes: Any, chunks: int, placement: str, count: int, seed: int
    ) -> None:
        wl.objects = [
            [
                self._place(self._fill((chunks, int(n)), None, seed + 31 * r + g), placement)
                for g, n in enumerate(object_nbytes)
            ]
            for r in range(count)
        ]
        jax.block_until_ready(wl.objects)
        wl.extra["placement"] = placement

    def run(self, path: str, plan: Any, wl: Workload, r: int) -> Any:
        if wl.extra.get("placement") == "pinned":  # the backend stages pinned objects
            caches, objects = self._backends[path].execute(plan, wl.tensors, wl.objects[r])
        else:  # the executor itself, as the torch kit calls TorchBackend.execute
            if "arrays" not in wl.extra:
                wl.tensors = [getattr(x, "obj", x) for x in wl.tensors]  # TensorDescs -> arrays
                wl.extra["arrays"] = True
            caches, objects = execute_plan(plan, wl.tensors, wl.objects[r], lowering=LOWERING[path])
        if plan.direction == "load":
            wl.tensors = list(caches)  # donated: the old arrays are gone
            return caches
        wl.objects[r] = list(objects)
        return objects

    # --- public calls (kvgroups_tools.bench_public) ----------------------------------------
    def public_calls(self) -> tuple[str, ...]:
        return ("store", "load", "prepared", "jit", "layerwise")

    def public_paths(self, placement: str) -> list[tuple[str, str | None]]:
        """(path, backend name for ``backend=``; None: the default) as a user picks a
        lowering: the default backend, or a ``JaxBackend(lowering=...)`` registered under a
        name (``jax-triton`` comes registered)."""
        out = [(self.default_path, None)]
        for path in self.paths():
            if path not in (self.default_path, "interpret"):
                name = f"jax-{LOWERING[path]}"
                register_backend(name, self._backends[path], replace=True)
                out.append((path, name))
        return out

    def device_ids(self, ids: Any) -> Any:
        if isinstance(ids, dict):
            return {k: self.device_ids(v) for k, v in ids.items()}
        return jax.device_put(jnp.asarray(np.asarray(ids, np.int32)), self.sharding)

    def jit_call(self, case: Any, ids_kind: str) -> Callable[[int], None]:
        """The call inside ``jax.jit``, donating what it writes (the objects of a store, the
        caches of a load). Device ids are traced arguments (one compilation for every id set);
        host ids are NumPy constants of the trace, so one id set serves every call."""
        from kvgroups_tools.bench_public import adopt

        m, wl, be = case.manager, case.wl, case.backend
        host = ids_kind == "host"
        if host:
            case.ids = case.ids[:1]
        fixed = case.ids[0]
        if case.direction == "store":

            def step(caches: Any, objs: Any, ids: Any) -> Any:
                return kc.store(m, caches, fixed if host else ids, objs, backend=be)

            jitted = jax.jit(step, donate_argnums=(1,))

            def fn(i: int) -> None:
                r = i % case.rotate
                wl.objects[r] = list(
                    jitted(wl.caches, wl.objects[r], None if host else case.ids[i % len(case.ids)])
                )
        else:

            def step(caches: Any, objs: Any, ids: Any) -> Any:
                return kc.load(m, objs, caches, fixed if host else ids, backend=be)

            jitted = jax.jit(step, donate_argnums=(0,))

            def fn(i: int) -> None:
                r = i % case.rotate
                adopt(
                    wl,
                    jitted(wl.caches, wl.objects[r], None if host else case.ids[i % len(case.ids)]),
                )

        return fn

    def graph_call(self, case: Any, ids_kind: str) -> Callable[[int], None]:
        raise Refused("graph: a torch CUDA-graph call (JAX: see jit)")

    def scramble(self, wl: Workload, r: int) -> None:
        wl.objects[r] = [
            self._place(
                self._fill(tuple(o.shape), SCRATCH_FILL, 0), wl.extra.get("placement", "device")
            )
            for o in wl.objects[r]
        ]

    def host_bytes(self, wl: Workload, r: int) -> list[np.ndarray]:
        return [np.array(jax.device_get(o), copy=True) for o in wl.objects[r]]

    def _sync(self, wl: Workload) -> None:
        leaves = jax.tree_util.tree_leaves((wl.tensors, wl.objects))
        jax.block_until_ready([x for x in leaves if isinstance(x, jax.Array)])

    def release(self) -> None:
        gc.collect()

    # --- timing ----------------------------------------------------------------------------
    def time(self, fn: Callable[[int], Any], wl: Workload, **timing: Any) -> Timing:
        return wall_timer(fn, lambda: self._sync(wl), **timing)

    def ceiling(self, name: str, nbytes: int, rotate: int, **timing: Any) -> Timing:
        """``device_copy``, ``pinned_h2d`` or ``pinned_d2h`` of ``nbytes``, one buffer per
        rotation."""
        shape = (nbytes // 4096, 4096) if nbytes % 4096 == 0 else (1, nbytes)
        src = [self._fill(shape, None, i) for i in range(rotate)]
        held: list = [None]
        if name == "device_copy":
            if nbytes % 4096 == 0:  # 32-bit elements: the vector width XLA copies with
                words = jax.jit(
                    lambda x: jax.lax.bitcast_convert_type(x.reshape(shape[0], 1024, 4), jnp.uint32)
                )
                src = [words(x) for x in src]
            copy = device_copy_step()
            # Allocated once, as a transfer's targets are.
            dst = [jax.device_put(jnp.zeros_like(x), self.sharding) for x in src]

            def fn(i: int) -> None:
                r = i % rotate
                dst[r] = copy(dst[r], src[r])
                held[0] = dst[r]

            jax.block_until_ready((src, dst))
            return wall_timer(fn, lambda: jax.block_until_ready(held[0]), **timing)
        if name in ("pinned_h2d", "pinned_d2h") and self.device == "cuda":
            if name == "pinned_h2d":
                src = [self._place(x, "pinned") for x in src]
                step = partial(jax.device_put, device=self.sharding)
            else:
                step = partial(self._place, placement="pinned")
        else:
            raise UnsupportedConfigError(
                f"ceiling: expected one of 'device_copy', 'pinned_h2d', "
                f"'pinned_d2h' (pinned ones on GPU), got {name!r}"
            )

        def fn(i: int) -> None:
            held[0] = step(src[i % rotate])

        jax.block_until_ready(src)
        return wall_timer(fn, lambda: jax.block_until_ready(held[0]), **timing)


def device_copy_step() -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``x + 1`` written into the donated ``out`` (same shape and dtype): one read and one
    write of every byte, into a buffer that already exists. A fresh output per call would
    time the allocator too (large without a preallocated pool), which the transfer paths,
    writing donated buffers, never pay."""
    # keep_unused: ``out`` is never read, and jit would otherwise drop it, donation and all.
    return jax.jit(lambda out, x: x + 1, donate_argnums=0, keep_unused=True)


def make_kit(device: str | None = None) -> JaxKit:
    """The JAX kit: ``device`` ``None`` (the GPU when JAX has one, else the CPU), ``"cpu"``,
    ``"cuda"``, ``"cuda:N"`` or ``"gpu"``."""
    return JaxKit(device)
